"""The job worker's end of its socket (``isolation/worker.py`` runs the jobs; this module carries them).

- :class:`Channel`: whole frames, one writer at a time; chunk frames held briefly and sent together.
- :class:`Inbox`: the reader thread, for the worker's whole life: each ``Start`` becomes a
  :class:`JobState` (built there, so a ``Cancel`` right behind it always finds it), ``Cancel`` sets the
  job's :class:`StopFlag`, ``TaskRun`` answers a :class:`TaskRunCalls` call; the sidecar's end of file ends
  the worker at once while a job runs unreported.
- :class:`StopFlag`: the job's cancel flag, which also notices the sidecar gone.
- :class:`ChunkSender`: ``ctx.emit_chunk``, shaped and bounded.

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import math
import os
import queue
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    Cancel,
    Chunk,
    FindTaskRun,
    FrameError,
    FromWorker,
    Start,
    TaskRun,
    ToWorker,
    decode_to_worker,
    encode,
    payload_length,
)
from aip_crewai.sidecar.jobs.context import TASK_CANCELLED_OPERATIONS
from aip_crewai.sidecar.jobs.live import chunk_labels

#: Exit status of a worker whose sidecar sent something other than a job.
PROTOCOL_STATUS = 4


#: How long a worker holds a chunk frame before it sends it, with every chunk frame emitted meanwhile, in one
#: write (seconds): a chatty crew's 1,000 chunks cross the socket in tens of writes instead of 1,000, and the
#: sidecar wakes for each write, not for each chunk (ARCHITECTURE.md §5, "chunk frames").
CHUNK_HOLD_S = 0.002
#: Held chunk frames of at least this many bytes in all are sent at once, by the thread that holds the last one.
CHUNK_HOLD_BYTES = 65_536


class Shared:
    """What the processes sharing a worker's socket share besides it (made when the worker first forks: a
    crew's own child, ``multiprocessing`` with fork): an anonymous file (``memfd``).

    - Its POSIX record lock (:meth:`locked`; per process, freed when its holder dies; a process's threads
      already write one at a time under the channel's lock) makes each write whole: a write of one process
      could otherwise land between two parts of another's write of more than about 37 KB on this Linux 6.18 (a frame
      cut in two, which the sidecar takes for a broken worker).
    - Its first 8 bytes hold the job whose chunks the channel takes (:meth:`job`; written by the worker only):
      a child forked during a job keeps that job's chunk sender, and its chunks after the job's end are dropped,
      never sent as the next job's. A child forked when no such file could be made sends no chunk frame.

    A child stopped (SIGSTOP) in the middle of a write holds the lock, and so the worker's next write waits
    until it runs again or dies (a cancel's kill of the worker's group ends it). Source: ARCHITECTURE.md §5.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def make(cls) -> Shared | None:
        """A new file, or None when none can be made (the worker's writes are then not made whole against a
        child's, and the child sends no chunk frame: :meth:`Channel._write`)."""
        try:
            return cls(os.memfd_create("aip-crewai-worker-channel", os.MFD_CLOEXEC))
        except (OSError, AttributeError):  # AttributeError: no memfd_create on this platform
            return None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the file's lock (not re-entrant: a process's second hold is its first one). A lock that cannot
        be taken leaves the block unlocked (never an error: the socket's own say counts)."""
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def job(self) -> int | None:
        """Under the lock: the job whose chunks the channel takes, or None (an unreadable file: None)."""
        try:
            data = os.pread(self.fd, 8, 0)
        except OSError:
            return None
        job = int.from_bytes(data, "little") if len(data) == 8 else 0
        return job or None

    def set_job(self, job: int | None) -> None:
        """Under the lock: name ``job`` (None: none)."""
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, (job or 0).to_bytes(8, "little"), 0)


