"""The job runtime (ARCHITECTURE.md §4, §5) with a fake executor and a real journal."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from contextlib import asynccontextmanager

import msgspec
import pytest
from kits.poll import at_once, until_async
from kits.sidecar_fakes import FakeExecutor, job, make_settings

from aip_crewai.sidecar.errors import JobNotCancellable, JobWaitTimeout, ShuttingDown
from aip_crewai.sidecar.jobs.context import GENERIC_FAILURE
from aip_crewai.sidecar.jobs.model import JobStatus
from aip_crewai.sidecar.jobs.replay_inputs import ReplayInputs
from aip_crewai.sidecar.jobs.runtime import Runtime
from aip_crewai.sidecar.journal.store import Journal

pytestmark = pytest.mark.timeout(30)

CREWS = ("echo", "slow", "worker", "failing", "bulky", "chatty", "bad")


@asynccontextmanager
async def runtime(tmp_path, **overrides):
    settings = make_settings(tmp_path, **overrides)
    journal = await Journal.open(settings.journal)
    fake = FakeExecutor()
    rt = Runtime(settings, journal, CREWS, fake)
    try:
        yield rt, fake
    finally:
        await rt.shutdown(0)
        await journal.close()


async def admit(rt, action_id, crew="echo", operation="run", input=None, **extra):
    body = msgspec.json.encode(job(action_id, crew, operation, input, **extra))
    return await rt.admit(body, idempotency_key="k", header_action_id=None)


async def events_of(rt, action_id):
    return [json.loads(row.to_json()) for row in await rt.journal.read_events(action_id, 0)]


async def test_chunks_reach_followers_live_before_they_are_committed(tmp_path):
    async with runtime(tmp_path, stream_checkpoint_events=1000) as (rt, fake):
        await admit(rt, "a", "slow")
        follower = rt.reads.follow("a", 0)
        seen: list = []
        while len(seen) < 2:  # keep-alive ticks (None) come between events on a slow machine
            row = await anext(follower)
            if row is not None:
                seen.append(row)
        assert [r.event for r in seen] == ["started", "chunk"]
        assert [r.event for r in await rt.journal.read_events("a", 0)] == ["started"]  # chunk not committed yet
        fake.release.set()
        rest = [row async for row in follower if row is not None]
        assert [r.event for r in rest] == ["completed"]
        assert [e["event"] for e in await events_of(rt, "a")] == ["started", "chunk", "completed"]


@pytest.mark.parametrize("checkpoint,committed", [(4, {1}), (2, {3, 4}), (1, {4})])
async def test_chunks_commit_in_groups_of_stream_checkpoint_events(tmp_path, checkpoint, committed):
    """3 chunks from a worker thread: committed rows = started + at least the whole groups of `checkpoint`.

    A checkpoint commits what is pending when it runs: with groups of 2, the third chunk may have
    arrived before the first group's write started (seen under load), so 3 or 4 rows are committed.
    With groups of 4 nothing is committed before the terminal event."""
    async with runtime(tmp_path, stream_checkpoint_events=checkpoint) as (rt, fake):
        await admit(rt, "w", "worker")
        await until_async(lambda: _count(rt, "w", 4), interval=0.005)  # started + 3 chunks visible
        await until_async(lambda: _committed_in(rt, "w", committed), interval=0.005)
        live = rt._live["w"]  # no checkpoint scheduled or running: nothing more is committed before the end
        await until_async(lambda: not live.flush_scheduled and not live.flush_lock.locked(), interval=0.005)
        assert len(await rt.journal.read_events("w", 0)) in committed
        fake.release_thread.set()
        await rt.reads.wait("w", 5000)
        assert [e["event"] for e in await events_of(rt, "w")] == ["started", "chunk", "chunk", "chunk", "completed"]


async def _count(rt, action_id, n):
    _status, events, _ = await rt.reads.page(action_id, 0)
    return len(events) >= n


async def _committed_in(rt, action_id, counts):
    return len(await rt.journal.read_events(action_id, 0)) in counts


async def test_events_per_run_are_capped_so_the_terminal_event_always_fits(tmp_path):
    async with runtime(tmp_path, max_events_per_run=5) as (rt, _fake):
        await admit(rt, "c", "chatty", input={"chunks": 50})
        record = await rt.reads.wait("c", 5000)
        events = await events_of(rt, "c")
        view = await rt.reads.view("c")
    assert record.status is JobStatus.COMPLETED
    assert [e["event"] for e in events] == ["started", "chunk", "chunk", "chunk", "completed"]
    assert [e["sequence"] for e in events] == [0, 1, 2, 3, 4]
    assert record.dropped_events == 47 and view["dropped_events"] == 47


async def test_an_oversize_chunk_is_truncated_to_the_event_bound(tmp_path):
    async with runtime(tmp_path, max_event_bytes=4096) as (rt, _fake):
        await admit(rt, "c", "chatty", input={"chunks": 2, "chunk_bytes": 10_000})
        await rt.reads.wait("c", 5000)
        rows = await rt.journal.read_events("c", 0)
    chunks = [r for r in rows if r.event == "chunk"]
    assert len(chunks) == 2
    for row in chunks:
        assert len(row.to_json()) <= 4096
        data = json.loads(row.data)
        assert data["truncated"] is True and data["content"] == "y" * len(data["content"])
        assert len(row.to_json()) > 4000  # cut to fit, not emptied


async def test_failures_publish_class_name_generic_message_and_mutation_uncertainty(tmp_path):
    async with runtime(tmp_path) as (rt, _fake):
        await admit(rt, "f", "failing")
        await admit(rt, "k", "failing", "knowledge_query", {"query": ["q"]})
        await admit(rt, "b", "bad")
        failed = json.loads((await rt.reads.wait("f", 5000)).error)
        read_only = json.loads((await rt.reads.wait("k", 5000)).error)
        bad = json.loads((await rt.reads.wait("b", 5000)).error)
    assert failed == {
        "status": "failed",
        "error_type": "RuntimeError",
        "message": GENERIC_FAILURE,
        "uncertain_outcome": True,
    }
    assert read_only["uncertain_outcome"] is False
    assert bad["error_type"] == "InvalidOutput"


async def test_output_over_4_mib_fails_and_a_large_output_is_omitted_from_its_event(tmp_path):
    async with runtime(tmp_path) as (rt, _fake):
        await admit(rt, "huge", "bulky", input={"size": 4 * 1024 * 1024 + 1})
        await admit(rt, "big", "bulky", input={"size": 300_000})
        huge = await rt.reads.wait("huge", 5000)
        big = await rt.reads.wait("big", 5000)
        big_events = await events_of(rt, "big")
    assert json.loads(huge.error)["error_type"] == "OutputTooLarge"
    assert big.status is JobStatus.COMPLETED and len(json.loads(big.output)["raw"]) == 300_000
    assert big_events[-1]["data"] == {"status": "completed", "output_omitted": True, "output_bytes": len(big.output)}


async def test_execution_bound_fails_the_job_and_stops_it(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "t", "slow", timeout_ms=50)
        with pytest.raises(JobWaitTimeout):
            await rt.reads.wait("t", 1)
        record = await rt.reads.wait("t", 5000)
        stop = await until_async(lambda: _stop_observed(rt, "t"), interval=0.005)
    error = json.loads(record.error)
    assert error["error_type"] == "ExecutionTimeout" and error["uncertain_outcome"] is True
    assert stop is True
    assert not fake.release.is_set()


async def _stop_observed(rt, action_id):
    record = await rt.journal.get(action_id)
    return record.provider_stop_observed if record.provider_stop_observed is not None else None


async def test_cancelling_a_run_cancels_its_task_at_once(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "r", "slow")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        loop = asyncio.get_running_loop()
        start = loop.time()
        view = await rt.cancel("r", "slow")
        elapsed = loop.time() - start
        await until_async(lambda: _stop_observed(rt, "r"), interval=0.005)
        events = await events_of(rt, "r")
    assert view["status"] == "cancelled" and elapsed < 1.0
    assert [e["event"] for e in events] == ["started", "chunk", "cancelled"]


async def test_cancelling_a_worker_thread_op_records_cancelled_then_the_observed_stop(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "p", "worker", "test", {"n_iterations": 1, "eval_llm": "m"})
        await until_async(lambda: _count(rt, "p", 2), interval=0.005)
        view = await rt.cancel("p", "worker")
        assert view["status"] == "cancelled"
        assert "provider_stop_observed" in view
        observed = await until_async(lambda: _stop_observed(rt, "p"), interval=0.005)
        final = await rt.reads.view("p")
    assert observed is True and final["provider_stop_observed"] is True
    assert rt.health()["active_runs"] == 0


async def test_a_worker_that_ignores_the_flag_is_recorded_as_not_stopped(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "p", "slow", "train", {"n_iterations": 1, "artifact_name": "a"})
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        await rt.cancel("p", "slow")  # train: task not cancelled, the fake never checks the flag
        fake.release.set()
        await until_async(lambda: _stop_known(rt, "p"), interval=0.005)
        record = await rt.journal.get("p")
    assert record.status is JobStatus.CANCELLED and record.provider_stop_observed is False


async def _stop_known(rt, action_id):
    return (await rt.journal.get(action_id)).provider_stop_observed is not None


async def test_cancelling_a_queued_job_never_runs_it(tmp_path):
    async with runtime(tmp_path, max_concurrency=1) as (rt, fake):
        await admit(rt, "busy", "slow")
        await admit(rt, "q", "echo")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        view = await rt.cancel("q", "echo")
        fake.release.set()
        await rt.reads.wait("busy", 5000)
        events = await events_of(rt, "q")
        record = await rt.journal.get("q")
    assert view["status"] == "cancelled"
    assert events == [{"event": "cancelled", "sequence": 0, "data": {"status": "cancelled"}}]
    assert record.provider_stop_observed is True
    assert [c[0] for c in fake.calls] == ["slow"]


async def test_not_cancellable_operations_refuse_cancel_while_running(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "k", "slow", "knowledge_query", {"query": ["q"]})
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        with pytest.raises(JobNotCancellable):
            await rt.cancel("k", "slow")
        fake.release.set()
        assert (await rt.reads.wait("k", 5000)).status is JobStatus.COMPLETED
        assert (await rt.cancel("k", "slow"))["status"] == "completed"


async def test_concurrency_is_bounded_by_the_semaphore(tmp_path):
    async with runtime(tmp_path, max_concurrency=2) as (rt, fake):
        for aid in ("s1", "s2", "s3"):
            await admit(rt, aid, "slow")
        await until_async(lambda: len(fake.calls) == 2, interval=0.005)
        assert (await rt.reads.view("s3"))["status"] == "queued"
        assert rt.health()["active_runs"] == 3
        fake.release.set()
        for aid in ("s1", "s2", "s3"):
            assert (await rt.reads.wait(aid, 5000)).status is JobStatus.COMPLETED


async def test_a_queued_or_running_jobs_view_needs_no_journal_read_and_its_end_reads_the_journal(tmp_path):
    """``GET /jobs/{id}`` of a job queued or running here is answered from memory (it answers while a commit
    hangs) with what its journal row says; once ended, the row's output comes from the journal."""
    async with runtime(tmp_path, max_concurrency=1) as (rt, fake):
        await admit(rt, "r", "slow")
        await admit(rt, "q", "slow")
        await until_async(lambda: _count(rt, "r", 2), interval=0.005)  # started, then its chunk
        gate = threading.Event()
        rt.journal._worker.submit(gate.wait, 30)  # the journal's worker is stuck from here
        try:
            running, queued = at_once(rt.reads.view("r")), at_once(rt.reads.view("q"))
        finally:
            gate.set()
        base = {"crew_id": "slow", "operation": "run", "output": None}
        assert running == {"action_id": "r", "status": "running", "event_count": 2, **base}
        assert queued == {"action_id": "q", "status": "queued", "event_count": 0, **base}
        assert (await rt.journal.get("q")).status is JobStatus.QUEUED  # what the journal holds
        fake.release.set()
        for aid in ("r", "q"):
            await rt.reads.wait(aid, 5000)
        ended = await rt.reads.view("r")
    assert ended["status"] == "completed" and ended["event_count"] == 3 and ended["output"] is not None


