"""The worker sandbox through the real sidecar (docs/security.md "Security": worker sandbox; ``isolation/sandbox.py``).

A crew's code cannot read the sidecar's secrets: the inline token never reaches a worker's environment;
a worker cannot open the token file, the journal and its companions, the sidecar's ``/proc`` entry, nor
another tenant's training artifacts or namespace; when the sidecar runs as root with ``--worker-user``,
workers run as that user. Ordinary crews still run. The crews are ``aip_crewai.examples.isolation_crews``
(``environment`` answers its process environment, ``reach`` reads the file its input names first).

The token-file and Landlock tests share one sidecar (``sandboxed``: a token file, a training directory, another
tenant's files seeded before it started); the inline token and ``--worker-user`` need sidecars of their own.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from kits.poll import until
from kits.sidecar import (
    ISOLATION_REGISTRY,
    TOKEN,
    Sidecar,
    SidecarFactory,
    child_env,
    post_job,
    process_isolation_only,
    sidecar_command,
    wait_ready,
)

from aip_crewai.sidecar.isolation.landlock import abi_version  # ctypes only: no CrewAI in the test process
from aip_crewai.sidecar.isolation.sandbox import unreachable

pytestmark = [
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.timeout(240),
    process_isolation_only("the worker sandbox needs process isolation (tested in the default pass)"),
]

REGISTRY = ISOLATION_REGISTRY
TEST_USER = "aipcrewai-sbx"


def run(sidecar: Sidecar, action_id: str, crew: str, input: dict[str, Any]) -> dict[str, Any]:
    """The job's answer (a completed output or a failure body)."""
    response = post_job(sidecar, action_id, crew, "run", input)
    body: dict[str, Any] = response.json()
    return body


def health(sidecar: Sidecar) -> dict[str, Any]:
    body: dict[str, Any] = httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers, timeout=30).json()
    return body


def start_inline(workdir: Path) -> Sidecar:
    """A sidecar whose token comes from ``AIP_CREWAI_BEARER_TOKEN`` (no token file)."""
    stderr_path = workdir / "stderr.log"
    env = child_env(workdir / "calls.log", {"AIP_CREWAI_BEARER_TOKEN": TOKEN})
    cmd = sidecar_command(
        "--registry", REGISTRY, "--journal", str(workdir / "journal.db"), "--port", "0", "--isolation", "process"
    )
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
        )
    sidecar = Sidecar(process, "", TOKEN, workdir / "journal.db", workdir, workdir / "calls.log", stderr_path)
    try:
        sidecar.base_url = wait_ready(process, stderr_path)
    except BaseException:
        sidecar.kill()
        raise
    return sidecar


def test_an_inline_token_reaches_no_worker_environment(tmp_path: Path) -> None:
    sidecar = start_inline(tmp_path)
    try:
        body = run(sidecar, "acme:env-1", "environment", {"topic": "env"})
        assert "raw" in body, body
        assert "AIP_CREWAI_TEST_CALL_LOG" in body["raw"]  # the dump is there ...
        assert TOKEN not in json.dumps(body)  # ... without the token, in os.environ or /proc/self/environ
        assert "AIP_CREWAI_BEARER_TOKEN" not in body["raw"]
    finally:
        sidecar.kill()


def seed_other_tenant(state_dir: Path, training: Path) -> dict[str, Path]:
    """Files of tenant ``beta`` (a training artifact, a namespace's memory) and of ``acme`` itself."""
    files = {
        "beta_artifact": training / "beta" / "triage" / "model.pkl",
        "beta_memory": state_dir / "namespaces" / ("b" * 32) / "memory" / "data.lance",
        "acme_artifact": training / "acme" / "triage" / "model.pkl",
    }
    for path in files.values():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text("tenant data")
    return files


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, dict[str, Path]]]:
    """A sidecar on the isolation crews with its token in a file and ``--training-dir``, started after
    :func:`seed_other_tenant` wrote its files (returned beside it)."""
    workdir = tmp_path_factory.mktemp("sandboxed")
    workdir.chmod(0o700)
    training = tmp_path_factory.mktemp("sandboxed-training") / "training"
    factory = SidecarFactory(workdir)
    seeded = seed_other_tenant(workdir, training)
    try:
        yield (
            factory.start(args=["--registry", REGISTRY, "--isolation", "process", "--training-dir", str(training)]),
            seeded,
        )
    finally:
        factory.close()


def test_a_token_files_contents_reach_no_worker_environment(sandboxed: tuple[Sidecar, dict[str, Path]]) -> None:
    sidecar, _ = sandboxed
    body = run(sidecar, "acme:env-2", "environment", {"topic": "env"})
    assert "raw" in body and "AIP_CREWAI_TEST_CALL_LOG" in body["raw"], body
    assert TOKEN not in json.dumps(body)