class Channel:
    """The worker's end of its socket: whole frames, one writer at a time (any thread).

    :meth:`send` writes a frame now. :meth:`send_soon` (a chunk) writes it now after a quiet spell (no write
    for :data:`CHUNK_HOLD_S`), else holds it until the frames held are :data:`CHUNK_HOLD_S` old (written by the
    next :meth:`send_soon` after that, or by a thread of the channel's that waits that long: whichever comes
    first) or :data:`CHUNK_HOLD_BYTES` in all. Held frames always go before the frame of a later
    :meth:`send`, in the same write, so the sidecar receives the frames in the order of the calls: the job's
    end (``Done``/``Failed``) after every chunk the job emitted. In a process forked from the one that made it
    (a crew's own child) it holds nothing: every frame goes at once, and the parent's held frames stay the
    parent's. From the first fork on, the processes share a :class:`Shared` file: each write of the worker and
    its children is whole across them, and a child's chunk frame of a job the worker ended since is dropped.
    Source: ARCHITECTURE.md §5 (isolation).

    Args:
        sock: the worker's end of its socketpair with the sidecar.
        bound: the largest frame :meth:`recv` accepts, bytes.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, sock: socket.socket, bound: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.sock = sock
        self.bound = bound
        self._clock = clock
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._held_since = 0.0  # when the oldest frame held was
        self._written_at = -math.inf  # when the last write was
        self._held_some = threading.Condition(self._lock)
        self._holder: threading.Thread | None = None
        self._broken = False  # a write failed: the sidecar is gone
        self._hold = True  # False in a process forked from the one that made the channel: every frame at once
        self._chunk_jobs = itertools.count(1)
        self._chunk_job: int | None = None  # the job whose chunk frames the channel takes (open_chunks)
        self._shared: Shared | None = None  # made at the first fork (_share)
        _CHANNELS.add(self)

    def send(self, message: FromWorker) -> None:
        """Send one frame now, after the frames held. Raises OSError when the sidecar is gone."""
        frame = encode(message)
        with self._lock:
            self._write(frame)

    def open_chunks(self) -> int:
        """Take the chunk frames of a new job from now on, and none of an earlier one's, in this process and in
        those forked from it; the job's number (for :meth:`send_soon` and :meth:`close_chunks`; unique to this
        process: a forked child's own numbers never name the worker's jobs)."""
        with self._lock:
            job = os.getpid() << 32 | next(self._chunk_jobs)
            self._set_chunk_job(job)
            return job

    def close_chunks(self, job: int) -> None:
        """Take no more chunk frames of ``job`` (it ended), here or from a process forked from here; those
        held already still go."""
        with self._lock:
            if self._chunk_job == job:
                self._set_chunk_job(None)

    def _set_chunk_job(self, job: int | None) -> None:
        """Under the lock: the open job, here and, in the process that made the channel, in the shared file
        (a forked child's own jobs are its own)."""
        self._chunk_job = job
        if self._shared is not None and self._hold:
            with self._shared.locked():
                self._shared.set_job(job)

    def send_soon(self, message: FromWorker, *, chunks_of: int | None = None) -> None:
        """Send one frame now or hold it (the class's rules); a frame of a job other than the one
        :meth:`open_chunks` opened last, or of a job closed since, is dropped. Raises OSError when the sidecar
        is gone (known from an earlier write, or found by this one)."""
        frame = encode(message)
        with self._lock:
            if chunks_of is not None and chunks_of != self._chunk_job:
                return
            self._check_open()
            now = self._clock()
            if not self._held:
                if not self._hold or now - self._written_at >= CHUNK_HOLD_S:
                    # after a quiet spell: at once (the job may not run Python for a while)
                    self._write(frame, chunks_of=chunks_of)
                    return
                self._held_since = now
            self._held.append(frame)
            self._held_bytes += len(frame)
            due = self._held_bytes >= CHUNK_HOLD_BYTES or now - self._held_since >= CHUNK_HOLD_S
            if due or not self._start_holder():
                self._write(b"")
            elif len(self._held) == 1:
                self._held_some.notify()

    def flush(self) -> None:
        """Send the frames held, now. Raises OSError when the sidecar is gone."""
        with self._lock:
            self._write(b"")

    def _write(self, frame: bytes, *, chunks_of: int | None = None) -> None:
        """Under the lock: the frames held, then ``frame``, in one write, whole across the processes sharing
        the socket (:class:`Shared`). In a forked child (which holds nothing) ``frame``, a chunk frame of job
        ``chunks_of``, is dropped unless the shared file names that job: its worker ended the job since, or
        the file could not be made at the fork (then nothing tells the child's chunks from a later job's)."""
        self._check_open()
        if self._held:
            frame = b"".join([*self._held, frame])
            self._held.clear()
            self._held_bytes = 0
        if not frame:
            return
        shared = self._shared
        with shared.locked() if shared is not None else contextlib.nullcontext():
            if chunks_of is not None and not self._hold and (shared is None or shared.job() != chunks_of):
                return
            self._written_at = self._clock()
            try:
                self.sock.sendall(frame)
            except OSError:
                self._broken = True  # part of a frame may be out: nothing more can follow it
                raise

    def _share(self) -> None:
        """Under the lock, before the process that made the channel forks: make the :class:`Shared` file, once (a
        failure leaves the next fork to try again; a child forking keeps the file it has, or none)."""
        if self._shared is None and self._hold:
            self._shared = Shared.make()
            if self._shared is not None:
                self._shared.set_job(self._chunk_job)

    def _check_open(self) -> None:
        if self._broken:
            raise BrokenPipeError(errno.EPIPE, "the sidecar is gone (a held chunk could not be sent)")

    def _start_holder(self) -> bool:
        """Under the lock: whether the thread that sends held frames runs (started here when it does not: the
        first time, after it died)."""
        if self._holder is None or not self._holder.is_alive():
            holder = threading.Thread(target=self._send_held, name="aip-crewai-worker-chunks", daemon=True)
            try:
                holder.start()
            except RuntimeError:  # no thread can be started (a job's resource limit): send at once
                return False
            self._holder = holder
        return True

    def _send_held(self) -> None:
        """The holder thread: once a frame is held, wait :data:`CHUNK_HOLD_S`, then send what is held. A failed
        write is kept for the next call (the worker's job finds the sidecar gone there, or at its stop flag)."""
        while True:
            with self._lock:
                while not self._held:
                    self._held_some.wait()
            time.sleep(CHUNK_HOLD_S)
            with self._lock:
                with contextlib.suppress(OSError):  # the channel is broken now: the next call raises
                    self._write(b"")

    def _forked(self) -> None:
        """In a process just forked from this one (a crew's own child): a free lock, nothing of the parent's held
        (its frames are the parent's to send), no holder thread, and every frame written at once (such a child
        may leave with ``os._exit``, which no holder thread would outlive)."""
        self._lock = threading.Lock()
        self._held_some = threading.Condition(self._lock)
        self._held.clear()
        self._held_bytes = 0
        self._holder = None
        self._hold = False

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


#: The channels of this process: a fork takes each one's lock first, so the child never inherits one locked by a
#: thread it does not have (the holder thread takes it every time it sends), and resets them in the child.
_CHANNELS: weakref.WeakSet[Channel] = weakref.WeakSet()
_locked_for_fork: list[Channel] = []
#: One fork at a time takes the channels' locks: two threads forking at once would otherwise share
#: ``_locked_for_fork``, and the second fork's locks would never be released.
_fork_lock = threading.Lock()


def _before_fork() -> None:
    _fork_lock.acquire()
    _locked_for_fork[:] = list(_CHANNELS)
    for held in _locked_for_fork:
        held._lock.acquire()
        held._share()


def _after_fork_in_parent() -> None:
    for held in _locked_for_fork:
        held._lock.release()
    _locked_for_fork.clear()
    _fork_lock.release()


def _after_fork_in_child() -> None:
    for held in _locked_for_fork:
        held._forked()
    _locked_for_fork.clear()
    _fork_lock.release()  # taken by this very thread before the fork


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class StopFlag(threading.Event):
    """A worker's job cancel flag (``ctx.cancel_flag``) that also notices a sidecar gone, and then ends the
    worker at once.

    The reader thread ends the worker at the sidecar's end of file, but only once it runs: a worker at
    ``--worker-nice`` on a busy machine may wait for a CPU, and its job thread, woken first, would make its
    next model call for a sidecar already killed. Every point that checks the flag before an effect (each
    model call, each chunk: ``operations/_common.py``) therefore looks at the socket too (a non-blocking
    poll for the hang-up: the kernel marks it at the kill, whichever thread runs first). Until the job's end
    is reported (:attr:`reported`): after it, the sidecar closing the socket is expected.

    Source: ARCHITECTURE.md §5 (isolation: a crash of the sidecar runs nothing more).
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock
        #: Set once the job's end is being sent: an end of file then lets the worker leave after its spans.
        self.reported = threading.Event()

    def is_set(self) -> bool:
        if not self.reported.is_set() and sidecar_gone(self._sock):
            exit_now(0)
        return super().is_set()


def sidecar_gone(sock: socket.socket) -> bool:
    """The sidecar's end of ``sock`` is closed (hung up, even with a frame still unread, or the socket is
    broken); never blocks."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


