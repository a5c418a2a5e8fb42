"""One job's frames from its worker process, and its stop on a cancel (``--isolation process``).

:class:`JobFollower` is what :class:`~aip_crewai.sidecar.isolation.pool.WorkerPool` does with a worker once the
job's ``Start`` is sent: chunks go to ``ctx.emit_chunk``, replay's ``find_task_run`` calls are answered over the
same socket, the end (``Done``/``Failed``) becomes the output or the job's typed failure, a broken frame kills the
worker (``WorkerProtocolError``), a death fails the job (``WorkerDied``), and a cancel asks the worker to stop,
killing it after ``--cancel-grace-seconds``.

Source: ARCHITECTURE.md §5 (isolation); docs/security.md "Process isolation".
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import anyio
import msgspec
import structlog

from aip_crewai.sidecar.isolation.fork_server import describe_exit
from aip_crewai.sidecar.isolation.handle import WorkerDied, WorkerHandle
from aip_crewai.sidecar.isolation.wire import (
    Cancel,
    Chunk,
    Done,
    Failed,
    FindTaskRun,
    FrameError,
    FromWorker,
    Started,
    TaskRun,
)
from aip_crewai.sidecar.jobs.context import GENERIC_FAILURE, JobCancelled, JobContext, SafeJobError

log = structlog.get_logger(__name__)


class Counts(Protocol):
    """What a :class:`JobFollower` reads and counts on its pool."""

    cancel_grace_seconds: float
    killed_total: int
    died_total: int


class JobFollower:
    """Follow one job's frames in its worker until its end; stop it on a cancel (grace, then kill).

    Args:
        pool: where the deaths and kills are counted, and its ``cancel_grace_seconds``.
        worker: the worker the job's ``Start`` was sent to.
        ctx: the job's context (chunks, replay lookups, run state and the stop go there).
    """

    def __init__(self, pool: Counts, worker: WorkerHandle, ctx: JobContext) -> None:
        self.pool = pool
        self.worker = worker
        self.ctx = ctx
        self.calls: set[asyncio.Task[None]] = set()
        #: The worker reported the job's end with ``last: false`` and was never told to stop: it may be kept warm.
        self.reusable = False
        self.stopping = False
        #: A frame of the job came (``Started`` first, from a real worker): a death now may have had effects.
        self.started = False

    async def follow(self) -> dict[str, Any]:
        """Apply the job's frames until its end; its output.

        Raises: as :meth:`WorkerPool.__call__ <aip_crewai.sidecar.isolation.pool.WorkerPool.__call__>`.
        """
        try:
            while True:
                try:
                    message = await self._next()
                except asyncio.CancelledError:
                    return await self._stop()
                result = self._handle(message)
                if result is not None:
                    return result
        finally:
            for call in self.calls:
                call.cancel()

    async def _next(self) -> FromWorker:
        try:
            message = await self.worker.recv()
        except FrameError as exc:
            self.worker.kill()
            await self.worker.reap()
            log.error("worker_protocol_error", action_id=self.ctx.action_id, pid=self.worker.pid, error=str(exc))
            raise SafeJobError(
                "the worker process sent a frame the sidecar refuses; it was stopped",
                error_type="WorkerProtocolError",
                uncertain=True,
            ) from None
        if message is None:
            raise await self._died()
        return message

    async def _died(self) -> WorkerDied:
        code = await self.worker.reap()
        self.pool.died_total += 1
        log.error(
            "worker_died",
            action_id=self.ctx.action_id,
            pid=self.worker.pid,
            exit=describe_exit(code),
            before_start=not self.started,
        )
        return WorkerDied(code, before_start=not self.started)

    def _handle(self, message: FromWorker) -> dict[str, Any] | None:
        """Apply one frame; the output once the job completed; raises its failure."""
        ctx = self.ctx
        self.started = True  # any frame of the job: it took it
        if isinstance(message, Started):
            return None
        if isinstance(message, Chunk):
            ctx.emit_chunk(message.data)
            return None
        if isinstance(message, FindTaskRun):
            call = asyncio.get_running_loop().create_task(self._answer(message))
            self.calls.add(call)
            call.add_done_callback(self.calls.discard)
            return None
        if isinstance(message, Done | Failed):
            cancelled = isinstance(message, Failed) and message.cancelled
            self.reusable = not (message.last or cancelled or self.stopping)
            if message.dropped and ctx.note_dropped is not None:
                ctx.note_dropped(message.dropped)
        if isinstance(message, Done):
            ctx.run_state.update({index: state for index, state in message.run_state})
            output: dict[str, Any] = msgspec.json.decode(message.output)
            return output
        if isinstance(message, Failed):
            if message.cancelled:
                ctx.stop_observed = True
                raise JobCancelled(f"job {ctx.action_id} was cancelled")
            ctx.stop_observed = ctx.stop_observed or message.stop_observed
            raise SafeJobError(
                message.message or GENERIC_FAILURE,
                error_type=message.error_type,
                before_any_effect=message.before_any_effect,
                uncertain=message.uncertain,
            )
        raise SafeJobError(
            "the worker process sent an unexpected message", error_type="WorkerProtocolError", uncertain=True
        )

    async def _answer(self, message: FindTaskRun) -> None:
        run = None
        if self.ctx.find_task_run is not None:
            try:
                run = await self.ctx.find_task_run(message.task_id)
            except Exception as exc:  # noqa: BLE001 - the replay then finds no run: a typed refusal
                log.error("task_run_lookup_failed", action_id=self.ctx.action_id, error_type=type(exc).__name__)
        await self.worker.send(TaskRun(message.request, run))

    async def _stop(self) -> dict[str, Any]:
        """The job's task was cancelled: ask the worker to stop, kill it after the grace.

        Returns the output when the worker completed anyway (the stop is then not observed).
        Raises CancelledError once the worker stopped or died (stop observed), or the job's failure.
        """
        ctx = self.ctx
        asked = time.monotonic()
        self.stopping = True
        await self.worker.send(Cancel())
        deadline = asked + self.pool.cancel_grace_seconds
        how = "died"
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                with anyio.fail_after(remaining):
                    message = await self.worker.recv()
                if message is None:  # died before answering: nothing ran after the flag
                    await self.worker.reap()
                    break
                if isinstance(message, Failed) and message.cancelled:
                    how = "stopped"  # the job ended on its cancel flag; the worker exits right after:
                    await self.worker.reap()  # confirmed once it is gone (a thread it left dies with it)
                    break
                result = self._handle(message)
                if result is not None:
                    log.warning("job_finished_despite_cancel", action_id=ctx.action_id, pid=self.worker.pid)
                    return result
        except (TimeoutError, FrameError, asyncio.CancelledError):
            how = "killed"
            self.worker.kill()
            self.pool.killed_total += 1
            await self.worker.reap()
        ctx.stop_observed = True
        log.info(
            "job_worker_stopped",
            action_id=ctx.action_id,
            pid=self.worker.pid,
            how=how,
            killed=how == "killed",
            stop_ms=round((time.monotonic() - asked) * 1000, 1),
        )
        raise asyncio.CancelledError
