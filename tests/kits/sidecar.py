"""The sidecar launcher: real sidecar processes on loopback (the integration, browser, real-crew and
reliability suites; the fixtures are in tests/integration/conftest.py).

:func:`launch` runs ``python -m aip_crewai.cli sidecar`` with the
offline test crews (``aip_crewai.examples.testing:CREWS``) on an ephemeral port
(``--port 0``: the sidecar binds first and logs ``sidecar_listening`` with the
real port on stderr, so there is no free-port race), a 0600 token file and a
journal in a private temporary directory. It waits for ``/health`` and
returns a :class:`Sidecar`. Model calls are appended to ``call_log`` (one
line ``<time> <pid> <model>`` per call), so tests count executions across
processes and restarts. Processes still alive at teardown are killed.

:class:`SidecarFactory` starts them in one private directory and waits for each (``wait_ready``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kits.poll import Deadline, until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "integration-token-5f1c"
REGISTRY = "aip_crewai.examples.testing:CREWS"
ALLOWED = "run,batch_run,replay,test,knowledge_query,memory_reset"
#: Registry of the offline crews for process isolation tests (``aip_crewai.examples.isolation_crews``).
ISOLATION_REGISTRY = "aip_crewai.examples.isolation_crews:CREWS"


def process_isolation_only(why: str) -> pytest.MarkDecorator:
    """Skip in the suite's in-process pass (``AIP_CREWAI_ISOLATION=inprocess``): the test pins
    ``--isolation process`` itself and ran in the default pass already; ``why`` says what needs it."""
    return pytest.mark.skipif(os.environ.get("AIP_CREWAI_ISOLATION") == "inprocess", reason=why)


#: Longest wait for a sidecar's /health, seconds: generous, since it follows the sidecar's own readiness. On a
#: shared machine at a load near 17 the real-crew sidecar took 52 s to import CrewAI and 40 s more for its
#: crews' start-up checks (each builds its crew and probes its embedder); the tests' own timeouts still bound it.
START_TIMEOUT_S = 240.0


@dataclass
class Sidecar:
    """One running sidecar process."""

    process: subprocess.Popen[bytes]
    base_url: str
    token: str
    journal: Path
    state_dir: Path
    call_log: Path
    stderr_path: Path
    args: list[str] = field(default_factory=list)
    #: Where the process's stdout went, when it was captured (:func:`launch` ``stdout``).
    stdout_path: Path | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def client(self, **kwargs: Any) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=30.0, **kwargs)

    def calls(self, pid: int | None = None, since: float | None = None) -> list[str]:
        """Model calls logged so far (all processes, or one pid; those at or after unix time ``since``).

        With process isolation a call is made by a job's worker process, not the sidecar's own pid:
        tell sidecars apart by time (``since``), not by pid.
        """
        if not self.call_log.exists():
            return []
        lines = [line for line in self.call_log.read_text().splitlines() if line.strip()]
        return [
            line
            for line in lines
            if (pid is None or line.split()[1] == str(pid)) and (since is None or float(line.split()[0]) >= since)
        ]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def log_events(self, name: str) -> list[dict[str, Any]]:
        """Parsed JSON log lines of event ``name`` from stderr."""
        out = []
        for line in self.stderr().splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                record = json.loads(line)
                if record.get("event") == name:
                    out.append(record)
        return out

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` and wait for the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=60)


def sidecar_command(*args: str, main: Path | None = None) -> list[str]:
    """``python -m aip_crewai.cli sidecar <args>`` with this interpreter (``python <main> sidecar <args>``
    when a ``main`` script is given, as the ``aip-crewai`` console script runs it)."""
    entry = [str(main)] if main is not None else ["-m", "aip_crewai.cli"]
    return [sys.executable, *entry, "sidecar", *args]


#: Kept from the test process's environment: the suite runs its sidecars in either isolation mode
#: (``AIP_CREWAI_ISOLATION=inprocess make test``; docs/security.md "Process isolation").
PASSED_ENV = ("AIP_CREWAI_ISOLATION",)


_PRIVATE_TMP: list[Path] = []


def private_tmp() -> Path:
    """A short private ``TMPDIR`` for the sidecars this test process starts, removed when it exits. A sidecar's
    fork server keeps its socket in a ``pymp-*`` directory there and CrewAI its lock files; a sidecar killed with
    SIGKILL (as many tests and every teardown do) leaves them behind, which filled the machine's ``/tmp`` by
    hundreds a run, and a worker's sandbox lists that directory at each boot. Short: the socket's path must
    fit in 108 bytes."""
    if not _PRIVATE_TMP:
        path = Path(tempfile.mkdtemp(prefix="aipt-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _PRIVATE_TMP.append(path)
    return _PRIVATE_TMP[0]


def child_env(call_log: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test process environment without ``AIP_CREWAI_*`` (but :data:`PASSED_ENV`) or ``NOTIFY_SOCKET``,
    plus the call log and a private ``TMPDIR`` (:func:`private_tmp`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if (not k.startswith("AIP_CREWAI_") or k in PASSED_ENV) and k != "NOTIFY_SOCKET"
    }
    env["TMPDIR"] = str(private_tmp())
    env["AIP_CREWAI_TEST_CALL_LOG"] = str(call_log)
    # made now: a sandboxed worker may not create a file beside the sidecar's token and journal (docs/security.md "Security")
    call_log.touch(exist_ok=True)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def launch(
    workdir: Path,
    *,
    journal: Path | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    tag: str = "",
    stdout: Path | None = None,
    stderr: Path | None = None,
    token_file: Path | None = None,
    fsize_limit: int | None = None,
    main: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start a sidecar process (without waiting) on the offline test crews, journal ``journal`` (default
    ``workdir/journal.db``), token file ``token_file`` (default ``workdir/token``, written 0600 with
    :data:`TOKEN` if absent); ``args`` are appended to the command line, ``env`` to the environment
    (:func:`child_env`). stderr goes to ``stderr`` (default ``workdir/stderr<tag>.log``), stdout to ``stdout``
    when given (else nowhere). ``fsize_limit`` (bytes) sets ``RLIMIT_FSIZE`` in the child: writes past it fail
    with EFBIG (real write failures without root or mounts). ``main``: a script to run instead of
    ``-m aip_crewai.cli`` (:func:`sidecar_command`)."""
    if token_file is None:
        token_file = workdir / "token"
        if not token_file.exists():
            token_file.write_text(TOKEN + "\n")
            token_file.chmod(0o600)
    cmd = [
        *sidecar_command("--registry", REGISTRY, main=main),
        "--journal",
        str(journal or workdir / "journal.db"),
        "--token-file",
        str(token_file),
        "--port",
        "0",
        "--allowed-operations",
        ALLOWED,
        "--sse-keepalive-seconds",
        "0.2",
        "--shutdown-grace-seconds",
        "2",
        *(args or []),
    ]

    def limits() -> None:
        if fsize_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))

    err = open(stderr or workdir / f"stderr{tag}.log", "wb")  # noqa: SIM115 - the child owns it
    out = open(stdout, "wb") if stdout is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            cmd,
            cwd=workdir,
            env=child_env(workdir / "calls.log", env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            preexec_fn=limits if fsize_limit is not None else None,
        )
    finally:
        err.close()
        if stdout is not None:
            out.close()  # type: ignore[union-attr]


