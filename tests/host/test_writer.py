"""The writer's rules, in-process over a real SQLite store (docs/ARCHITECTURE.md "Action states"): every
method applies one lifecycle event from its table sources only, so a stale writer changes nothing; a result
is stored only by the event that stores its status; a withdrawal is a cancellation; every stored result is
counted once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aip_crewai.contracts.aip import ActionResult
from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
from aip_crewai.host.actions.lifecycle import ActionEvent, ActionState, DispatchState
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.writer import ActionWriter
from aip_crewai.host.store.store import Store

T0 = 1_800_000_000_000


class Counted:
    """A stand-in for the host metrics' ``actions`` and ``stream_errors`` counters."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[tuple[str, str], ...]] = Counter()

    def inc(self, **labels: str) -> None:
        self.counts[tuple(sorted(labels.items()))] += 1


class Metrics:
    def __init__(self) -> None:
        self.actions = Counted()
        self.stream_errors = Counted()


@pytest.fixture
async def writer(tmp_path: Path) -> Any:
    tmp_path.chmod(0o700)
    store = await Store.open(tmp_path / "host.db", clock=lambda: T0 / 1000)
    try:
        yield ActionWriter(store, metrics=Metrics())
    finally:
        await store.close()


async def create(writer: ActionWriter, action_id: str, event: ActionEvent = ActionEvent.ADMIT, **kw: Any) -> Any:
    created, record = await writer.create(
        event, "acme", action_id, "cap:crewai:beta", "beta", "run", '{"topic":"t"}', "h", "acme-invoker", None, **kw
    )
    assert created
    return record


def completed(action_id: str) -> ActionResult:
    return ActionResult(action_id=action_id, status="completed", output={"raw": "done"})


async def test_create_applies_only_the_events_that_create_an_action(writer):
    assert (await create(writer, "a1")).status == ActionState.RUNNING
    pending = await create(writer, "a2", ActionEvent.REQUEST_APPROVAL, approval_id="apr_2")
    assert pending.status == ActionState.PENDING_APPROVAL and pending.approval_id == "apr_2"
    with pytest.raises(ValueError, match="does not create an action"):
        await create(writer, "a3", ActionEvent.COMPLETE)
    assert await writer.store.get_action("acme", "a3") is None


async def test_the_first_result_stands_and_a_stale_writer_changes_nothing(writer):
    await create(writer, "r1")
    first = await writer.finish("acme", "r1", completed("r1"), DispatchState.ACKNOWLEDGED.value)
    assert first is not None and first.status == ActionState.COMPLETED
    late = failed_result("r1", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True))
    assert await writer.finish("acme", "r1", late, None) is None
    stored = await writer.store.get_action("acme", "r1")
    assert stored.status == ActionState.COMPLETED and msgspec.json.decode(stored.result_json)["status"] == "completed"
    assert writer.metrics.actions.counts == Counter({(("operation", "run"), ("status", "completed")): 1})


async def test_a_result_is_stored_only_by_the_event_that_stores_its_status(writer):
    await create(writer, "e1")
    with pytest.raises(ValueError, match="stores failed, not a completed result"):
        await writer.finish("acme", "e1", completed("e1"), None, event=ActionEvent.FAIL)
    assert (await writer.store.get_action("acme", "e1")).status == ActionState.RUNNING


async def test_only_from_limits_the_source_state(writer):
    """``fail`` starts from running or pending_approval; ``only_from`` narrows it to one of them."""
    await create(writer, "o1", ActionEvent.REQUEST_APPROVAL, approval_id="apr_o1")  # pending
    failed = failed_result("o1", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=False))
    assert await writer.finish("acme", "o1", failed, None, only_from=ActionState.RUNNING) is None
    assert (await writer.store.get_action("acme", "o1")).status == ActionState.PENDING_APPROVAL
    with pytest.raises(ValueError, match="not allowed"):  # complete never starts from pending_approval
        await writer.finish("acme", "o1", completed("o1"), None, only_from=ActionState.PENDING_APPROVAL)
    assert await writer.finish("acme", "o1", failed, None, only_from=ActionState.PENDING_APPROVAL) is not None


async def test_withdraw_cancels_a_pending_action_only(writer):
    pending = await create(writer, "w1", ActionEvent.REQUEST_APPROVAL, approval_id="apr_w1")
    await writer.open_approval(pending, "hash", T0 + 60_000)
    cancelled = ActionResult(action_id="w1", status="cancelled", output={})
    with pytest.raises(ValueError, match="a withdrawn action is cancelled"):
        await writer.withdraw("acme", "w1", completed("w1"))
    withdrawn = await writer.withdraw("acme", "w1", cancelled)
    assert withdrawn is not None and withdrawn.status == ActionState.CANCELLED
    assert (await writer.store.get_approval("acme", "apr_w1")).status == "withdrawn"
    await create(writer, "w2")  # running: not withdrawn
    assert await writer.withdraw("acme", "w2", ActionResult(action_id="w2", status="cancelled", output={})) is None


async def test_requeue_and_mark_sent_move_only_a_running_action(writer):
    await create(writer, "q1", dispatch=DispatchState.SENT)
    requeued = await writer.requeue("acme", "q1")
    assert requeued is not None and requeued.dispatch == DispatchState.NOT_SENT
    sent = await writer.mark_sent("acme", "q1")
    assert sent is not None and sent.dispatch == DispatchState.SENT
    await writer.finish("acme", "q1", completed("q1"), None)
    assert await writer.requeue("acme", "q1") is None and await writer.mark_sent("acme", "q1") is None


async def test_a_correction_replaces_only_the_result_it_read(writer):
    await create(writer, "c1")
    provisional = failed_result("c1", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True))
    read = await writer.finish("acme", "c1", provisional, DispatchState.SENT.value)
    corrected = await writer.correct(read, completed("c1"))
    assert corrected is not None and corrected.status == ActionState.COMPLETED
    assert corrected.dispatch == DispatchState.ACKNOWLEDGED
    assert await writer.correct(read, completed("c1")) is None  # the stored result is no longer the one read
    running = await create(writer, "c2")
    with pytest.raises(ValueError, match="only a stored result can be corrected"):
        await writer.correct(running, completed("c2"))


async def test_expire_fails_a_pending_action_with_approval_expired(writer):
    pending = await create(writer, "x1", ActionEvent.REQUEST_APPROVAL, approval_id="apr_x1")
    await writer.open_approval(pending, "hash", T0 + 1)
    expired = await writer.expire_due(T0 + 2)
    assert [r.action_id for r in expired] == ["x1"] and expired[0].status == ActionState.FAILED
    assert msgspec.json.decode(expired[0].result_json)["error"]["code"] == "policy.approval_expired"
    assert await writer.expire_due(T0 + 3) == []  # nothing pending is left to expire
