"""A result corrected from the sidecar's journal carries the job's whole stream (ARCHITECTURE.md §9
"Final results"): after a stream that repeated a sequence, ended early or was reset more
often than the dispatch rereads it, the action first fails provisionally with the chunks before the break;
its correction reads the journal back from the first event through the host's normalizer and backfills the
chunks the host did not store, so it ends ``completed`` with every chunk, in order, ending with ``done``. The
same holds for a ``cancelled_unconfirmed`` (the cross-host cancel race: 0 chunks stored) and for a cancel
that found the job ended. A journal over the stream's bounds ends in the live stream's typed error, final.

In-process: the action service over a SQLite store and a scripted fake sidecar (``kits.fake_sidecar``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import msgspec
import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import open_action_service

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
from aip_crewai.host.actions import cancellation, dispatch
from aip_crewai.host.actions.lifecycle import ActionEvent, DispatchState
from aip_crewai.host.actions.live import LiveAction
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.recovery import JOURNAL_REFUSED, correct, is_final
from aip_crewai.host.auth.principals import Principal
from aip_crewai.sse import encode_event

INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
DATA = 8  # data chunks of the job: started, 8 llm chunks, completed (10 events)
EVENTS = DATA + 2
BREAK_AT = 4  # the broken reads repeat sequence 3 (the case: 3 of 8 data chunks stored)


class JournalSidecar(FakeSidecar):
    """A job of ``DATA`` llm chunks (``content`` of ``size`` characters) whose first SSE reads break as
    ``faults`` lists, one fault per read, at sequence ``BREAK_AT`` (a reread from past it breaks at once):
    ``repeat``: the event before again; ``early_end``: no terminal event; ``reset``: the connection
    resets. Every later read of the journal is whole. Only job ``acme:r1`` is broken this way."""

    def __init__(self, faults: list[str] | None = None, size: int = 2) -> None:
        super().__init__()
        self.faults = list(faults or [])
        self.size = size
        self.streams = 0

    def _admit(self, body: dict[str, Any]) -> Any:
        job = super()._admit(body)
        if len(job.events) == 3:
            done = job.events[-1]
            chunks = [
                {"event": "chunk", "sequence": s, "data": {"content": f"c{s}".ljust(self.size, "."), "channel": "llm"}}
                for s in range(1, DATA + 1)
            ]
            job.events = [job.events[0], *chunks, {**done, "sequence": DATA + 1}]
        return job

    def _sse(self, events: list[dict[str, Any]]) -> httpx2.Response:
        self.streams += 1
        frames = [encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"])) for e in events]
        fault = self.faults.pop(0) if self.faults else "none"
        headers = {"content-type": "text/event-stream"}
        if fault == "none":
            return httpx2.Response(200, content=b"".join(frames), headers=headers)
        first = int(events[0]["sequence"])
        cut = max(BREAK_AT - first, 0)  # a reread from past the break breaks at once: no progress
        head = frames[:cut]
        if fault == "repeat":
            again = self.jobs["acme:r1"].events[first + cut - 1]  # sequence 3, or the one before the cursor
            body = b"".join(head) + encode_event(json.dumps(again), event=again["event"]) + b"".join(frames[cut:])
            return httpx2.Response(200, content=body, headers=headers)
        if fault == "early_end":
            return httpx2.Response(200, content=b"".join(head), headers=headers)

        async def reset() -> AsyncIterator[bytes]:
            for piece in head:
                yield piece
            raise httpx2.ReadError("connection reset by peer")

        return httpx2.Response(200, content=reset(), headers=headers)

    def journal_bytes(self, job_id: str) -> int:
        """The size of the job's whole journal as one SSE body (what a read from cursor 0 receives)."""
        events = self.jobs[job_id].events
        return sum(len(encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"]))) for e in events)


@pytest.fixture
async def service_with(tmp_path):
    opened: list[tuple[Any, Any]] = []

    async def open_with(sidecar: FakeSidecar) -> Any:
        tenants = {"acme": {"support": frozenset(ops.OPERATION_NAMES)}}
        service, _, http, _ = await open_action_service(tmp_path, tenants, sidecar=sidecar)
        opened.append((service, http))
        return service

    yield open_with
    for service, http in opened:
        await http.aclose()
        await service.store.close()


async def run_live(service: Any, action_id: str = "r1") -> Any:
    """Submit, approve and wait for the dispatch to store its result (no read that would correct it)."""
    action = Action(
        id=action_id, capability_id="cap:crewai:support", input={"topic": "x"}, idempotency_key=f"k-{action_id}"
    )
    pending = await service.submit(INVOKER, action, None, stream=False)
    assert await service.decide(APPROVER, pending.approval_id, "approved", "ok", service.now_ms()) is not None
    live = service.live.get("acme", action_id)
    if live is not None and live.task is not None:
        await live.task
    record = await service.store.get_action("acme", action_id)
    assert record is not None
    return record


async def stream_of(service: Any, action_id: str = "r1") -> list[dict[str, Any]]:
    return [json.loads(c.chunk_json) for c in await service.store.list_chunks("acme", action_id)]


def assert_whole(chunks: list[dict[str, Any]]) -> None:
    assert [c["sequence"] for c in chunks] == list(range(EVENTS))
    assert [c["kind"] for c in chunks] == ["progress", *["data"] * DATA, "done"]
    assert [c["part"]["text"].rstrip(".") for c in chunks if c["kind"] == "data"] == [
        f"c{s}" for s in range(1, DATA + 1)
    ]


def error_of(record: Any) -> dict[str, Any]:
    return msgspec.json.decode(record.result_json)["error"]


# --- a stream broken more often than the dispatch rereads it, then corrected ---------------------------------


@pytest.mark.parametrize(
    "faults",
    [
        ["repeat"] * (dispatch.MAX_INVALID_REREADS + 1),
        ["early_end"] * (dispatch.MAX_INVALID_REREADS + 1),
        ["reset", *["repeat"] * (dispatch.MAX_INVALID_REREADS + 1)],
    ],
    ids=["repeat", "early_end", "reset_then_repeat"],
)
async def test_a_corrected_stream_ends_completed_with_every_chunk_in_order_ending_with_done(service_with, faults):
    sidecar = JournalSidecar(faults)
    service = await service_with(sidecar)
    failed = await run_live(service)
    assert failed.status == "failed" and error_of(failed)["code"] == "connector.crewai.invalid_stream"
    assert failed.chunk_count == BREAK_AT  # started + 3 of 8 data chunks, no done: the case
    assert not is_final(failed, await service.result(failed))
    corrected = await service.get(INVOKER, "r1")  # a read corrects a provisional result
    assert corrected.status == "completed" and corrected.chunk_count == EVENTS
    assert_whole(await stream_of(service))
    assert (await service.result(corrected)).output["raw"].startswith("done:")
    assert sidecar.executions == 1
    journal_reads = [r for r in sidecar.requests if r.url.path == "/jobs/acme:r1/events"]
    assert journal_reads[-1].url.params["cursor"] == "0"  # read back from the first event


async def test_the_reconciler_corrects_with_the_whole_stream_too(service_with):
    from aip_crewai.host.actions.recovery import correct_provisional

    sidecar = JournalSidecar(["repeat"] * (dispatch.MAX_INVALID_REREADS + 1))
    service = await service_with(sidecar)
    assert (await run_live(service)).status == "failed"
    await correct_provisional(service)
    record = await service.store.get_action("acme", "r1")
    assert record.status == "completed" and record.chunk_count == EVENTS
    assert_whole(await stream_of(service))


# --- the cross-host cancel race: failed (cancelled_unconfirmed) with no chunk, then completed ---------------


async def stored_unconfirmed(service: Any, action_id: str, sidecar: JournalSidecar, live_chunks: int) -> Any:
    """What the cancelling host stored while the job ran on: running, ``live_chunks`` chunks, then
    ``cancelled_unconfirmed`` (uncertain) before the job (admitted meanwhile) completed at the sidecar."""
    sidecar._admit({"crew_id": "support", "action_id": f"acme:{action_id}", "operation": "run", "input": {}})
    await service.writer.create(
        ActionEvent.ADMIT, "acme", action_id, "cap:crewai:support", "support", "run", "{}", "h", "svc:acme", None
    )
    if live_chunks:
        rows = [(s, json.dumps({"sequence": s, "kind": "progress", "stored": "live"})) for s in range(live_chunks)]
        await service.store.append_chunks("acme", action_id, rows)
    unconfirmed = ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True, dispatch="sent")
    return await service.writer.finish("acme", action_id, failed_result(action_id, unconfirmed), DispatchState.SENT)


@pytest.mark.parametrize("live_chunks", [0, 2])
async def test_a_cancelled_unconfirmed_action_corrected_to_completed_carries_every_chunk(service_with, live_chunks):
    sidecar = JournalSidecar()
    service = await service_with(sidecar)
    record = await stored_unconfirmed(service, "x1", sidecar, live_chunks)
    assert record.status == "failed" and record.chunk_count == live_chunks
    corrected = await correct(service, record)
    assert corrected is not None and corrected.status == "completed" and corrected.chunk_count == EVENTS
    chunks = await stream_of(service, "x1")
    assert [c["sequence"] for c in chunks] == list(range(EVENTS)) and chunks[-1]["kind"] == "done"
    assert all(c.get("stored") == "live" for c in chunks[:live_chunks])  # never duplicated nor replaced
    assert await correct(service, corrected) is None  # final


async def test_a_journal_that_cannot_be_read_now_leaves_the_provisional_result(service_with, monkeypatch):
    """The journal read breaks and the sidecar stops answering: nothing is written now (the next pass
    tries again), never a ``completed`` without its chunks."""

    class Unreachable(JournalSidecar):
        def handle(self, request: httpx2.Request) -> httpx2.Response:
            if request.url.path == "/jobs/acme:x2" and self.streams > 0:  # after the journal read broke
                raise httpx2.ConnectError("connection refused", request=request)
            return super().handle(request)

    monkeypatch.setattr(dispatch, "READ_RETRY_BUDGET_S", 0.0)
    sidecar = Unreachable(["reset"])
    service = await service_with(sidecar)
    record = await stored_unconfirmed(service, "x2", sidecar, 1)
    assert await correct(service, record) is None
    assert sidecar.streams == 1
    after = await service.store.get_action("acme", "x2")
    assert after.status == "failed" and after.chunk_count == 1 and not is_final(after, await service.result(after))


# --- a cancel that finds the job already ended settles it from the journal, with every chunk --------------


async def test_a_cancel_that_finds_the_job_completed_stores_it_with_every_chunk(service_with):
    sidecar = JournalSidecar()
    service = await service_with(sidecar)
    sidecar._admit({"crew_id": "support", "action_id": "acme:e1", "operation": "run", "input": {}})
    await service.writer.create(
        ActionEvent.ADMIT,
        "acme",
        "e1",
        "cap:crewai:support",
        "support",
        "run",
        "{}",
        "h",
        "svc:acme",
        None,
        dispatch=DispatchState.SENT,
        sidecar="sidecar",  # placed and sent (its dispatch is gone): the cancel goes to the sidecar
    )
    await service.store.append_chunks("acme", "e1", [(0, json.dumps({"sequence": 0, "stored": "live"}))])
    record = await service.store.get_action("acme", "e1")
    service.live.add(LiveAction(job=service.job(record, stream=True)))  # its follower stopped (no task): a read
    # does not reconcile it, and nothing but the cancel stores its end
    result = await cancellation.cancel(service, INVOKER, "e1")
    assert result.status == "completed"
    record = await service.store.get_action("acme", "e1")
    assert record.status == "completed" and record.chunk_count == EVENTS
    chunks = await stream_of(service, "e1")
    assert [c["sequence"] for c in chunks] == list(range(EVENTS)) and chunks[-1]["kind"] == "done"


async def test_a_cancel_that_finds_the_job_ended_but_cannot_read_its_stream_stores_it_provisional(
    service_with, monkeypatch
):
    """Never ``completed`` without its chunks: ``cancelled_unconfirmed`` (uncertain), which the reconciler
    corrects with the whole stream once the journal can be read."""

    class Unreachable(JournalSidecar):
        def handle(self, request: httpx2.Request) -> httpx2.Response:
            if request.url.path == "/jobs/acme:e2" and self.streams > 0 and self.faults:
                raise httpx2.ConnectError("connection refused", request=request)
            return super().handle(request)

    monkeypatch.setattr(dispatch, "READ_RETRY_BUDGET_S", 0.0)
    sidecar = Unreachable(["reset", "never popped: the view refuses while this is here"])
    service = await service_with(sidecar)
    sidecar._admit({"crew_id": "support", "action_id": "acme:e2", "operation": "run", "input": {}})
    job = service.job(
        (
            await service.writer.create(
                ActionEvent.ADMIT, "acme", "e2", "cap:crewai:support", "support", "run", "{}", "h", "svc:acme", None
            )
        )[1],
        stream=True,
    )
    ended = await cancellation.ended_before_cancel(service, job, {"status": "completed"})
    assert ended is not None
    result, chunks = ended
    assert result.status == "failed" and chunks == []
    assert result.error.code == "connector.crewai.cancelled_unconfirmed"
    assert result.error.details["uncertain_outcome"] is True and result.error.details["job_status"] == "completed"
    stored = await service.writer.finish("acme", "e2", result, None)
    assert not is_final(stored, await service.result(stored))
    sidecar.faults.clear()  # the sidecar answers again: the correction brings the whole stream
    corrected = await correct(service, stored)
    assert corrected is not None and corrected.status == "completed" and corrected.chunk_count == EVENTS


# --- bounds: a journal over the stream's bounds ends in the live stream's typed error ----------------------


async def test_a_journal_over_the_response_bound_ends_as_the_live_stream_did(service_with):
    sidecar = JournalSidecar(size=4096)
    service = await service_with(sidecar)
    sidecar._admit({"crew_id": "support", "action_id": "acme:probe", "operation": "run", "input": {"topic": "x"}})
    service.dispatcher.max_response_bytes = sidecar.journal_bytes("acme:probe") - 1
    live = await run_live(service)  # the live stream over the bound: cancelled, failed, provisional
    live_error = error_of(live)
    assert live.status == "failed" and live_error["code"] == "connector.crewai.response_too_large"
    corrected = await service.get(INVOKER, "r1")
    error = error_of(corrected)
    assert corrected.status == "failed" and error["code"] == live_error["code"]
    assert error["details"]["reconciled"] == JOURNAL_REFUSED and error["details"]["job_status"] == "completed"
    assert is_final(corrected, await service.result(corrected))
    chunks = await stream_of(service)
    assert [c["sequence"] for c in chunks] == list(range(len(chunks))) and len(chunks) < EVENTS  # the valid prefix
    assert await correct(service, corrected) is None


@pytest.mark.parametrize("over", [0, 1], ids=["at_the_bound", "one_past"])
async def test_the_response_bound_holds_at_its_edge_for_a_backfill(service_with, over):
    sidecar = JournalSidecar(["repeat"] * (dispatch.MAX_INVALID_REREADS + 1), size=64)
    service = await service_with(sidecar)
    assert (await run_live(service)).status == "failed"
    service.dispatcher.max_response_bytes = sidecar.journal_bytes("acme:r1") - over
    corrected = await correct(service, await service.store.get_action("acme", "r1"))
    assert corrected is not None
    if over == 0:
        assert corrected.status == "completed" and corrected.chunk_count == EVENTS
    else:
        assert error_of(corrected)["code"] == "connector.crewai.response_too_large"
        assert corrected.chunk_count < EVENTS


@pytest.mark.parametrize("over", [0, 1], ids=["at_the_bound", "one_past"])
async def test_the_event_bound_holds_at_its_edge_for_a_backfill(service_with, over):
    sidecar = JournalSidecar(["repeat"] * (dispatch.MAX_INVALID_REREADS + 1))
    service = await service_with(sidecar)
    assert (await run_live(service)).status == "failed"
    service.dispatcher.max_events = EVENTS - over
    corrected = await correct(service, await service.store.get_action("acme", "r1"))
    assert corrected is not None
    if over == 0:
        assert corrected.status == "completed" and corrected.chunk_count == EVENTS
    else:
        error = error_of(corrected)
        assert error["code"] == "connector.crewai.invalid_stream"
        assert f"more than {EVENTS - 1} events" in error["message"]
        assert error["details"]["reconciled"] == JOURNAL_REFUSED
        assert corrected.chunk_count == EVENTS - 1  # every valid chunk before the bound


async def test_a_blocking_operation_is_corrected_without_a_stream(service_with):
    sidecar = JournalSidecar()
    service = await service_with(sidecar)
    sidecar._admit({"crew_id": "support", "action_id": "acme:q1", "operation": "knowledge_query", "input": {}})
    await service.writer.create(
        ActionEvent.ADMIT,
        "acme",
        "q1",
        "cap:crewai:support:knowledge_query",
        "support",
        "knowledge_query",
        '{"query":"q"}',
        "h",
        "svc:acme",
        None,
    )
    unconfirmed = ConnectorCancelledUnconfirmed(operation="knowledge_query", uncertain_outcome=True)
    record = await service.writer.finish("acme", "q1", failed_result("q1", unconfirmed), DispatchState.SENT)
    corrected = await correct(service, record)
    assert corrected is not None and corrected.status == "completed" and corrected.chunk_count == 0
    assert not [r for r in sidecar.requests if r.url.path.endswith("/events") and r.url.params.get("cursor") == "0"]
