"""The lifecycle tables (pure): transitions, cancellation outcomes, AIP vocabularies."""

import pytest

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import VOCABULARIES
from aip_crewai.host.actions.lifecycle import (
    CANCEL_OUTCOMES,
    CORRECTION_EVENTS,
    RESULT_EVENTS,
    TERMINAL_STATES,
    TRANSITIONS,
    ActionEvent,
    ActionState,
    CancelCase,
    DispatchState,
    ack_status,
    allowed,
    cancel_case,
    lifecycle_state,
    result_is_final,
)


def test_terminal_states_are_left_only_by_a_correction_of_a_failure():
    leaving = {event for event, t in TRANSITIONS.items() if t.sources & TERMINAL_STATES}
    assert leaving == set(CORRECTION_EVENTS.values())
    for event in leaving:
        assert TRANSITIONS[event].sources == {ActionState.FAILED}
    for terminal in (ActionState.COMPLETED, ActionState.CANCELLED):
        assert not any(allowed(terminal, target) for target in ActionState)
    assert not allowed(ActionState.FAILED, ActionState.RUNNING)
    assert not allowed(ActionState.FAILED, ActionState.PENDING_APPROVAL)


_UNCERTAIN = {"uncertain_outcome": True, "dispatch": "sent"}


@pytest.mark.parametrize(
    "status, startable, code, details, final",
    [
        ("running", True, None, None, False),
        ("completed", True, None, None, True),
        ("cancelled", True, None, None, True),
        ("failed", True, "connector.crewai.execution_failed", _UNCERTAIN, True),  # the journal's own word
        ("failed", True, "connector.crewai.cancelled_unconfirmed", _UNCERTAIN, False),
        ("failed", True, "connector.crewai.transport", _UNCERTAIN, False),
        ("failed", False, "connector.crewai.transport", _UNCERTAIN, True),  # status/events/cancel: no job of its own
        ("failed", True, "connector.crewai.transport", {"uncertain_outcome": False, "dispatch": "not_sent"}, True),
        (
            "failed",
            True,
            "connector.crewai.remote_temporary",
            {"uncertain_outcome": False, "remote_status": 504},
            False,
        ),
        ("failed", True, "connector.crewai.remote_temporary", {"uncertain_outcome": False, "remote_status": 429}, True),
        ("failed", True, "connector.crewai.cancelled_unconfirmed", {**_UNCERTAIN, "reconciled": "job_unknown"}, True),
        ("failed", True, "connector.crewai.dispatch_deadline", {"uncertain_outcome": False}, True),
        ("failed", True, "policy.approval_denied", None, True),
    ],
)
def test_which_results_are_final(status, startable, code, details, final):
    assert result_is_final(status, startable=startable, error_code=code, details=details) is final


def test_allowed_is_exactly_the_table():
    pairs = {(s, t.target) for t in TRANSITIONS.values() for s in t.sources}
    for source in ActionState:
        for target in ActionState:
            assert allowed(source, target) == ((source, target) in pairs)
    assert not allowed("running", "nonsense") and not allowed("nonsense", "running")


def test_every_event_is_in_the_table_and_results_map_to_their_own_status():
    assert set(TRANSITIONS) == set(ActionEvent)
    for status, event in RESULT_EVENTS.items():
        assert TRANSITIONS[event].target.value == status and ActionState.RUNNING in TRANSITIONS[event].sources
    assert TRANSITIONS[ActionEvent.WITHDRAW].sources == {ActionState.PENDING_APPROVAL}


@pytest.mark.parametrize("spec", ops.CATALOGUE, ids=lambda s: s.name)
def test_cancel_cases_follow_the_operation(spec):
    assert cancel_case("completed", spec.name, read_only=spec.read_only) is CancelCase.ENDED
    running = cancel_case("running", spec.name, read_only=spec.read_only)
    if spec.name in ("memory_reset", "cancel"):
        assert running is CancelCase.NOT_CANCELLABLE
    elif spec.name == "events":
        assert running is CancelCase.DETACH_STREAM
    elif spec.read_only:
        assert running is CancelCase.DETACH_READ
    else:
        assert running is CancelCase.STOP_REMOTE and spec.cancel
    pending = cancel_case("pending_approval", spec.name, read_only=spec.read_only)
    assert pending in (CancelCase.WITHDRAW, CancelCase.NOT_CANCELLABLE)
    assert set(CANCEL_OUTCOMES) == set(CancelCase)


def test_stored_states_read_as_aip_vocabularies():
    for state in ActionState:
        for dispatch in DispatchState:
            assert lifecycle_state(state.value, dispatch.value) in VOCABULARIES["ActionLifecycleState"]
            for streaming in (False, True):
                assert ack_status(state.value, dispatch.value, streaming=streaming) in VOCABULARIES["AckStatus"]
    assert lifecycle_state("running", "not_sent") == "queued" and lifecycle_state("running", "sent") == "running"
    assert lifecycle_state("weird", "sent") == "unknown"
    assert ack_status("completed", "acknowledged", streaming=True) == "cached"
    assert ack_status("running", "sent", streaming=True) == "streaming"
    assert ack_status("pending_approval", "not_sent", streaming=True) == "accepted"
