"""The host store's data model: the row types, the timestamp representation (integers, ms since the
Unix epoch, UTC; rendered as RFC 3339 only at the edges), the store's errors and the opaque cursor of
approval pages. No SQL runs here: the schema is :mod:`.migrations`, the shared SQL text :mod:`.sql`,
the engines :mod:`.engines.sqlite` and :mod:`.engines.postgres`.

Source: ARCHITECTURE.md §7, ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Protocol

import msgspec

from ...contracts.errors import AipError, Category
from ...contracts.inputs import RFC3339_PATTERN
from ..actions.lifecycle import ActionState, ApprovalStatus, DispatchState

#: Dispatch states in order (only forward, see :meth:`Store.update_action`).
DISPATCH_RANK = {state.value: rank for rank, state in enumerate(DispatchState)}
APPROVAL_DECISIONS = ("approved", "denied")
_RFC3339_RE = re.compile(RFC3339_PATTERN)


# --- timestamps ----------------------------------------------------------------


#: The instants RFC 3339 (four-digit years) and Python's datetime both hold, epoch ms:
#: ``0001-01-01T00:00:00.000Z`` .. ``9999-12-31T23:59:59.999Z``.
MIN_RFC3339_MS = -62_135_596_800_000
MAX_RFC3339_MS = 253_402_300_799_999


def ms_to_rfc3339(ms: int) -> str:
    """Render epoch milliseconds as RFC 3339 UTC, e.g. ``2026-11-29T10:00:00.123Z``; the year always has four
    digits (``0999-…``). ``ms`` within :data:`MIN_RFC3339_MS` .. :data:`MAX_RFC3339_MS` (else ValueError)."""
    moment = datetime.fromtimestamp(ms // 1000, tz=timezone.utc)
    return f"{moment.year:04d}" + moment.strftime("-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def rfc3339_to_ms(text: str) -> int:
    """Parse an RFC 3339 timestamp (``Z`` or ``±hh:mm`` offset) to epoch ms.

    Raises:
        ValueError: not RFC 3339 (no offset, a date alone, out of range), or an instant outside
            :data:`MIN_RFC3339_MS` .. :data:`MAX_RFC3339_MS` once in UTC (``9999-12-31T23:59:59-01:00`` is in
            year 10000, which no answer could echo).
    """
    match = _RFC3339_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError("not an RFC 3339 timestamp")
    offset = "+00:00" if match["offset"] in ("Z", "z") else match["offset"]
    moment = datetime.fromisoformat(f"{match['date']}T{match['time']}{offset}")
    fraction = (match["fraction"] or "") + "000"
    ms = int(moment.timestamp()) * 1000 + int(fraction[:3])
    if not MIN_RFC3339_MS <= ms <= MAX_RFC3339_MS:
        raise ValueError("the instant is outside years 0001 to 9999 in UTC")
    return ms


# --- records -------------------------------------------------------------------


@dataclass(frozen=True)
class ActionRecord:
    """One row of ``actions``. ``*_json`` hold canonical JSON text; times are ms."""

    tenant: str
    action_id: str
    capability_id: str
    crew_id: str
    operation: str
    input_json: str
    input_hash: str
    principal_id: str
    idempotency_key: str | None
    status: ActionState
    dispatch: DispatchState
    result_json: str | None
    error_json: str | None
    approval_id: str | None
    timeout_ms: int | None
    chunk_count: int
    created_at: int
    updated_at: int
    #: the host that dispatches or reconciles the running action, and until when (ms): ARCHITECTURE.md §10
    lease_owner: str | None = None
    lease_expires_at: int | None = None
    #: the lease's fencing token: raised each time another host takes the lease (ARCHITECTURE.md §10)
    lease_epoch: int = 0
    #: the W3C ``traceparent`` current at its creation, continued by its dispatch (docs/observing.md "Observing actions")
    trace_parent: str | None = None
    #: the name of the sidecar its job is placed on (docs/operating.md "Several sidecars"); None: not placed (nothing
    #: sent yet, or an inspection, which follows its target); '': sent before placements (the crew's first)
    sidecar: str | None = None

    def __post_init__(self) -> None:  # rows hold the values: the record holds the lifecycle's enums
        object.__setattr__(self, "status", ActionState(self.status))
        object.__setattr__(self, "dispatch", DispatchState(self.dispatch))


@dataclass(frozen=True)
class IdempotencyRecord:
    """One idempotency reservation; ``created`` is True for the call that made it."""

    tenant: str
    key: str
    capability_id: str
    action_id: str
    input_hash: str
    created_at: int
    expires_at: int
    created: bool = False


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval. ``status`` is as stored; see :meth:`effective_status`."""

    tenant: str
    approval_id: str
    action_id: str
    capability_id: str
    policy_hash: str
    requested_by: str
    input_snapshot_json: str
    status: ApprovalStatus
    decision_reason: str | None
    decided_by: str | None
    decided_at: int | None
    created_at: int
    expires_at: int
    #: JSON proof of a signed decision (:meth:`aip_crewai.plumbing.httpsig.VerifiedSignature.proof` plus ``body``), else None.
    decision_proof: str | None = None

    def __post_init__(self) -> None:  # the row holds the value: the record holds the enum
        object.__setattr__(self, "status", ApprovalStatus(self.status))

    def effective_status(self, now_ms: int) -> ApprovalStatus:
        """``expired`` for a pending approval past ``expires_at`` (before the sweep ran)."""
        expired = self.status is ApprovalStatus.PENDING and now_ms >= self.expires_at
        return ApprovalStatus.EXPIRED if expired else self.status


