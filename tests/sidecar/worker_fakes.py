"""Fake job workers for ``test_workers.py``: process targets speaking the worker pipe protocol.

Importable by name in a spawned child (the test directory is on ``sys.path``). No CrewAI.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from aip_crewai.sidecar.isolation.channel import Channel
from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    Cancel,
    Chunk,
    Done,
    Failed,
    FindTaskRun,
    Ready,
    Start,
    TaskRun,
    decode_boot,
    frame_bound,
)


def _start(sock: socket.socket) -> tuple[Channel, Start]:
    channel = Channel(sock, frame_bound(1024))
    channel.send(Ready(os.getpid()))
    start = channel.recv()
    assert isinstance(start, Start)
    return channel, start


def oversized(sock: socket.socket, _boot: bytes) -> None:
    """Announces a frame one byte over the sidecar's bound."""
    channel, start = _start(sock)
    sock.sendall(HEADER.pack(frame_bound(start.max_event_bytes) + 1))
    time.sleep(60)


def dies(sock: socket.socket, _boot: bytes) -> None:
    """Sends a chunk, then kills itself (SIGKILL)."""
    channel, _start_message = _start(sock)
    channel.send(Chunk({"content": "before", "channel": "llm"}))
    os.kill(os.getpid(), signal.SIGKILL)


def ignores_cancel(sock: socket.socket, _boot: bytes) -> None:
    """Sends a chunk, then blocks whatever it is told (a tool in ``time.sleep``)."""
    channel, _start_message = _start(sock)
    channel.send(Chunk({"content": "blocking", "channel": "tools"}))
    time.sleep(60)
    channel.send(Done(b'{"late": true}', []))


def stops_on_cancel(sock: socket.socket, _boot: bytes) -> None:
    """Waits for Cancel, then reports a cooperative stop."""
    channel, _start_message = _start(sock)
    channel.send(Chunk({"content": "running", "channel": "llm"}))
    while not isinstance(channel.recv(), Cancel):
        pass
    channel.send(Failed("JobCancelled", cancelled=True, stop_observed=True))


def finishes_despite_cancel(sock: socket.socket, _boot: bytes) -> None:
    """Answers a Cancel with a completed output (it finished its work anyway)."""
    channel, _start_message = _start(sock)
    channel.send(Chunk({"content": "running", "channel": "llm"}))
    while not isinstance(channel.recv(), Cancel):
        pass
    channel.send(Done(b'{"raw": "done anyway"}', []))


def asks_for_a_run(sock: socket.socket, _boot: bytes) -> None:
    """replay's lookup: FindTaskRun, then completes with what it got, keeping run state and dropped chunks."""
    channel, start = _start(sock)
    channel.send(FindTaskRun(1, start.input["task_id"]))
    answer = channel.recv()
    assert isinstance(answer, TaskRun) and answer.request == 1
    output = b'{"found": %s}' % (b"true" if answer.run else b"false")
    channel.send(Done(output, [(None, {"inputs": {"topic": "t"}}), (3, {"fingerprint": []})], dropped=2))


def fails(sock: socket.socket, _boot: bytes) -> None:
    """Reports a failure with a class name only (no publishable message)."""
    _channel, _start_message = _start(sock)
    _channel.send(Failed("RuntimeError"))


def serves_jobs(sock: socket.socket, _boot: bytes) -> None:
    """A warm worker: answers each job with its pid and ``last: false`` until end of file; a job with the input
    ``hold`` first asks for a task run (``FindTaskRun``) and ends once it is answered."""
    channel = Channel(sock, frame_bound(1024))
    channel.send(Ready(os.getpid()))
    while isinstance(start := channel.recv(), Start):
        if start.input.get("hold"):
            channel.send(FindTaskRun(1, "held"))
            assert isinstance(channel.recv(), TaskRun)
        channel.send(Done(b'{"pid": %d}' % os.getpid(), [], last=False))


def stays_after_cancel(sock: socket.socket, _boot: bytes) -> None:
    """A job with the input ``wait`` answers a Cancel with its output (it finished anyway) and says the
    worker could run another job (``last: false``); other jobs report the worker's pid (``last: false``)."""
    channel = Channel(sock, frame_bound(1024))
    channel.send(Ready(os.getpid()))
    while isinstance(start := channel.recv(), Start):
        if start.input.get("wait"):
            channel.send(Chunk({"content": "running", "channel": "llm"}))
            while not isinstance(channel.recv(), Cancel):
                pass
            channel.send(Done(b'{"pid": %d}' % os.getpid(), [], last=False))
        else:
            channel.send(Done(b'{"pid": %d}' % os.getpid(), [], last=False))


def dies_before_start_once(sock: socket.socket, boot: bytes) -> None:
    """Dies (SIGKILL) as it gets its job, before any frame, the first time (a marker file at the path named by
    ``Boot.registry``); a later worker completes the job."""
    marker = Path(decode_boot(boot).registry)
    _channel, _start_message = _start(sock)
    if not marker.exists():
        marker.write_text("died")
        os.kill(os.getpid(), signal.SIGKILL)
    _channel.send(Done(b'{"raw": "second worker"}', []))


def always_dies_before_start(sock: socket.socket, _boot: bytes) -> None:
    """Dies (SIGKILL) as it gets its job, before any frame."""
    _start(sock)
    os.kill(os.getpid(), signal.SIGKILL)


def serves_one_job_then_dies_taking_the_next(sock: socket.socket, _boot: bytes) -> None:
    """A warm worker that answers its first job with its pid (``last: false``) and dies (SIGKILL) as it gets
    its second, before any frame (killed between two jobs, as an operator's ``kill -9`` would)."""
    channel = Channel(sock, frame_bound(1024))
    channel.send(Ready(os.getpid()))
    assert isinstance(channel.recv(), Start)
    channel.send(Done(b'{"pid": %d}' % os.getpid(), [], last=False))
    assert isinstance(channel.recv(), Start)
    os.kill(os.getpid(), signal.SIGKILL)
