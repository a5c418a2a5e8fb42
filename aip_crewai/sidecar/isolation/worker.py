"""One job worker process: boots, runs its job (or up to ``--worker-jobs`` of one tenant's one crew, one
after the other), reports each, exits.

Started by :class:`aip_crewai.sidecar.isolation.pool.WorkerPool` from the worker
fork server, which imported CrewAI and the operations beforehand
(``operations/startup/preload.py``), so a worker starts in about 10 ms and pays no
CrewAI import. :func:`serve` is the process target:

1. boot: SIGINT and SIGTERM ignored (the sidecar drains its jobs at a stop
   and kills a worker with SIGKILL when it must); logging to stderr as the
   sidecar logs; fd 1 to ``/dev/null`` and ``sys.stdout`` to a
   ``PrintedErrorLog`` of its own; CrewAI's environment; the registry; one
   throwaway kickoff (``operations/startup/preload.warm_up``: the pages a kickoff
   writes are copied now, not on the job's time). Then
   :class:`~aip_crewai.sidecar.isolation.wire.Ready`;
2. wait for :class:`~aip_crewai.sidecar.isolation.wire.Start` (end of file: the sidecar is gone,
   exit at once);
3. run ``operations.execute`` on the worker's event loop, with a
   :class:`JobContext` whose chunk sink writes :class:`~aip_crewai.sidecar.isolation.wire.Chunk`
   frames (at most ``max_events - 2`` per job: the ``started`` and terminal
   events need their slots; the rest are counted), whose ``find_task_run``
   asks the sidecar, and whose cancel flag the reader thread (:class:`~aip_crewai.sidecar.isolation.channel.Inbox`) sets on
   :class:`~aip_crewai.sidecar.isolation.wire.Cancel` (cancelling the task of ``run`` and
   ``batch_run`` too, as the in-process runtime does);
4. send :class:`~aip_crewai.sidecar.isolation.wire.Done` or :class:`~aip_crewai.sidecar.isolation.wire.Failed` and
   exit with ``os._exit`` (CrewAI's threads never hold the process); with ``Boot.jobs`` above 1 (the
   default 100), a job that completed (no cancel, no failure, the worker's memory not grown by more than
   :data:`WARM_GROWTH_LIMIT_BYTES` since its first job) is reported with
   ``last: false`` instead: the worker restores ``os.environ``, its working directory, the standard
   streams, umask, process group, signals, timers and limits (:class:`_ProcessState`; what it cannot put
   back retires it) and goes back to 2 for
   the next job, which the sidecar sends only for the same tenant and crew (the job sandbox layer,
   ``confinement.enter_job``, is its first job's for good).

The same module holds the start-up registry check (:func:`describe`): one
process forked like a worker, before any, that loads the registry and runs
the preflight and answers :class:`~aip_crewai.sidecar.isolation.wire.Described`, so that with
process isolation the sidecar process itself never imports CrewAI (one
import per sidecar, in the fork server, instead of two).

A worker whose sidecar goes away (end of file on its socket) exits at once:
nothing it would do next could be recorded.

With ``Boot.jobs`` 1, everything a job changes in its process
(environment, working directory, ``sys.stdout``, module state, CrewAI's event
bus handlers and replay storage, threads it started) dies with it: the next
job runs in a new process. Above 1, what a job leaves besides what
:class:`_ProcessState` puts back (module state, threads, event-bus
handlers its crew registered) reaches the next job of the same tenant and crew
in that worker, as every job's does with ``--isolation inprocess``, never
another tenant's (docs/security.md).

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import structlog

from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.sidecar.isolation.channel import (
    PROTOCOL_STATUS,
    Channel,
    ChunkSender,
    Inbox,
    JobState,
    exit_now,
)
from aip_crewai.sidecar.isolation.sandbox import Confinement
from aip_crewai.sidecar.isolation.wire import (
    Boot,
    Described,
    Done,
    Failed,
    FromWorker,
    Ready,
    Refused,
    Start,
    Started,
    decode_boot,
    frame_bound,
)
from aip_crewai.sidecar.jobs.context import JobCancelled, JobContext, SafeJobError

log = structlog.get_logger(__name__)

#: Exit status of a worker that could not boot (its log line says why).
BOOT_FAILED_STATUS = 3
#: Bound on a SafeJobError message sent back, characters (the runtime cuts again).
MAX_MESSAGE_CHARS = 2048
#: A warm worker whose resident memory grew by more than this since its first job ended runs no more jobs
#: (bytes): crews that grow per job (CrewAI builds classes per kickoff; a memory crew's LanceDB adds threads and
#: buffers, about 2 MiB a job) get a fresh process instead of holding it for ``--worker-jobs`` jobs.
WARM_GROWTH_LIMIT_BYTES = 64 * 1024 * 1024


def serve(sock: socket.socket, boot_data: bytes) -> None:
    """Process target: boot, run its jobs (``Boot.jobs``, at most), report each, exit (never returns).

    Args:
        sock: the worker's end of its socketpair with the sidecar.
        boot_data: an encoded :class:`~aip_crewai.sidecar.isolation.wire.Boot`.
    """
    started = time.monotonic()
    with contextlib.suppress(OSError):  # its own process group: a hard kill takes what its jobs start too
        os.setpgid(0, 0)
    preloaded = "crewai" in sys.modules
    boot = decode_boot(boot_data)
    if boot.nice:  # before the boot's own work (the registry import, the warm-up kickoff): jobs yield the CPU
        os.nice(boot.nice)
    channel = Channel(sock, frame_bound(262_144))
    threads = _fork_server_threads()
    if threads:  # forked from a multi-threaded process: a lock another thread held stays held here
        _send_and_exit(channel, Refused(threads), BOOT_FAILED_STATUS)
    confinement = _confine(boot)
    try:
        registry = _boot(boot)
    except BaseException as exc:  # noqa: BLE001 - report the type only, never the text
        log.error("worker_boot_failed", pid=os.getpid(), error_type=type(exc).__name__)
        exit_now(BOOT_FAILED_STATUS)
    loop = asyncio.new_event_loop()  # the worker's one loop: every job of it runs here
    asyncio.set_event_loop(loop)
    try:
        channel.send(Ready(os.getpid()))
    except OSError:
        exit_now(PROTOCOL_STATUS)
    log.debug(
        "worker_ready",
        pid=os.getpid(),
        boot_ms=round((time.monotonic() - started) * 1000, 1),
        crewai_preloaded=preloaded,
    )
    inbox = Inbox(channel, loop)
    owner: tuple[str, str, str | None] | None = None
    baseline = 0  # resident bytes once the first job ended (what the crew's first job loads is not growth)
    for count in itertools.count(1):
        job = inbox.next_job()
        if job is None:  # the sidecar closed the pool (or retired this worker)
            break
        start = job.start
        if owner is None:
            owner = _owner(start)
            channel.bound = frame_bound(start.max_event_bytes)
            _trace(boot)
        elif _owner(start) != owner:  # the pool sends a worker only its first job's tenant and crew
            log.error("worker_sent_another_owner", pid=os.getpid(), action_id=start.action_id)
            exit_now(PROTOCOL_STATUS)
        try:
            channel.send(Started())  # before anything of the job: a death before it did nothing of the job
        except OSError:
            exit_now(0)
        kept = _ProcessState() if count < boot.jobs else None
        outcome = run_job(registry, job, channel, confinement, reusable=kept is not None)
        if job.cancelled:  # a cancel reached the job: this worker runs nothing more
            outcome = msgspec.structs.replace(outcome, last=True)
        if not outcome.last:
            resident = _resident_bytes()
            baseline = baseline or resident
            if resident - baseline > WARM_GROWTH_LIMIT_BYTES:
                log.info("warm_worker_outgrown", pid=os.getpid(), jobs=count, grown_bytes=resident - baseline)
                outcome = msgspec.structs.replace(outcome, last=True)
        if not outcome.last and kept is not None and not kept.restore():
            outcome = msgspec.structs.replace(outcome, last=True)
        job.flag.reported.set()  # from here the sidecar's end of file (it reaps us) is expected
        try:
            channel.send(outcome)
        except OSError:
            exit_now(0)
        if outcome.last:
            break
        _flush_spans(leaving=False)
    if owner is not None:
        _flush_spans(leaving=True)
    exit_now(0)


def _resident_bytes() -> int:
    """This process's resident set size, bytes (``/proc/self/statm``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _owner(start: Start) -> tuple[str, str, str | None]:
    """What the jobs of one worker share: the tenant, the crew and the training directory (its job sandbox
    layer's inputs)."""
    return start.tenant, start.crew_id, start.training_dir