@dataclass(frozen=True)
class ApprovalEvent:
    """One row of a tenant's approval event log: position ``seq`` (from 1), the approval, its new status."""

    seq: int
    approval_id: str
    status: ApprovalStatus

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", ApprovalStatus(self.status))


@dataclass(frozen=True)
class SealedRows:
    """What a result leaves besides itself, written in its own transaction (:mod:`.ledger`):
    ``result_json`` (the result with its ``usage`` and ``receipt`` reference), the usage row (values in
    ``action_usage`` column order: tenant, action_id, crew_id, operation, finished_at, prompt, completion,
    total, cached, requests, latency_ms, cost_picos, currency) or None, and the receipt row (tenant,
    receipt_id, action_id, approval_id, hash, document, created_at) or None."""

    result_json: str
    usage: tuple[object, ...] | None = None
    receipt: tuple[object, ...] | None = None
    #: The webhook events of the result (docs/webhooks.md), written to the outbox with it.
    outbox: tuple[OutboxRow, ...] = ()


#: Called by the store inside a result's write with the action as just written and the decision proof
#: of its approval (JSON text, or None); returns what to write with it, or None (docs/observing.md "Observing actions").
Seal = Callable[[ActionRecord, str | None], SealedRows | None]


@dataclass(frozen=True)
class UsageTotal:
    """One crew's usage in a period (``GET /aip/v1/usage``): sums over its actions' usage rows.
    ``cost_picos`` sums the priced actions in ``currency`` (None: none priced)."""

    crew_id: str
    currency: str | None
    actions: int
    prompt: int
    completion: int
    total: int
    cached: int
    requests: int
    latency_ms: int
    cost_picos: int | None


class ChunkRecord(msgspec.Struct, frozen=True):
    """One stored chunk: its sequence and its compact ``StreamChunk`` JSON (a Struct: a replay page
    builds one per chunk, in C)."""

    sequence: int
    chunk_json: str


@dataclass(frozen=True)
class ApprovalPage:
    """A page of approvals. Follow ``next_cursor`` until ``done`` is True
    (``next_cursor`` is None exactly when ``done``)."""

    items: list[ApprovalRecord]
    next_cursor: str | None
    done: bool


class StoreError(AipError):
    """The host store failed (the root of the store's errors; an outage is :class:`StoreUnavailable`)."""

    code = "store.error"
    category = Category.TEMPORARY
    default_message = "the host store failed"


class StoreUnavailable(StoreError):
    """The database cannot be reached right now: the connection was refused or lost, or no pooled
    connection came free within the pool's timeout (a PostgreSQL store); the SQLite file is full, failing,
    read-only or write-locked from outside (``engines.sqlite.UNWRITABLE_CODES``). Temporary: 503, retryable
    (a retried submission with the same idempotency key is answered once). Raised by every store
    method (``Store._run``) for the engine's :attr:`~.engines.engine.Db.unavailable_errors`."""

    code = "store.unavailable"
    category = Category.TEMPORARY
    http_status = 503
    default_message = "the host store is unavailable; retry shortly"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, retry_after_ms=1000)

    @property
    def retryable(self) -> bool:
        return True


