"""One job worker process: boots, runs exactly one job, reports it, exits.

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
3. run ``operations.execute`` on a fresh event loop of its own, with a
   :class:`JobContext` whose chunk sink writes :class:`~aip_crewai.sidecar.isolation.wire.Chunk`
   frames (at most ``max_events - 2`` per job: the ``started`` and terminal
   events need their slots; the rest are counted), whose ``find_task_run``
   asks the sidecar, and whose cancel flag a reader thread sets on
   :class:`~aip_crewai.sidecar.isolation.wire.Cancel` (cancelling the task of ``run`` and
   ``batch_run`` too, as the in-process runtime does);
4. send :class:`~aip_crewai.sidecar.isolation.wire.Done` or :class:`~aip_crewai.sidecar.isolation.wire.Failed` and
   exit with ``os._exit`` (CrewAI's threads never hold the process).

The same module holds the start-up registry check (:func:`describe`): one
process forked like a worker, before any, that loads the registry and runs
the preflight and answers :class:`~aip_crewai.sidecar.isolation.wire.Described`, so that with
process isolation the sidecar process itself never imports CrewAI (one
import per sidecar, in the fork server, instead of two).

A worker whose sidecar goes away (end of file on its socket) exits at once:
nothing it would do next could be recorded.

Everything a job changes in its process (environment, working directory,
``sys.stdout``, CrewAI's event bus handlers and replay storage) dies with
it: the next job runs in a new process.

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import structlog

from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.sidecar.isolation.sandbox import Confinement
from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    Boot,
    Cancel,
    Chunk,
    Described,
    Done,
    Failed,
    FindTaskRun,
    FrameError,
    FromWorker,
    Ready,
    Refused,
    Start,
    TaskRun,
    ToWorker,
    decode_boot,
    decode_to_worker,
    encode,
    frame_bound,
    payload_length,
)
from aip_crewai.sidecar.jobs.context import TASK_CANCELLED_OPERATIONS, JobCancelled, JobContext, SafeJobError
from aip_crewai.sidecar.jobs.live import MAX_LABEL_CHARS

log = structlog.get_logger(__name__)

#: Exit status of a worker that could not boot (its log line says why).
BOOT_FAILED_STATUS = 3
#: Exit status of a worker whose sidecar sent something other than a job.
PROTOCOL_STATUS = 4
#: Bound on a SafeJobError message sent back, characters (the runtime cuts again).
MAX_MESSAGE_CHARS = 2048
#: Set once the job's outcome is being sent: the worker then exits from its main thread, after its spans.
_REPORTED = threading.Event()


class Channel:
    """The worker's end of its socket: whole frames, one writer at a time (any thread)."""

    def __init__(self, sock: socket.socket, bound: int) -> None:
        self.sock = sock
        self.bound = bound
        self._lock = threading.Lock()

    def send(self, message: FromWorker) -> None:
        """Send one frame. Raises OSError when the sidecar is gone."""
        frame = encode(message)
        with self._lock:
            self.sock.sendall(frame)

    def recv(self) -> ToWorker | None:
        """The next message; None at end of file. Raises FrameError on a bad frame."""
        header = self._exact(HEADER.size)
        if header is None:
            return None
        payload = self._exact(payload_length(header, self.bound))
        if payload is None:
            return None
        return decode_to_worker(payload)

    def _exact(self, size: int) -> bytes | None:
        data = bytearray()
        while len(data) < size:
            try:
                piece = self.sock.recv(min(size - len(data), 1 << 20))
            except OSError:
                return None
            if not piece:
                return None
            data += piece
        return bytes(data)