def _trace(boot: Boot) -> None:
    """The worker's tracer provider, at its first job (after the fork: the exporter's thread starts here)."""
    if boot.trace_protocol is None:
        return
    from aip_crewai import tracing
    from aip_crewai.sidecar import tracing as sidecar_tracing

    sidecar_tracing.configure(tracing.TraceSettings(boot.trace_protocol, boot.trace_content))
    sidecar_tracing.install()


#: Signals whose disposition a worker keeps (ignored: a stop and a drain are the sidecar's) and puts back after
#: each job of a warm worker.
KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


#: Every signal a handler may be set for (SIGKILL and SIGSTOP cannot be caught).
CATCHABLE_SIGNALS = tuple(sorted(set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}))
#: The interval timers a job may leave armed (a pending ``signal.alarm`` is ``ITIMER_REAL``'s).
TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
#: The resource limits a job may lower (a lowered hard limit cannot be raised back: the worker retires).
LIMITS = tuple(getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_"))


class _ProcessState:
    """What a worker puts back after a job when it runs another: ``os.environ`` (the mapping itself, should a
    job rebind it, and its variables) and the time zone read from it, the working directory,
    ``sys.stdin``/``sys.stdout``/``sys.stderr``, the file-mode creation mask, the process group, every signal's
    disposition, the blocked signals, the interval timers (a pending ``signal.alarm``), the scheduling
    priority, the resource limits and the recursion limit, as they were before the job ran. A variable set
    with ``os.putenv`` alone bypasses ``os.environ`` and stays. What cannot be put back (a job that raised its
    niceness as an unprivileged user, lowered a hard resource limit, or left a signal pending behind the mask)
    retires the worker: :meth:`restore` answers False (ARCHITECTURE.md §5 "warm workers")."""

    def __init__(self) -> None:
        self.mapping = os.environ
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.umask = os.umask(0o077)
        os.umask(self.umask)
        self.group, self.session = os.getpgrp(), os.getsid(0)
        self.handlers = {sig: signal.getsignal(sig) for sig in CATCHABLE_SIGNALS}
        self.blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        self.timers = {timer: signal.getitimer(timer) for timer in TIMERS}
        self.priority = os.getpriority(os.PRIO_PROCESS, 0)
        self.limits = {limit: resource.getrlimit(limit) for limit in LIMITS}
        self.recursion = sys.getrecursionlimit()

    def restore(self) -> bool:
        """Put the state back; False when some of it cannot be (the worker then runs no other job)."""
        try:
            self._restore_python()
            self._restore_process()
            return self._restore_mask()
        except Exception as exc:  # noqa: BLE001 - whatever the job left, its outcome is still reported
            log.info("warm_worker_state_not_restored", pid=os.getpid(), error_type=type(exc).__name__)
            return False

    def _restore_python(self) -> None:
        if os.environ is not self.mapping:
            os.environ = self.mapping  # noqa: B003 - putting back the mapping a job rebound
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        time.tzset()  # the time zone follows TZ as it is again (a job may have called tzset itself)
        try:
            if os.getcwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError:
            os.chdir(self.cwd)
        sys.stdin, sys.stdout, sys.stderr = self.streams
        os.umask(self.umask)
        sys.setrecursionlimit(self.recursion)
        for timer, (delay, interval) in self.timers.items():
            signal.setitimer(timer, delay, interval)
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)

    def _restore_mask(self) -> bool:
        """Unblock what the job blocked, unless a signal it left pending would then be delivered (the worker
        retires instead: its outcome is reported before it could die of it)."""
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, ()) - self.blocked
        if unblocked & signal.sigpending():
            log.info("warm_worker_state_not_restored", pid=os.getpid(), error_type="PendingSignal")
            return False
        signal.pthread_sigmask(signal.SIG_SETMASK, self.blocked)
        return True

    def _restore_process(self) -> None:
        """The session, process group, priority and resource limits: what a job may leave beyond repair
        (OSError, ValueError: a lowered hard limit, a raised niceness, another session)."""
        if os.getsid(0) != self.session:
            raise PermissionError("the job left the worker's session")
        if os.getpgrp() != self.group:
            os.setpgid(0, self.group)
        if os.getpriority(os.PRIO_PROCESS, 0) != self.priority:
            os.setpriority(os.PRIO_PROCESS, 0, self.priority)
        for limit, values in self.limits.items():
            if resource.getrlimit(limit) != values:
                resource.setrlimit(limit, values)