async def test_concurrent_jobs_never_see_each_others_events(tmp_path):
    async with runtime(tmp_path) as (rt, _fake):
        ids = [f"j{i}" for i in range(8)]
        for aid in ids:
            await admit(rt, aid, "chatty", input={"chunks": 20})
        for aid in ids:
            await rt.reads.wait(aid, 5000)
            events = await events_of(rt, aid)
            assert [e["sequence"] for e in events] == list(range(22))
            assert json.loads(json.dumps(events[-1]["data"]))["tasks_output"][0]["task_id"] == f"task-{aid}-0"


async def test_shutdown_refuses_admissions_and_cancels_jobs_past_the_grace(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "s", "slow")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        await rt.shutdown(0.05)
        with pytest.raises(ShuttingDown):
            await admit(rt, "n", "echo")
        events = await events_of(rt, "s")
        assert rt.health()["status"] == "stopping"
    assert events[-1] == {
        "event": "cancelled",
        "sequence": 2,
        "data": {"status": "cancelled", "reason": "sidecar_shutdown"},
    }


async def test_shutdown_lets_jobs_finish_within_the_grace(tmp_path):
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "s", "slow")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        asyncio.get_running_loop().call_later(0.05, fake.release.set)
        await rt.shutdown(5)
        record = await rt.journal.get("s")
    assert record.status is JobStatus.COMPLETED


