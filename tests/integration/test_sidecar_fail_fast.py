"""Start-up refusals arrive before the CrewAI import: a registry module that is not on the
path, a port that cannot be bound, a token file with a loose mode and a journal path that is a directory each
end the sidecar with one line on stderr and exit 2 before its log says ``crewai_importing`` (the step a good
start logs right before ``import crewai``, in the order the last test checks); a good start logs its progress.
No bound on the seconds it takes: the log's order is the proof, and a slow machine fails no test."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from kits.poll import until
from kits.sidecar import ROOT, launch, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _refusal(workdir: Path, **kwargs) -> list[str]:
    """The sidecar's stderr lines that are not JSON log lines, once it exited 2 without logging
    ``crewai_importing``."""
    process = launch(workdir, **kwargs)
    try:
        status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert status == 2, (workdir / "stderr.log").read_text()
    lines = (workdir / "stderr.log").read_text().splitlines()
    assert not any("crewai_importing" in line for line in lines)
    return [line for line in lines if not line.startswith("{")]


def test_a_registry_module_not_on_the_path_is_refused_before_the_crewai_import(tmp_path):
    lines = _refusal(tmp_path, args=["--registry", "no_such_realcrews_module.crews:CREWS"])
    assert len(lines) == 1 and "no module 'no_such_realcrews_module'" in lines[0], lines


def test_a_port_in_use_is_refused_before_the_crewai_import(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        lines = _refusal(tmp_path, args=["--port", str(taken.getsockname()[1])])
    assert len(lines) == 1 and "cannot listen" in lines[0], lines


def test_a_token_file_others_can_write_is_refused_before_the_crewai_import(tmp_path):
    token = tmp_path / "token"
    token.write_text("integration-token-5f1c\n")
    token.chmod(0o666)
    lines = _refusal(tmp_path)
    assert len(lines) == 1 and "token" in lines[0].lower(), lines


def test_a_journal_path_that_is_a_directory_is_refused_before_the_crewai_import(tmp_path):
    (tmp_path / "journal-dir").mkdir(mode=0o700)
    lines = _refusal(tmp_path, journal=tmp_path / "journal-dir")
    assert len(lines) == 1 and "--journal" in lines[0], lines


def test_a_good_start_logs_its_progress_in_order(tmp_path):
    process = launch(tmp_path)
    try:
        wait_ready(process, tmp_path / "stderr.log")
    finally:
        process.kill()
        process.wait(timeout=60)
    events = [
        json.loads(line).get("event")
        for line in (tmp_path / "stderr.log").read_text().splitlines()
        if line.startswith("{")
    ]
    progress = [e for e in events if e in ("journal_checked", "crewai_importing", "crewai_ready", "sidecar_listening")]
    assert progress == ["journal_checked", "crewai_importing", "crewai_ready", "sidecar_listening"], events


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no second thread on one core")
def test_a_fork_server_left_with_a_second_thread_is_refused_in_one_line_naming_it(tmp_path):
    """numpy's OpenBLAS starts a native thread per core at import unless OPENBLAS_NUM_THREADS=1 (the sidecar's
    default); forced to 2, the fork server has a second thread and no worker may be forked from it."""
    text, line = _one_line_exit(tmp_path, args=["--isolation", "process"], env={"OPENBLAS_NUM_THREADS": "2"})
    assert "fork server runs 1 thread(s)" in line and "native-thread-1" in line, line
    assert "sidecar_listening" not in text


@pytest.mark.parametrize("isolation", ["process", "inprocess"])
def test_a_registry_module_that_raises_at_import_is_one_line_and_exit_2_without_a_traceback(tmp_path, isolation):
    """Found after the CrewAI import (the module must run to fail), still one line naming the exception type and
    the module's file and line, never its text or a traceback, in either isolation mode."""
    (tmp_path / "boom_registry.py").write_text('TOKEN = "sk-live-0"\nraise RuntimeError(TOKEN)\n')
    args = ["--registry", "boom_registry:CREWS", "--isolation", isolation]
    text, line = _one_line_exit(tmp_path, args=args, env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}, timeout=110)
    assert "RuntimeError at boom_registry.py:2" in line, line
    assert "sk-live-0" not in text


#: Modules of the ``--preload-modules`` tests: each records the pid of the process importing it (the fork server),
#: then misbehaves.
PRELOADED_MODULES = {
    "raises_sdk": "raise RuntimeError('broken at import')\n",
    "exits_sdk": "raise SystemExit('exit at import')\n",
    "dies_sdk": "import os\nos._exit(7)\n",
    "threaded_sdk": "import threading\n"  # a thread that never ends, as an SDK's flusher
    "threading.Thread(target=threading.Event().wait, name='sdk-flusher', daemon=False).start()\n",
}


