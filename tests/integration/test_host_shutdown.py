"""Host shutdown with open tenant streams and blocking calls, real processes.

On Python 3.12.1 and later hypercorn waits for open connections, so before
this fix a host with one open SSE stream was still alive 60 s after SIGTERM.
The matrix (`make test-matrix`) runs these on the lowest and highest Python.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx2
import pytest
from kits.host import TOKENS, free_port, start_host, write_config
from kits.poll import until

from aip_crewai.client import new_id
from aip_crewai.host.http.stopping import SHUTDOWN_COMMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.host_processes]

#: The host's own bound on a stop: hypercorn's grace for connections plus the dispatch drain.
STOP_BOUND_S = 5.0 + 20.0


@pytest.fixture
def host_sidecar_workdir(sidecar_factory, tmp_path):
    sidecar = sidecar_factory.start()
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token)
    try:
        yield host, sidecar, tmp_path / "host"
    finally:
        host.stop(signal.SIGKILL)


def approved_slow_run(host) -> str:
    """An approved run of the ``slow`` crew (about 6 s), running; returns its action id."""
    action_id = new_id("act")
    with host.client("acme-app") as app:
        pending = app.call(
            "cap:crewai:slow", {"topic": "t"}, action_id=action_id, idempotency_key=new_id("key"), mode="async"
        )
        approval_id = pending["body"]["action_result"]["output"]["approval_id"]
    with host.client("acme-approver") as approver:
        approver.decide(approval_id, "approved", "shutdown test")
    return action_id


def log_has(host, text: str, deadline_s: float = 30.0) -> None:
    until(lambda: text in host.log.read_text(), timeout=deadline_s, what=f"{text!r} logged")


def test_sigterm_ends_open_streams_and_the_host_exits_in_its_grace(host_sidecar_workdir):
    host, sidecar, workdir = host_sidecar_workdir
    action_id = approved_slow_run(host)
    headers = {"Authorization": f"Bearer {TOKENS['acme-app']}", "Accept": "text/event-stream"}
    received = bytearray()
    first_chunk = threading.Event()

    def follow() -> None:
        with httpx2.stream(
            "GET", f"{host.base_url}/aip/v1/actions/{action_id}/events", headers=headers, timeout=60
        ) as response:
            for piece in response.iter_raw():
                received.extend(piece)
                if b"event: chunk" in received:
                    first_chunk.set()

    follower = threading.Thread(target=follow)
    follower.start()
    assert first_chunk.wait(30)
    started = time.monotonic()
    host.process.send_signal(signal.SIGTERM)
    follower.join(10)
    assert not follower.is_alive(), "the stream did not end at SIGTERM"
    assert host.process.wait(timeout=STOP_BOUND_S + 5) == 0
    assert time.monotonic() - started < STOP_BOUND_S
    assert bytes(received).endswith(SHUTDOWN_COMMENT) and b"event: result" not in received
    log = host.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log
    for line in log.splitlines():  # hypercorn's own lines too are JSON events
        assert json.loads(line)["event"], line
    # the tenant resumes on a new host from the last position it saw
    last_id = bytes(received).rsplit(b"id: ", 1)[1].split(b"\n", 1)[0].decode()
    again = start_host(workdir, sidecar.base_url, sidecar.token)
    try:
        with again.client("acme-app") as app:
            resumed = list(app.follow(action_id, last_event_id=last_id))
        assert resumed[-1][0] == "result"
        assert resumed[0][1]["_sse_id"] != last_id  # nothing repeated
    finally:
        again.stop()


def test_a_second_sigint_exits_at_once_without_draining(host_sidecar_workdir):
    host, _sidecar, _workdir = host_sidecar_workdir
    approved_slow_run(host)
    host.process.send_signal(signal.SIGINT)
    log_has(host, "host_stopping")
    started = time.monotonic()
    host.process.send_signal(signal.SIGINT)
    assert host.process.wait(timeout=10) == 130
    assert time.monotonic() - started < 5


def test_sighup_stops_the_host_as_sigterm_does_and_exits_129(host_sidecar_workdir):
    """A closed terminal's SIGHUP: the same stop as SIGTERM (``host_stopping`` names it), exit 129 (128 +
    SIGHUP, as the signal's default gives); before, the host died at once without a line."""
    host, _sidecar, _workdir = host_sidecar_workdir
    host.process.send_signal(signal.SIGHUP)
    assert host.process.wait(timeout=30) == 129
    log_has(host, "SIGHUP")
    log_has(host, "host_stopping")


def test_a_host_whose_log_pipe_lost_its_reader_still_answers_and_stops_on_sigterm(sidecar_factory, tmp_path):
    """``aip-crewai host ... 2>&1 | head``: once ``head`` exits, every log write fails with EPIPE. The host keeps
    answering and stops on SIGTERM (before, the stop's own log line raised and the host ignored every signal)."""
    sidecar = sidecar_factory.start()
    port = free_port()
    config = write_config(tmp_path / "host", sidecar.base_url, sidecar.token, port)
    argv = [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config), "--log-format", "json"]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    try:
        assert process.stderr is not None
        first = process.stderr.readline()  # the host writes to the pipe, then its reader goes away
        assert first.startswith(b"{"), first
        process.stderr.close()

        def ready() -> bool:
            try:
                return httpx2.get(f"{base_url}/ready", timeout=5).status_code == 200
            except httpx2.TransportError:
                return False

        until(ready, timeout=60, what="the host ready")
        for _ in range(3):  # requests log lines: each write now fails
            answer = httpx2.get(
                f"{base_url}/aip/v1/manifest", headers={"Authorization": f"Bearer {TOKENS['acme-app']}"}
            )
            assert answer.status_code == 200, answer.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_BOUND_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