@pytest.mark.parametrize("checkpoint", [1, 3, 1000])
async def test_followed_pages_hold_every_event_once_in_order_and_end_at_the_terminal(tmp_path, monkeypatch, checkpoint):
    """Pages stitch committed and pending events; no page is empty or crosses the terminal event."""
    from aip_crewai.sidecar.jobs import reader

    monkeypatch.setattr(reader, "FOLLOW_PAGE_EVENTS", 4)
    async with runtime(tmp_path, stream_checkpoint_events=checkpoint) as (rt, _fake):
        await admit(rt, "p", input={"chunks": 9})
        pages = [page async for page in rt.reads.follow_pages("p", 0) if page is not None]
        later = [page async for page in rt.reads.follow_pages("p", 5) if page is not None]
    assert all(0 < len(page) <= 4 for page in pages + later)
    assert [row.sequence for page in pages for row in page] == list(range(11))  # started, 9 chunks, completed
    assert [row.sequence for page in later for row in page] == list(range(5, 11))
    assert pages[-1][-1].event == "completed" and not any(row.terminal for page in pages for row in page[:-1])


def test_a_chunk_fits_the_smallest_event_bound_even_with_long_labels():
    """--max-event-bytes 1024 (the reference's lower bound): long labels are dropped before
    the content is cut, so the event still fits."""
    from aip_crewai.sidecar.jobs.live import MAX_LABEL_CHARS, chunk_row

    row = chunk_row(
        7,
        {
            "content": "c" * 5000,
            "channel": "llm",
            "task_id": "\u2028" * MAX_LABEL_CHARS,
            "agent_role": "r" * MAX_LABEL_CHARS,
        },
        1024,
    )
    assert row is not None and len(row.to_json()) <= 1024
    data = json.loads(row.data)
    assert data["truncated"] is True and data["content"].startswith("ccc") and "task_id" not in data
    short = chunk_row(8, {"content": "c" * 5000, "channel": "llm", "task_id": "t1"}, 1024)
    assert short is not None and len(short.to_json()) <= 1024 and json.loads(short.data)["task_id"] == "t1"


