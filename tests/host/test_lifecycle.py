"""The lifecycle tables (pure): transitions, cancellation outcomes, AIP vocabularies."""

import pytest

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import VOCABULARIES
from aip_crewai.host.lifecycle import (
    CANCEL_OUTCOMES,
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
)


def test_terminal_states_are_left_by_no_event():
    assert all(not (t.sources & TERMINAL_STATES) for t in TRANSITIONS.values())
    for terminal in TERMINAL_STATES:
        assert not any(allowed(terminal, target) for target in ActionState)


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
