"""AIP 1.0 objects (the native HTTP binding subset the host speaks) as msgspec Structs.

Shapes and vocabularies follow the official AIP 1.0 JSON Schemas (draft
2020-12, ``https://getaip.org/schemas/aip/<name>.schema.json``); the
conformance suite in ``tests/conformance/`` validates every body the host
sends against them. Field names are the schemas'; the docs/reference/http-api.md section "AIP
1.0 conformance" lists which message types and routes the host implements.

Outbound objects omit unset optional fields (``omit_defaults``), except the
capability-contract Structs, which publish constants (rendered through
:func:`aip_crewai.host.crews.manifest.to_wire`). Inbound objects (:class:`Envelope`,
:class:`Action`, :class:`Cancel`, :class:`DecisionRequest`) declare every
field the schema allows, so a schema-valid message is accepted and the
fields the host does not act on are ignored; a field the schema does not
know is refused, as the schema's ``additionalProperties: false`` says.

Source: AIP 1.0 schemas envelope, action, ack, stream_chunk, action_result,
action_status, action_events, event, approval_request, approval_decision,
approval_record_view, approval_list, manifest, capability_contract;
docs/ARCHITECTURE.md (glossary).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

from .errors import AipError, Category
from .inputs import ACTION_ID_PATTERN, NO_CONTROL, RFC3339_PATTERN

AIP_VERSION: Literal["1.0"] = "1.0"
MANIFEST_VERSION = "aip-manifest/v1"
PROFILES = ("aip.native.http.v1", "aip.connector.crewai.v1", "aip.sse.stream.v1")
NATIVE_PROFILE = "aip.native.http.v1"
CONNECTOR_PROFILE = "aip.connector.crewai.v1"
SSE_PROFILE = "aip.sse.stream.v1"
CONTENT_TYPE = "application/aip+json"

#: Message ids: the schema allows any string; the host bounds them (1..256, no control characters).
MessageId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=NO_CONTROL)]
ActionId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=ACTION_ID_PATTERN)]
IdempotencyKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=NO_CONTROL)]
Timestamp = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=RFC3339_PATTERN, description="RFC 3339 timestamp")
]
_Text = Annotated[str, msgspec.Meta(max_length=1024)]

# --- state vocabularies, exactly as the schemas define them -------------------

#: ActionLifecycleState (action_status.schema.json).
# fmt: off
ActionLifecycleState = Literal["unknown", "accepted", "queued", "running", "streaming", "pending_approval",
                               "cancelling", "cancelled", "completed", "failed", "expired", "dead_lettered"]
# fmt: on
#: AckStatus (ack.schema.json).
AckStatus = Literal["accepted", "rejected", "queued", "streaming", "cached"]
#: ActionResultStatus (action_result.schema.json).
ActionResultStatus = Literal["completed", "failed", "cancelled", "pending_approval", "requires_human"]
#: StreamChunkKind (stream_chunk.schema.json).
StreamChunkKind = Literal["data", "progress", "tool", "thought", "preview", "pending_approval", "error", "done"]
#: ErrorCategory (the ProtocolError ``category``): :class:`~aip_crewai.contracts.errors.Category`.
ErrorCategory = Category
#: ApprovalDecisionKind (approval_decision.schema.json).
ApprovalDecisionKind = Literal["approved", "denied", "expired", "revoked"]
#: PrincipalKind (envelope.schema.json ``Principal.kind``).
PrincipalKind = Literal["human", "agent", "service", "tenant", "customer", "contact", "system"]
#: Approval record status labels of this host (``ApprovalRecordView.status`` is a free label in the schema).
#: ``withdrawn``: the tenant cancelled the action before any decision.
ApprovalStatus = Literal["pending", "approved", "denied", "expired", "withdrawn"]

#: Each vocabulary's values, for tests and for code that iterates them.
VOCABULARIES: dict[str, tuple[str, ...]] = {
    "ActionLifecycleState": get_args(ActionLifecycleState),
    "AckStatus": get_args(AckStatus),
    "ActionResultStatus": get_args(ActionResultStatus),
    "StreamChunkKind": get_args(StreamChunkKind),
    "ErrorCategory": tuple(c.value for c in Category),
    "ApprovalDecisionKind": get_args(ApprovalDecisionKind),
    "PrincipalKind": get_args(PrincipalKind),
}


class _Out(msgspec.Struct, frozen=True, omit_defaults=True):
    """Base of outbound objects: unset optional fields are omitted on the wire."""


class _Full(msgspec.Struct, frozen=True):
    """Base of outbound objects whose defaults are published values: every
    field is always encoded (``omit_defaults`` would drop e.g. ``ttl_ms``)."""


class _In(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of inbound objects."""