def _flush_spans(*, leaving: bool) -> None:
    """Export the jobs' spans (bounded: ``tracing.WORKER_FLUSH_MS``): before the worker leaves, and between
    two jobs (a retired warm worker is killed without a word)."""
    from aip_crewai.sidecar import tracing as sidecar_tracing

    try:
        if leaving:
            sidecar_tracing.shutdown(sidecar_tracing.WORKER_FLUSH_MS)
        else:
            sidecar_tracing.flush(sidecar_tracing.WORKER_FLUSH_MS)
    except Exception as exc:  # noqa: BLE001 - spans are lost, the job is not
        log.warning("worker_span_flush_failed", error_type=type(exc).__name__)


def describe(sock: socket.socket, boot_data: bytes) -> None:
    """Process target of the start-up registry check: answer one :class:`~aip_crewai.sidecar.isolation.wire.Described`, exit.

    Loads CrewAI (preloaded by the fork server) and ``boot.registry``, then runs the start-up preflight
    (``operations/startup/preflight.py``: each crew built once) and sends the crew ids and the facts found. A registry
    that cannot be loaded is answered with its message in ``refused``, a failed ``import crewai`` with its
    exception class in ``import_failed``; anything else ends the process without an answer (the sidecar
    then names the exit status).

    Args:
        sock: this process's end of a socketpair with the sidecar.
        boot_data: an encoded :class:`~aip_crewai.sidecar.isolation.wire.Boot`.
    """
    boot = decode_boot(boot_data)
    channel = Channel(sock, frame_bound(262_144))
    threads = _fork_server_threads()
    if threads:  # forked from a multi-threaded process: refuse before importing anything
        _send_and_exit(channel, Refused(threads), BOOT_FAILED_STATUS)
    _confine(boot)  # the registry's import-time code and the preflight's crews run confined too
    _prepare(boot)
    from aip_crewai.sidecar.crewai_env import import_crewai
    from aip_crewai.sidecar.registry import RegistryError, load_registry

    try:
        import_crewai()
    except Exception as exc:  # noqa: BLE001 - a broken install: only its class is published
        answer = Described(import_failed=type(exc).__name__)
    else:
        try:
            registry = load_registry(boot.registry)
        except (RegistryError, ImportError) as exc:
            answer = Described(refused=str(exc))
        else:
            from aip_crewai.sidecar.operations.startup.preflight import preflight

            found = preflight(registry)
            answer = Described(
                list(registry),
                {k: list(v) for k, v in found.problems.items()},
                {k: dict(v) for k, v in found.inputs.items()},
            )
    preload = sys.modules.get("aip_crewai.sidecar.operations.startup.preload")
    skipped = [list(pair) for pair in getattr(preload, "PRELOAD_SKIPPED", [])]
    _send_and_exit(channel, msgspec.structs.replace(answer, preload_skipped=skipped), 0)