class _StopFlag(threading.Event):
    """A worker's job cancel flag (``ctx.cancel_flag``) that also notices a sidecar gone, and then ends the
    worker at once.

    The reader thread ends the worker at the sidecar's end of file, but only once it runs: a worker at
    ``--worker-nice`` on a busy machine may wait for a CPU, and its job thread, woken first, would make its
    next model call for a sidecar already killed. Every point that checks the flag before an effect (each
    model call, each chunk: ``operations/_common.py``) therefore looks at the socket too (a non-blocking
    poll for the hang-up: the kernel marks it at the kill, whichever thread runs first). Until the job's end
    is reported: after it, the sidecar closing the socket is expected.

    Source: ARCHITECTURE.md §5 (isolation: a crash of the sidecar runs nothing more).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def is_set(self) -> bool:
        if not _REPORTED.is_set() and _sidecar_gone(self._sock):
            _exit(0)
        return super().is_set()


def _sidecar_gone(sock: socket.socket) -> bool:
    """The sidecar's end of ``sock`` is closed (hung up, even with a frame still unread, or the socket is
    broken); never blocks."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


def serve(sock: socket.socket, boot_data: bytes) -> None:
    """Process target: boot, run one job, report it, exit (never returns).

    Args:
        sock: the worker's end of its socketpair with the sidecar.
        boot_data: an encoded :class:`~aip_crewai.sidecar.isolation.wire.Boot`.
    """
    started = time.monotonic()
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
        _exit(BOOT_FAILED_STATUS)
    try:
        channel.send(Ready(os.getpid()))
        log.debug(
            "worker_ready",
            pid=os.getpid(),
            boot_ms=round((time.monotonic() - started) * 1000, 1),
            crewai_preloaded=preloaded,
        )
        start = channel.recv()
    except (OSError, FrameError):
        _exit(PROTOCOL_STATUS)
    if start is None:  # the sidecar closed the pool
        _exit(0)
    if not isinstance(start, Start):
        _exit(PROTOCOL_STATUS)
    channel.bound = frame_bound(start.max_event_bytes)
    if boot.trace_protocol is not None:  # after the fork, at the job: the exporter's thread starts here
        from aip_crewai import tracing
        from aip_crewai.sidecar import tracing as sidecar_tracing

        sidecar_tracing.configure(tracing.TraceSettings(boot.trace_protocol, boot.trace_content))
        sidecar_tracing.install()
    outcome = run_job(registry, start, channel, confinement)
    _REPORTED.set()  # from here the sidecar's end of file (it reaps us) no longer ends the process at once
    try:
        channel.send(outcome)
    except OSError:
        _exit(0)
    _flush_spans()
    _exit(0)


def _flush_spans() -> None:
    """Export the job's spans before the worker leaves (bounded: ``tracing.WORKER_FLUSH_MS``)."""
    from aip_crewai.sidecar import tracing as sidecar_tracing

    try:
        sidecar_tracing.shutdown(sidecar_tracing.WORKER_FLUSH_MS)
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
    _send_and_exit(channel, answer, 0)


def _send_and_exit(channel: Channel, message: FromWorker, status: int) -> NoReturn:
    try:
        channel.send(message)
    except OSError:
        pass
    _exit(status)


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
        _exit(BOOT_FAILED_STATUS)
    return confinement