# --- principals ---------------------------------------------------------------


class Principal(_Out, frozen=True):
    """An actor: ``{id, kind, display_name?}`` (schema ``Principal``)."""

    id: str
    kind: PrincipalKind
    display_name: str | None = None


class InboundPrincipal(_In, frozen=True):
    """A ``Principal`` as a client may send it (``from``/``to``/``approver``);
    the host reads ``id`` only and ignores the rest."""

    id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    kind: PrincipalKind
    display_name: str | None = None
    trust_domain: str | None = None
    did: str | None = None
    external_refs: list[Any] | None = None
    delegated_authority: list[Any] | None = None
    auth_context: Any = None


# --- message parts (tagged by "type") -------------------------------------------


class TextPart(_Out, tag="text", tag_field="type", frozen=True):
    text: str
    format: str | None = None


class JsonPart(_Out, tag="json", tag_field="type", frozen=True):
    data: Any
    schema: Any = None


MessagePart = TextPart | JsonPart


# --- errors -------------------------------------------------------------------


class ProtocolError(_Out, frozen=True):
    """The AIP error object; HTTP status by category (errors.CATEGORY_HTTP_STATUS)."""

    code: str
    message: str
    category: Category
    retryable: bool
    retry_after_ms: int | None = None
    details: dict[str, Any] | None = None
    source: str | None = None


class ErrorBody(_Out, frozen=True):
    """``body.error`` of an ``aip.core.v1.error`` envelope: ``{"error": ProtocolError}``."""

    error: ProtocolError


# --- actions --------------------------------------------------------------------


#: ``action.mode`` values: the schema's ActionMode, plus this host's earlier ``stream`` (read as ``streaming``).
ActionMode = Literal["sync", "async", "streaming", "stream"]


class Action(_In, frozen=True):
    """``body.action`` of an ``aip.core.v1.action`` envelope.

    The host acts on ``id``, ``capability_id``, ``input``, ``idempotency_key``,
    ``timeout_ms`` and ``mode``; the other schema fields are accepted and
    ignored (an ``approval`` in the action grants nothing: approvals are
    decided through the approval routes, bound to the stored action).
    """

    id: ActionId
    capability_id: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    input: Any = msgspec.field(default_factory=dict)
    idempotency_key: IdempotencyKey | None = None
    timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] | None = None
    mode: ActionMode | None = None
    conversation: Any = None
    memory_context: Any = None
    delegation_chain: list[Any] | None = None
    federation: Any = None
    callback: Any = None
    observability: Any = None
    compliance: Any = None
    identity: Any = None
    approval: Any = None
    transaction: Any = None

    @property
    def streaming(self) -> bool:
        """Whether the caller asked for a streaming invocation."""
        return self.mode in ("streaming", "stream")


class CancelTarget(_In, frozen=True):
    """``cancel.target``: ``{"action": id}`` (a session target is refused: the host has no sessions)."""

    action: ActionId | None = None
    session: str | None = None


class Cancel(_In, frozen=True):
    """``body.cancel`` of an ``aip.core.v1.cancel`` envelope."""

    target: CancelTarget
    reason: Annotated[str, msgspec.Meta(max_length=2048)] | None = None