class JobState:
    """The job a worker runs (or ran last): its :class:`Start`, its cancel flag, its replay calls and, once
    started, its task. Built by the reader thread at the ``Start`` frame, so a ``Cancel`` right behind it
    always finds it."""

    def __init__(self, start: Start, channel: Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.start = start
        self.loop = loop
        self.flag = StopFlag(channel.sock)
        self.calls = TaskRunCalls(channel, loop)
        self.cancelled = False
        self._task: asyncio.Task[Any] | None = None
        self._lock = threading.Lock()

    def begin(self, task: asyncio.Task[Any]) -> None:
        """Main thread: the job's task exists (cancelled at once for run/batch_run if a cancel came first)."""
        with self._lock:
            self._task = task
            if self.cancelled and self.start.operation in TASK_CANCELLED_OPERATIONS:
                task.cancel()

    def cancel(self) -> None:
        """Reader thread, at ``Cancel``: set the flag (and cancel run/batch_run's task)."""
        with self._lock:
            self.cancelled = True
            self.flag.set()
            if self._task is not None and self.start.operation in TASK_CANCELLED_OPERATIONS:
                self.loop.call_soon_threadsafe(self._task.cancel)


class Inbox:
    """The worker's reader thread, for its whole life.

    ``Start`` becomes the :class:`JobState` :meth:`next_job` hands to the main thread; ``Cancel`` sets the
    current job's flag (and cancels run/batch_run's task); ``TaskRun`` answers its call. End of file or a
    bad frame: the sidecar is gone; while a job runs unreported the worker exits at once, else
    :meth:`next_job` answers None (the main thread leaves after flushing the spans). A ``Start`` while a job
    runs is a protocol error (exit)."""

    def __init__(
        self, channel: Channel, loop: asyncio.AbstractEventLoop, leave: Callable[[int], None] | None = None
    ) -> None:
        self.channel = channel
        self.loop = loop
        self._leave = leave or exit_now  # tests pass a stand-in: this thread may outlive them
        self._jobs: queue.SimpleQueue[JobState | None] = queue.SimpleQueue()
        self._job: JobState | None = None
        threading.Thread(target=self._read, name="aip-crewai-worker-reader", daemon=True).start()

    def next_job(self) -> JobState | None:
        """Block until the sidecar's next job; None once the sidecar hung up."""
        return self._jobs.get()

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except FrameError:
                message = None
            job = self._job
            running = job is not None and not job.flag.reported.is_set()
            if message is None:
                if running:
                    self._leave(0)
                self._jobs.put(None)
                return
            if isinstance(message, Start):
                if running:
                    self._leave(PROTOCOL_STATUS)
                self._job = JobState(message, self.channel, self.loop)
                self._jobs.put(self._job)
            elif job is None:  # nothing to cancel or answer yet
                continue
            elif isinstance(message, Cancel):
                job.cancel()
            elif isinstance(message, TaskRun):
                self.loop.call_soon_threadsafe(job.calls.resolve, message.request, message.run)


class ChunkSender:
    """``ctx.emit_chunk`` of one job in a worker: shape, bound, hold for the next write (:meth:`Channel.send_soon`);
    never raises into CrewAI (a sidecar gone ends the worker).

    Its chunks end with :meth:`close` (the job's end): a thread the job left behind, started in the job's context
    (as ``asyncio.to_thread`` starts one), or a process the job forked, may still emit, and the sidecar would
    take such a chunk for whichever job of the worker runs then. It is dropped, uncounted (here, or by the
    channel: :meth:`Channel.open_chunks`, :class:`Shared`; ARCHITECTURE.md §5 "Warm workers")."""

    def __init__(self, channel: Channel, limit: int, max_event_bytes: int) -> None:
        self.channel = channel
        self.limit = limit
        self.max_content = max_event_bytes + 1  # longer content would be cut by the sidecar anyway
        self.sent = 0
        self.dropped = 0
        self._job = channel.open_chunks()
        self._closed = False
        self._lock = threading.Lock()

    def __call__(self, data: dict[str, Any]) -> None:
        if not isinstance(data, dict):
            return
        with self._lock:
            if self._closed:  # after its job: neither sent nor counted
                return
            if self.sent >= self.limit:
                self.dropped += 1
                return
            self.sent += 1
        content = data.get("content")
        shaped: dict[str, Any] = {
            "content": ("" if content is None else str(content))[: self.max_content],
            **chunk_labels(data),
        }
        try:
            self.channel.send_soon(Chunk(shaped), chunks_of=self._job)
        except OSError:
            exit_now(0)  # the sidecar is gone

    def close(self) -> None:
        """The job ended: the channel takes none of its chunks from now on, nor counts them."""
        with self._lock:
            self._closed = True
        self.channel.close_chunks(self._job)


class TaskRunCalls:
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


def exit_now(status: int) -> NoReturn:
    """Leave now: flush what was logged, skip interpreter shutdown (CrewAI's threads would hold it)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - nothing left to report to
            pass
    os._exit(status)
