"""The error catalogue: one exception root, stable codes, categories, statuses.

Every error of ours subclasses :class:`AipError`. Each class carries a stable ``code``, a ``category`` and an
HTTP status (derived from the category unless the class overrides it); the data lives in attributes and the
message is built from them. The host renders any ``AipError`` as an AIP ``ProtocolError`` body.

Source: ARCHITECTURE.md §6 (categories and statuses), §7 (host codes), §8 (connector codes, retryability).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

from .display import json_string


class Category(str, enum.Enum):
    """AIP error categories (ARCHITECTURE.md §6)."""

    TEMPORARY = "temporary"
    PERMANENT = "permanent"
    AUTH = "auth"
    POLICY = "policy"
    ECONOMIC = "economic"
    CONNECTOR = "connector"
    TRANSPORT = "transport"


#: HTTP status by category (ARCHITECTURE.md §6). Idempotency conflicts override to 409.
CATEGORY_HTTP_STATUS: dict[Category, int] = {
    Category.AUTH: 401,
    Category.POLICY: 403,
    Category.TEMPORARY: 503,
    Category.TRANSPORT: 503,
    Category.CONNECTOR: 502,
    Category.ECONOMIC: 402,
    Category.PERMANENT: 400,
}


def http_status_for(category: Category) -> int:
    """Return the HTTP status of an error category (ARCHITECTURE.md §6)."""
    return CATEGORY_HTTP_STATUS[category]


class AipError(Exception):
    """Root of every error this project raises on purpose.

    Class attributes: ``code`` (stable, dotted), ``category``, ``http_status``
    (None: derived from the category), ``default_message``.
    Instance attributes: ``message`` (safe to show a caller: never provider
    text or secrets), ``details`` (JSON-able mapping), ``retry_after_ms``.
    """

    code: ClassVar[str] = "internal.error"
    category: ClassVar[Category] = Category.PERMANENT
    http_status: ClassVar[int | None] = None
    default_message: ClassVar[str] = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        details: dict[str, Any] | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.details = dict(details or {})
        self.retry_after_ms = retry_after_ms
        super().__init__(self.message)

    @property
    def status(self) -> int:
        """HTTP status of this error (class override, else by category)."""
        return self.http_status if self.http_status is not None else http_status_for(self.category)

    @property
    def retryable(self) -> bool:
        """Whether a caller may retry. Default: never (ARCHITECTURE.md §8)."""
        return False


# --- host errors (ARCHITECTURE.md §7) -------------------------------------------


class Unauthenticated(AipError):
    code = "auth.unauthenticated"
    category = Category.AUTH
    default_message = "authentication required"


class Forbidden(AipError):
    code = "policy.forbidden"
    category = Category.POLICY
    default_message = "the principal is not allowed to do this"


class CapabilityNotFound(AipError):
    """No capability ``capability_id`` for this tenant (unknown, not allowed, or a crew the tenant
    may not see: indistinguishable, ARCHITECTURE.md §7). The message names the id asked for (at
    most 200 characters, invisible code points escaped) and where the right ids are listed;
    ``details.capability_id`` holds at most 1024 characters of it."""

    code = "capability.not_found"
    category = Category.PERMANENT
    http_status = 404
    default_message = "capability not found"

    def __init__(self, capability_id: str | None = None) -> None:
        if capability_id is None:
            super().__init__()
            return
        super().__init__(capability_not_found_message(capability_id), details={"capability_id": capability_id[:1024]})


#: Where a tenant finds the capability ids it may call (docs/reference/cli.md, docs/reference/http-api.md).
MANIFEST_POINTER = "`aip-crewai manifest` (GET /aip/v1/manifest) lists the ids this tenant may call"


def shown_id(value: str) -> str:
    """An id a caller sent, as a message shows it: a JSON string of at most 200 characters (``…`` past
    them), invisible and control code points escaped (contracts/display.py). Pure."""
    return json_string(value[:200] + ("…" if len(value) > 200 else ""))


def capability_not_found_message(capability_id: str) -> str:
    """The message of :class:`CapabilityNotFound`: the id asked for, a hint for the two usual
    slips (a ``:run`` suffix, a missing ``cap:crewai:`` prefix), and :data:`MANIFEST_POINTER`. Pure."""
    shown = shown_id(capability_id)
    hint = ""
    if not capability_id.startswith("cap:crewai:"):
        hint = "; capability ids start with cap:crewai:"
    elif capability_id.endswith(":run"):
        hint = f"; a crew's run is {json_string(capability_id[:-4][:200])} (no :run suffix)"
    return f"capability {shown} not found{hint}; {MANIFEST_POINTER}"


class ActionNotFound(AipError):
    """No action ``action_id`` this caller may read (unknown, another tenant's, or not the caller's:
    indistinguishable, ARCHITECTURE.md §7); with ``run_action_id`` the run an inspection names. The
    message names the id (:func:`shown_id`) and what to check; ``details`` carries it (1024 characters)."""

    code = "action.not_found"
    category = Category.PERMANENT
    http_status = 404
    default_message = "action not found"

    def __init__(self, action_id: str | None = None, *, run_action_id: str | None = None) -> None:
        if run_action_id is not None:
            super().__init__(
                f"run_action_id {shown_id(run_action_id)} names no run of this crew this caller may read; "
                "give the id of a run action (its envelope id)",
                details={"run_action_id": run_action_id[:1024]},
            )
        elif action_id is not None:
            super().__init__(
                f"action {shown_id(action_id)} not found for this credential's tenant; "
                "check the id (the envelope's id) and the credential",
                details={"action_id": action_id[:1024]},
            )
        else:
            super().__init__()


class ApprovalNotFound(AipError):
    """No approval ``approval_id`` in this caller's tenant (unknown or another tenant's). The message
    names the id (:func:`shown_id`) and where the pending ones are listed."""

    code = "approval.not_found"
    category = Category.PERMANENT
    http_status = 404
    default_message = "approval not found"

    def __init__(self, approval_id: str | None = None) -> None:
        if approval_id is None:
            super().__init__()
            return
        super().__init__(
            f"approval {shown_id(approval_id)} not found for this credential's tenant; "
            "`aip-crewai approvals list` (GET /aip/v1/approvals) lists the pending ones",
            details={"approval_id": approval_id[:1024]},
        )


class ProofNotFound(AipError):
    """The approval's decision was not signed (or not made yet): it has no proof to show."""

    code = "approval.no_proof"
    category = Category.PERMANENT
    http_status = 404
    default_message = "this approval has no signed decision"