class ReceiptRef(_Out, frozen=True):
    """``ActionResult.receipt``: ``{id, hash}`` of the signed receipt (``GET /aip/v1/receipts/{id}``)."""

    id: str
    hash: str


class Receipt(_Out, frozen=True):
    """One entry of a receipt chain (schema ``Receipt``): ``data`` is the signed receipt document."""

    id: str
    receipt_type: str
    actor: Principal
    occurred_at: Timestamp
    data: Any = None
    hash: str | None = None
    previous_hash: str | None = None


class ReceiptChain(_Out, frozen=True):
    """``receipt_chain`` of an action or approval view (schema ``ReceiptChain``), oldest first."""

    chain_id: str
    receipts: list[Receipt]
    root_hash: str | None = None


class ActionResult(_Out, frozen=True):
    """``body.action_result``: the final (or pending-approval) result.

    A ``pending_approval`` result carries the approval reference in
    ``output`` (:class:`PendingApproval`) and a text message part. ``usage``
    (``{tokens, latency_ms, cost}``) and ``receipt`` are added when the result
    is stored (docs/observing.md "Observing actions").
    """

    action_id: str
    status: ActionResultStatus
    output: Any = None
    message: list[MessagePart] = msgspec.field(default_factory=list)
    error: ProtocolError | None = None
    usage: dict[str, Any] | None = None
    receipt: ReceiptRef | None = None


class PendingApproval(_Out, frozen=True):
    """``output`` of a ``pending_approval`` result: what an approver decides on."""

    approval_id: str
    policy_hash: str
    expires_at: Timestamp
    approval_url: str


class StreamChunk(_Out, frozen=True):
    """``body.stream_chunk``: one normalized event of an action's stream."""

    action_id: str
    sequence: int
    kind: StreamChunkKind
    data: Any = None
    part: MessagePart | None = None


class Ack(_Out, frozen=True):
    """``body.ack``: the host accepted (or replays) the action."""

    action_id: str
    status: AckStatus
    reason: str | None = None
    retry_after_ms: int | None = None


class ActionStatus(_Out, frozen=True):
    """``GET /aip/v1/actions/{id}``: the durable lifecycle view."""

    action_id: str
    state: ActionLifecycleState
    updated_at: Timestamp
    capability_id: str | None = None
    correlation_id: str | None = None
    result_status: ActionResultStatus | None = None
    approval_id: str | None = None
    started_at: Timestamp | None = None
    completed_at: Timestamp | None = None
    result: ActionResult | None = None
    receipt_chain: ReceiptChain | None = None
    links: dict[str, str] = msgspec.field(default_factory=dict)


class Event(_Out, frozen=True):
    """One action-scoped event: ``kind`` is the AIP message type of ``data``."""

    id: str
    kind: str
    occurred_at: Timestamp
    action_id: str | None = None
    correlation_id: str | None = None
    actor: Principal | None = None
    data: Any = None


class ActionEvents(_Out, frozen=True):
    """``GET /aip/v1/actions/{id}/events`` and ``/chunks`` (JSON pages)."""

    action_id: str
    events: list[Event]
    chunks: list[StreamChunk]
    terminal: bool
    cursor: str | None = None


# --- envelope -------------------------------------------------------------------

#: message_type -> the single body key it carries (the types this host sends or accepts).
MESSAGE_BODY_KEYS: dict[str, str] = {
    "aip.core.v1.action": "action",
    "aip.core.v1.cancel": "cancel",
    "aip.core.v1.action_result": "action_result",
    "aip.core.v1.stream_chunk": "stream_chunk",
    "aip.core.v1.ack": "ack",
    "aip.core.v1.error": "error",
}
#: The message types a client may post to ``POST /aip/v1/messages``.
INBOUND_MESSAGE_TYPES = ("aip.core.v1.action", "aip.core.v1.cancel")