def _preloading(tmp_path: Path, modules: str) -> tuple[list[str], dict[str, str]]:
    """Sidecar arguments preloading ``modules`` of :data:`PRELOADED_MODULES` (written under ``tmp_path``), and
    the environment that finds them."""
    directory = tmp_path / "modules"
    directory.mkdir(exist_ok=True)
    for name, body in PRELOADED_MODULES.items():
        marker = tmp_path / f"{name}.pid"
        (directory / f"{name}.py").write_text(f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n{body}")
    args = ["--isolation", "process", "--preload-modules", modules]
    return args, {"PYTHONPATH": f"{directory}{os.pathsep}{ROOT}"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped


def test_a_preloaded_module_that_starts_a_thread_is_refused_in_one_line_and_its_fork_server_killed(tmp_path):
    """``--preload-modules`` imports a module into the fork server with the sidecar's rights before any fork; one
    that starts a thread at import leaves the fork server threaded: start-up is refused (exit 2) in one line
    naming the thread and the option, before any worker is forked. The thread (not a daemon) would keep the
    fork server alive after the sidecar's exit: the sidecar kills it."""
    args, env = _preloading(tmp_path, "threaded_sdk")
    text, line = _one_line_exit(tmp_path, args=args, env=env)
    assert "sdk-flusher" in line and "--preload-modules" in line, line
    assert "sidecar_listening" not in text
    fork_server = int((tmp_path / "threaded_sdk.pid").read_text())
    until(lambda: _gone(fork_server), timeout=30, what="the fork server killed")


def test_preloaded_modules_that_raise_at_import_are_skipped_and_named_in_a_warning(tmp_path):
    """A ``--preload-modules`` module whose import raises (an exception, ``SystemExit`` too) is skipped: the
    fork server lives on, the sidecar serves and logs ``preload_module_skipped`` with the module and the
    exception class (never its message); a module that is not installed is skipped the same way."""
    args, env = _preloading(tmp_path, "raises_sdk,no_such_sdk_module,exits_sdk,httpcore")
    process = launch(tmp_path, args=args, env=env)
    try:
        wait_ready(process, tmp_path / "stderr.log")
    finally:
        process.terminate()
        process.wait(timeout=60)
    text = (tmp_path / "stderr.log").read_text()
    skipped = [json.loads(line) for line in text.splitlines() if '"preload_module_skipped"' in line]
    assert [(e["module"], e["error_type"]) for e in skipped] == [
        ("raises_sdk", "RuntimeError"),
        ("no_such_sdk_module", "ModuleNotFoundError"),
        ("exits_sdk", "SystemExit"),
    ], skipped
    assert "broken at import" not in text and "Traceback" not in text


def test_a_preloaded_module_that_ends_the_fork_server_is_refused_in_one_line(tmp_path):
    """A module that ends the process at import (``os._exit``: nothing to catch) takes the fork server with it:
    start-up stops (exit 1) with one line that points at ``--preload-modules``, never a traceback."""
    args, env = _preloading(tmp_path, "dies_sdk")
    text, line = _one_line_exit(tmp_path, args=args, env=env, status=1)
    assert "--preload-modules" in line, line
    assert "sidecar_listening" not in text


def _one_line_exit(
    tmp_path: Path, *, args: list[str], env: dict[str, str], status: int = 2, timeout: float = 240.0
) -> tuple[str, str]:
    """Start a sidecar that must refuse to start; once it exited with ``status``: (its stderr, its one line
    that is not a JSON log line), asserting there is exactly one such line and no traceback."""
    process = launch(tmp_path, args=args, env=env)
    try:
        exited = process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    text = (tmp_path / "stderr.log").read_text()
    assert exited == status, text
    lines = [line for line in text.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, lines
    assert "Traceback" not in text
    return text, lines[0]


def test_a_module_shadowing_the_serving_stack_is_one_line_naming_it_and_exit_2(tmp_path):
    """An ``h2.py`` on PYTHONPATH hides the HTTP/2 package the server imports once the crews are loaded: that was
    two ``crewai_printed_error`` labels (``Traceback``, ``ModuleNotFoundError``) and exit 1; now one line naming
    the module, exit 2."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "h2.py").write_text("")
    args = ["--registry", "aip_crewai.examples.isolation_crews:CREWS"]
    text, line = _one_line_exit(tmp_path, args=args, env={"PYTHONPATH": f"{shadow}{os.pathsep}{ROOT}"})
    assert "cannot import 'h2." in line and "'h2' on PYTHONPATH" in line, line
    assert "crewai_ready" in text  # it got as far as serving


def test_a_state_dir_where_crewai_storage_cannot_be_made_is_one_line_naming_it_and_exit_2(tmp_path):
    """A read-only file system (here: a file where the storage directory goes, the same OSError path without
    a mount) was a ``crewai_printed_error`` traceback label and exit 1; now the setting, the path and the reason."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "crewai").write_text("")
    text, line = _one_line_exit(tmp_path, args=["--state-dir", str(state)], env={})
    assert line.startswith("aip-crewai sidecar: error: --state-dir") and f"{state}/crewai" in line, line
    assert "crewai_printed_error" not in text