def wait_ready(process: subprocess.Popen[bytes], stderr_path: Path) -> str:
    """Wait for ``sidecar_listening`` then a 200 from ``/health``; return the base URL.

    Raises:
        AssertionError: the process exited first (its stderr in the message).
        kits.poll.Deadline: not ready within :data:`START_TIMEOUT_S` (its stderr in the message).
    """

    def listening() -> int | None:
        if process.poll() is not None:
            raise AssertionError(f"sidecar exited with {process.returncode}:\n{stderr_path.read_text()}")
        ports = [
            json.loads(line)["port"]
            for line in stderr_path.read_text(errors="replace").splitlines()
            if '"sidecar_listening"' in line
        ]
        return ports[-1] if ports else None

    def healthy() -> bool:
        try:
            return httpx2.get(f"{base_url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        except httpx2.TransportError:
            return False

    started = time.monotonic()
    try:
        port = until(listening, timeout=START_TIMEOUT_S, interval=0.05, what="sidecar listening")
        base_url = f"http://127.0.0.1:{port}"
        until(healthy, timeout=START_TIMEOUT_S - (time.monotonic() - started), interval=0.05, what="sidecar /health")
    except Deadline as exc:
        raise Deadline(f"{exc}:\n{stderr_path.read_text(errors='replace')}") from None
    return base_url


class SidecarFactory:
    """Starts sidecars in one private directory; kills survivors at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Sidecar] = []
        self._count = 0

    def start(
        self,
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        journal: Path | None = None,
        main: Path | None = None,
    ) -> Sidecar:
        self._count += 1
        tag = str(self._count)
        journal = journal or self.workdir / "journal.db"
        process = launch(self.workdir, journal=journal, args=args, env=env, tag=tag, main=main)
        stderr_path = self.workdir / f"stderr{tag}.log"
        sidecar = Sidecar(
            process, "", TOKEN, journal, self.workdir, self.workdir / "calls.log", stderr_path, list(args or [])
        )
        self.started.append(sidecar)
        sidecar.base_url = wait_ready(process, stderr_path)
        return sidecar

    def restart(self, old: Sidecar, **kwargs: Any) -> Sidecar:
        """A new process on the same journal (the old one must be gone)."""
        return self.start(journal=old.journal, args=kwargs.pop("args", old.args), **kwargs)

    def close(self) -> None:
        for sidecar in self.started:
            if sidecar.process.poll() is None:
                sidecar.kill(signal.SIGKILL)


def start_with_training_dir(factory: SidecarFactory, tmp_path: Path, registry: str, operations: str) -> Sidecar:
    """A sidecar on ``registry`` allowing ``operations``, its ``--training-dir`` at ``tmp_path/training``
    (kept as ``.training_dir``)."""
    training = tmp_path / "training"
    training.mkdir(mode=0o700)
    sidecar = factory.start(
        args=["--registry", registry, "--allowed-operations", operations, "--training-dir", str(training)]
    )
    sidecar.training_dir = training  # type: ignore[attr-defined]
    return sidecar


def post_job(sidecar: Sidecar, action_id: str, crew: str, operation: str, input: Any) -> httpx2.Response:
    """``POST /jobs`` with the idempotency key ``key-<action_id>`` (timeout 240 s)."""
    body = {"crew_id": crew, "action_id": action_id, "operation": operation, "input": input}
    return httpx2.post(
        f"{sidecar.base_url}/jobs",
        json=body,
        timeout=240,
        headers={**sidecar.headers, "Idempotency-Key": f"key-{action_id}"},
    )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a sidecar's fork server and its workers), read from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = []
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
        found += children
        todo += children
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def signal_tree(pid: int, signum: int) -> None:
    """Send ``signum`` to process ``pid`` and every process below it (the fork server and its workers), as
    ``systemctl kill`` does to a unit; the tree is read from /proc."""
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signum)