class Body(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Externally tagged body: exactly one key is present."""

    action: Action | None = None
    cancel: Cancel | None = None
    action_result: ActionResult | None = None
    stream_chunk: StreamChunk | None = None
    ack: Ack | None = None
    error: ErrorBody | None = None

    def __post_init__(self) -> None:
        present = [name for name in self.__struct_fields__ if getattr(self, name) is not None]
        if len(present) != 1:
            raise ValueError("body must hold exactly one of " + ", ".join(self.__struct_fields__))

    @property
    def key(self) -> str:
        return next(name for name in self.__struct_fields__ if getattr(self, name) is not None)


class Envelope(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """An AIP 1.0 message (schema ``Envelope``).

    ``from``/``to`` may be a Principal object (the schema) or a principal id
    string (accepted for older clients); ``security`` is read by the
    authenticator from the raw JSON (Ed25519 scheme, docs/approvals.md "Signed
    requests"); ``session_id``, ``in_response_to``, ``trace`` and
    ``extensions`` are accepted and ignored.
    """

    aip_version: Literal["1.0"]
    message_type: str
    message_id: MessageId
    sent_at: Timestamp
    body: Body
    idempotency_key: IdempotencyKey | None = None
    correlation_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    session_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    in_response_to: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    from_: InboundPrincipal | Annotated[str, msgspec.Meta(max_length=256)] | None = msgspec.field(
        default=None, name="from"
    )
    to: InboundPrincipal | Annotated[str, msgspec.Meta(max_length=256)] | None = None
    trace: Any = None
    security: Any = None
    extensions: Any = None

    def __post_init__(self) -> None:
        expected = MESSAGE_BODY_KEYS.get(self.message_type)
        if expected is None:
            raise ValueError(f"unsupported message_type {self.message_type!r}")
        if self.body.key != expected:
            raise ValueError(f"message_type {self.message_type} needs body key {expected!r}")


# --- approvals ------------------------------------------------------------------


class ApproverSelector(_Full, frozen=True):
    """Who may approve: the tenant's policy (approvers of the same tenant, not the requester)."""

    type: Literal["tenant_policy"] = "tenant_policy"


class EvidenceArtifact(_Out, frozen=True):
    """Evidence attached to an approval request (schema ``EvidenceArtifact``)."""

    id: str
    kind: str
    redacted: bool
    uri: str | None = None
    hash: str | None = None


class ApprovalRequest(_Out, frozen=True):
    """The approval request of one governed action (schema ``ApprovalRequest``)."""

    id: str
    action_id: str
    capability_id: str
    requester: Principal
    subject: Principal
    approver_selector: ApproverSelector
    reason: str
    evidence: list[EvidenceArtifact]
    expires_at: Timestamp
    policy_hash: str
    risk: Literal["low", "medium", "high", "critical"] | None = None


class ApprovalDecision(_Out, frozen=True):
    """The one decision of an approval (schema ``ApprovalDecision``)."""

    approval_id: str
    decision: ApprovalDecisionKind
    approver: Principal
    decided_at: Timestamp
    reason: str | None = None
    policy_hash: str | None = None
    decision_id: str | None = None
    #: A signed decision's proof (kind ``http_message_signature``, ``uri`` the proof route).
    evidence: list[EvidenceArtifact] | None = None


class ApprovalEvidencePayload(_Out, frozen=True):
    """The exact governed input, shown to approvers with ``GET /aip/v1/approvals/{id}`` only."""

    action_id: str
    capability_id: str
    input_hash: str
    input: Any


class ApprovalRecordView(_Out, frozen=True):
    """One approval with its request, decision and status (schema ``ApprovalRecordView``)."""

    request: ApprovalRequest
    status: ApprovalStatus
    created_at: Timestamp
    updated_at: Timestamp
    decision: ApprovalDecision | None = None
    evidence_payload: ApprovalEvidencePayload | None = None
    receipt_chain: ReceiptChain | None = None


class ApprovalList(_Out, frozen=True):
    """``GET /aip/v1/approvals``: one page; ``cursor`` is None on the last page."""

    approvals: list[ApprovalRecordView]
    cursor: str | None = None


class DecisionRequest(_In, frozen=True):
    """Body of ``POST /aip/v1/approvals/{id}/decision``.

    Either this host's short form ``{decision, reason, approval_id?}`` or the
    official ApprovalDecision object. The approver is the authenticated
    principal: an ``approver`` naming anyone else is refused (403); a
    ``policy_hash`` other than the approval's is refused (409); only
    ``approved`` and ``denied`` can be decided; ``reason`` is required (the
    capability contract's evidence requirement). ``decided_at``,
    ``constraints``, ``evidence``, ``decision_id``, ``authority_path`` and
    ``target_decision_id`` are accepted and ignored (the host stamps its
    own decision time).
    """

    decision: ApprovalDecisionKind
    reason: Annotated[str, msgspec.Meta(max_length=2048)] | None = None
    approval_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    approver: InboundPrincipal | None = None
    decided_at: str | None = None
    constraints: list[Any] | None = None
    evidence: list[Any] | None = None
    decision_id: str | None = None
    policy_hash: str | None = None
    authority_path: list[Any] | None = None
    target_decision_id: str | None = None


# --- manifest -------------------------------------------------------------------


class IdempotencyContract(_Full, frozen=True):
    requirement: Literal["required", "optional"]
    collision_behavior: str = "revalidate_input_hash"
    key_scope: str = "tenant"
    ttl_ms: int = 86_400_000


class ExecutionContract(_Full, frozen=True):
    """Schema ``ExecutionContract``: what invocation styles a capability supports."""

    supports_sync: bool
    supports_async: bool
    supports_streaming: bool
    supports_cancel: bool
    supports_retry: bool
    expected_completion: Literal["sync", "async", "streaming", "any"]
    retry_safety: Literal["safe", "safe_with_idempotency_key", "unsafe", "unknown"]


class DataContract(_Full, frozen=True):
    sensitivity: str = "confidential"
    contains_pii: bool = True
    redaction_required: bool = True


class ApprovalSelector(_Full, frozen=True):
    type: str = "tenant_policy"


class ApprovalContract(_Full, frozen=True):
    required: bool
    approver_selector: ApprovalSelector = msgspec.field(default_factory=ApprovalSelector)
    ttl_ms: int = 900_000
    evidence_requirements: list[str] = msgspec.field(
        default_factory=lambda: ["reason", "input_snapshot", "policy_decision"]
    )


class CompensationContract(_Full, frozen=True):
    mode: str = "rollback_not_supported"
    requires_approval: bool = False


class CapabilityContract(_Out, frozen=True):
    side_effects: list[str]
    idempotency: IdempotencyContract
    execution: ExecutionContract
    data: DataContract
    approval: ApprovalContract | None = None
    compensation: CompensationContract | None = None


class Binding(_Out, frozen=True):
    """A profile binding: the native AIP route, or the private sidecar route (informational)."""

    profile: str
    method: str
    path: str
    protocol: str | None = None
    stream_path: str | None = None
    message_type: str | None = None


class Capability(_Out, frozen=True):
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


class Manifest(_Out, frozen=True):
    """Schema ``Manifest``: the host (``agent``), profiles and the tenant's capabilities."""

    manifest_version: str
    agent: Principal
    profiles: list[str]
    capabilities: list[Capability]
    limits: dict[str, Any] | None = None


def protocol_error(exc: AipError, *, source: str = "aip-crewai") -> ProtocolError:
    """The ProtocolError object of one of our errors (code, message, category,
    retryable, retry hint and details exactly as the error class built them)."""
    return ProtocolError(
        code=exc.code,
        message=exc.message,
        category=exc.category,
        retryable=exc.retryable,
        retry_after_ms=exc.retry_after_ms,
        details=exc.details or None,
        source=source,
    )
