"""The cancellation rows carried out by ``actions/cancellation.py`` directly, in-process over a real SQLite
store and the scripted fake sidecar (docs/reference/http-api.md "Capabilities"): an ended action keeps its result, memory_reset
is never cancelled, a pending action is withdrawn without anything sent, a running run is stopped at the
sidecar, and another tenant's action is not found."""

from __future__ import annotations

import pytest
from kits.hostapp import open_action_service

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.contracts.errors import ActionNotFound, NotCancellable
from aip_crewai.host.actions.cancellation import cancel, ended_before_cancel
from aip_crewai.host.auth.principals import Principal

ALL = frozenset(ops.OPERATION_NAMES)
INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
OTHER = Principal("svc:beta", "beta", frozenset({"invoker", "approver"}))


@pytest.fixture
async def env(tmp_path):
    service, sidecar, http, clock = await open_action_service(tmp_path, {"acme": {"support": ALL}, "beta": {}})
    yield service, sidecar
    await http.aclose()
    await service.store.close()


def action(action_id, cap="cap:crewai:support", inp=None):
    return Action(id=action_id, capability_id=cap, input=inp or {"ticket": "t"}, idempotency_key=f"k-{action_id}")


async def approved(service, action_id):
    record = await service.submit(INVOKER, action(action_id), None, stream=False)
    decided = await service.decide(APPROVER, record.approval_id, "approved", "ok", service.now_ms())
    assert decided is not None
    return await service.wait(await service.get(INVOKER, action_id), 10)


async def test_a_pending_action_is_withdrawn_and_nothing_is_sent(env):
    service, sidecar = env
    record = await service.submit(INVOKER, action("p1"), None, stream=False)
    result = await cancel(service, INVOKER, "p1")
    assert result.status == "cancelled"
    assert (await service.store.get_action("acme", "p1")).status == "cancelled"
    assert (await service.store.get_approval("acme", record.approval_id)).status == "withdrawn"
    assert sidecar.executions == 0 and sidecar.requests == []


async def test_an_ended_action_keeps_its_result(env):
    service, sidecar = env
    done = await approved(service, "e1")
    assert done.status == "completed"
    result = await cancel(service, INVOKER, "e1")
    assert result.status == "completed" and result.output["raw"].startswith("done:")
    assert (await service.store.get_action("acme", "e1")).status == "completed" and sidecar.executions == 1
    assert not [r for r in sidecar.requests if r.url.path.endswith("/cancel")]  # nothing was asked to stop


async def test_memory_reset_is_never_cancelled(env):
    service, _ = env
    await service.submit(
        INVOKER, action("m1", "cap:crewai:support:memory_reset", {"command_type": "all"}), None, stream=False
    )
    with pytest.raises(NotCancellable):
        await cancel(service, INVOKER, "m1")
    assert (await service.store.get_action("acme", "m1")).status == "pending_approval"


async def test_another_tenants_action_is_not_found(env):
    service, _ = env
    await service.submit(INVOKER, action("t1"), None, stream=False)
    with pytest.raises(ActionNotFound):
        await cancel(service, OTHER, "t1")
    assert (await service.store.get_action("acme", "t1")).status == "pending_approval"


async def test_a_view_that_is_not_final_reads_no_terminal_event():
    """Only a sidecar view saying completed or failed sends the cancel on to read the job's own outcome."""
    for view in (None, {}, {"status": "running"}, {"status": "cancelled"}):
        assert await ended_before_cancel(None, None, view) is None
