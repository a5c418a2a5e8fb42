"""The worker pipe protocol and the worker's chunk bound (``isolation/wire.py``, ``isolation/worker.py``; ARCHITECTURE.md §5 "Isolation")."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator

import msgspec
import pytest
from kits.poll import until

from aip_crewai.sidecar.isolation import channel, fork_server
from aip_crewai.sidecar.isolation.channel import Channel, ChunkSender
from aip_crewai.sidecar.isolation.fork_server import WorkerStartFailed, describe_exit, describe_registry
from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    Boot,
    Cancel,
    Chunk,
    Done,
    Failed,
    FrameError,
    FromWorker,
    Start,
    TaskRun,
    decode_boot,
    decode_from_worker,
    decode_to_worker,
    encode,
    encode_boot,
    frame_bound,
    payload_length,
)
from aip_crewai.sidecar.jobs.live import MAX_LABEL_CHARS
from aip_crewai.sidecar.options import PRELOAD_ENV


def test_every_message_round_trips_in_its_direction():
    start = Start("t:a", "echo", "run", "t", {"topic": "x", "n": [1, 2.5, None]}, "/s", None, 1000, 262144)
    for message in (start, Cancel(), TaskRun(3, {"tasks_output": []}), TaskRun(4, None)):
        assert decode_to_worker(encode(message)[HEADER.size :]) == message
    for message in (
        Chunk({"content": "c", "channel": "llm"}),
        Done(b'{"raw":"x"}', [(None, {"inputs": {}}), (2, {})], 3),
        Failed("RuntimeError"),
        Failed("JobCancelled", cancelled=True, stop_observed=True),
    ):
        assert decode_from_worker(encode(message)[HEADER.size :]) == message
    boot = Boot("aip_crewai.examples.testing:CREWS", "/state", True, "info")
    assert decode_boot(encode_boot(boot)) == boot


def test_a_message_of_the_other_direction_or_garbage_is_a_frame_error():
    with pytest.raises(FrameError):
        decode_from_worker(encode(Cancel())[HEADER.size :])
    with pytest.raises(FrameError):
        decode_to_worker(encode(Chunk({}))[HEADER.size :])
    with pytest.raises(FrameError):
        decode_from_worker(b"\xc1 not msgpack")


def test_the_frame_bound_is_enforced_at_its_limit_and_one_past_it():
    bound = frame_bound(1024)
    assert payload_length(HEADER.pack(bound), bound) == bound
    with pytest.raises(FrameError, match=f"{bound + 1} bytes exceeds the bound of {bound} bytes"):
        payload_length(HEADER.pack(bound + 1), bound)
    assert frame_bound(4096) - frame_bound(1024) == 6 * 3072


def test_a_channel_refuses_an_oversized_frame_before_reading_it():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel = Channel(theirs, 64)
        ours.sendall(encode(Cancel()) + HEADER.pack(64) + b"x" * 64 + HEADER.pack(65))
        assert channel.recv() == Cancel()
        with pytest.raises(FrameError):  # 64 bytes are read (and are no message), 65 are not
            channel.recv()
        with pytest.raises(FrameError):
            channel.recv()
        ours.close()
        assert channel.recv() is None  # end of file: the sidecar is gone


@pytest.mark.parametrize("limit", [0, 1, 5])
def test_a_worker_sends_at_most_its_chunk_limit_and_counts_the_rest(limit):
    """The per-job bound holds in the worker too: ``limit`` chunks cross the pipe, one more is only counted."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = ChunkSender(Channel(theirs, frame_bound(1024)), limit, 1024)
        for i in range(limit + 1):
            sender({"content": f"c{i}", "channel": "llm"})
        assert (sender.sent, sender.dropped) == (limit, 1)
        sender.channel.flush()
        theirs.close()
        received = _read_all(ours)
        assert [m.data["content"] for m in received] == [f"c{i}" for i in range(limit)]


def test_a_worker_cuts_chunk_content_and_labels_the_sidecar_would_cut_anyway():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = ChunkSender(Channel(theirs, frame_bound(1024)), 10, 1024)
        sender({"content": "x" * 5000, "channel": "tools", "task_id": "t" * 999, "agent_role": None, "other": "y"})
        sender("not a mapping")  # dropped, as the sidecar would
        sender.channel.flush()
        theirs.close()
        (message,) = _read_all(ours)
    assert isinstance(message, Chunk)
    assert message.data == {"content": "x" * 1025, "channel": "tools", "task_id": "t" * MAX_LABEL_CHARS}