def _send_and_exit(channel: Channel, message: FromWorker, status: int) -> NoReturn:
    try:
        channel.send(message)
    except OSError:
        pass
    exit_now(status)


def _fork_server_threads() -> list[str]:
    """The threads the fork server had besides its main one (``operations/startup/preload.FORK_SERVER_THREADS``);
    ``[]`` when it did not preload (nothing is imported here then: the worker's own count says nothing)."""
    preload = sys.modules.get("aip_crewai.sidecar.operations.startup.preload")
    return list(getattr(preload, "FORK_SERVER_THREADS", []))


def _confine(boot: Boot) -> Confinement:
    """The worker sandbox's boot step (user drop, Landlock layer 1: ``isolation/sandbox.py``), before
    anything of the registry is imported; a failure ends the process (its log line says why)."""
    confinement = Confinement(boot.sandbox)
    try:
        confinement.enter_boot()
    except (OSError, ValueError) as exc:
        log.error("worker_sandbox_failed", pid=os.getpid(), error_type=type(exc).__name__, error=str(exc))
        exit_now(BOOT_FAILED_STATUS)
    return confinement


def _prepare(boot: Boot) -> None:
    """Signals, logging, stdout and CrewAI's environment, as the sidecar has them."""
    for sig in KEPT_SIGNALS:  # a stop and a drain are the sidecar's (systemctl kill may reach us too)
        signal.signal(sig, signal.SIG_IGN)
    from aip_crewai.plumbing.log import configure_logging
    from aip_crewai.sidecar.crewai_env import capture_crewai_prints, prepare_crewai_environment

    configure_logging(json=boot.log_json, level=boot.log_level)
    capture_crewai_prints()
    prepare_crewai_environment(Path(boot.state_dir))


