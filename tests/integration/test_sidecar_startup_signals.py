"""Signals during the sidecar's start-up (``aip_crewai/sidecar/starting.py``): SIGTERM, SIGINT and SIGHUP stop it
with one line and every process it started gone; SIGUSR1 stops it once started, without listening
(docs/operating.md "Draining a sidecar"). The registry module here blocks at import on a FIFO, so the signal
lands while the registry check (or, in process, the sidecar's own import) waits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.poll import until
from kits.sidecar import ROOT, alive, descendants, launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: The registry check process (``--isolation process``) or the sidecar itself (``inprocess``) waits at import until
#: the writer of the FIFO ``gate`` beside it closes it; the job workers go straight on. Then the test crews.
GATED_REGISTRY = """import multiprocessing
if multiprocessing.current_process().name in ("aip-crewai-registry-check", "MainProcess"):
    open({gate!r}).read()
from aip_crewai.examples.testing import CREWS
"""


@pytest.fixture
def survivors() -> Iterator[set[int]]:
    """Pids killed at teardown if still there (a failing test leaves no sidecar or fork server running)."""
    pids: set[int] = set()
    yield pids
    for pid in filter(alive, pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_gated(tmp_path: Path, survivors: set[int]):
    """A sidecar whose registry import waits on a FIFO; returns (process, the FIFO's write end) once it waits:
    the import goes on when the write end is closed."""
    modules = tmp_path / "modules"
    modules.mkdir()
    gate = modules / "gate"
    os.mkfifo(gate, 0o600)
    (modules / "gated_registry.py").write_text(GATED_REGISTRY.format(gate=str(gate)))
    process = launch(
        tmp_path,
        args=["--registry", "gated_registry:CREWS"],
        env={"PYTHONPATH": f"{modules}{os.pathsep}{ROOT}"},
    )

    survivors.add(process.pid)

    def waiting() -> int | None:
        survivors.update(descendants(process.pid))
        assert process.poll() is None, (tmp_path / "stderr.log").read_text()
        try:  # succeeds once the import opened the FIFO for reading
            return os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return None

    return process, until(waiting, timeout=200, what="the registry import under way")


def _events(tmp_path: Path) -> list[dict]:
    text = (tmp_path / "stderr.log").read_text()
    assert "Traceback" not in text, text
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 0), (signal.SIGHUP, 129)])
def test_a_stop_signal_during_start_up_logs_one_line_and_leaves_no_process_behind(tmp_path, survivors, signum, status):
    """Start-up before this change: Python's defaults (143 and no line for SIGTERM, a traceback for SIGINT), and
    the fork server, the resource tracker and the registry check left running with parent pid 1."""
    process, gate = _start_gated(tmp_path, survivors)
    started = descendants(process.pid)  # the fork server, its registry check, multiprocessing's resource tracker
    process.send_signal(signum)
    try:
        assert process.wait(timeout=60) == status, (tmp_path / "stderr.log").read_text()
    finally:
        os.close(gate)
    stopped = [e for e in _events(tmp_path) if e.get("event") == "sidecar_stopped_starting"]
    assert [e["signal"] for e in stopped] == [signal.Signals(signum).name]
    assert not [e for e in _events(tmp_path) if e.get("event") in ("crewai_ready", "sidecar_listening")]
    until(lambda: not any(alive(pid) for pid in started), timeout=30, what=f"{started} gone")


def test_sigusr1_during_start_up_stops_once_started_without_listening(tmp_path, survivors):
    process, gate = _start_gated(tmp_path, survivors)
    process.send_signal(signal.SIGUSR1)
    until(
        lambda: any(e.get("event") == "sidecar_drain_asked_starting" for e in _events(tmp_path)),
        what="the drain noted",
    )
    os.close(gate)  # the registry import goes on
    assert process.wait(timeout=200) == 0, (tmp_path / "stderr.log").read_text()
    events = [e.get("event") for e in _events(tmp_path)]
    assert "crewai_ready" in events and "sidecar_drained" in events, events
    assert "sidecar_listening" not in events and "sidecar_stopped_starting" not in events