@pytest.mark.parametrize(("item", "kept"), [(0, 0), (3, 3), (-1, None), (True, None), ("2", None), (1.0, None)])
def test_a_batch_run_chunk_keeps_its_item_index_and_only_a_non_negative_integer(item, kept):
    from aip_crewai.sidecar.jobs.live import chunk_row

    row = chunk_row(1, {"content": "x", "channel": "llm", "task_id": "t", "batch_item": item}, 65536)
    assert row is not None and json.loads(row.data).get("batch_item") == kept


async def test_a_live_follower_sends_what_arrives_within_its_window_in_one_page(tmp_path, monkeypatch):
    """Chunks a worker emits one by one, sooner after the follower's last read than the window, go out in
    one page (one socket write), not one page each; the job's end cuts the window short."""
    from aip_crewai.sidecar.jobs import reader

    monkeypatch.setattr(reader, "FOLLOW_PAGE_WINDOW_S", 60.0)
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "w", "worker")
        pages: list = []

        async def consume() -> None:
            async for page in rt.reads.follow_pages("w", 0):
                if page is not None:
                    pages.append(page)

        consumer = asyncio.create_task(consume())
        await until_async(lambda: rt._live["w"].snapshot()[3] >= 4, interval=0.005)  # started + 3 chunks
        fake.release_thread.set()
        await asyncio.wait_for(consumer, 10)  # the end cut the 60 s window short
    assert len(pages) <= 2
    assert [row.event for page in pages for row in page] == ["started", "chunk", "chunk", "chunk", "completed"]


