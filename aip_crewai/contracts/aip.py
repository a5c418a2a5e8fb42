"""AIP 1.0 objects (native HTTP binding subset) as msgspec Structs.

Field names follow DESIGN.md §6 and §7 exactly. Outbound objects omit unset
optional fields; inbound ones (:class:`Envelope`, :class:`Action`,
:class:`DecisionRequest`) reject unknown fields.

Source: DESIGN.md §6 (envelope, objects, manifest), §7 (approvals, signed
envelopes); seeds/crewai-capabilities.md (contract fields).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .errors import Category
from .inputs import ACTION_ID_PATTERN, END, NO_CONTROL

AIP_VERSION = "1.0"
MANIFEST_VERSION = "aip-manifest/v1"
PROFILES = ("aip.native.http.v1", "aip.connector.crewai.v1")
SSE_PROFILE = "aip.sse.stream.v1"
CONTENT_TYPE = "application/aip+json"

MessageId = Annotated[str, msgspec.Meta(min_length=5, max_length=256, pattern=r"^msg_[A-Za-z0-9._:-]+" + END)]
ActionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=ACTION_ID_PATTERN)]
IdempotencyKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=NO_CONTROL)]
Timestamp = Annotated[str, msgspec.Meta(min_length=1, max_length=64, description="RFC 3339 timestamp")]

ActionStatusName = Literal["pending_approval", "running", "completed", "failed", "cancelled"]
ResultStatus = Literal["completed", "failed", "cancelled", "pending_approval"]
ChunkKind = Literal["data", "progress", "tool", "thought", "preview", "pending_approval", "error", "done"]
Dispatch = Literal["not_sent", "sent", "acknowledged"]


class _Out(msgspec.Struct, frozen=True, omit_defaults=True):
    """Base of outbound objects whose defaults are all None (omitted on the wire)."""


class _Full(msgspec.Struct, frozen=True):
    """Base of outbound objects whose defaults are published values: every
    field is always encoded (``omit_defaults`` would drop e.g. ``ttl_ms``)."""


class _In(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of inbound objects."""


# --- message parts (tagged by "type") ---------------------------------------


class TextPart(_Out, tag="text", tag_field="type"):
    text: str


class DataPart(_Out, tag="data", tag_field="type"):
    data: Any


MessagePart = TextPart | DataPart


# --- errors -----------------------------------------------------------------


class ProtocolError(_Out):
    """AIP error body; HTTP status by category (errors.CATEGORY_HTTP_STATUS)."""

    code: str
    message: str
    category: Category
    retryable: bool
    retry_after_ms: int | None = None
    details: dict[str, Any] | None = None
    source: str | None = None


# --- actions ----------------------------------------------------------------


class Action(_In):
    """``body.action`` of an ``aip.core.v1.action`` envelope."""

    id: ActionId
    capability_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    input: dict[str, Any] = msgspec.field(default_factory=dict)
    idempotency_key: IdempotencyKey | None = None
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] | None = None
    mode: Literal["sync", "stream"] | None = None


class ApprovalRef(_Out):
    """What a ``pending_approval`` result carries (DESIGN.md §7)."""

    approval_id: str
    policy_hash: str
    expires_at: Timestamp


class ActionResult(_Full):
    """``body.action_result``."""

    action_id: str
    status: ResultStatus
    output: Any = None
    message: list[MessagePart] = msgspec.field(default_factory=list)
    error: ProtocolError | None = None
    approval: ApprovalRef | None = None
    dispatch: Dispatch | None = None


class ActionStatus(_Full):
    """``GET /aip/v1/actions/{id}``."""

    action_id: str
    capability_id: str
    status: ActionStatusName
    created_at: Timestamp
    updated_at: Timestamp
    dispatch: Dispatch = "not_sent"
    chunk_count: int = 0
    approval_id: str | None = None


class StreamChunk(_Out):
    """``body.chunk``: one normalized event of an action's stream."""

    action_id: str
    sequence: int
    kind: ChunkKind
    data: Any = None
    part: MessagePart | None = None


class Ack(_Out):
    """``body.ack``: the host accepted the action (first SSE event)."""

    action_id: str
    status: ActionStatusName


# --- envelope ---------------------------------------------------------------


class Security(_In):
    """Ed25519 envelope signature (DESIGN.md §7)."""

    scheme: Literal["ed25519"]
    key_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    signature: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