def _read_all(ours: socket.socket) -> list[FromWorker]:
    """Every message until end of file (worker → sidecar direction)."""
    reader = Channel(ours, frame_bound(1024))
    out = []
    while (header := reader._exact(HEADER.size)) is not None:
        out.append(decode_from_worker(reader._exact(payload_length(header, reader.bound)) or b""))
    return out


@pytest.mark.parametrize(
    "code, text",
    [
        (-signal.SIGKILL, "signal SIGKILL"),
        (-signal.SIGSEGV, "signal SIGSEGV"),
        (7, "exit status 7"),
        (None, "exit status unknown"),
        (-200, "signal 200"),
    ],
)
def test_a_worker_exit_is_named_by_its_signal_or_status(code, text):
    assert describe_exit(code) == text


def test_chunks_sent_from_many_threads_arrive_whole():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender = ChunkSender(Channel(theirs, frame_bound(1024)), 1000, 1024)
        threads = [
            threading.Thread(target=lambda n=n: [sender({"content": f"{n}-{i}" * 50}) for i in range(50)])
            for n in range(8)
        ]
        received: list[object] = []
        drain = threading.Thread(target=lambda: received.extend(_read_all(ours)))
        drain.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sender.channel.flush()
        theirs.shutdown(socket.SHUT_WR)
        drain.join(30)
    assert len(received) == 400 and all(isinstance(m, Chunk) for m in received)
    assert msgspec.json.encode(sorted(m.data["content"] for m in received))


class _Writes:
    """A worker's socket that records each write (one ``sendall``) before making it; ``fail`` makes them fail;
    ``peer`` is the sidecar's end, where the test reads."""

    def __init__(self, sock: socket.socket, peer: socket.socket) -> None:
        self.sock = sock
        self.peer = peer
        self.writes: list[bytes] = []
        self.fail = False

    def sendall(self, data: bytes) -> None:
        if self.fail:
            raise BrokenPipeError(32, "gone")
        self.writes.append(bytes(data))
        self.sock.sendall(data)


def _frames(data: bytes) -> list[FromWorker]:
    """The messages of the frames in ``data`` (whole frames, worker → sidecar)."""
    out = []
    while data:
        size = HEADER.size + payload_length(data[: HEADER.size], frame_bound(1024))
        out.append(decode_from_worker(data[HEADER.size : size]))
        data = data[size:]
    return out


def test_a_workers_chunks_cross_its_socket_together_and_reach_the_sidecar_without_another_call():
    """ARCHITECTURE.md §5: a chunk frame is held for ``CHUNK_HOLD_S`` and sent with the ones emitted meanwhile
    (the code before wrote each of the 50 on its own); the holder thread sends them with no further call."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sock = _Writes(theirs, ours)
        sender = ChunkSender(Channel(sock, frame_bound(1024)), 100, 1024)
        for i in range(50):
            sender({"content": f"c{i}"})
        ours.settimeout(60)
        received: list[FromWorker] = []
        reader = Channel(ours, frame_bound(1024))
        while len(received) < 50:  # blocks until the holder thread wrote them (no flush, no later chunk)
            header = reader._exact(HEADER.size)
            assert header is not None
            received.append(decode_from_worker(reader._exact(payload_length(header, reader.bound)) or b""))
    assert [m.data["content"] for m in received] == [f"c{i}" for i in range(50)]
    assert len(sock.writes) < 50


class _Clock:
    """A monotonic clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def writes(monkeypatch) -> Iterator[tuple[_Writes, Channel, _Clock]]:
    """A worker's channel on a socket that records its writes (the sidecar's end stays open, unread), on a
    clock the test moves; its holder thread waits an hour, so it never writes during the test."""
    monkeypatch.setattr(channel, "CHUNK_HOLD_S", 3600.0)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sock, clock = _Writes(theirs, ours), _Clock()
        yield sock, Channel(sock, frame_bound(1024), clock), clock  # type: ignore[arg-type]


def _contents(sock: _Writes) -> list[list[str]]:
    """Each write's frames: a chunk's content, or another message's type name."""
    return [[m.data["content"] if isinstance(m, Chunk) else type(m).__name__ for m in _frames(w)] for w in sock.writes]


