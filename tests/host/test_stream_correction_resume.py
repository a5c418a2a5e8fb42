"""A tenant resuming an action's stream after a provisional result never skips the chunks its correction
backfilled (docs/reference/http-api.md "Stream positions"; ARCHITECTURE.md §9 "Final results"): the
provisional result's frames take the sub-positions ``sse_<C>.1``, ``sse_<C>.2``, and a ``Last-Event-ID``
naming one, once the result was corrected, resumes at the first chunk the tenant was not sent.

In-process: the host app over a SQLite store and a scripted sidecar whose job is still running when the
tenant first reads the provisional result, and completes with more chunks afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import msgspec
import pytest
from kits import aip
from kits.fake_sidecar import FakeJob, FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, open_action_service, running

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import StreamChunk
from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
from aip_crewai.contracts.hashing import canonical_json
from aip_crewai.host.actions.idempotency import fence_hash
from aip_crewai.host.actions.lifecycle import ActionEvent, DispatchState
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.stream_positions import parse

DATA = 6  # llm chunks of the job: its stream is started, DATA chunks, completed
EVENTS = DATA + 2  # chunks of the corrected action: progress, DATA data, done
STORED = 3  # chunks the host stored before its provisional result
CAPABILITY, INPUT, KEY = "cap:crewai:beta", {"topic": "tides"}, "key-r1"
SSE = {**bearer("acme-invoker"), "Accept": "text/event-stream"}


class ProgressingSidecar(FakeSidecar):
    """Job ``acme:r1`` (crew beta, ``run``): while ``running`` its journal holds its first ``STORED``
    events and its view says running; :meth:`finish` gives it every event, ending ``completed``."""

    def __init__(self) -> None:
        super().__init__(SIDECAR_TOKEN)
        chunks = [
            {"event": "chunk", "sequence": s, "data": {"content": f"c{s}", "channel": "llm"}}
            for s in range(1, DATA + 1)
        ]
        self.all_events = [
            {"event": "started", "sequence": 0, "data": {"status": "running", "operation": "run"}},
            *chunks,
            {"event": "completed", "sequence": DATA + 1, "data": {"raw": "done", "tasks_output": []}},
        ]
        self.jobs["acme:r1"] = FakeJob("acme:r1", "beta", "run", INPUT, events=self.all_events[:STORED])

    def finish(self) -> None:
        self.jobs["acme:r1"].events = list(self.all_events)


@pytest.fixture
async def seeded(settings: Any) -> None:
    """The store a host left: action r1 ran, stored ``STORED`` chunks, then failed ``cancelled_unconfirmed``
    with ``uncertain_outcome: true`` (a provisional result) while the job ran on at the sidecar."""
    tenants = {"acme": {"beta": frozenset(ops.OPERATION_NAMES)}}
    service, _, http, _ = await open_action_service(settings.store_path.parent, tenants)
    try:
        await service.writer.create(
            ActionEvent.ADMIT,
            "acme",
            "r1",
            CAPABILITY,
            "beta",
            "run",
            canonical_json(INPUT).decode(),
            fence_hash(CAPABILITY, INPUT),
            "acme-invoker",
            KEY,
            dispatch=DispatchState.SENT,
        )
        rows = [
            (s, msgspec.json.encode(StreamChunk("r1", s, "progress" if s == 0 else "data", data={"s": s})).decode())
            for s in range(STORED)
        ]
        await service.store.append_chunks("acme", "r1", rows)
        unconfirmed = ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True, dispatch="sent")
        await service.writer.finish("acme", "r1", failed_result("r1", unconfirmed), DispatchState.SENT)
    finally:
        await http.aclose()
        await service.store.close()


@pytest.fixture
def sidecar_job() -> ProgressingSidecar:
    return ProgressingSidecar()


@pytest.fixture
async def http(make_app: Any, sidecar_job: ProgressingSidecar, seeded: None) -> Any:
    async with running(make_app(sidecar_transport=sidecar_job.transport())) as client:
        yield client


Frame = tuple[str, str, Any]  # (event, id, data)


async def stream(http: httpx2.AsyncClient, last_event_id: str | None = None) -> tuple[int, list[Frame]]:
    """``GET /aip/v1/actions/r1/events`` as SSE (after ``last_event_id``): status and frames."""
    headers = {**SSE, **({"Last-Event-ID": last_event_id} if last_event_id else {})}
    response = await http.get("/aip/v1/actions/r1/events", headers=headers)
    return response.status_code, [(e, i or "", d) for e, i, d in aip.sse_events(response.content)]


def chunk_sequences(frames: list[Frame]) -> list[int]:
    return [d["body"]["stream_chunk"]["sequence"] for e, _, d in frames if e in ("chunk", "done")]


def result_of(frames: list[Frame]) -> dict[str, Any]:
    assert frames[-1][0] == "result", frames[-1]
    return frames[-1][2]["body"]["action_result"]


async def provisional_stream(http: httpx2.AsyncClient) -> list[Frame]:
    status, frames = await stream(http)
    assert status == 200
    return frames


async def test_a_provisional_result_takes_sub_positions_after_its_chunks(http):
    frames = await provisional_stream(http)
    ids = [i for _, i, _ in frames]
    assert ids == ["sse_0", "sse_1", "sse_2", "sse_3", "sse_3.1", "sse_3.2"]
    assert [e for e, _, _ in frames] == ["ack", "chunk", "chunk", "chunk", "aip_error", "result"]
    assert result_of(frames)["error"]["details"]["uncertain_outcome"] is True
    # still the action's result: a resume after its result frame is 204, after its error frame the result
    assert (await stream(http, "sse_3.2"))[0] == 204
    status, rest = await stream(http, "sse_3.1")
    assert status == 200 and [(e, i) for e, i, _ in rest] == [("result", "sse_3.2")]


async def test_a_resume_after_the_provisional_result_gets_every_backfilled_chunk_once_then_the_final_result(
    http, sidecar_job
):
    seen = await provisional_stream(http)
    sidecar_job.finish()  # the job completes: the next read corrects the action with the whole stream
    status, resumed = await stream(http, seen[-1][1])
    assert status == 200
    assert chunk_sequences(resumed) == list(range(STORED, EVENTS))
    assert resumed[-2][0] == "done" and result_of(resumed)["status"] == "completed"
    assert [i for _, i, _ in resumed] == [f"sse_{n}" for n in range(STORED + 1, EVENTS + 2)]
    assert chunk_sequences(seen) + chunk_sequences(resumed) == list(range(EVENTS))
    # the final stream ended: a resume after its result frame is 204
    assert (await stream(http, resumed[-1][1]))[0] == 204


async def test_every_split_point_of_the_provisional_stream_resumes_without_a_gap_or_a_repeat(http, sidecar_job):
    """The tenant saw the provisional stream up to any of its frames, then the correction landed: what it
    saw plus the resumed frames hold every chunk once, in order, then the final result, ids growing."""
    first = await provisional_stream(http)
    sidecar_job.finish()
    for cut in range(1, len(first) + 1):
        seen = first[:cut]
        status, resumed = await stream(http, seen[-1][1])
        assert status == 200, cut
        assert chunk_sequences(seen) + chunk_sequences(resumed) == list(range(EVENTS)), cut
        assert result_of(resumed)["status"] == "completed", cut
        positions = [parse(i) for _, i, _ in seen + resumed]
        assert positions == sorted(set(positions)), cut  # strictly growing: no id named twice


async def test_the_json_events_page_resumes_the_same_way(http, sidecar_job):
    page = (await http.get("/aip/v1/actions/r1/events", headers=bearer("acme-invoker"))).json()
    assert [e["id"] for e in page["events"]][-2:] == ["sse_3.1", "sse_3.2"] and page.get("cursor") is None
    sidecar_job.finish()
    resumed = (await http.get("/aip/v1/actions/r1/events?cursor=sse_3.2", headers=bearer("acme-invoker"))).json()
    assert [c["sequence"] for c in resumed["chunks"]] == list(range(STORED, EVENTS))
    assert [e["id"] for e in resumed["events"]] == [f"sse_{n}" for n in range(STORED + 1, EVENTS + 2)]
    assert resumed["events"][-1]["data"]["status"] == "completed" and resumed.get("cursor") is None


async def test_a_re_post_of_the_envelope_with_last_event_id_resumes_the_same_way(http, sidecar_job):
    await provisional_stream(http)
    sidecar_job.finish()
    env = aip.envelope(aip.action("r1", CAPABILITY, INPUT, KEY), message_id="msg_again")
    response = await http.post(
        "/aip/v1/messages",
        content=json.dumps(env),
        headers={**SSE, "Content-Type": "application/aip+json", "Last-Event-ID": "sse_3.2"},
    )
    assert response.status_code == 200, response.text
    frames = list(aip.sse_events(response.content))
    assert [d["body"]["stream_chunk"]["sequence"] for e, _, d in frames if e in ("chunk", "done")] == list(
        range(STORED, EVENTS)
    )
    assert frames[-1][0] == "result" and frames[-1][2]["body"]["action_result"]["status"] == "completed"


async def test_a_resume_with_a_chunk_id_works_as_before(http, sidecar_job):
    seen = await provisional_stream(http)
    sidecar_job.finish()
    status, resumed = await stream(http, "sse_2")  # after chunk 1: chunks 2.. (the stored and the backfilled)
    assert status == 200 and chunk_sequences(resumed) == list(range(2, EVENTS))
    assert [i for _, i, _ in resumed][0] == "sse_3" and result_of(resumed)["status"] == "completed"
    assert chunk_sequences(seen)[:2] + chunk_sequences(resumed) == list(range(EVENTS))
