"""Process isolation: every job runs in a worker process of its own (``--isolation process``).

The sidecar process keeps HTTP, the journal (its only writer), admission,
the bounds and the event fan-out; :class:`WorkerPool` is the runtime's
executor (the same ``async executor(crew_id, operation, input, ctx)`` as the
in-process one) and runs each job in a fresh worker (:mod:`worker`):

- **Fork server.** :func:`~aip_crewai.sidecar.isolation.fork_server.start_forkserver`
  starts multiprocessing's fork server right after CrewAI's environment is set
  (in parallel with the sidecar's own CrewAI import); it imports CrewAI and the
  operations once (``operations/startup/preload.py``), never the crew registry
  (which may start threads: each worker imports it after the fork).
  Workers fork from it, not from the sidecar,
  whose event loop and threads make a plain ``fork`` unsafe. A worker is
  ready in about 10 ms and shares the fork server's pages.
- **Pool.** At most ``--max-concurrency`` workers exist at any time;
  ``--idle-workers`` of them (default: all) are booted ahead of need and wait
  for their job, and a job that finds none idle waits for one to boot. A
  worker runs up to ``--worker-jobs`` jobs of one owner (below); a spent
  worker exits and its replacement boots :data:`REPLACE_DELAY_S` after its
  last job ended (at once for a job waiting for a worker). With
  ``--worker-jobs 1`` no job inherits another's environment, working
  directory, stdout, module state, event-bus handlers or CrewAI replay
  storage. The idle workers trade memory (each holds about 23 MiB of its own)
  for start latency (a boot is a fork, the registry import and a warm-up
  kickoff: about 60 ms of CPU for a small registry).
- **Shrink when quiet** (``--idle-shrink-seconds`` S, default 30; 0: never).
  Once S seconds passed without a job starting or ending, the idle workers
  beyond one (none with ``--idle-workers 0``) exit and warm workers are
  retired: an idle sidecar holds one worker, not ``--idle-workers``. The next
  job's start boots the spares back at once (it finds the one kept; the jobs
  right behind it in a burst wait for a boot). A deployment with a job at
  least every S seconds never shrinks.
- **Warm workers** (``--worker-jobs`` N above 1; default 100). A worker whose
  job completed (``last: false``: no cancel, no kill, no crash, no failure, and
  not grown past ``worker.WARM_GROWTH_LIMIT_BYTES``) is kept *warm* for
  its *owner*: the job's tenant, crew and training directory (what its job
  sandbox layer was built from). The owner's next job takes it before any
  fresh worker and skips the boot and the fork's copy-on-write; it runs up to N
  jobs, then exits and is replaced. Warm workers hold slots of
  ``--max-concurrency`` but are not idle spares; when a job waits with every
  slot held, or when no spare is left and more than one worker is warm (with
  ``--idle-workers`` above 0: the next owner's job then finds a booted worker),
  the oldest warm worker is retired (killed; it runs nothing) to
  make room. Another tenant's job never runs in a warm worker.
- **Events.** Chunks come back as frames (:mod:`~aip_crewai.sidecar.isolation.wire`) and go to
  ``ctx.emit_chunk``: the runtime shapes, bounds, journals and fans them out
  as in-process. ``ctx.find_task_run`` (replay) is answered over the same
  socket; ``ctx.run_state`` and the output come back with the end.
- **Hard cancel** (:attr:`stops_by_task`: the runtime cancels the executor's
  task for every operation). The worker is told to stop (its cancel flag;
  ``run``/``batch_run``'s task); a worker that has not ended within
  ``--cancel-grace-seconds`` is killed (SIGKILL). The stop counts as
  confirmed (``provider_stop_observed``) when the worker stopped on the
  cancel or died before answering: no model call or tool runs in it after
  the flag is set, and a killed one runs nothing at all. A worker that
  finished its work anyway leaves the job ``uncertain_outcome: true``.
- **Crash containment.** A worker that dies on its own (a signal, an exit)
  fails only its job: ``error_type`` ``WorkerDied``, a message naming the
  signal or exit status, ``uncertain_outcome: true``; a broken frame kills
  it and fails the job ``WorkerProtocolError``. A replacement is started.
  A worker that dies before any frame of its job (``Started`` comes first)
  ran nothing of it: the job goes to one other worker (a second such death
  fails it before any effect, ``uncertain_outcome: false``).

Source: ARCHITECTURE.md §5 (isolation); docs/security.md "Process isolation".
"""

from __future__ import annotations

import asyncio
import atexit
import socket
import time
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

import anyio
import structlog