class LeaseLost(StoreError):
    """This host wrote on behalf of an action whose dispatch lease another host has taken since (its
    fencing token is no longer current): nothing was written. The host stops dispatching and following
    that action (the new holder does); a tenant request that met it may be retried at once (the retry
    writes as any host that does not hold the lease). Source: ARCHITECTURE.md §10 (dispatch leases)."""

    code = "store.lease_lost"
    category = Category.TEMPORARY
    http_status = 503
    default_message = "another host took over this action; retry"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message, retry_after_ms=1000)

    @property
    def retryable(self) -> bool:
        return True


class InsecureStorePath(StoreError):
    code = "store.insecure_path"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store path is not safe"


class StoreLocked(AipError):
    """Another host process owns this store (its ``<store>.lock`` is held)."""

    code = "store.locked"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the store is owned by another host process"


class UnusableStore(StoreError):
    """The store file is not SQLite, is damaged, or is another application's database."""

    code = "store.unusable"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store file cannot be used"


class MissingTarget(LookupError):
    """:meth:`Store.create_action` found no target action (the run a
    status/events/cancel action names); nothing was written. Internal: the
    action service answers ``action.not_found``."""


class InvalidCursor(AipError):
    code = "request.invalid_cursor"
    category = Category.PERMANENT
    default_message = "the cursor is not valid"


# --- file safety ---------------------------------------------------------------


def encode_cursor(created_at: int, approval_id: str) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode([created_at, approval_id])).decode().rstrip("=")


#: A page cursor's decoded form: ``[created_at (epoch ms, a 64-bit SQL integer), id]``.
_CURSOR = msgspec.json.Decoder(tuple[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)], str])


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The ``(created_at, id)`` of a listing's page cursor (:func:`encode_cursor`).

    Raises:
        InvalidCursor: (400 ``request.invalid_cursor``) not base64url JSON of that shape, or a time outside
            0 .. 2**63 - 1 (a SQL INTEGER: a larger one was a 500 from the store).
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, approval_id = _CURSOR.decode(raw)
    except (ValueError, msgspec.DecodeError) as exc:
        raise InvalidCursor() from exc
    return created_at, approval_id


# --- the webhook outbox (docs/webhooks.md) ---


@dataclass(frozen=True)
class OutboxRow:
    """One event for one webhook endpoint, written to the outbox in the state change's transaction.
    ``body``: the JSON text sent (and signed) on every attempt; times are epoch ms."""

    tenant: str
    delivery_id: str
    endpoint_id: str
    event_type: str
    action_id: str
    body: str
    created_at: int
    deadline_at: int


class OutboxEvents(Protocol):
    """The store's outbox hook (``Store.outbox_events``): called on the store's worker thread inside the
    transaction that changes an approval's status or stores an action's result, it returns the rows to
    write with it (none when no endpoint subscribes). Pure: no I/O."""

    def for_approval(self, approval: ApprovalRecord) -> Sequence[OutboxRow]: ...

    def for_result(self, record: ActionRecord) -> Sequence[OutboxRow]: ...


@dataclass(frozen=True)
class ClaimedDelivery:
    """A due outbox row this host claimed for one attempt (``attempts``: made before this one)."""

    tenant: str
    delivery_id: str
    endpoint_id: str
    event_type: str
    action_id: str
    body: str
    attempts: int
    created_at: int
    deadline_at: int


@dataclass(frozen=True)
class DeliveryAttempt:
    """One attempt of a delivery: ``outcome`` is ``delivered``, ``http_error``, ``timeout``,
    ``connect_error``, ``refused`` (a destination the rules refuse) or ``endpoint_removed``."""

    attempt: int
    host_id: str
    started_at: int
    duration_ms: int
    outcome: str
    status_code: int | None


@dataclass(frozen=True)
class DeliveryRecord:
    """One outbox row as operators list it, with its latest attempts (oldest first)."""

    tenant: str
    delivery_id: str
    endpoint_id: str
    event_type: str
    action_id: str
    status: str
    attempts: int
    created_at: int
    deadline_at: int
    next_attempt_at: int
    finished_at: int | None
    last_outcome: str | None
    history: tuple[DeliveryAttempt, ...] = ()