class ReceiptNotFound(AipError):
    """No receipt of the caller's tenant has this id (docs/observing.md "Observing actions")."""

    code = "receipt.not_found"
    category = Category.PERMANENT
    http_status = 404
    default_message = "receipt not found"


class InvalidRange(AipError):
    """``GET /aip/v1/usage``: ``from``/``to`` not RFC 3339, or ``from`` not before ``to``."""

    code = "request.invalid_range"
    category = Category.PERMANENT
    default_message = "from and to must be RFC 3339 timestamps with from before to"


class ApprovalAlreadyDecided(AipError):
    code = "approval.already_decided"
    category = Category.PERMANENT
    http_status = 409
    default_message = "the approval is already decided or expired"


class ApprovalExpiredUndecidable(AipError):
    code = "approval.expired"
    category = Category.PERMANENT
    http_status = 409
    default_message = "the approval expired before this decision; the action failed (policy.approval_expired)"


class ApprovalWithdrawn(AipError):
    code = "approval.withdrawn"
    category = Category.PERMANENT
    http_status = 409
    default_message = "the action was cancelled before this decision; there is nothing left to approve"


class ApprovalPolicyMismatch(AipError):
    code = "approval.policy_mismatch"
    category = Category.PERMANENT
    http_status = 409
    default_message = (
        "the decision names a policy_hash other than the approval's (the approver evaluated something else)"
    )


class InvalidInput(AipError):
    """Input failed validation. ``field`` is a JSON path (``$.query[2]``),
    ``rule`` the broken rule in words (``at most 4096 UTF-8 bytes``)."""

    code = "action.invalid_input"
    category = Category.PERMANENT
    default_message = "invalid input"

    def __init__(self, field: str, rule: str, *, message: str | None = None) -> None:
        self.field = field
        self.rule = rule
        super().__init__(message or f"invalid input at {field}: {rule}", details={"field": field, "rule": rule})


class InputTooLarge(InvalidInput):
    """The whole encoded input exceeds its byte bound (ARCHITECTURE.md §3: 1 MiB)."""

    code = "action.input_too_large"
    http_status = 413

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__("$", f"encoded input is {size_bytes} bytes; at most {limit_bytes} bytes")


class MessageTooLarge(AipError):
    """A request body exceeds its byte bound (read stops at the bound)."""

    code = "message.too_large"
    category = Category.PERMANENT
    http_status = 413
    default_message = "the request body is too large"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"the request body exceeds {limit_bytes} bytes", details={"limit_bytes": limit_bytes})


class UnsupportedMediaType(AipError):
    """A body whose ``Content-Type`` is not the route's JSON (absent, ``text/plain``, ...): 415, the body unread."""

    code = "message.unsupported_media_type"
    category = Category.PERMANENT
    http_status = 415
    default_message = "the request body must be JSON: Content-Type application/json or application/aip+json"