def test_a_chunk_after_a_quiet_spell_goes_at_once_and_held_ones_when_the_oldest_is_due(writes):
    """ARCHITECTURE.md §5: held at most CHUNK_HOLD_S (here an hour), at its edge: a frame held for one second
    less waits, at the hold the next chunk writes them all; a chunk after a quiet spell as long goes at once
    (a job that then runs C code holding the GIL has sent it)."""
    sock, held, clock = writes
    hour = channel.CHUNK_HOLD_S
    for at, content in [(0, "a"), (1, "b"), (hour, "c"), (hour + 1, "d"), (hour + 2, "e"), (2 * hour + 2, "f")]:
        clock.now = at
        held.send_soon(Chunk({"content": content}))
    assert _contents(sock) == [["a"], ["b", "c", "d"], ["e", "f"]]
    clock.now = 3 * hour + 1  # one second short of a quiet hour since the last write: held
    held.send_soon(Chunk({"content": "g"}))
    clock.now = 5 * hour
    held.send_soon(Chunk({"content": "h"}))  # the held "g" is due: both go
    clock.now = 6 * hour
    held.send_soon(Chunk({"content": "i"}))  # a quiet hour since: at once
    assert _contents(sock)[3:] == [["g", "h"], ["i"]]


def test_a_frame_sent_now_follows_the_held_chunks_in_the_same_write(writes):
    """The job's end never overtakes a chunk: ``send`` writes the frames held first, in one write."""
    sock, held, clock = writes
    held.send_soon(Chunk({"content": "a"}))  # the first: at once
    clock.now = 1
    held.send_soon(Chunk({"content": "b"}))
    held.send_soon(Chunk({"content": "c"}))
    assert _contents(sock) == [["a"]]  # b and c held
    held.send(Done(b"{}", [], 0))
    assert _contents(sock) == [["a"], ["b", "c", "Done"]]


def test_a_closed_jobs_chunks_are_dropped_its_held_ones_still_go_and_the_next_jobs_flow(writes):
    """A warm worker's jobs share its channel: a chunk of a job after its end (a thread it left behind) is
    dropped, not taken as the next job's; its chunks held at the end still go, before the job's outcome, and
    a job's sender opened later takes the channel over from one never closed."""
    sock, held, clock = writes
    first = ChunkSender(held, 10, 1024)
    first({"content": "a"})
    clock.now = 1
    first({"content": "b"})  # held
    first.close()
    first({"content": "late"})
    held.send(Done(b"{}", [], 0))
    second = ChunkSender(held, 10, 1024)
    first({"content": "later"})
    second({"content": "c"})
    third = ChunkSender(held, 10, 1024)  # the second never closed (a worker's job that broke off)
    second({"content": "stale"})
    third({"content": "d"})
    held.flush()
    assert _contents(sock) == [["a"], ["b", "Done"], ["c", "d"]]


@pytest.mark.parametrize("room, written", [(1, [["x"]]), (0, [["x"], ["y", "y"]])])
def test_held_chunk_frames_go_at_once_when_they_reach_the_byte_bound(monkeypatch, writes, room, written):
    """The bound on what a worker holds, at its edge: two frames one byte under it are held, two frames at it
    go now, in one write."""
    monkeypatch.setattr(channel, "CHUNK_HOLD_BYTES", 2 * len(encode(Chunk({"content": "y"}))) + room)
    sock, held, _clock = writes
    held.send_soon(Chunk({"content": "x"}))  # the first: at once
    held.send_soon(Chunk({"content": "y"}))
    held.send_soon(Chunk({"content": "y"}))
    assert _contents(sock) == written