from aip_crewai.sidecar.isolation.fork_server import (
    BOOT_TIMEOUT_SECONDS,
    REAP_SECONDS,
    ForkServerThreaded,
    WorkerStartFailed,
    describe_exit,
    start_forkserver,
)
from aip_crewai.sidecar.isolation.handle import WorkerDied, WorkerHandle, kill_worker
from aip_crewai.sidecar.isolation.job import JobFollower
from aip_crewai.sidecar.isolation.wire import (
    Boot,
    FrameError,
    Ready,
    Refused,
    Start,
    encode_boot,
    frame_bound,
)
from aip_crewai.sidecar.jobs.context import JobContext

log = structlog.get_logger(__name__)

#: Whose jobs a warm worker may run: (tenant, crew id, training directory or None), its job sandbox layer's inputs.
Owner = tuple[str, str, str | None]

#: Delay before starting a worker again after one failed to boot (s), doubling up to the maximum.
RESPAWN_DELAY_SECONDS, MAX_RESPAWN_DELAY_SECONDS = 0.5, 10.0
#: How long after a job ended its spent worker's replacement boots (s): the fork and the boot then do not compete
#: for the CPU with the job's terminal commit and answer (2 cores: a `fast` job's POST /jobs about 4 ms faster at
#: p50, bench/results/HISTORY.md). A job that waits for a worker meanwhile boots one at once.
REPLACE_DELAY_S = 0.05
#: After a shrink that found workers still booting, when to look again (s): a boot ends within its timeout.
SHRINK_RECHECK_S = 1.0