#: message_type -> the single body key it carries.
MESSAGE_BODY_KEYS: dict[str, str] = {
    "aip.core.v1.action": "action",
    "aip.core.v1.action_result": "action_result",
    "aip.core.v1.stream_chunk": "chunk",
    "aip.core.v1.ack": "ack",
    "aip.core.v1.error": "error",
}


class Body(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Externally tagged body: exactly one key is present."""

    action: Action | None = None
    action_result: ActionResult | None = None
    chunk: StreamChunk | None = None
    ack: Ack | None = None
    error: ProtocolError | None = None

    def __post_init__(self) -> None:
        present = [name for name in self.__struct_fields__ if getattr(self, name) is not None]
        if len(present) != 1:
            raise ValueError("body must hold exactly one of " + ", ".join(self.__struct_fields__))

    @property
    def key(self) -> str:
        return next(name for name in self.__struct_fields__ if getattr(self, name) is not None)


class Envelope(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """An AIP 1.0 message (DESIGN.md §6)."""

    aip_version: Literal["1.0"]
    message_type: str
    message_id: MessageId
    sent_at: Timestamp
    body: Body
    idempotency_key: IdempotencyKey | None = None
    correlation_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    from_: Annotated[str, msgspec.Meta(max_length=256)] | None = msgspec.field(default=None, name="from")
    security: Security | None = None

    def __post_init__(self) -> None:
        expected = MESSAGE_BODY_KEYS.get(self.message_type)
        if expected is None:
            raise ValueError(f"unknown message_type {self.message_type!r}")
        if self.body.key != expected:
            raise ValueError(f"message_type {self.message_type} needs body key {expected!r}")


# --- approvals --------------------------------------------------------------


class ApprovalRequest(_Out):
    """An approval waiting for (or holding) its one decision (DESIGN.md §7)."""

    approval_id: str
    action_id: str
    capability_id: str
    tenant: str
    requested_by: str
    policy_hash: str
    status: Literal["pending", "approved", "denied", "expired"]
    created_at: Timestamp
    expires_at: Timestamp
    evidence_requirements: list[str] = msgspec.field(default_factory=list)
    input_snapshot: Any = None
    decision: ApprovalDecision | None = None


class ApprovalDecision(_Out):
    """The one decision of an approval."""

    approval_id: str
    decision: Literal["approved", "denied"]
    reason: str
    decided_by: str
    decided_at: Timestamp


class DecisionRequest(_In):
    """Body of ``POST /aip/v1/approvals/{id}/decision``; the approver is the
    authenticated principal, never a body field (DESIGN.md §7)."""

    decision: Literal["approved", "denied"]
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    approval_id: str | None = None


# --- manifest ---------------------------------------------------------------


class IdempotencyContract(_Full):
    requirement: Literal["required", "optional"]
    collision_behavior: str = "revalidate_input_hash"
    key_scope: str = "tenant"
    ttl_ms: int = 86_400_000


class ExecutionContract(_Full):
    streaming: bool
    cancellable: bool
    retry_safe: bool
    mutation: bool
    default_timeout_ms: int = 600_000
    max_timeout_ms: int = 3_600_000


class DataContract(_Full):
    sensitivity: str = "confidential"
    contains_pii: bool = True
    redaction_required: bool = True


class ApprovalSelector(_Full):
    type: str = "tenant_policy"


class ApprovalContract(_Full):
    required: bool
    approver_selector: ApprovalSelector = msgspec.field(default_factory=ApprovalSelector)
    ttl_ms: int = 900_000
    evidence_requirements: list[str] = msgspec.field(
        default_factory=lambda: ["reason", "input_snapshot", "policy_decision"]
    )


class CompensationContract(_Full):
    mode: str = "rollback_not_supported"


class CapabilityContract(_Out):
    side_effects: list[str]
    idempotency: IdempotencyContract
    execution: ExecutionContract
    data: DataContract
    approval: ApprovalContract | None = None
    compensation: CompensationContract | None = None


class Binding(_Out):
    """Private binding to the sidecar route (informational)."""

    protocol: str
    method: str
    path: str
    stream_path: str | None = None


class Capability(_Out):
    id: str
    name: str
    kind: str
    risk: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    requires_human_approval: bool
    bindings: list[Binding]
    contract: CapabilityContract
    description: str | None = None


class Manifest(_Out):
    manifest_version: str
    profiles: list[str]
    capabilities: list[Capability]
    tenant: str | None = None