def test_chunks_go_at_once_when_no_thread_can_hold_them(monkeypatch, writes):
    """A job whose resource limits leave no room for the holder thread still streams, one write per chunk."""

    def refuse(_self: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(channel.threading.Thread, "start", refuse)
    sock, held, _clock = writes
    for content in "xyz":
        held.send_soon(Chunk({"content": content}))
    assert _contents(sock) == [["x"], ["y"], ["z"]]


def test_a_holder_thread_that_died_is_started_again():
    """A holder thread that died sends nothing more: the next held frame starts another, which sends it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sock, clock = _Writes(theirs, ours), _Clock()
        held = Channel(sock, frame_bound(1024), clock)
        gone = threading.Thread(target=lambda: None)
        gone.start()
        gone.join()
        held._holder = gone
        held.send_soon(Chunk({"content": "a"}))  # at once
        held.send_soon(Chunk({"content": "b"}))  # held; the new holder sends it
        until(lambda: len(sock.writes) == 2, what="the held chunk sent by a new holder thread")
    assert _contents(sock) == [["a"], ["b"]]
    assert held._holder is not gone


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # another test of the process imported LanceDB
def test_a_process_forked_from_the_worker_sends_its_chunks_at_once_and_never_the_workers_held_ones(writes):
    """A crew's own child (``multiprocessing`` with fork) shares the worker's channel: before, the child wrote
    the worker's held chunk a second time, and lost its own held chunk when it left with ``os._exit``."""
    sock, held, clock = writes
    held.send_soon(Chunk({"content": "worker-a"}))  # at once
    clock.now = 1
    held.send_soon(Chunk({"content": "worker-b"}))  # held in the worker
    child = os.fork()
    if child == 0:  # the child: two chunks close together, then leave as multiprocessing's children do
        try:
            held.send_soon(Chunk({"content": "child-c"}))
            held.send_soon(Chunk({"content": "child-d"}))
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    held.flush()
    sock.sock.shutdown(socket.SHUT_WR)
    received = [m.data["content"] for m in _read_all(sock.peer)]
    assert sorted(received) == ["child-c", "child-d", "worker-a", "worker-b"]


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # another test of the process imported LanceDB
def test_large_frames_of_the_worker_and_its_forked_child_at_once_each_arrive_whole():
    """A crew's own child and the worker write frames larger than the socket takes at once, at the same
    time: each frame arrives whole (before, a write of one landed inside the other's: a frame cut in two,
    which the sidecar takes for a broken worker)."""
    bound, count = frame_bound(262_144), 40
    ours, theirs = socket.socketpair()
    with ours, theirs:
        held = Channel(theirs, bound)
        child = os.fork()
        if child == 0:
            try:
                signal.alarm(60)  # never left blocked behind a test that failed
                for _ in range(count):
                    held.send(Chunk({"content": "c" * 150_000}))
            finally:
                os._exit(0)
        received: list[str] = []
        reader = Channel(ours, bound)

        def read() -> None:
            try:
                while (header := reader._exact(HEADER.size)) is not None:
                    message = decode_from_worker(reader._exact(payload_length(header, bound)) or b"")
                    received.append(message.data["content"] if isinstance(message, Chunk) else "?")
            except FrameError:
                received.append("a frame cut in two")
                while ours.recv(1 << 20):  # keep draining: the writers never block on a full socket
                    pass

        drain = threading.Thread(target=read)
        drain.start()
        for _ in range(count):
            held.send(Chunk({"content": "w" * 150_000}))
        assert os.waitpid(child, 0)[1] == 0
        theirs.shutdown(socket.SHUT_WR)
        drain.join(60)
    shared = getattr(held, "_shared", None)
    if shared is not None:
        os.close(shared.fd)
    assert sorted(set(received)) == ["c" * 150_000, "w" * 150_000] and len(received) == 2 * count


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # another test of the process imported LanceDB
def test_a_forked_childs_chunk_after_its_job_ended_is_not_sent_as_the_next_jobs(writes):
    """A child a job forked keeps the job's chunk sender: what it emits after the worker ended the job and
    opened the next is dropped (before, the sidecar took it for the next job's), what it emitted during the
    job still went."""
    sock, held, _clock = writes
    first = ChunkSender(held, 10, 1024)
    (go_r, go_w), (sent_r, sent_w) = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:
        try:
            signal.alarm(60)
            first({"content": "child-during"})
            os.write(sent_w, b"1")
            os.read(go_r, 1)  # the worker ended the job and opened the next
            first({"content": "child-after"})
        finally:
            os._exit(0)
    assert os.read(sent_r, 1) == b"1"
    first.close()
    second = ChunkSender(held, 10, 1024)
    os.write(go_w, b"1")
    assert os.waitpid(child, 0)[1] == 0
    second({"content": "next"})
    held.flush()
    sock.sock.shutdown(socket.SHUT_WR)
    received = [m.data["content"] for m in _read_all(sock.peer)]
    shared = getattr(held, "_shared", None)
    for fd in (go_r, go_w, sent_r, sent_w, *([shared.fd] if shared else [])):
        os.close(fd)
    assert received == ["child-during", "next"]


def _in_child(work: Callable[[], None]) -> None:
    """Fork, run ``work`` in the child (then ``os._exit``), and wait for it."""
    child = os.fork()
    if child == 0:
        try:
            signal.alarm(60)
            work()
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0


def _received(sock: _Writes, held: Channel) -> list[str]:
    """The contents of every chunk frame written, once the worker's held ones went; closes the shared file."""
    held.flush()
    sock.sock.shutdown(socket.SHUT_WR)
    if held._shared is not None:
        os.close(held._shared.fd)
    return [m.data["content"] if isinstance(m, Chunk) else type(m).__name__ for m in _read_all(sock.peer)]


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # another test of the process imported LanceDB
def test_a_child_forked_when_the_shared_file_could_not_be_made_sends_no_chunk(writes, monkeypatch):
    """Without the file (``memfd_create`` refused, e.g. a job at its open-files limit) nothing tells a child's
    chunk from a later job's, nor makes its writes whole: it sends none (before, it wrote them unchecked)."""
    sock, held, _clock = writes
    job = ChunkSender(held, 10, 1024)
    monkeypatch.setattr(channel.Shared, "make", classmethod(lambda cls: None))
    _in_child(lambda: job({"content": "child"}))
    job({"content": "worker"})
    assert _received(sock, held) == ["worker"]


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # another test of the process imported LanceDB
def test_a_child_that_opens_or_closes_chunks_changes_nothing_of_the_workers(writes):
    """A crew's child that unwinds into its job's end (``close``) and opens chunks of its own: the worker's job
    still sends, the next one too, and the child's own chunks go nowhere (before, the child's close made the
    worker drop its own job's chunks)."""
    sock, held, clock = writes
    first = ChunkSender(held, 10, 1024)

    def child() -> None:
        first.close()
        ChunkSender(held, 10, 1024)({"content": "child-own"})

    _in_child(child)
    first({"content": "worker-1"})
    first.close()
    clock.now = 1
    ChunkSender(held, 10, 1024)({"content": "worker-2"})
    assert _received(sock, held) == ["worker-1", "worker-2"]


class _WatchedLock:
    """A lock that says when a caller found it taken and waits for it."""

    def __init__(self) -> None:
        self.lock, self.waiting = threading.Lock(), threading.Event()

    def acquire(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.waiting.set()
            self.lock.acquire()

    def release(self) -> None:
        self.lock.release()


def test_two_threads_forking_at_once_leave_the_channel_free(writes, monkeypatch):
    """The fork hooks of two threads forking at once: the second waits for the first fork's hooks to end, and
    both release what they took (before, the second fork's lock was never released: every later frame hung)."""
    sock, held, clock = writes
    watched = _WatchedLock()
    monkeypatch.setattr(channel, "_fork_lock", watched)
    channel._before_fork()  # this thread's fork is under way
    second = threading.Thread(target=lambda: (channel._before_fork(), channel._after_fork_in_parent()))
    second.start()
    assert watched.waiting.wait(10)  # the second fork waits for the first fork's hooks
    assert second.is_alive()
    channel._after_fork_in_parent()
    second.join(10)
    assert not second.is_alive()
    assert held._lock.acquire(blocking=False)
    held._lock.release()


def test_a_held_write_that_fails_makes_the_next_frame_fail_as_the_sidecar_gone():
    """The holder thread does not end the worker: its failed write is the next call's OSError, which the
    chunk sender and the job's end already take for a sidecar gone."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sock, clock = _Writes(theirs, ours), _Clock()
        held = Channel(sock, frame_bound(1024), clock)
        held.send_soon(Chunk({"content": "a"}))  # at once
        sock.fail = True
        held.send_soon(Chunk({"content": "b"}))  # held: the holder's write fails
        until(lambda: held._broken, what="the holder's failed write")
        sock.fail = False
        with pytest.raises(OSError):
            held.send_soon(Chunk({"content": "c"}))
        with pytest.raises(OSError):
            held.send(Done(b"{}", [], 0))
    assert _contents(sock) == [["a"]]


class _UnreachableForkServer:
    """A multiprocessing context whose fork server refuses the connection (as for a user that may not reach it)."""

    class Process:
        def __init__(self, **_kwargs: object) -> None:
            pass

        def start(self) -> None:
            raise ConnectionRefusedError(111, "Connection refused")


def test_a_fork_server_that_cannot_be_reached_is_a_start_failure_not_a_traceback():
    """The sidecar turns WorkerStartFailed into one line and exit 1 (docs/reference/cli.md "Exit codes")."""
    boot = Boot("x:y", "/tmp", True, "info", None, None, False)
    with pytest.raises(WorkerStartFailed, match=r"did not start the registry check process \(.*Connection refused"):
        describe_registry(_UnreachableForkServer(), boot)


class _Exited(Exception):
    """Stands for the worker's ``os._exit`` in a test process."""


def test_a_jobs_stop_flag_ends_the_worker_once_the_sidecar_is_gone(monkeypatch):
    """A worker's cancel flag also looks at its socket: while the sidecar holds its end (a frame pending or
    not) it reads as set or not; at the sidecar's end of file the worker exits at the check, before the
    effect the check guards (its reader thread may not have run yet); after the job's end was reported, an
    end of file is expected and changes nothing."""

    def exit_now(status):
        raise _Exited(status)

    monkeypatch.setattr(channel, "exit_now", exit_now)
    ours, theirs = socket.socketpair()
    flag = channel.StopFlag(ours)
    assert flag.is_set() is False
    theirs.sendall(encode(Cancel()))  # a frame waiting for the reader: the sidecar is there
    assert flag.is_set() is False
    flag.set()
    assert flag.is_set() is True
    theirs.close()
    with pytest.raises(_Exited):
        flag.is_set()
    flag.reported.set()
    assert flag.is_set() is True
    ours.close()


def start_frame(action_id: str, operation: str = "run") -> bytes:
    return encode(Start(action_id, "crew", operation, "t", {}, "/s", None, 10, 1024))


def test_a_workers_reader_gives_each_job_its_cancel_and_lets_it_wait_for_the_next():
    """The worker's reader thread (``channel.Inbox``) builds each job at its ``Start``: a ``Cancel`` right
    behind it reaches that job even before the job's task exists (and cancels run's task once it does); once
    the job's end is reported, the next ``Start`` is the next job, and the sidecar's end of file then ends
    the wait (None), not the process; a ``Start`` while a job runs unreported is a protocol error (exit)."""
    import asyncio

    exits: list[int] = []  # the reader thread's exits (a stand-in that outlives the test, as the thread may)
    loop = asyncio.new_event_loop()
    ours, theirs = socket.socketpair()
    try:
        inbox = channel.Inbox(channel.Channel(ours, frame_bound(1024)), loop, exits.append)
        theirs.sendall(start_frame("t:one") + encode(Cancel()))
        first = inbox.next_job()
        assert first is not None and first.start.action_id == "t:one"
        until(lambda: first.cancelled, what="the cancel reached the first job")
        task = loop.create_task(asyncio.sleep(60))
        first.begin(task)
        loop.run_until_complete(asyncio.wait([task], timeout=30))
        assert task.cancelled()
        first.flag.reported.set()
        theirs.sendall(start_frame("t:two"))
        second = inbox.next_job()
        assert second is not None and second.start.action_id == "t:two" and not second.cancelled
        second.flag.reported.set()
        theirs.close()
        assert inbox.next_job() is None and exits == []
    finally:
        ours.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()

    exits.clear()
    ours, theirs = socket.socketpair()
    try:
        inbox = channel.Inbox(channel.Channel(ours, frame_bound(1024)), loop, exits.append)
        theirs.sendall(start_frame("t:running") + start_frame("t:sent-too-soon"))
        until(lambda: exits == [channel.PROTOCOL_STATUS], what="a Start during a job ends the worker")
        for _ in range(2):  # the stand-in exit returned: let the reader thread end here, not after the test
            job = inbox.next_job()
            assert job is not None
            job.flag.reported.set()
        theirs.close()
        assert inbox.next_job() is None and exits == [channel.PROTOCOL_STATUS]
    finally:
        theirs.close()
        ours.close()


class _PreloadRecorder:
    """Stands in for multiprocessing's fork server context: records the preload list it is given."""

    preload: list[str] | None = None

    def set_forkserver_preload(self, names: list[str]) -> None:
        self.preload = list(names)


@pytest.mark.parametrize("modules", [(), ("httpcore",), ("a.b", "c")])
def test_the_fork_server_is_told_the_preloaded_modules_in_its_environment(monkeypatch, modules):
    """``--preload-modules`` reach the fork server in its environment (``options.PRELOAD_ENV``, read by the
    ``preload`` module, which imports them before CrewAI and skips one that raises); its own preload list is
    ours alone, in its order."""
    recorder = _PreloadRecorder()
    monkeypatch.delenv(PRELOAD_ENV, raising=False)  # restored after the test
    monkeypatch.setattr(fork_server.multiprocessing, "get_context", lambda method: recorder)
    monkeypatch.setattr("multiprocessing.forkserver.ensure_running", lambda: None)
    assert fork_server.start_forkserver(modules) is recorder
    assert recorder.preload == fork_server.PRELOAD
    assert os.environ[PRELOAD_ENV] == ",".join(modules)