class WorkerPool:
    """The process-isolated executor (see the module docstring).

    Args:
        boot: what each worker loads (registry, state dir, logging).
        size: workers alive at once, at most (``--max-concurrency``).
        idle: workers kept booted ahead of need (``--idle-workers``; default and at most ``size``): with
            fewer, a job that finds none idle waits for one to boot.
        shrink_after_s: ``--idle-shrink-seconds``: seconds without a job starting or ending after which at most
            one idle worker is kept and warm workers are retired (0: never; see the module docstring).
        cancel_grace_seconds: how long a cancelled job may take to stop before its worker is killed.
        max_events: ``--max-events-per-run``; max_event_bytes: ``--max-event-bytes``.
        context: the multiprocessing context (default: :func:`start_forkserver`'s).
        target: the worker process's function ``(socket, boot bytes)`` (default: :func:`worker.serve`;
            tests pass fakes).

    ``boot.jobs`` (``--worker-jobs``) above 1 keeps warm workers (see the module docstring).
    """

    #: The runtime cancels this executor's task for every operation (hard cancel).
    stops_by_task = True

    def __init__(
        self,
        boot: Boot,
        size: int,
        *,
        cancel_grace_seconds: float,
        max_events: int,
        max_event_bytes: int,
        context: BaseContext | None = None,
        target: Callable[[socket.socket, bytes], None] | None = None,
        idle: int | None = None,
        shrink_after_s: float = 0.0,
    ) -> None:
        self.boot = boot
        self.size = size
        self.spare = size if idle is None else min(idle, size)
        self.shrink_after_s = shrink_after_s
        self.cancel_grace_seconds = cancel_grace_seconds
        self.max_events = max_events
        self.max_event_bytes = max_event_bytes
        self.bound = frame_bound(max_event_bytes)
        self._context = context
        self._target = target or _worker_entry
        self._boot_data = encode_boot(boot)
        self._idle: asyncio.Queue[WorkerHandle] = asyncio.Queue()
        self._warm: dict[WorkerHandle, Owner] = {}  # warm workers and their owners, oldest first
        self._alive: set[WorkerHandle] = set()
        self._processes: set[Any] = set()  # every worker process started and not yet known to be reaped
        self._spawning: set[asyncio.Task[Any]] = set()
        self._replacing: asyncio.TimerHandle | None = None  # the pending _replace_later
        self._shrinking: asyncio.TimerHandle | None = None  # the pending _shrink_if_quiet
        self._last_activity = time.monotonic()  # a job's start or end (or the pool's start), monotonic s
        self._booting = 0  # workers being started in the background (_top_up)
        self._busy = 0  # workers running a job
        self._waiting = 0  # jobs waiting for an idle worker
        self._closing = False
        self._started = False
        self._failures = 0
        self.started_total = 0
        self.killed_total = 0
        self.died_total = 0
        self.reused_total = 0  # jobs that ran in a warm worker
        self.retired_total = 0  # warm workers killed to make room
        self.shrunk_total = 0  # idle and warm workers ended by a shrink

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        """Boot the idle workers (``idle``, at least one); return when all are ready.

        Raises:
            WorkerStartFailed: a worker could not boot (its log line says why).
        """
        if self._started:
            return
        if self._context is None:
            self._context = start_forkserver()
        # Before multiprocessing's own exit hook, which joins every child: never wait on a worker at exit.
        atexit.register(self.kill_all_now)
        # At least one even with --idle-workers 0: a worker that cannot boot stops the start, not a first job.
        count = max(1, self.spare)
        results = await asyncio.gather(*(self._start_one() for _ in range(count)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.close()
            threaded = next((r for r in failed if isinstance(r, ForkServerThreaded)), None)
            if threaded is not None:
                raise threaded
            raise WorkerStartFailed(f"{len(failed)} of {count} job workers could not start ({failed[0]})")
        self._started = True
        self._note_activity()  # a sidecar that never gets a job shrinks too
        log.info("workers_ready", workers=count, max_workers=self.size)

    async def close(self) -> None:
        """Stop starting workers and kill every worker (idle or busy); wait for their exits."""
        self._closing = True
        atexit.unregister(self.kill_all_now)
        for timer in (self._replacing, self._shrinking):
            if timer is not None:
                timer.cancel()
        for task in list(self._spawning):
            task.cancel()
        workers = list(self._alive)
        for worker in workers:
            worker.kill()
        self.kill_all_now()  # also workers still booting
        await asyncio.gather(*(w.reap() for w in workers), return_exceptions=True)
        await asyncio.gather(
            *(asyncio.to_thread(p.join, REAP_SECONDS) for p in self._processes), return_exceptions=True
        )
        self._alive.clear()
        self._warm.clear()
        self._processes.clear()

    def _track(self, process: Any, started: asyncio.Future[None]) -> None:
        if started.cancelled() or started.exception() is not None:
            return
        self._processes.add(process)
        if self._closing:
            kill_worker(process)

    def kill_all_now(self) -> None:
        """SIGKILL every worker process started (at interpreter exit: none may hold it; at a second Ctrl-C)."""
        for process in list(self._processes):
            kill_worker(process)

    def stop_replacing(self) -> None:
        """At a stop: start no more workers (jobs still running keep theirs; queued ones wait to be cancelled)."""
        self._closing = True

    def idle(self) -> int:
        """Fresh workers booted and waiting for a job, alive (warm ones not counted: :meth:`warm`; one killed
        while idle is not counted, and is replaced when a job next needs a worker)."""
        waiting = [self._idle.get_nowait() for _ in range(self._idle.qsize())]  # no getter waits: not empty
        for worker in waiting:
            self._idle.put_nowait(worker)
        return sum(1 for worker in waiting if worker.process.is_alive())

    def warm(self) -> int:
        """Warm workers waiting for their owner's next job (alive: one killed while warm is not counted)."""
        return sum(1 for worker in self._warm if worker.process.is_alive())

    def gauges(self) -> dict[str, int]:
        """The pool's ``GET /metrics`` values (names as in ``http/metrics._HELP``): idle and warm workers now, and
        the workers booted, jobs run warm, warm workers retired and workers shrunk since start."""
        return {
            "workers_idle": self.idle(),
            "workers_warm": self.warm(),
            "workers_started_total": self.started_total,
            "worker_jobs_reused_total": self.reused_total,
            "warm_workers_retired_total": self.retired_total,
            "workers_shrunk_total": self.shrunk_total,
        }

    def pids(self) -> list[int]:
        """Process ids of the workers alive now (idle and busy)."""
        return sorted(w.pid for w in self._alive)

    async def _start_one(self) -> None:
        context = self._context
        if context is None:
            raise RuntimeError("the pool is not started")
        ours, theirs = socket.socketpair()
        try:
            process = context.Process(  # type: ignore[attr-defined]
                target=self._target,
                args=(theirs, self._boot_data),
                name="aip-crewai-job-worker",
                daemon=False,
            )
            started = asyncio.ensure_future(asyncio.to_thread(process.start))
            # Tracked once started, even when this task is cancelled meanwhile (a close kills it).
            started.add_done_callback(lambda future: self._track(process, future))
            await asyncio.shield(started)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        worker = WorkerHandle(process, reader, writer, self.bound)
        self._alive.add(worker)
        try:
            with anyio.fail_after(BOOT_TIMEOUT_SECONDS):
                ready = await worker.recv()
        except (TimeoutError, FrameError):
            ready = None
            worker.kill()
        if not isinstance(ready, Ready):
            code = await worker.reap()
            self._alive.discard(worker)
            if isinstance(ready, Refused):
                raise ForkServerThreaded(ready.threads)
            raise WorkerStartFailed(f"a job worker did not boot ({describe_exit(code)})")
        self.started_total += 1
        self._idle.put_nowait(worker)

    def _top_up(self) -> None:
        """Start workers in the background until the idle and booting ones cover the jobs waiting plus
        ``idle`` spares, within ``size`` minus the busy ones (after a failure, with a growing delay)."""
        self._processes = {p for p in self._processes if p.exitcode is None}  # forget the reaped ones
        if self._closing:
            return
        for worker in [w for w in self._warm if not w.process.is_alive()]:  # died while warm: its slot is free
            del self._warm[worker]
            log.warning("worker_died_idle", pid=worker.pid, warm=True)
            self._forget(worker)
        ready = self._idle.qsize() + self._booting
        unserved = self._waiting - ready
        free = self.size - self._busy - len(self._warm) - ready
        while self._warm and unserved > max(free, 0):  # every slot held: the oldest warm worker makes room
            self._retire(next(iter(self._warm)))
            free += 1
        if unserved <= 0 and ready == 0 and free <= 0 and len(self._warm) > 1 and self._spares() > 0:
            # Warm workers leave room for one spare: with more owners than slots, the next owner's job then
            # finds a booted worker instead of waiting for a retire and a boot.
            self._retire(next(iter(self._warm)))
        wanted = min(self.size - self._busy - len(self._warm), self._spares() + self._waiting)
        for _ in range(wanted - ready):
            self._booting += 1
            task = asyncio.get_running_loop().create_task(self._boot_one())
            self._spawning.add(task)
            task.add_done_callback(self._spawning.discard)

    async def _boot_one(self) -> None:
        failed = False
        try:
            if self._failures:
                await asyncio.sleep(min(MAX_RESPAWN_DELAY_SECONDS, RESPAWN_DELAY_SECONDS * 2 ** (self._failures - 1)))
            if self._closing:
                return
            try:
                await self._start_one()
            except (WorkerStartFailed, OSError) as exc:
                failed = True
                self._failures += 1
                log.error("worker_start_failed", error=str(exc), failures=self._failures)
                return
            self._failures = 0
        finally:
            self._booting -= 1
            if failed:
                self._top_up()

    def _retire(self, worker: WorkerHandle) -> None:
        """Kill a warm worker (it runs nothing) and reap it in the background."""
        del self._warm[worker]
        self.retired_total += 1
        log.info("warm_worker_retired", pid=worker.pid)
        worker.kill()
        self._forget(worker)

    def _spares(self) -> int:
        """Idle workers wanted now: ``idle``, or at most one once :attr:`shrink_after_s` passed without a job
        starting or ending."""
        quiet = self.shrink_after_s > 0 and time.monotonic() - self._last_activity >= self.shrink_after_s
        return min(self.spare, 1) if quiet else self.spare

    def _note_activity(self) -> None:
        """A job starts or ends (or the pool started): the quiet time counts from now; one timer watches it (a
        worker left warm by a job that outlived a shrink is retired once the pool is quiet again)."""
        self._last_activity = time.monotonic()
        if self.shrink_after_s > 0 and self._shrinking is None and not self._closing:
            self._shrinking = asyncio.get_running_loop().call_later(self.shrink_after_s, self._shrink_if_quiet)

    def _shrink_if_quiet(self) -> None:
        """Once :attr:`shrink_after_s` passed since a job last started or ended: end the idle workers beyond
        :meth:`_spares` (the oldest first) and every warm one (each is killed: it runs nothing), then watch again
        while a boot under way may still add one."""
        self._shrinking = None
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        left = self._last_activity + self.shrink_after_s - time.monotonic()
        if left > 0:
            self._shrinking = loop.call_later(left, self._shrink_if_quiet)
            return
        ended = 0
        while self._idle.qsize() > self._spares():
            worker = self._idle.get_nowait()
            worker.kill()
            self._forget(worker)
            ended += 1
        for worker in list(self._warm):
            del self._warm[worker]
            worker.kill()
            self._forget(worker)
            ended += 1
        self._top_up()  # the one kept: booted when none was idle (a warm worker's owner gone quiet)
        if ended:
            self.shrunk_total += ended
            log.info(
                "idle_workers_shrunk",
                ended=ended,
                idle=self._idle.qsize(),
                booting=self._booting,
                quiet_s=self.shrink_after_s,
            )
        if self._booting:
            self._shrinking = loop.call_later(SHRINK_RECHECK_S, self._shrink_if_quiet)

    def _forget(self, worker: WorkerHandle) -> None:
        """The worker holds no slot any more: reap it in the background (it exits by itself or was killed)."""
        self._alive.discard(worker)
        task = asyncio.get_running_loop().create_task(worker.reap())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    def _take_warm(self, owner: Owner) -> WorkerHandle | None:
        """The newest warm worker of ``owner`` still alive, or None."""
        for worker in reversed([w for w, o in self._warm.items() if o == owner]):
            del self._warm[worker]
            if worker.process.is_alive():
                return worker
            log.warning("worker_died_idle", pid=worker.pid, warm=True)
            self._forget(worker)
        return None

    async def _take(self, owner: Owner) -> tuple[WorkerHandle, bool]:
        """A warm worker of ``owner`` (``(worker, True)``), else an idle one, booting one when none is
        (``_top_up`` counts this job as waiting)."""
        worker = self._take_warm(owner)
        if worker is not None:
            return worker, True
        self._waiting += 1
        try:
            while True:
                self._top_up()
                worker = await self._idle.get()
                if worker.process.is_alive():
                    return worker, False
                self._alive.discard(worker)  # died while idle: start another
                log.warning("worker_died_idle", pid=worker.pid, exit=describe_exit(await worker.reap()))
        finally:
            self._waiting -= 1

    # ------------------------------------------------------------- executor

    async def __call__(self, crew_id: str, operation: str, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
        """Run one job in a worker (``runtime.Executor``).

        Returns:
            The operation output (ARCHITECTURE.md §4 Outputs).

        Raises:
            asyncio.CancelledError: the job was stopped (cooperatively or by a kill) after its task was cancelled.
            JobCancelled: the worker stopped on a cancel.
            WorkerDied: the worker died first (``uncertain_outcome: true``); a worker that died before it took
                the job (no frame yet) is replaced once by another, and a second such death fails the job
                before any effect.
            SafeJobError: the worker reported a failure (its type; a message only when publishable).
        """
        owner = (ctx.tenant, crew_id, str(ctx.training_dir) if ctx.training_dir is not None else None)
        start = Start(
            ctx.action_id,
            crew_id,
            operation,
            ctx.tenant,
            input,
            str(ctx.state_dir),
            str(ctx.training_dir) if ctx.training_dir is not None else None,
            self.max_events,
            self.max_event_bytes,
            ctx.traceparent,
        )
        try:
            return await self._run_in_one(owner, start, ctx)
        except WorkerDied as exc:
            if not exc.before_start or self._closing:
                raise
            # it died idle or as it got the job (killed, OOM): nothing ran, so one other worker may run it
            log.warning("job_given_to_another_worker", action_id=ctx.action_id, exit=describe_exit(exc.exitcode))
            return await self._run_in_one(owner, start, ctx)

    async def _run_in_one(self, owner: Owner, start: Start, ctx: JobContext) -> dict[str, Any]:
        """Run ``start`` in one worker (warm for ``owner``, else idle, else booted)."""
        self._note_activity()  # before _take: after a quiet time, the spares boot back with this job's own
        worker, warm = await self._take(owner)
        self._busy += 1
        self._top_up()  # a spare for the next job, booted while this one runs
        job: JobFollower | None = None
        try:
            if not await worker.send(start):
                raise WorkerDied(await worker.reap(), before_start=True)
            job = JobFollower(self, worker, ctx)
            return await job.follow()
        except WorkerDied as exc:
            warm = warm and not exc.before_start  # it died before it took the job: the job ran elsewhere
            raise
        finally:
            if warm:
                self.reused_total += 1
            self._busy -= 1
            self._note_activity()  # a job that outlived a shrink: its warm worker is retired once quiet again
            kept = job is not None and job.reusable and not self._closing
            if kept:
                self._warm[worker] = owner
            else:  # the worker exits by itself after its last job (else it was killed)
                self._forget(worker)
            if kept or self._waiting:
                self._top_up()
            else:
                self._replace_later()

    def _replace_later(self) -> None:
        """Boot the spent worker's replacement in :data:`REPLACE_DELAY_S` (one timer covers every slot freed
        meanwhile: :meth:`_top_up` counts them all); a job that waits for a worker meanwhile boots one at once."""
        if self._replacing is None or self._replacing.cancelled():
            self._replacing = asyncio.get_running_loop().call_later(REPLACE_DELAY_S, self._replace_now)

    def _replace_now(self) -> None:
        self._replacing = None
        self._top_up()


def _worker_entry(sock: socket.socket, boot_data: bytes) -> None:
    """Process target (imported by reference in the fork server's child)."""
    from aip_crewai.sidecar.isolation.worker import serve

    serve(sock, boot_data)