def _boot(boot: Boot) -> dict[str, Any]:
    """:func:`_prepare`, CrewAI, the registry."""
    from aip_crewai.sidecar.crewai_env import import_crewai
    from aip_crewai.sidecar.registry import load_registry

    _prepare(boot)
    import_crewai()
    registry = dict(
        load_registry(boot.registry)
    )  # after the fork: its threads start here (fork_server.start_forkserver)
    from aip_crewai.sidecar.operations.startup import preload as _preload

    try:  # the copy-on-write cost of a first kickoff, paid while idle (operations/startup/preload.py)
        _preload.warm_up(in_worker=True)
    except Exception as exc:  # noqa: BLE001 - the job then pays it, nothing worse
        log.warning("worker_warm_up_failed", error_type=type(exc).__name__)
    return registry


def run_job(
    registry: dict[str, Any],
    job: JobState,
    channel: Channel,
    confinement: Confinement | None = None,
    *,
    reusable: bool = False,
) -> Done | Failed:
    """Run ``job`` on the worker's event loop; return the message that reports its end.

    The job's sandbox layer (``confinement.enter_job``: only its own namespace and training
    directories of all tenants') is entered first (once per worker: a later job of the same tenant and crew
    finds it in place); a refusal fails the job ``SandboxFailed`` before any effect.

    Args:
        reusable: the worker may run another job after this one: a job that completed says ``last: false``;
            every failure says ``last: true`` (``Failed``'s default), a cancel included: the crew's factory, its
            callbacks or its run may have broken off half-way and left the process in a state no later job
            should meet (a ``before_any_effect`` failure such as ``CrewBuildFailed`` still ran the factory).

    Source: ARCHITECTURE.md §4 (outputs, failed events), §5 (isolation).
    """
    from aip_crewai.sidecar import tracing as sidecar_tracing
    from aip_crewai.sidecar.operations import execute

    start = job.start
    if start.crew_id not in registry:  # the sidecar admitted it from the same registry: never expected
        return Failed(
            "CrewNotFound", f"crew {start.crew_id!r} is not in this worker's registry", before_any_effect=True
        )
    if confinement is not None:
        failed = _enter_job(confinement, start)
        if failed is not None:
            return failed
    chunks = ChunkSender(channel, max(0, start.max_events - 2), start.max_event_bytes)
    ctx = JobContext(
        action_id=start.action_id,
        crew_id=start.crew_id,
        operation=start.operation,
        tenant=start.tenant,
        emit_chunk=chunks,
        cancel_flag=job.flag,
        state_dir=Path(start.state_dir),
        training_dir=Path(start.training_dir) if start.training_dir else None,
        find_task_run=job.calls.find,
        traceparent=start.traceparent,
        spans=sidecar_tracing.crew_spans(
            start.traceparent, sidecar_tracing.job_attributes(start.action_id, start.crew_id, start.operation)
        ),
    )
    loop = job.loop
    task = loop.create_task(execute(registry[start.crew_id], start.operation, dict(start.input), ctx))
    job.begin(task)
    try:
        result = _until_done(loop, task, ctx)
    except (asyncio.CancelledError, JobCancelled):
        return Failed("JobCancelled", cancelled=True, stop_observed=True, dropped=chunks.dropped)
    except SafeJobError as exc:
        return Failed(
            exc.error_type,
            str(exc.message)[:MAX_MESSAGE_CHARS],
            exc.before_any_effect,
            dropped=chunks.dropped,
            uncertain=exc.uncertain,
        )
    except BaseException as exc:  # noqa: BLE001 - only the class is published
        return Failed(type(exc).__name__, stop_observed=ctx.stop_observed, dropped=chunks.dropped, last=True)
    finally:
        chunks.close()  # a thread or a process the job left behind may still emit: never as a later job's chunk
    try:
        output = msgspec.json.encode(result)
    except (TypeError, ValueError) as err:
        log.error("job_output_not_json", action_id=start.action_id, error_type=type(err).__name__)
        return Failed("InvalidOutput", "the operation output is not JSON", dropped=chunks.dropped)
    if len(output) > MAX_OUTPUT_BYTES:
        return Failed(
            "OutputTooLarge",
            f"the operation output is {len(output)} bytes; at most {MAX_OUTPUT_BYTES} bytes",
            dropped=chunks.dropped,
        )
    return Done(output, list(ctx.run_state.items()), chunks.dropped, last=not reusable)


def _enter_job(confinement: Confinement, start: Start) -> Failed | None:
    """The job's sandbox layer for its tenant and crew; a ``SandboxFailed`` failure when refused."""
    from aip_crewai.sidecar.operations.knowledge_query import namespace_storage_dir
    from aip_crewai.sidecar.tenancy import namespace_key, tenant_dir_name

    training = os.path.join(start.training_dir, tenant_dir_name(start.tenant)) if start.training_dir else None
    try:
        confinement.enter_job(str(namespace_storage_dir(namespace_key(start.tenant, start.crew_id))), training)
    except OSError as exc:
        log.error("worker_sandbox_failed", action_id=start.action_id, error_type=type(exc).__name__)
        return Failed(
            "SandboxFailed",
            f"the job's worker could not confine itself to its tenant's files ({type(exc).__name__})",
            before_any_effect=True,
        )
    return None


def _until_done(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], ctx: JobContext) -> Any:
    """The job's result; its CrewAI spans still open are ended on every path (a cancelled job)."""
    try:
        return loop.run_until_complete(task)
    finally:
        if ctx.spans is not None:
            ctx.spans.close()
