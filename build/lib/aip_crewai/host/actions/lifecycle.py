"""The action lifecycle, as data (pure; no I/O).

One place for the host's action state machine: the stored states
(:class:`ActionState`), the events that move an action
(:class:`ActionEvent`) and the event-keyed :data:`TRANSITIONS` table; the
runtime-cancellation outcomes of an action (:data:`CANCEL_OUTCOMES`); the
approval binding (:func:`policy_hash`, :func:`approval_admits`); and how a
stored state reads in AIP's vocabularies (:data:`LIFECYCLE`,
:func:`ack_status`). :class:`~aip_crewai.host.actions.writer.ActionWriter` is the
only code that changes an action's or an approval's state, and it moves
states only through this table; the storage layer's ``WHERE`` clauses make a
stale writer change nothing.

State machine (docs/ARCHITECTURE.md "Action states"):

| event | from | to |
|---|---|---|
| ``request_approval`` | (new) | ``pending_approval`` |
| ``admit`` | (new) | ``running`` |
| ``approve`` | ``pending_approval`` | ``running`` |
| ``deny`` / ``expire`` | ``pending_approval`` | ``failed`` |
| ``withdraw`` | ``pending_approval`` | ``cancelled`` (its approval ``withdrawn``) |
| ``mark_sent`` | ``running`` | ``running`` (dispatch ``sent``) |
| ``complete`` | ``running`` | ``completed`` |
| ``fail`` | ``running``, ``pending_approval`` | ``failed`` |
| ``cancel`` | ``running`` | ``cancelled`` |
| ``requeue`` | ``running`` | ``running`` (dispatch back to ``not_sent``: the sidecar provably did not admit the start) |
| ``correct_complete`` / ``correct_fail`` / ``correct_cancel`` | ``failed`` (a provisional result only) | ``completed`` / ``failed`` / ``cancelled`` |

A running action also records how far its request got to the sidecar
(:class:`DispatchState`): ``not_sent`` → ``sent`` → ``acknowledged``, only
forward, except the dispatch's own final word (a refused connection is
``not_sent``).

Source: docs/reference/http-api.md "AIP 1.0 conformance", "The approval flow"; docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ...contracts.aip import AckStatus, ActionLifecycleState
from ...contracts.hashing import canonical_json, sha256_hex


class Vocabulary(str, enum.Enum):
    """Base of the lifecycle's string enums: a member IS its value (``str()``, f-strings, JSON, hashing
    and ``==`` all see ``"running"``), so records carry enums end to end while every stored, logged and
    sent value stays the same string (the behaviour of Python 3.11's ``StrEnum``, on 3.10 too)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(str.__str__(self), spec)


class ActionState(Vocabulary):
    """The stored states of an action (a subset of AIP's ActionLifecycleState)."""

    PENDING_APPROVAL = "pending_approval"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class DispatchState(Vocabulary):
    """How far a running action's request got to the sidecar."""

    NOT_SENT = "not_sent"
    SENT = "sent"  # the request may have reached the sidecar
    ACKNOWLEDGED = "acknowledged"  # the sidecar answered it (admitted the job)


class ApprovalStatus(Vocabulary):
    """The stored statuses of an approval: ``pending`` until its one decision, expiry or withdrawal
    (ARCHITECTURE.md §9 "Approval statuses")."""

    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"
    WITHDRAWN = "withdrawn"


class ActionEvent(Vocabulary):
    """What moves an action (see the module table)."""

    REQUEST_APPROVAL = "request_approval"
    ADMIT = "admit"
    APPROVE = "approve"
    DENY = "deny"
    EXPIRE = "expire"
    WITHDRAW = "withdraw"
    MARK_SENT = "mark_sent"
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"
    REQUEUE = "requeue"
    CORRECT_COMPLETE = "correct_complete"
    CORRECT_FAIL = "correct_fail"
    CORRECT_CANCEL = "correct_cancel"


@dataclass(frozen=True)
class Transition:
    """``sources`` (empty: the action is created by the event) → ``target``."""

    sources: frozenset[ActionState]
    target: ActionState


_S = ActionState
#: The transition table: each event's allowed source states and its target.
TRANSITIONS: dict[ActionEvent, Transition] = {
    ActionEvent.REQUEST_APPROVAL: Transition(frozenset(), _S.PENDING_APPROVAL),
    ActionEvent.ADMIT: Transition(frozenset(), _S.RUNNING),
    ActionEvent.APPROVE: Transition(frozenset({_S.PENDING_APPROVAL}), _S.RUNNING),
    ActionEvent.DENY: Transition(frozenset({_S.PENDING_APPROVAL}), _S.FAILED),
    ActionEvent.EXPIRE: Transition(frozenset({_S.PENDING_APPROVAL}), _S.FAILED),
    ActionEvent.WITHDRAW: Transition(frozenset({_S.PENDING_APPROVAL}), _S.CANCELLED),
    ActionEvent.MARK_SENT: Transition(frozenset({_S.RUNNING}), _S.RUNNING),
    ActionEvent.COMPLETE: Transition(frozenset({_S.RUNNING}), _S.COMPLETED),
    ActionEvent.FAIL: Transition(frozenset({_S.RUNNING, _S.PENDING_APPROVAL}), _S.FAILED),
    ActionEvent.CANCEL: Transition(frozenset({_S.RUNNING}), _S.CANCELLED),
    # A start the sidecar provably did not admit: the action waits for its retry, dispatch `not_sent`.
    ActionEvent.REQUEUE: Transition(frozenset({_S.RUNNING}), _S.RUNNING),
    # A provisional result (see `result_is_final`) replaced by what the sidecar's journal says.
    ActionEvent.CORRECT_COMPLETE: Transition(frozenset({_S.FAILED}), _S.COMPLETED),
    ActionEvent.CORRECT_FAIL: Transition(frozenset({_S.FAILED}), _S.FAILED),
    ActionEvent.CORRECT_CANCEL: Transition(frozenset({_S.FAILED}), _S.CANCELLED),
}
#: Stored states with a final result.
TERMINAL_STATES = frozenset({_S.COMPLETED, _S.FAILED, _S.CANCELLED})
#: Stored states an action is created in.
INITIAL_STATES = frozenset({_S.PENDING_APPROVAL, _S.RUNNING})
#: The event that stores a result of each status from ``running``.
RESULT_EVENTS: dict[str, ActionEvent] = {
    "completed": ActionEvent.COMPLETE,
    "failed": ActionEvent.FAIL,
    "cancelled": ActionEvent.CANCEL,
}


#: The event that replaces a provisional result with the sidecar's, by the new result's status.
CORRECTION_EVENTS: dict[str, ActionEvent] = {
    "completed": ActionEvent.CORRECT_COMPLETE,
    "failed": ActionEvent.CORRECT_FAIL,
    "cancelled": ActionEvent.CORRECT_CANCEL,
}
#: Connector error codes of a stored failure that the sidecar's job may still contradict.
PROVISIONAL_CODES = frozenset(
    {
        "connector.crewai.remote_temporary",
        "connector.crewai.cancelled_unconfirmed",
        "connector.crewai.transport",
        "connector.crewai.invalid_stream",
        "connector.crewai.response_too_large",
    }
)
#: ``remote_status`` of a blocking start whose wait ended before the job did (409, 502, 504: the job was read).
_STILL_RUNNING_STATUSES = frozenset({409, 502, 504})
#: Compact-JSON fragments one of which a provisional result's text holds (the store's prefilter of
#: :func:`result_is_final`: uncertain, or a status of a wait that ended first).
PROVISIONAL_MARKERS = ('"uncertain_outcome":true', *(f'"remote_status":{s}' for s in sorted(_STILL_RUNNING_STATUSES)))


def result_is_final(
    status: ActionState, *, startable: bool, error_code: str | None, details: dict[str, object] | None
) -> bool:
    """Whether a stored result is final: the host will not change it
    (ARCHITECTURE.md §9 "Final results"). Pure.

    Every ``completed`` and ``cancelled`` result is final, and every failure
    except a *provisional* one: an action that started a sidecar job
    (``startable``) failed with one of :data:`PROVISIONAL_CODES` while the job
    may have been admitted and may still end otherwise: ``uncertain_outcome:
    true``, or a ``remote_temporary`` whose blocking wait ended before the job
    (``remote_status`` 409, 502 or 504). A result the reconciler marked
    ``reconciled`` (the sidecar no longer knows the job) is final as it is.
    ``status``: the stored state; ``details``: the error's details (None: none).
    """
    if not is_terminal(status):
        return False
    if status != ActionState.FAILED or not startable or error_code not in PROVISIONAL_CODES:
        return True
    facts = details or {}
    if facts.get("reconciled"):
        return True
    if facts.get("uncertain_outcome") is True:
        return False
    return not (
        error_code == "connector.crewai.remote_temporary" and facts.get("remote_status") in _STILL_RUNNING_STATUSES
    )


def allowed(source: str | ActionState, target: str | ActionState) -> bool:
    """Whether some event moves ``source`` to ``target`` (the storage layer's guard). Pure."""
    try:
        src, dst = ActionState(source), ActionState(target)
    except ValueError:
        return False
    return any(src in t.sources and t.target is dst for t in TRANSITIONS.values())


def is_terminal(status: str) -> bool:
    """Whether a stored state has a final result."""
    return status in {s.value for s in TERMINAL_STATES}


# --- the approval binding -------------------------------------------------------


def policy_hash(tenant: str, action_id: str, capability_id: str, hashed_input: str) -> str:
    """The hash an approval binds: tenant, action id, capability and input hash (docs/approvals.md "The approval flow")."""
    return sha256_hex(
        canonical_json(
            {"tenant": tenant, "action_id": action_id, "capability_id": capability_id, "input_hash": hashed_input}
        )
    )


class ApprovalFacts(Protocol):
    """What :func:`approval_admits` reads of a stored approval."""

    @property
    def status(self) -> ApprovalStatus: ...
    @property
    def policy_hash(self) -> str: ...
    @property
    def decided_at(self) -> int | None: ...
    @property
    def expires_at(self) -> int: ...


class ActionFacts(Protocol):
    """What :func:`approval_admits` reads of a stored action."""

    @property
    def tenant(self) -> str: ...
    @property
    def action_id(self) -> str: ...
    @property
    def capability_id(self) -> str: ...
    @property
    def input_hash(self) -> str: ...


def approval_admits(approval: ApprovalFacts, record: ActionFacts) -> bool:
    """Whether ``approval`` lets ``record`` run: approved, bound to this exact
    action (tenant, action id, capability, input hash: the policy hash), and
    decided before it expired (docs/approvals.md "The approval flow"). Pure."""
    return (
        approval.status == ApprovalStatus.APPROVED
        and approval.policy_hash
        == policy_hash(record.tenant, record.action_id, record.capability_id, record.input_hash)
        and not (approval.decided_at is not None and approval.decided_at >= approval.expires_at)
    )


# --- runtime cancellation (docs/reference/http-api.md "Capabilities") -------------------------------


class CancelCase(Vocabulary):
    """Which row of the cancellation table applies to an action now."""

    ENDED = "ended"  # already terminal: its result stands
    NOT_CANCELLABLE = "not_cancellable"  # memory_reset, cancel: 409
    WITHDRAW = "withdraw"  # pending approval: nothing was sent
    DETACH_READ = "detach_read"  # status, knowledge_query: stop waiting, nothing to stop
    DETACH_STREAM = "detach_stream"  # events: stop following; the target job is untouched
    STOP_REMOTE = "stop_remote"  # run, batch_run, replay, train, test: the sidecar's cancel
    DEQUEUE = "dequeue"  # queued for a retry of a start the sidecar did not admit: nothing was admitted


@dataclass(frozen=True)
class CancelOutcome:
    """What a cancel of one case stores: the result status and output, or an error."""

    status: str | None  # None: the case stores nothing (ended, refused)
    output: dict[str, object] | None = None
    description: str = ""


#: The cancellation outcomes. STOP_REMOTE's output is completed with
#: ``provider_stop_observed`` from the sidecar's answer; when the sidecar does
#: not confirm, the result is ``failed`` with ``connector.crewai.cancelled_unconfirmed``.
CANCEL_OUTCOMES: dict[CancelCase, CancelOutcome] = {
    CancelCase.ENDED: CancelOutcome(None, description="the stored result, unchanged"),
    CancelCase.NOT_CANCELLABLE: CancelOutcome(None, description="409 action.not_cancellable"),
    CancelCase.WITHDRAW: CancelOutcome(
        "cancelled",
        {"remote_stop_confirmed": False, "provider_effect": "none"},
        "cancelled; its approval withdrawn in the same commit",
    ),
    CancelCase.DETACH_READ: CancelOutcome(
        "cancelled",
        {"remote_stop_confirmed": False, "provider_effect": "read_only", "completion_unobserved": True},
        "cancelled; the read may still complete at the sidecar (no effect)",
    ),
    CancelCase.DETACH_STREAM: CancelOutcome(
        "cancelled",
        {
            "stream_detached": True,
            "remote_stop_confirmed": False,
            "provider_effect": "read_only",
            "completion_unobserved": True,
        },
        "cancelled; the followed job is untouched",
    ),
    CancelCase.DEQUEUE: CancelOutcome(
        "cancelled",
        {"remote_stop_confirmed": False, "provider_effect": "none"},
        "cancelled before its start was sent, or while waiting to retry a start the sidecar did not admit",
    ),
    CancelCase.STOP_REMOTE: CancelOutcome(
        "cancelled",
        {"remote_stop_confirmed": True},
        "the sidecar's cancel; confirmed: cancelled, else cancelled_unconfirmed",
    ),
}
#: Operations that can never be cancelled once admitted.
NOT_CANCELLABLE_OPERATIONS = frozenset({"memory_reset", "cancel"})


def cancel_case(status: ActionState, operation: str, *, read_only: bool) -> CancelCase:
    """The :class:`CancelCase` of an action in stored state ``status``. Pure."""
    if is_terminal(status):
        return CancelCase.ENDED
    if operation in NOT_CANCELLABLE_OPERATIONS:
        return CancelCase.NOT_CANCELLABLE
    if status == ActionState.PENDING_APPROVAL:
        return CancelCase.WITHDRAW
    if read_only:
        return CancelCase.DETACH_STREAM if operation == "events" else CancelCase.DETACH_READ
    return CancelCase.STOP_REMOTE


# --- AIP vocabularies ---------------------------------------------------------------

#: (stored state, dispatch) -> AIP ActionLifecycleState. A running action whose
#: request has not left the host is ``queued``; once sent, ``running``.
LIFECYCLE: dict[tuple[str, str], ActionLifecycleState] = {
    **{("pending_approval", d.value): "pending_approval" for d in DispatchState},
    ("running", "not_sent"): "queued",
    ("running", "sent"): "running",
    ("running", "acknowledged"): "running",
    **{(s.value, d.value): s.value for s in TERMINAL_STATES for d in DispatchState},
}


def lifecycle_state(status: ActionState, dispatch: DispatchState) -> ActionLifecycleState:
    """The AIP ActionLifecycleState of a stored action (``unknown`` for a pair outside the table)."""
    return LIFECYCLE.get((status, dispatch), "unknown")


def ack_status(status: ActionState, dispatch: DispatchState, *, streaming: bool) -> AckStatus:
    """The AckStatus the host answers for an action it has accepted.

    - ended (a repeat, or a replayed stream): ``cached``, the stored result follows;
    - waiting for its approval: ``accepted`` (the ack's ``reason`` says ``pending_approval``);
    - running, request not yet sent: ``queued``;
    - running: ``streaming`` when a stream follows, else ``accepted``.
    """
    if is_terminal(status):
        return "cached"
    if status == ActionState.RUNNING and dispatch == DispatchState.NOT_SENT:
        return "queued"
    if status == ActionState.RUNNING and streaming:
        return "streaming"
    return "accepted"


def ack_reason(status: ActionState) -> str | None:
    """The ack's ``reason``: the stored state when it is not plain running."""
    return None if status == ActionState.RUNNING else status.value