async def test_a_live_follower_caught_up_with_a_running_job_waits_out_its_window_before_reading_again(
    tmp_path, monkeypatch
):
    """A follower whose page took every event of a running job reads again only once its window passed since
    that page's read (or the job ended): an event emitted while the page was being sent joins the next
    page with what follows, instead of going out alone the moment the follower asks for more."""
    from aip_crewai.sidecar.jobs import reader

    monkeypatch.setattr(reader, "FOLLOW_PAGE_WINDOW_S", 60.0)
    async with runtime(tmp_path) as (rt, fake):
        await admit(rt, "w", "worker")
        count = lambda: rt._live["w"].snapshot()[3]  # noqa: E731
        pages = rt.reads.follow_pages("w", 0)
        first = await pages.__anext__()
        assert first is not None and first[-1].event != "completed"
        await until_async(lambda: count() > len(first), interval=0.005)  # an event the first page lacks
        later = asyncio.create_task(pages.__anext__())
        await until_async(lambda: count() >= 4, interval=0.005)  # started + 3 chunks
        fake.release_thread.set()
        second = await asyncio.wait_for(later, 10)  # the job's end cut the 60 s window short
        await pages.aclose()
    assert second is not None
    assert [row.event for row in first + second] == ["started", "chunk", "chunk", "chunk", "completed"]


async def test_a_runs_inputs_are_in_place_before_its_terminal_commit_and_flushed_beside_it(tmp_path, monkeypatch):
    """The replay inputs' file is renamed into place before the terminal commit, fsynced while it commits,
    and the job's followers hear of its end only once both are done (jobs/replay_inputs.py)."""
    flushing, flushed = threading.Event(), threading.Event()
    at_flush: dict = {}

    def sync(self: ReplayInputs, action_id: str) -> bool:
        at_flush["file"] = json.loads(self.path(action_id).read_bytes())
        flushing.set()
        flushed.wait(30)
        return True

    monkeypatch.setattr(ReplayInputs, "sync", sync)
    settings = make_settings(tmp_path)
    journal = await Journal.open(settings.journal)
    fake = FakeExecutor()

    async def executor(crew_id, operation, input, ctx):
        ctx.run_state[None] = {"inputs": dict(input), "fingerprint": "f"}
        return await fake(crew_id, operation, input, ctx)

    rt = Runtime(settings, journal, CREWS, executor)
    try:
        await admit(rt, "r", "echo", input={"topic": "kept"})
        await until_async(flushing.is_set, interval=0.005)
        assert at_flush["file"] == {"-1": {"topic": "kept"}}  # in place when the flush began
        # The commit does not wait for the flush ...
        await until_async(lambda: _status_is(rt, "r", JobStatus.COMPLETED), interval=0.005)
        _record, live = await rt.reads.record("r")
        assert live is not None and not live.finished.is_set()  # ... but the job's followers do
        flushed.set()
        assert (await rt.reads.wait("r", 5000)).status is JobStatus.COMPLETED
        assert rt.replay_inputs.read("r", None) == {"topic": "kept"}
    finally:
        flushed.set()
        await rt.shutdown(0)
        await journal.close()


