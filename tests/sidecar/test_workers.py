"""The worker pool (``isolation/pool.py`` ``WorkerPool``; ARCHITECTURE.md §5 "Isolation") with fake workers (no CrewAI).

Each test starts a pool of spawned fake workers (``worker_fakes``: one, unless it is about the pool's size) and runs
jobs through it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import worker_fakes
from kits.poll import until_async

from aip_crewai.sidecar.isolation import pool as pool_module
from aip_crewai.sidecar.isolation.handle import WorkerDied
from aip_crewai.sidecar.isolation.pool import WorkerPool
from aip_crewai.sidecar.isolation.wire import Boot
from aip_crewai.sidecar.jobs.context import GENERIC_FAILURE, JobCancelled, JobContext, SafeJobError

pytestmark = [pytest.mark.timeout(60), pytest.mark.processes]

GRACE = 0.3


def make_pool(
    target: Any,
    *,
    grace: float = GRACE,
    size: int = 1,
    idle: int | None = None,
    registry: str = "unused:CREWS",
    context: Any = None,
    shrink_after_s: float = 0.0,
) -> WorkerPool:
    return WorkerPool(
        Boot(registry, "/nonexistent", True, "info"),
        size,
        cancel_grace_seconds=grace,
        max_events=10,
        max_event_bytes=1024,
        context=context or multiprocessing.get_context("spawn"),
        target=target,
        idle=idle,
        shrink_after_s=shrink_after_s,
    )


def make_ctx(find: Any = None) -> tuple[JobContext, list[dict[str, Any]], list[int]]:
    chunks: list[dict[str, Any]] = []
    dropped: list[int] = []
    ctx = JobContext(
        action_id="t:job",
        crew_id="crew",
        operation="replay",
        emit_chunk=chunks.append,
        cancel_flag=threading.Event(),
        state_dir=Path("/nonexistent"),
        find_task_run=find,
        tenant="t",
        note_dropped=dropped.append,
    )
    return ctx, chunks, dropped


async def run_job(pool: WorkerPool, ctx: JobContext, input: dict[str, Any] | None = None) -> Any:
    await pool.start()
    try:
        return await pool("crew", "replay", input or {}, ctx)
    finally:
        await pool.close()


async def test_a_frame_over_the_bound_kills_the_worker_and_fails_the_job_typed():
    pool = make_pool(worker_fakes.oversized)
    ctx, _chunks, _dropped = make_ctx()
    with pytest.raises(SafeJobError) as raised:
        await run_job(pool, ctx)
    assert raised.value.error_type == "WorkerProtocolError" and raised.value.uncertain is True


async def test_a_worker_that_dies_fails_its_job_naming_the_signal():
    pool = make_pool(worker_fakes.dies)
    ctx, chunks, _dropped = make_ctx()
    with pytest.raises(WorkerDied) as raised:
        await run_job(pool, ctx)
    assert raised.value.error_type == "WorkerDied" and raised.value.uncertain is True
    assert "signal SIGKILL" in raised.value.message
    assert chunks == [{"content": "before", "channel": "llm"}]


async def cancel_after_first_chunk(pool: WorkerPool, ctx: JobContext, chunks: list[Any]) -> tuple[Any, float, int]:
    """Start a job, cancel its task once a chunk arrived; (its result or exception, seconds, worker pid)."""
    await pool.start()
    try:
        job = asyncio.create_task(pool("crew", "replay", {}, ctx))

        def first_chunk() -> bool:
            assert not job.done(), "the job ended before its first chunk"
            return bool(chunks)

        await until_async(first_chunk, interval=0.01, what="the worker's first chunk")
        (pid,) = pool.pids()
        asked = time.monotonic()
        job.cancel()
        try:
            outcome: Any = await job
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome = exc
        return outcome, time.monotonic() - asked, pid
    finally:
        await pool.close()


async def test_a_worker_that_ignores_its_cancel_is_killed_after_the_grace():
    pool = make_pool(worker_fakes.ignores_cancel)
    ctx, chunks, _dropped = make_ctx()
    outcome, took, pid = await cancel_after_first_chunk(pool, ctx, chunks)
    assert isinstance(outcome, asyncio.CancelledError)
    assert GRACE <= took < GRACE + 5
    assert ctx.stop_observed is True and pool.killed_total == 1
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


async def test_a_worker_that_stops_on_its_cancel_is_a_confirmed_stop_without_a_kill():
    pool = make_pool(worker_fakes.stops_on_cancel, grace=30)
    ctx, chunks, _dropped = make_ctx()
    outcome, took, _pid = await cancel_after_first_chunk(pool, ctx, chunks)
    assert isinstance(outcome, asyncio.CancelledError)
    assert took < 5 and ctx.stop_observed is True and pool.killed_total == 0


async def test_a_worker_that_finishes_despite_its_cancel_leaves_the_stop_unobserved():
    pool = make_pool(worker_fakes.finishes_despite_cancel, grace=30)
    ctx, chunks, _dropped = make_ctx()
    outcome, _took, _pid = await cancel_after_first_chunk(pool, ctx, chunks)
    assert outcome == {"raw": "done anyway"} and ctx.stop_observed is False


async def test_replay_lookups_run_state_and_dropped_chunks_cross_the_pipe():
    asked: list[str] = []

    async def find(task_id: str) -> dict[str, Any] | None:
        asked.append(task_id)
        return {"tasks_output": [{"task_id": task_id}]}

    pool = make_pool(worker_fakes.asks_for_a_run)
    ctx, _chunks, dropped = make_ctx(find)
    assert await run_job(pool, ctx, {"task_id": "task-1"}) == {"found": True}
    assert asked == ["task-1"] and dropped == [2]
    assert ctx.run_state == {None: {"inputs": {"topic": "t"}}, 3: {"fingerprint": []}}


async def test_a_failure_without_a_message_is_published_with_the_generic_one():
    pool = make_pool(worker_fakes.fails)
    ctx, _chunks, _dropped = make_ctx()
    with pytest.raises(SafeJobError) as raised:
        await run_job(pool, ctx)
    assert (raised.value.error_type, raised.value.message, raised.value.uncertain) == (
        "RuntimeError",
        GENERIC_FAILURE,
        None,
    )
    assert not isinstance(raised.value, JobCancelled)


def held_lookup(release: asyncio.Event, asked: list[str]) -> Any:
    """A ``find_task_run`` for ``worker_fakes.asks_for_a_run`` that holds its job until ``release`` is set."""

    async def find(task_id: str) -> dict[str, Any] | None:
        asked.append(task_id)
        await release.wait()
        return {"tasks_output": []}

    return find


async def test_fewer_idle_workers_than_jobs_at_once_boot_on_demand_and_settle_back_to_the_idle_count():
    """``--idle-workers 1`` of ``--max-concurrency 3``: one worker waits at start; three jobs at once all run,
    each in a worker of its own (two booted on demand); once they end, one idle worker is kept again."""
    pool = make_pool(worker_fakes.asks_for_a_run, size=3, idle=1)
    release, asked = asyncio.Event(), []
    await pool.start()
    try:
        assert (len(pool.pids()), pool.idle()) == (1, 1)
        jobs = [
            asyncio.create_task(
                pool("crew", "replay", {"task_id": f"task-{n}"}, make_ctx(held_lookup(release, asked))[0])
            )
            for n in range(3)
        ]
        await until_async(lambda: len(asked) == 3, what="three jobs running at once")
        assert len(pool.pids()) == 3 and pool.idle() == 0
        release.set()
        assert await asyncio.gather(*jobs) == [{"found": True}] * 3
        await until_async(lambda: (len(pool.pids()), pool.idle()) == (1, 1), what="one idle worker again")
    finally:
        await pool.close()


async def test_no_idle_worker_boots_one_per_job_and_keeps_none():
    """``--idle-workers 0``: one worker boots at start (a registry that cannot load stops the start); after its
    job none is kept, and the next job boots its own."""
    pool = make_pool(worker_fakes.asks_for_a_run, size=2, idle=0)
    release, asked = asyncio.Event(), []
    release.set()
    await pool.start()
    try:
        assert len(pool.pids()) == 1
        for n in range(2):
            job = pool("crew", "replay", {"task_id": f"task-{n}"}, make_ctx(held_lookup(release, asked))[0])
            assert await job == {"found": True}
            await until_async(lambda: pool.pids() == [], what="no worker kept after the job")
        assert pool.started_total == 2
    finally:
        await pool.close()


class CountingContext:
    """The spawn context, counting the worker processes created (a boot creates its process first thing)."""

    def __init__(self) -> None:
        self.inner = multiprocessing.get_context("spawn")
        self.processes = 0

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - multiprocessing's name
        self.processes += 1
        return self.inner.Process(*args, **kwargs)


async def test_a_spent_workers_replacement_waits_for_the_delay_and_a_waiting_job_boots_its_own(monkeypatch):
    """``--worker-jobs 1``: a worker that ran its job exits, and its replacement boots only
    ``REPLACE_DELAY_S`` later (here: after the test), not while the job's end goes out; a job that comes
    meanwhile and finds no idle worker boots one at once (it would wait the hour otherwise)."""
    monkeypatch.setattr(pool_module, "REPLACE_DELAY_S", 3600.0)
    context = CountingContext()
    pool = make_pool(worker_fakes.asks_for_a_run, size=1, idle=1, context=context)
    release, asked = asyncio.Event(), []
    release.set()
    await pool.start()
    try:
        assert await pool("crew", "replay", {"task_id": "task-0"}, make_ctx(held_lookup(release, asked))[0])
        # Every callback scheduled so far runs before this one: a boot task started at the job's end has
        # created its process by then (its first step does).
        turned = asyncio.Event()
        asyncio.get_running_loop().call_soon(turned.set)
        await turned.wait()
        assert (context.processes, pool.pids(), pool.idle()) == (1, [], 0)
        job = pool("crew", "replay", {"task_id": "task-1"}, make_ctx(held_lookup(release, asked))[0])
        assert await job == {"found": True}
        assert context.processes == 2
    finally:
        await pool.close()


async def test_a_quiet_pool_keeps_one_idle_worker_and_the_next_job_boots_the_others_back():
    """``--idle-shrink-seconds``: a pool of three idle workers that gets no job keeps one of them once the quiet
    time passed (the other two exit); the next job runs in the one kept, and its start boots three spares at
    once, beside it (six worker processes created in all)."""
    context = CountingContext()
    pool = make_pool(worker_fakes.asks_for_a_run, size=4, idle=3, context=context, shrink_after_s=0.2)
    release, asked = asyncio.Event(), []
    await pool.start()
    try:
        assert (pool.idle(), context.processes) == (3, 3)
        await until_async(lambda: (len(pool.pids()), pool.idle()) == (1, 1), what="one idle worker kept")
        assert pool.shrunk_total == 2
        (kept,) = pool.pids()
        job = asyncio.create_task(pool("crew", "replay", {"task_id": "t"}, make_ctx(held_lookup(release, asked))[0]))
        await until_async(lambda: asked == ["t"], what="the job running in the worker kept")
        assert kept in pool.pids() and context.processes == 6
        release.set()
        assert await job == {"found": True}
    finally:
        await pool.close()


async def test_warm_workers_leave_room_for_one_spare_so_a_new_owners_job_finds_a_booted_worker():
    """Three slots, three owners one after the other: when t3's job takes the last spare, the oldest warm
    worker (t1's) is retired and a spare boots, so t4's job finds it booted; t2's and t3's stay warm."""
    pool = warm_pool(worker_fakes.serves_jobs, size=3, idle=3)
    await pool.start()
    try:
        t1, t2, t3 = [await job_pid(pool, tenant) for tenant in ("t1", "t2", "t3")]
        await until_async(lambda: (pool.warm(), pool.idle()) == (2, 1), what="two warm workers and one spare")
        assert pool.retired_total == 1 and t1 not in pool.pids() and {t2, t3} <= set(pool.pids())
        spare = next(pid for pid in pool.pids() if pid not in {t2, t3})
        assert await job_pid(pool, "t4") == spare
        assert await job_pid(pool, "t3") == t3
    finally:
        await pool.close()


async def test_a_warm_worker_killed_while_warm_frees_its_slot():
    """A warm worker killed while it waits for its owner (one slot): the next pool step forgets it (not counted
    warm, not counted retired), and another owner's job runs in a fresh worker."""
    pool = warm_pool(worker_fakes.serves_jobs, size=1, idle=1)
    await pool.start()
    try:
        first = await job_pid(pool, "t1")
        assert pool.warm() == 1
        os.kill(first, signal.SIGKILL)
        await until_async(lambda: pool.warm() == 0, what="the killed worker not counted warm")
        assert await job_pid(pool, "t2") != first
        assert pool.retired_total == 0
    finally:
        await pool.close()


async def test_a_job_whose_warm_worker_died_as_it_took_it_is_not_counted_as_run_warm():
    """The owner's warm worker dies as it gets the next job (before any frame): the job runs in another
    worker, and ``worker_jobs_reused_total`` does not count it."""
    pool = warm_pool(worker_fakes.serves_one_job_then_dies_taking_the_next, size=2, idle=1)
    await pool.start()
    try:
        first = await job_pid(pool, "t1")
        assert await job_pid(pool, "t1") != first
        assert pool.reused_total == 0 and pool.gauges()["worker_jobs_reused_total"] == 0
    finally:
        await pool.close()


async def test_an_idle_worker_killed_while_idle_is_not_counted_idle():
    """``workers_idle`` counts live workers: one killed while it waits for a job leaves the gauge at once, and
    the next job runs in another worker."""
    pool = warm_pool(worker_fakes.serves_jobs, size=2, idle=1)
    await pool.start()
    try:
        await until_async(lambda: pool.idle() == 1, what="the spare booted")
        (spare,) = pool.pids()
        os.kill(spare, signal.SIGKILL)
        await until_async(lambda: pool.gauges()["workers_idle"] == 0, what="the killed spare not counted idle")
        assert await job_pid(pool, "t1") != spare
    finally:
        await pool.close()


async def test_a_quiet_pool_retires_its_warm_workers_and_keeps_one_fresh_one():
    """A warm worker is not kept past the quiet time either: it is retired (killed: it runs nothing), one fresh
    idle worker stays, and the owner's next job runs in a fresh process."""
    pool = warm_pool(worker_fakes.serves_jobs, size=2, idle=1, shrink_after_s=0.2)
    await pool.start()
    try:
        first = await job_pid(pool, "t1")
        assert pool.warm() == 1
        await until_async(lambda: (pool.warm(), pool.idle(), len(pool.pids())) == (0, 1, 1), what="warm retired")
        assert first not in pool.pids() and pool.shrunk_total == 1
        assert await job_pid(pool, "t1") != first
    finally:
        await pool.close()


async def test_a_worker_left_warm_by_a_job_that_outlived_a_shrink_is_retired_once_quiet_again():
    """A job still running when the pool shrank (its spare beyond one ended) leaves its worker warm at its end;
    that worker does not stay for good: once no job started or ended for the quiet time, it is retired too."""
    pool = warm_pool(worker_fakes.serves_jobs, size=3, idle=2, shrink_after_s=0.2)
    release, asked = asyncio.Event(), []
    ctx, _chunks, _dropped = make_ctx(held_lookup(release, asked))
    await pool.start()
    try:
        job = asyncio.create_task(pool("crew", "run", {"hold": True}, ctx))
        await until_async(lambda: pool.shrunk_total == 1 and pool.idle() == 1, what="a shrink while the job runs")
        assert asked == ["held"] and not job.done()
        release.set()
        pid = (await job)["pid"]
        assert pid in pool.pids()
        await until_async(lambda: pool.warm() == 0 and pid not in pool.pids(), what="the warm worker retired")
        assert pool.shrunk_total >= 2  # the warm one, and the spare its job's end booted back
    finally:
        await pool.close()


def warm_pool(target: Any, *, size: int = 2, idle: int = 1, shrink_after_s: float = 0.0) -> WorkerPool:
    """A pool of ``target`` workers, which say for themselves whether they run another job (``last``)."""
    return make_pool(target, size=size, idle=idle, shrink_after_s=shrink_after_s)


async def job_pid(pool: WorkerPool, tenant: str, crew: str = "crew") -> int:
    ctx, _chunks, _dropped = make_ctx()
    ctx.tenant = tenant
    output = await pool(crew, "run", {}, ctx)
    return int(output["pid"])


async def test_a_warm_worker_runs_only_its_owners_next_jobs():
    """A worker that reported ``last: false`` runs the same tenant's next job of the same crew; another
    tenant's job, or another crew's, goes to another worker."""
    pool = warm_pool(worker_fakes.serves_jobs, size=4, idle=1)
    await pool.start()
    try:
        first = await job_pid(pool, "t1")
        assert pool.warm() == 1
        assert await job_pid(pool, "t1") == first
        other_tenant = await job_pid(pool, "t2")
        other_crew = await job_pid(pool, "t1", crew="other")
        assert len({first, other_tenant, other_crew}) == 3
        assert await job_pid(pool, "t1") == first and pool.reused_total == 2
    finally:
        await pool.close()


async def test_a_job_with_every_slot_held_by_warm_workers_retires_the_oldest():
    """Two slots, both held by warm workers of t1 and t2: t3's job retires t1's (killed, it runs nothing)
    and runs in a fresh worker; t2's warm worker still serves t2."""
    pool = warm_pool(worker_fakes.serves_jobs, size=2, idle=0)
    await pool.start()
    try:
        t1, t2 = await asyncio.gather(job_pid(pool, "t1"), job_pid(pool, "t2"))
        assert pool.warm() == 2
        t3 = await job_pid(pool, "t3")
        assert t3 not in {t1, t2} and pool.retired_total == 1
        assert await job_pid(pool, "t2") == t2
    finally:
        await pool.close()


async def test_a_worker_told_to_stop_is_never_kept_warm_whatever_it_reports():
    """A worker told to stop that finished its job anyway and reports ``last: false`` is not handed the
    owner's next job."""
    pool = warm_pool(worker_fakes.stays_after_cancel, size=1, idle=1)
    ctx, chunks, _dropped = make_ctx()
    await pool.start()
    try:
        job = asyncio.create_task(pool("crew", "run", {"wait": True}, ctx))
        await until_async(lambda: bool(chunks), interval=0.01, what="the worker's first chunk")
        (cancelled_pid,) = pool.pids()
        job.cancel()
        assert await job == {"pid": cancelled_pid}
        assert pool.warm() == 0
        assert await job_pid(pool, "t") != cancelled_pid
    finally:
        await pool.close()


async def test_a_worker_that_dies_before_it_takes_its_job_hands_the_job_to_another(tmp_path):
    """A worker killed as it got its job (no frame yet: nothing of the job ran) is replaced once: the job
    completes in another worker; a second such death fails the job before any effect, not uncertain."""
    pool = make_pool(worker_fakes.dies_before_start_once, registry=str(tmp_path / "died-once"))
    ctx, _chunks, _dropped = make_ctx()
    assert await run_job(pool, ctx) == {"raw": "second worker"}
    assert pool.died_total == 1

    pool = make_pool(worker_fakes.always_dies_before_start)
    ctx, _chunks, _dropped = make_ctx()
    with pytest.raises(WorkerDied) as raised:
        await run_job(pool, ctx)
    assert (raised.value.before_any_effect, raised.value.uncertain, pool.died_total) == (True, False, 2)
    assert "before it started it" in raised.value.message
