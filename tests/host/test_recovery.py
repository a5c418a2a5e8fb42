"""Recovery's rules directly, in-process over a real SQLite store and the scripted fake sidecar
(docs/ARCHITECTURE.md §9 "Final results"): which stored results are final, and the correction of one that
is not: the sidecar's terminal event replaces it, a job the sidecar does not know marks it reconciled (then
final), and a final result is never touched."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from kits.hostapp import open_action_service
from kits.poll import until_async
from structlog.testing import capture_logs

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import ActionResult
from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
from aip_crewai.host.actions import recovery
from aip_crewai.host.actions.lifecycle import ActionEvent, DispatchState
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.recovery import correct, is_final
from aip_crewai.host.http import lifespan
from aip_crewai.host.store.records import StoreUnavailable

ALL = frozenset(ops.OPERATION_NAMES)


@pytest.fixture
async def env(tmp_path):
    service, sidecar, http, _ = await open_action_service(tmp_path, {"acme": {"support": ALL}})
    yield service, sidecar
    await http.aclose()
    await service.store.close()


async def stored(service, action_id: str, result: ActionResult):
    await service.writer.create(
        ActionEvent.ADMIT, "acme", action_id, "cap:crewai:support", "support", "run", '{"ticket":"t"}', "h", "svc", None
    )
    return await service.writer.finish("acme", action_id, result, DispatchState.SENT.value)


def uncertain(action_id: str) -> ActionResult:
    return failed_result(action_id, ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True))


async def test_only_an_uncertain_failure_of_a_started_job_is_provisional(env):
    service, _ = env
    provisional = await stored(service, "f1", uncertain("f1"))
    assert not is_final(provisional, await service.result(provisional))
    certain = await stored(
        service, "f2", failed_result("f2", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=False))
    )
    assert is_final(certain, await service.result(certain))
    done = await stored(service, "f3", ActionResult(action_id="f3", status="completed", output={"raw": "x"}))
    assert is_final(done, await service.result(done))


async def test_the_sidecars_terminal_event_replaces_a_provisional_result(env):
    service, sidecar = env
    sidecar._admit({"crew_id": "support", "action_id": "acme:c1", "operation": "run", "input": {"ticket": "t"}})
    record = await stored(service, "c1", uncertain("c1"))
    corrected = await correct(service, record)
    assert corrected is not None and corrected.status == "completed"
    assert is_final(corrected, await service.result(corrected)) and sidecar.executions == 1


async def test_a_job_the_sidecar_does_not_know_is_marked_reconciled_and_final(env):
    service, sidecar = env
    record = await stored(service, "u1", uncertain("u1"))
    corrected = await correct(service, record)
    assert corrected is not None and corrected.status == "failed"
    details = msgspec.json.decode(corrected.result_json)["error"]["details"]
    assert details["reconciled"] == "job_unknown" and details["uncertain_outcome"] is True
    assert is_final(corrected, await service.result(corrected))
    assert await correct(service, corrected) is None and sidecar.executions == 0


async def test_a_final_result_is_never_corrected(env):
    service, sidecar = env
    sidecar._admit({"crew_id": "support", "action_id": "acme:n1", "operation": "run", "input": {"ticket": "t"}})
    record = await stored(service, "n1", ActionResult(action_id="n1", status="cancelled", output={}))
    assert await correct(service, record) is None
    assert (await service.store.get_action("acme", "n1")).status == "cancelled"


async def test_a_reconciliation_or_purge_the_store_cannot_serve_now_logs_no_traceback(env, monkeypatch):
    # A store fault (a row locked from outside, the database gone) is logged by the store; the housekeeping
    # loops used to add a traceback on every pass, as if it were a bug.
    service, _ = env
    record = await stored(service, "r1", uncertain("r1"))

    calls: list[object] = []

    async def unavailable(*args: object) -> None:
        calls.append(args)
        raise StoreUnavailable()

    monkeypatch.setattr(service, "refresh", unavailable)
    monkeypatch.setattr(service.store, "purge_message_ids", unavailable)
    monkeypatch.setattr(lifespan, "PURGE_INTERVAL_S", 0.0)
    with capture_logs() as logs:
        await recovery._settle(service, record)
        purge = asyncio.create_task(lifespan._purge_loop(service.store))
        await until_async(lambda: len(calls) >= 3, timeout=10, what="two failed purges")
        purge.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await purge
    assert [(entry["event"], entry.get("code")) for entry in logs] == [("reconcile_deferred", "store.unavailable")]
    assert not any("exc_info" in entry for entry in logs)