async def _status_is(rt, action_id, status):
    return (await rt.journal.get(action_id)).status is status


async def test_a_job_with_a_free_slot_is_admitted_running_in_its_admission_commit(tmp_path, monkeypatch):
    """A free concurrency slot: the job's row is inserted ``running`` with its ``started`` event, no second
    commit; no slot: ``queued``, then ``running`` once a slot frees (ARCHITECTURE.md §5)."""
    starts: list[str] = []
    transition = Journal.transition

    async def counting(self, action_id, target, **kwargs):
        if target is JobStatus.RUNNING:
            starts.append(action_id)
        return await transition(self, action_id, target, **kwargs)

    monkeypatch.setattr(Journal, "transition", counting)
    async with runtime(tmp_path, max_concurrency=1) as (rt, fake):
        await admit(rt, "first", "slow")
        await admit(rt, "second", "slow")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        assert (await rt.journal.get("second")).status is JobStatus.QUEUED
        fake.release.set()
        for action_id in ("first", "second"):
            assert (await rt.reads.wait(action_id, 5000)).status is JobStatus.COMPLETED
        await admit(rt, "third", "echo")  # both slots were given back: it runs
        assert (await rt.reads.wait("third", 5000)).status is JobStatus.COMPLETED
        firsts = [(await events_of(rt, a))[0] for a in ("first", "second", "third")]
    assert starts == ["second"]
    assert all(e["event"] == "started" and e["sequence"] == 0 for e in firsts)


async def test_a_queued_job_never_starts_once_shutdown_began_and_is_cancelled_as_never_run(tmp_path):
    """Found by a break-it session: a queued job took the slot a finished job freed during the shutdown's
    grace, committed ``started`` and waited for a worker the stopping pool never booted (the shutdown then
    lasted its whole grace and the job read ``uncertain_outcome: true``)."""
    async with runtime(tmp_path, max_concurrency=1) as (rt, fake):
        await admit(rt, "busy", "slow")
        await admit(rt, "q", "echo")
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        stopping = asyncio.create_task(rt.shutdown(30))
        await until_async(lambda: rt.health()["status"] == "stopping", interval=0.005)
        fake.release.set()
        await asyncio.wait_for(stopping, 10)  # once the running job ended, not after the 30 s grace
        record, events, view = await rt.journal.get("q"), await events_of(rt, "q"), await rt.reads.view("q")
    assert [call[0] for call in fake.calls] == ["slow"]
    assert record.status is JobStatus.CANCELLED and view["uncertain_outcome"] is False
    assert events == [
        {"event": "cancelled", "sequence": 0, "data": {"status": "cancelled", "reason": "sidecar_shutdown"}}
    ]


def test_the_replay_inputs_flush_covers_the_file_and_the_directory_holding_its_rename(tmp_path, monkeypatch):
    inputs, flushed, fsync = ReplayInputs(tmp_path), [], os.fsync
    assert inputs.place("a", {None: {"topic": "kept"}})

    def recording(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    assert inputs.sync("a") is True
    assert flushed == [str(inputs.path("a")), str(inputs.directory)]
    assert inputs.sync("never-placed") is False  # logged, never raised: the run still completes