class AmbiguousFraming(AipError):
    """A request carries both ``Content-Length`` and ``Transfer-Encoding``: refused
    with 400 and the connection closed, because a proxy that frames by
    ``Content-Length`` would see another request boundary than the server
    (request smuggling; RFC 9112 §6.3). Source: docs/security.md "Security"."""

    code = "request.ambiguous_framing"
    category = Category.PERMANENT
    default_message = "a request may not carry both Content-Length and Transfer-Encoding"


class BodyTimeout(AipError):
    """A request body did not arrive in time (a pause between chunks, or the
    whole body, longer than the bound): 408 and the connection closed.
    Source: docs/security.md "Security" (timeouts)."""

    code = "request.body_timeout"
    category = Category.PERMANENT
    http_status = 408
    default_message = "the request body did not arrive in time"

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        super().__init__(f"the request body did not arrive within {limit_s:g} s", details={"limit_s": limit_s})


class Overloaded(AipError):
    """Too many requests are in flight on this process: 503, retry later.
    Source: docs/security.md "Security" (bounded concurrent requests)."""

    code = "server.overloaded"
    category = Category.TEMPORARY
    default_message = "too many requests in flight; retry later"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(details={"max_in_flight": limit}, retry_after_ms=1000)

    @property
    def retryable(self) -> bool:
        return True


class RequestHeadTooLarge(AipError):
    """The request line plus headers exceed their bound: 431, connection closed. Details add
    ``limit_bytes``. Source: docs/security.md "Security" (timeouts and request heads)."""

    code = "request.head_too_large"
    category = Category.PERMANENT
    http_status = 431
    default_message = "the request line and headers exceed their bound"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(
            f"the request line and headers exceed {limit_bytes} bytes", details={"limit_bytes": limit_bytes}
        )


class BodyBudgetExhausted(AipError):
    """The process's budget of request bodies read before authentication is in use: 503, retry later.
    Details add ``budget_bytes``. Source: docs/security.md "Security" (bodies before authentication)."""

    code = "server.body_budget_exhausted"
    category = Category.TEMPORARY
    default_message = "too many unauthenticated request bodies are being read; retry later"

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(details={"budget_bytes": limit_bytes}, retry_after_ms=1000)

    @property
    def retryable(self) -> bool:
        return True


class NonCanonicalNumber(AipError):
    """A signed envelope holds a number whose RFC 8785 form decodes to another
    value or type (``1.0``, ``1e0``, ``-0.0``), or an integer of magnitude
    2^53 or more: what runs must be exactly what was signed, so it is refused.
    ``field`` is the JSON path, ``rule`` the reason. Source: docs/security.md "Security"."""

    code = "message.non_canonical_number"
    category = Category.PERMANENT
    default_message = "a number of the signed envelope is not canonical"

    def __init__(self, field: str, rule: str) -> None:
        self.field, self.rule = field, rule
        super().__init__(f"the number at {field} {rule}", details={"field": field, "rule": rule})


class InvalidEnvelope(AipError):
    code = "message.invalid_envelope"
    category = Category.PERMANENT
    default_message = "invalid AIP envelope"


class IdempotencyKeyRequired(AipError):
    code = "action.idempotency_key_required"
    category = Category.PERMANENT
    default_message = "this capability requires an idempotency key"


class IdempotencyConflict(AipError):
    code = "action.idempotency_conflict"
    category = Category.PERMANENT
    http_status = 409
    default_message = "the idempotency key or action id was already used with a different input"


class NotCancellable(AipError):
    code = "action.not_cancellable"
    category = Category.PERMANENT
    http_status = 409
    default_message = "this action cannot be cancelled"


class RouteNotFound(AipError):
    """No such route (or a route this host has switched off, such as a disabled console)."""

    code = "route.not_found"
    category = Category.PERMANENT
    http_status = 404
    default_message = "no such route"


class CapabilityRevoked(AipError):
    code = "policy.capability_revoked"
    category = Category.POLICY
    default_message = (
        "the action's capability or its requester's role was revoked since it was requested; it will not run"
    )


class CrewUnavailable(AipError):
    code = "capability.unavailable"
    category = Category.TEMPORARY
    http_status = 503
    default_message = (
        "the sidecar does not serve this capability's crew (the host's crews file lists it, the "
        "sidecar's registry does not); nothing was started and no approval was requested"
    )


class ApprovalDenied(AipError):
    code = "policy.approval_denied"
    category = Category.POLICY
    default_message = "the approval was denied"


class ApprovalExpired(AipError):
    code = "policy.approval_expired"
    category = Category.POLICY
    default_message = "the approval expired before a decision"


# --- connector errors (ARCHITECTURE.md §8) ---------------------------------------


