"""The sidecar's end of one job worker process (``isolation/pool.py`` keeps them; ARCHITECTURE.md §5).

- :class:`WorkerHandle`: the process, its socket's stream pair, frames in and out, kill and reap.
- :class:`WorkerDied`: the typed failure of a job whose worker died before it reported the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

from aip_crewai.sidecar.isolation.fork_server import REAP_SECONDS, describe_exit
from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    FromWorker,
    ToWorker,
    decode_from_worker,
    encode,
    payload_length,
)
from aip_crewai.sidecar.jobs.context import SafeJobError


class WorkerDied(SafeJobError):
    """The job's worker process died before it reported the job's end: ``uncertain_outcome: true``; or,
    with ``before_start``, before it took the job (no ``Started`` frame: nothing of the job ran, the
    failure is before any effect)."""

    def __init__(self, exitcode: int | None, *, before_start: bool = False) -> None:
        what = (
            "the worker process given the job died before it started it"
            if before_start
            else ("the worker process running the job died")
        )
        super().__init__(
            f"{what} ({describe_exit(exitcode)})",
            error_type="WorkerDied",
            before_any_effect=before_start,
            uncertain=not before_start,
        )
        self.exitcode = exitcode
        self.before_start = before_start


def kill_worker(process: Any) -> None:
    """SIGKILL a live worker process and every process in its process group: a worker leads its own group
    (``worker.serve``), so this also ends the processes its jobs started that are still in it (docs/security.md
    "Hard cancel"; a worker that already ended: :meth:`WorkerHandle.reap`). Raises nothing for a gone process."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if process.exitcode is not None:
            return
        with contextlib.suppress(OSError):  # no such group: the worker left its own (its kill below still holds)
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()


class WorkerHandle:
    """The sidecar's end of one worker process."""

    def __init__(self, process: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bound: int) -> None:
        self.process = process
        self.pid: int = process.pid
        self.reader = reader
        self.writer = writer
        self.bound = bound
        self.killed_at: float | None = None

    async def recv(self) -> FromWorker | None:
        """The next message; None at end of file (the worker exited). Raises FrameError."""
        try:
            header = await self.reader.readexactly(HEADER.size)
            payload = await self.reader.readexactly(payload_length(header, self.bound))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return decode_from_worker(payload)

    async def send(self, message: ToWorker) -> bool:
        """Send one frame; False when the worker is gone."""
        try:
            self.writer.write(encode(message))
            await self.writer.drain()
        except (ConnectionError, OSError):
            return False
        return True

    def kill(self) -> None:
        """SIGKILL it and its process group (:func:`kill_worker`; idempotent; a gone process is fine)."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        kill_worker(self.process)

    async def reap(self) -> int | None:
        """Close the socket, wait for the exit (killing it if it lingers) and return its exit code."""
        self.writer.close()
        await asyncio.to_thread(self.process.join, REAP_SECONDS)
        # What its jobs started ends with it: the group's id (the worker's pid) is no other process's while the
        # group has a member, and ESRCH once it has none.
        with contextlib.suppress(OSError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.process.exitcode is None:
            self.kill()
            await asyncio.to_thread(self.process.join, REAP_SECONDS)
        code: int | None = self.process.exitcode
        return code
