"""How the host's stored action states read in AIP's vocabularies (pure).

The host store keeps an action in one of five states (``pending_approval``,
``running``, ``completed``, ``failed``, ``cancelled``) plus how far its
request got to the sidecar (``dispatch``: ``not_sent``, ``sent``,
``acknowledged``). AIP clients see them as an ActionLifecycleState (the
``state`` of ``GET /aip/v1/actions/{id}``) and an AckStatus (the first
frame of a stream, the 202 of a call still running, the answer to an
``async`` call). The two tables below are the only place that mapping lives.

Source: AIP 1.0 schemas action_status (ActionLifecycleState), ack
(AckStatus); README "AIP 1.0 conformance".
"""

from __future__ import annotations

from ..contracts.aip import AckStatus, ActionLifecycleState

#: Stored states with a final result.
TERMINAL_STATES = frozenset({"completed", "failed", "cancelled"})

#: (stored state, dispatch) -> AIP lifecycle state. A running action whose
#: request has not left the host is ``queued``; once sent, ``running``.
LIFECYCLE: dict[tuple[str, str], ActionLifecycleState] = {
    **{("pending_approval", d): "pending_approval" for d in ("not_sent", "sent", "acknowledged")},
    ("running", "not_sent"): "queued",
    ("running", "sent"): "running",
    ("running", "acknowledged"): "running",
    **{(s, d): s for s in TERMINAL_STATES for d in ("not_sent", "sent", "acknowledged")},  # type: ignore[misc]
}


def lifecycle_state(status: str, dispatch: str) -> ActionLifecycleState:
    """The AIP ActionLifecycleState of a stored action.

    Args:
        status: the stored state (one of the five above).
        dispatch: ``not_sent`` | ``sent`` | ``acknowledged``.

    Returns ``unknown`` for a pair outside the table (never raised: a reader
    of an unexpected row still gets a valid answer).
    """
    return LIFECYCLE.get((status, dispatch), "unknown")


def ack_status(status: str, dispatch: str, *, streaming: bool) -> AckStatus:
    """The AckStatus the host answers for an action it has accepted.

    - ended (a repeat, or a replayed stream): ``cached``, the stored result follows;
    - waiting for its approval: ``accepted`` (the ack's ``reason`` says ``pending_approval``);
    - running, request not yet sent: ``queued``;
    - running: ``streaming`` when a stream follows, else ``accepted``.
    """
    if status in TERMINAL_STATES:
        return "cached"
    if status == "running" and dispatch == "not_sent":
        return "queued"
    if status == "running" and streaming:
        return "streaming"
    return "accepted"


def ack_reason(status: str) -> str | None:
    """The ack's ``reason``: the stored state when it is not plain running."""
    return None if status == "running" else status