class ConnectorError(AipError):
    """A failure talking to, or reported by, the sidecar.

    ``details`` always carry ``operation``, ``remote_status`` (int or None)
    and ``uncertain_outcome`` (bool), plus ``dispatch`` (not_sent | sent |
    acknowledged). Retryable only for read-only operations on temporary or
    transport failures (ARCHITECTURE.md §8).
    """

    code = "connector.crewai.error"
    category = Category.CONNECTOR
    default_message = "the CrewAI connector failed"

    def __init__(
        self,
        message: str | None = None,
        *,
        operation: str,
        remote_status: int | None = None,
        uncertain_outcome: bool = False,
        read_only: bool = False,
        dispatch: str = "sent",
        details: dict[str, Any] | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        merged = {
            "operation": operation,
            "remote_status": remote_status,
            "uncertain_outcome": uncertain_outcome,
            "dispatch": dispatch,
        }
        merged.update(details or {})
        self.operation = operation
        self.remote_status = remote_status
        self.uncertain_outcome = uncertain_outcome
        self.read_only = read_only
        self.dispatch = dispatch
        super().__init__(message, details=merged, retry_after_ms=retry_after_ms)

    @property
    def retryable(self) -> bool:
        return self.read_only and self.category in (Category.TEMPORARY, Category.TRANSPORT)


class ConnectorAuthentication(ConnectorError):
    code = "connector.crewai.authentication"
    default_message = "the sidecar refused the host's credentials"


class ConnectorRemoteTemporary(ConnectorError):
    code = "connector.crewai.remote_temporary"
    category = Category.TEMPORARY
    default_message = "the sidecar is temporarily unable to answer"


class ConnectorRemoteRejected(ConnectorError):
    code = "connector.crewai.remote_rejected"
    default_message = "the sidecar rejected the request"


class ConnectorTransport(ConnectorError):
    code = "connector.crewai.transport"
    category = Category.TRANSPORT
    default_message = "the sidecar could not be reached"


class ConnectorStreamSilent(ConnectorTransport):
    """The sidecar's event stream sent nothing (not even a keep-alive) for a
    few keep-alive intervals. The host reconciles from the job view and
    follows the job again; it never calls the run cancelled for this
    (ARCHITECTURE.md §8). Details add ``silence_seconds``."""

    code = "connector.crewai.stream_silent"
    default_message = "the sidecar's event stream went silent"


class ConnectorInvalidStream(ConnectorError):
    code = "connector.crewai.invalid_stream"
    default_message = "the sidecar sent an invalid event stream"


class ConnectorResponseTooLarge(ConnectorError):
    code = "connector.crewai.response_too_large"
    default_message = "the sidecar response exceeded its bound"


class ConnectorCancelledUnconfirmed(ConnectorError):
    code = "connector.crewai.cancelled_unconfirmed"
    default_message = "cancellation was requested but the sidecar did not confirm it"


class ConnectorCrewBusy(ConnectorError):
    """The sidecar refused the job before admitting it because a job of the same tenant and crew is
    active (409 ``sidecar.crew_busy``: a ``memory_reset`` beside a run, or a job beside a running
    ``memory_reset``). Nothing ran (``uncertain_outcome: false``): retryable, once that
    job is finished, as a new action (a new idempotency key: this one keeps this result).
    docs/security.md "Tenant-scoped crew state"."""

    code = "connector.crewai.crew_busy"
    category = Category.TEMPORARY
    default_message = (
        "the sidecar refused the job because another job of this crew is queued or running for the tenant "
        "(409 sidecar.crew_busy); nothing ran; retry when it is finished, with a new idempotency key"
    )

    @property
    def retryable(self) -> bool:
        return True


class ConnectorDispatchDeadline(ConnectorError):
    """A start the sidecar provably never admitted (no connection, 503 before
    admission, 507) was retried with backoff until the host's
    ``dispatch_deadline_seconds`` passed: nothing ran (``uncertain_outcome:
    false``, ``dispatch: not_sent``). Details add ``deadline_seconds``,
    ``attempts`` and ``last_cause`` (the code of the last refusal).
    ARCHITECTURE.md §9 (dispatch)."""

    code = "connector.crewai.dispatch_deadline"
    category = Category.TEMPORARY
    default_message = (
        "the sidecar did not admit the action before the dispatch deadline (it was unreachable, draining or "
        "full); nothing ran; retry later, with a new idempotency key"
    )

    @property
    def retryable(self) -> bool:
        """Nothing ran: submitting again is safe (ARCHITECTURE.md §9)."""
        return True


class ConnectorExecutionFailed(ConnectorError):
    code = "connector.crewai.execution_failed"
    default_message = "the crew failed"


class ConnectorConfigurationOrInput(ConnectorError):
    code = "connector.crewai.configuration_or_input"
    category = Category.PERMANENT
    default_message = "the sidecar refused the crew configuration or the input"


def all_error_classes() -> list[type[AipError]]:
    """Every concrete error class, for the uniqueness test and the docs."""
    seen: list[type[AipError]] = []
    stack: list[type[AipError]] = [AipError]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return seen
