"""The dispatcher's rules directly, in-process over the scripted fake sidecar (docs/ARCHITECTURE.md §8): a job
runs once whatever number of times it is dispatched (the sidecar's admission is keyed by the action), its
chunks reach the caller in order and the dispatch is acknowledged; a sidecar that refuses to cancel (409)
is NotCancellable and the job keeps running; any other failed cancel is unconfirmed."""

from __future__ import annotations

import pytest
from kits.fake_sidecar import FakeSidecar

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import NotCancellable
from aip_crewai.host.actions.dispatch import Dispatcher, Job
from aip_crewai.host.actions.lifecycle import DispatchState
from aip_crewai.host.sidecars.client import SidecarClient
from aip_crewai.host.sidecars.connection import SidecarHttp


@pytest.fixture
async def wired():
    sidecar = FakeSidecar()
    http = SidecarHttp.of("http://127.0.0.1:8090", token=sidecar.token, transport=sidecar.transport())
    yield Dispatcher(SidecarClient(http, max_response_bytes=1 << 20), max_response_bytes=1 << 20), sidecar
    await http.aclose()


def job(action_id: str, *, stream: bool = False) -> Job:
    return Job("acme", action_id, "support", ops.get("run"), {"ticket": "t"}, f"k-{action_id}", stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streamed"])
async def test_a_job_runs_once_and_its_chunks_arrive_in_order(wired, stream):
    dispatcher, sidecar = wired
    chunks = []

    async def on_chunks(batch):
        chunks.extend(batch)

    first = job("d1", stream=stream)
    result = await dispatcher.run(first, on_chunks)
    assert result.status == "completed" and result.output["raw"].startswith("done:")
    assert first.dispatch.state == DispatchState.ACKNOWLEDGED
    assert [c.sequence for c in chunks] == list(range(len(chunks))) and chunks
    again = await dispatcher.run(job("d1", stream=stream), on_chunks)  # the same action dispatched again
    assert again.status == "completed" and sidecar.executions == 1
    assert list(sidecar.jobs) == ["acme:d1"]  # the sidecar's job id carries the tenant


async def test_a_refused_cancel_is_not_cancellable_and_other_failures_are_unconfirmed(wired):
    dispatcher, sidecar = wired
    await dispatcher.run(job("c1"), lambda batch: _none())
    sidecar.cancel_status = 409
    with pytest.raises(NotCancellable):
        await dispatcher.cancel_remote(job("c1"))
    sidecar.cancel_status = 500
    assert await dispatcher.cancel_remote(job("c1")) == (False, {"remote_status": 500})
    sidecar.cancel_status = 200
    confirmed, view = await dispatcher.cancel_remote(job("c1"))
    assert confirmed and view is not None and view["status"] in ("cancelled", "completed", "failed")


async def _none() -> None:
    return None