@pytest.mark.skipif(abi_version() < 1, reason="this kernel offers no Landlock")
def test_a_landlocked_worker_cannot_open_the_sidecars_files_nor_another_tenants(
    sandboxed: tuple[Sidecar, dict[str, Path]],
) -> None:
    sidecar, seeded = sandboxed
    facts = health(sidecar)["worker_sandbox"]
    assert facts["landlock_abi"] >= 1 and "landlock" in facts["mode"], facts
    denied = {
        "token": sidecar.state_dir / "token",
        "journal": sidecar.journal,
        "journal_wal": Path(f"{sidecar.journal}-wal"),
        "journal_lock": Path(f"{sidecar.journal}.lock"),
        "sidecar_proc_environ": Path(f"/proc/{sidecar.process.pid}/environ"),
        "beta_artifact": seeded["beta_artifact"],
        "beta_memory": seeded["beta_memory"],
    }
    for n, (name, path) in enumerate(denied.items()):
        assert path.exists(), name
        body = run(sidecar, f"acme:deny-{n}", "reach", {"path": str(path)})
        assert body.get("error_type") == "PermissionError", (name, body)
        assert "tenant data" not in json.dumps(body) and TOKEN not in json.dumps(body)
    own = run(sidecar, "acme:own", "reach", {"path": str(seeded["acme_artifact"])})
    assert "opened" in own.get("raw", ""), own  # its own tenant's artifacts stay readable
    system = run(sidecar, "acme:system", "reach", {"path": "/etc/hostname"})
    assert "opened" in system.get("raw", ""), system
    assert "raw" in run(sidecar, "acme:echo", "echo", {"topic": "tides"})  # an ordinary crew still runs


@pytest.fixture
def worker_user() -> Iterator[str]:
    """An unprivileged user for ``--worker-user`` (made here when missing: needs root and ``useradd``)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("--worker-user needs a test run as root with useradd")
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
            check=True,
            capture_output=True,
        )
    yield TEST_USER


@contextmanager
def searchable_python(user: str) -> Iterator[None]:
    """Python's installation searchable by ``user`` while the block runs: CI's interpreter lives under
    ``/root`` (pyenv), which is 0700; the blocking directory gets ``o+x`` (search only) and its mode back after."""
    entry = pwd.getpwnam(user)
    blocked = unreachable(sys.base_prefix, entry.pw_uid, entry.pw_gid)
    mode = os.stat(blocked).st_mode if blocked else 0
    if blocked:
        os.chmod(blocked, stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield
    finally:
        if blocked:
            os.chmod(blocked, stat.S_IMODE(mode))


def test_workers_drop_to_the_worker_user(worker_user: str) -> None:
    # under /tmp (pytest's base directory is 0700: the worker user could not reach the state directory)
    workdir = Path(tempfile.mkdtemp(prefix="aip-crewai-sandbox-"))
    workdir.chmod(0o711)
    factory = SidecarFactory(workdir)
    with searchable_python(worker_user):
        try:
            training = workdir / "training"
            seeded = seed_other_tenant(workdir, training)
            sidecar = factory.start(
                args=[
                    "--registry",
                    REGISTRY,
                    "--isolation",
                    "process",
                    "--worker-user",
                    worker_user,
                    "--training-dir",
                    str(training),
                ]
            )
            sidecar.call_log.chmod(0o666)  # the test's own call log, written by the crews' model
            facts = health(sidecar)["worker_sandbox"]
            assert facts["worker_user"] == worker_user and facts["mode"].startswith("user"), facts
            assert "worker_user" not in facts["missing"]
            env = run(sidecar, "acme:env-user", "environment", {"topic": "env"})
            assert json.loads(env["raw"])["environ"]["USER"] == worker_user, env
            for n, path in enumerate([workdir / "token", sidecar.journal, seeded["beta_artifact"]]):
                body = run(sidecar, f"acme:user-deny-{n}", "reach", {"path": str(path)})
                assert body.get("error_type") == "PermissionError", (path, body)
            assert "raw" in run(sidecar, "acme:user-echo", "echo", {"topic": "tides"})
            assert (workdir / "token").stat().st_uid == 0 and sidecar.journal.stat().st_uid == 0
        finally:
            for started in factory.started:  # a drained stop, then no worker left to make files in workdir
                started.kill(signal.SIGTERM)
            factory.close()
            wait_for_no_process_of(pwd.getpwnam(worker_user).pw_uid)
            shutil.rmtree(workdir, ignore_errors=True)


def wait_for_no_process_of(uid: int, timeout: float = 60.0) -> None:
    """Poll (deadline ``timeout`` s) until no process runs as ``uid`` (the test's own worker user)."""

    def running() -> bool:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:  # the Uid line: a worker that dropped is not dumpable, so root owns its /proc entry
                    status = (entry / "status").read_text()
                except OSError:
                    continue
                if any(line.split()[1:2] == [str(uid)] for line in status.splitlines() if line.startswith("Uid:")):
                    return True
        return False

    until(lambda: not running(), timeout=timeout, interval=0.1, what=f"no process of uid {uid}")
