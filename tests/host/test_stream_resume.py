"""A broken read of a sidecar stream is resumed from the sidecar's journal, never a reason to cancel the job
(ARCHITECTURE.md §8): a connection reset, a repeated sequence or a stream that ends early leaves the tenant
every chunk, in order, ending with `done`, and the job untouched."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import open_action_service

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.host.actions import dispatch
from aip_crewai.host.auth.principals import Principal
from aip_crewai.sse import encode_event

INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
CHATTY = 20  # data chunks of the job


class BreakingSidecar(FakeSidecar):
    """A chatty job (started, CHATTY llm chunks, completed) whose first stream breaks as ``fault`` says
    after ``break_after`` events; every later read of its journal is whole."""

    def __init__(self, fault: str, break_after: int = 7) -> None:
        super().__init__()
        self.fault, self.break_after = fault, break_after
        self.streams = 0
        self.views_refused = 0  # GET /jobs/{id} answers that fail to connect before one succeeds
        self.views_busy: list[int] = []  # statuses GET /jobs/{id} answers (one each) before it answers the view

    def _admit(self, body: dict[str, Any]) -> Any:
        job = super()._admit(body)
        if len(job.events) == 3:
            done = job.events[-1]
            chunks = [
                {"event": "chunk", "sequence": s, "data": {"content": f"c{s}", "channel": "llm"}}
                for s in range(1, CHATTY + 1)
            ]
            job.events = [job.events[0], *chunks, {**done, "sequence": CHATTY + 1}]
        return job

    def _sse(self, events: list[dict[str, Any]]) -> httpx2.Response:
        self.streams += 1
        frames = [encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"])) for e in events]
        if self.streams > 1 or self.fault == "none":
            return httpx2.Response(200, content=b"".join(frames), headers={"content-type": "text/event-stream"})
        head = frames[: self.break_after]
        if self.fault == "repeat":
            again = events[self.break_after - 1]
            body = (
                b"".join(head)
                + encode_event(json.dumps(again), event=again["event"])
                + b"".join(frames[self.break_after :])
            )
            return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})
        if self.fault == "early_end":
            return httpx2.Response(200, content=b"".join(head), headers={"content-type": "text/event-stream"})

        async def reset() -> AsyncIterator[bytes]:
            for piece in head:
                yield piece
            raise httpx2.ReadError("connection reset by peer")

        return httpx2.Response(200, content=reset(), headers={"content-type": "text/event-stream"})

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        parts = request.url.path.split("/")
        if len(parts) == 3 and parts[1] == "jobs" and request.method == "GET" and self.views_refused > 0:
            self.views_refused -= 1
            raise httpx2.ConnectError("connection refused", request=request)
        if len(parts) == 3 and parts[1] == "jobs" and request.method == "GET" and self.views_busy:
            return httpx2.Response(self.views_busy.pop(0), json={"detail": "overloaded, try later"})
        return super().handle(request)


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


async def run_to_end(service: Any) -> tuple[Any, Any, list[Any]]:
    action = Action(id="r1", capability_id="cap:crewai:support", input={"topic": "x"}, idempotency_key="k-r1")
    pending = await service.submit(INVOKER, action, None, stream=False)
    decided = await service.decide(APPROVER, pending.approval_id, "approved", "ok", service.now_ms())
    assert decided is not None
    record = await service.wait(await service.get(INVOKER, "r1"), 10)
    return record, await service.result(record), await service.store.list_chunks("acme", "r1")


@pytest.mark.parametrize("fault", ["reset", "repeat", "early_end"])
async def test_a_broken_stream_is_resumed_from_the_journal_with_every_chunk_and_no_cancel(service_with, fault):
    sidecar = BreakingSidecar(fault)
    record, result, chunks = await run_to_end(await service_with(sidecar))
    assert record.status == "completed" and result.status == "completed", result
    assert [c.sequence for c in chunks] == list(range(CHATTY + 2))
    decoded = [json.loads(c.chunk_json) for c in chunks]
    assert decoded[-1]["kind"] == "done"
    assert [c["part"]["text"] for c in decoded if c["kind"] == "data"] == [f"c{s}" for s in range(1, CHATTY + 1)]
    assert sidecar.executions == 1 and sidecar.streams == 2
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)
    resumed = [r for r in sidecar.requests if r.url.path == "/jobs/acme:r1/events"]
    assert [r.url.params["cursor"] for r in resumed] == [str(sidecar.break_after)]


async def test_a_job_view_that_cannot_connect_is_retried_before_the_stream_resumes(service_with):
    sidecar = BreakingSidecar("reset")
    sidecar.views_refused = 2
    record, result, chunks = await run_to_end(await service_with(sidecar))
    assert result.status == "completed" and len(chunks) == CHATTY + 2
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)


async def test_a_job_view_answered_try_later_is_retried_and_the_run_completes_without_a_cancel(service_with):
    """An overloaded sidecar answering the view 503 or 429 after a broken stream says nothing about the job:
    the view is read again after the backoff and the stream resumes, never a cancel (once it was cancelled,
    and under load the cancel too went unanswered: ``cancelled_unconfirmed``)."""
    sidecar = BreakingSidecar("reset")
    sidecar.views_busy = [503, 429]
    record, result, chunks = await run_to_end(await service_with(sidecar))
    assert result.status == "completed" and len(chunks) == CHATTY + 2
    assert not sidecar.views_busy
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)


async def test_a_job_view_refused_for_good_still_fails_the_run(service_with):
    """A view refused with a status that is no "try later" (403) still ends the run with that refusal."""
    sidecar = BreakingSidecar("reset")
    sidecar.views_busy = [403]
    record, result, _ = await run_to_end(await service_with(sidecar))
    assert result.status == "failed"
    assert result.error.details.get("remote_status") == 403


async def test_a_sidecar_busy_past_the_budget_leaves_the_action_running_for_the_reconciler(service_with, monkeypatch):
    """A sidecar answering "try later" for the whole retry budget: the action stays running, never cancelled."""
    monkeypatch.setattr(dispatch, "READ_RETRY_BUDGET_S", 0.0)
    sidecar = BreakingSidecar("reset")
    sidecar.views_busy = [503]
    service = await service_with(sidecar)
    action = Action(id="r1", capability_id="cap:crewai:support", input={"topic": "x"}, idempotency_key="k-r1")
    pending = await service.submit(INVOKER, action, None, stream=False)
    await service.decide(APPROVER, pending.approval_id, "approved", "ok", service.now_ms())
    live = service.live.get("acme", "r1")
    if live is not None and live.task is not None:
        await live.task
    record = await service.store.get_action("acme", "r1")
    assert record.status == "running"
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)


async def test_a_sidecar_gone_after_the_break_leaves_the_action_running_for_the_reconciler(service_with, monkeypatch):
    """No answer within the retry budget: the action stays running (the reconciler follows it), never failed."""
    monkeypatch.setattr(dispatch, "READ_RETRY_BUDGET_S", 0.0)
    sidecar = BreakingSidecar("reset")
    sidecar.views_refused = 1
    service = await service_with(sidecar)
    action = Action(id="r1", capability_id="cap:crewai:support", input={"topic": "x"}, idempotency_key="k-r1")
    pending = await service.submit(INVOKER, action, None, stream=False)
    await service.decide(APPROVER, pending.approval_id, "approved", "ok", service.now_ms())
    live = service.live.get("acme", "r1")
    if live is not None and live.task is not None:
        await live.task
    record = await service.store.get_action("acme", "r1")
    assert record.status == "running"
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)
    assert len(await service.store.list_chunks("acme", "r1")) == sidecar.break_after


async def test_a_stream_invalid_on_every_read_fails_after_the_bounded_rereads_and_cancels(service_with):
    sidecar = FakeSidecar()
    sidecar.stream_override = b'event: started\ndata: {"event":"started","sequence":0,"data":{}}\n\n'
    _, result, _ = await run_to_end(await service_with(sidecar))
    assert result.status == "failed" and result.error.code == "connector.crewai.invalid_stream"
    rereads = [r for r in sidecar.requests if r.url.path == "/jobs/acme:r1/events"]
    assert len(rereads) == dispatch.MAX_INVALID_REREADS
    assert any(r.url.path.endswith("/cancel") for r in sidecar.requests)


class CrashedSidecar(BreakingSidecar):
    """The sidecar is killed after streaming ``sent`` events (started and chunks it had not committed yet), and
    restarts with a journal of the first ``kept`` of them plus its crash fence's ``failed`` (uncertain) event
    at the next sequence: a sequence the host may already hold for a lost chunk."""

    def __init__(self, sent: int, kept: int) -> None:
        super().__init__("reset", break_after=sent)
        self.kept = kept

    def _sse(self, events: list[dict[str, Any]]) -> httpx2.Response:
        response = super()._sse(events)
        if self.streams == 1:  # the crash: the journal loses what was not committed, and the fence ends the job
            job = next(iter(self.jobs.values()))
            fence = {"status": "failed", "error_type": "SidecarRestarted", "uncertain_outcome": True}
            job.events = [*job.events[: self.kept], {"event": "failed", "sequence": self.kept, "data": fence}]
        return response


@pytest.mark.parametrize(("sent", "kept"), [(3, 1), (3, 2), (2, 1), (3, 3)])
async def test_a_sidecar_that_lost_streamed_events_in_a_crash_settles_on_its_journals_failure(service_with, sent, kept):
    """Killed mid-run, a sidecar loses the chunks it streamed but had not committed; restarted, its journal ends
    with the crash fence's ``failed`` at a sequence the host may already hold. The run ends ``failed`` with
    ``uncertain_outcome: true`` (not an invalid stream, not left running), the chunks sent stay, no cancel."""
    sidecar = CrashedSidecar(sent, kept)
    record, result, chunks = await run_to_end(await service_with(sidecar))
    assert record.status == "failed" and result.status == "failed", result
    assert result.error.details.get("uncertain_outcome") is True, result.error
    sequences = [c.sequence for c in chunks]
    assert sequences[:sent] == list(range(sent)), sequences
    assert not any(r.url.path.endswith("/cancel") for r in sidecar.requests)


@pytest.mark.parametrize(
    ("view", "expected", "lost"),
    [
        ({"status": "failed", "event_count": 2}, 2, True),  # the reader wants sequence 2; the journal ends at 1
        ({"status": "failed", "event_count": 2}, 3, True),
        ({"status": "failed", "event_count": 3}, 2, False),  # sequence 2 is in the journal: read on
        ({"status": "running", "event_count": 2}, 5, False),  # a running job's tail may still come
        ({"status": "completed", "event_count": 0}, 1, False),
        ({"status": "cancelled"}, 1, False),
        ("not a view", 1, False),
    ],
)
def test_journal_lost_tail(view, expected, lost):
    assert dispatch.journal_lost_tail(view, expected) is lost