def _prepare(boot: Boot) -> None:
    """Signals, logging, stdout and CrewAI's environment, as the sidecar has them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a drain is the sidecar's (systemctl kill may reach us too)
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
    registry: dict[str, Any], start: Start, channel: Channel, confinement: Confinement | None = None
) -> Done | Failed:
    """Run ``start``'s job on a fresh event loop; return the message that reports its end.

    The job's sandbox layer (``confinement.enter_job``: only its own namespace and training
    directories of all tenants') is entered first; a refusal fails the job ``SandboxFailed`` before
    any effect.

    Source: ARCHITECTURE.md §4 (outputs, failed events), §5 (isolation).
    """
    from aip_crewai.sidecar import tracing as sidecar_tracing
    from aip_crewai.sidecar.operations import execute

    if start.crew_id not in registry:  # the sidecar admitted it from the same registry: never expected
        return Failed(
            "CrewNotFound", f"crew {start.crew_id!r} is not in this worker's registry", before_any_effect=True
        )
    if confinement is not None:
        failed = _enter_job(confinement, start)
        if failed is not None:
            return failed
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    chunks = _ChunkSender(channel, max(0, start.max_events - 2), start.max_event_bytes)
    calls = _TaskRunCalls(channel, loop)
    ctx = JobContext(
        action_id=start.action_id,
        crew_id=start.crew_id,
        operation=start.operation,
        tenant=start.tenant,
        emit_chunk=chunks,
        cancel_flag=_StopFlag(channel.sock),
        state_dir=Path(start.state_dir),
        training_dir=Path(start.training_dir) if start.training_dir else None,
        find_task_run=calls.find,
        traceparent=start.traceparent,
        spans=sidecar_tracing.crew_spans(
            start.traceparent, sidecar_tracing.job_attributes(start.action_id, start.crew_id, start.operation)
        ),
    )
    task = loop.create_task(execute(registry[start.crew_id], start.operation, dict(start.input), ctx))
    reader = threading.Thread(
        target=_read, args=(channel, loop, task, ctx, calls), name="aip-crewai-worker-reader", daemon=True
    )
    reader.start()
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
        return Failed(type(exc).__name__, stop_observed=ctx.stop_observed, dropped=chunks.dropped)
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
    return Done(output, list(ctx.run_state.items()), chunks.dropped)


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


def _read(
    channel: Channel, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], ctx: JobContext, calls: _TaskRunCalls
) -> None:
    """Reader thread: Cancel sets the flag (and cancels run/batch_run's task); TaskRun answers a call.
    End of file or a bad frame: the sidecar is gone, exit at once (once the job's end is reported, the
    main thread exits after flushing the job's spans instead)."""
    while True:
        try:
            message = channel.recv()
        except FrameError:
            message = None
        if message is None:
            if _REPORTED.is_set():
                return
            _exit(0)
        if isinstance(message, Cancel):
            ctx.cancel_flag.set()
            if ctx.operation in TASK_CANCELLED_OPERATIONS:
                loop.call_soon_threadsafe(task.cancel)
        elif isinstance(message, TaskRun):
            loop.call_soon_threadsafe(calls.resolve, message.request, message.run)


class _ChunkSender:
    """``ctx.emit_chunk`` of a worker: shape, bound, send; never raises into CrewAI."""

    def __init__(self, channel: Channel, limit: int, max_event_bytes: int) -> None:
        self.channel = channel
        self.limit = limit
        self.max_content = max_event_bytes + 1  # longer content would be cut by the sidecar anyway
        self.sent = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def __call__(self, data: dict[str, Any]) -> None:
        if not isinstance(data, dict):
            return
        with self._lock:
            if self.sent >= self.limit:
                self.dropped += 1
                return
            self.sent += 1
        content = data.get("content")
        shaped: dict[str, Any] = {"content": ("" if content is None else str(content))[: self.max_content]}
        for key in ("channel", "task_id", "agent_role"):
            value = data.get(key)
            if value is not None:
                shaped[key] = str(value)[:MAX_LABEL_CHARS]
        try:
            self.channel.send(Chunk(shaped))
        except OSError:
            _exit(0)  # the sidecar is gone


class _TaskRunCalls:
    """``ctx.find_task_run`` of a worker: one request per call, answered by the reader thread."""

    def __init__(self, channel: Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        self.loop = loop
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any] | None]] = {}

    async def find(self, task_id: str) -> dict[str, Any] | None:
        request = next(self._ids)
        future: asyncio.Future[dict[str, Any] | None] = self.loop.create_future()
        self._waiting[request] = future
        try:
            self.channel.send(FindTaskRun(request, task_id))
            return await future
        finally:
            self._waiting.pop(request, None)

    def resolve(self, request: int, run: dict[str, Any] | None) -> None:
        future = self._waiting.get(request)
        if future is not None and not future.done():
            future.set_result(run)


def _exit(status: int) -> NoReturn:
    """Leave now: flush what was logged, skip interpreter shutdown (CrewAI's threads would hold it)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - nothing left to report to
            pass
    os._exit(status)
