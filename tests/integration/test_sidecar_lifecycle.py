"""Sidecar process lifecycle: crash fence, journal ownership, graceful stop, limits (ARCHITECTURE.md §5, §11)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time

import httpx2
import pytest
from kits.poll import until, until_async
from kits.sidecar import (
    TOKEN,
    alive,
    child_env,
    descendants,
    launch,
    sidecar_command,
    signal_tree,
    wait_ready,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.sidecar_jobs]


def body(action_id: str, crew: str = "echo", operation: str = "run", input: dict | None = None) -> dict:
    return {"crew_id": crew, "action_id": action_id, "operation": operation, "input": input or {}}


async def test_kill_9_during_a_run_then_restart_fails_it_as_uncertain_without_rerunning(sidecar_factory):
    first = sidecar_factory.start()
    async with first.client() as client:
        task = asyncio.create_task(client.post("/jobs", json=body("crash-1", "slow"), headers={"Idempotency-Key": "k"}))
        await until_async(lambda: first.calls())  # CrewAI is executing (in the sidecar or its worker)
        assert first.kill(signal.SIGKILL) == -signal.SIGKILL
        with pytest.raises(httpx2.TransportError):  # the sidecar died mid-request
            await task
    restarted_at = time.time()
    second = sidecar_factory.restart(first)
    async with second.client() as client:
        view = (await client.get("/jobs/crash-1")).json()
        events = (await client.get("/jobs/crash-1/events")).json()["events"]
        repeat = await client.post("/jobs", json=body("crash-1", "slow"), headers={"Idempotency-Key": "k"})
        health = (await client.get("/health")).json()
    assert view["status"] == "failed"
    assert events[0]["event"] == "started" and events[-1]["event"] == "failed"
    assert events[-1]["data"] == {
        "status": "failed",
        "error_type": "SidecarRestarted",
        "message": "sidecar restarted before CrewAI produced a terminal result",
        "uncertain_outcome": True,
    }
    assert [e["sequence"] for e in events] == list(range(len(events)))
    assert repeat.status_code == 502 and repeat.json()["error_type"] == "SidecarRestarted"
    assert second.calls(since=restarted_at) == []  # never re-run (nor by a worker of the killed sidecar)
    assert health["active_runs"] == 0 and health["retained_runs"] == 1
    assert second.log_events("job_failed_by_restart")[0]["action_id"] == "crash-1"


async def test_a_second_sidecar_on_the_same_journal_refuses_to_start(sidecar_factory):
    owner = sidecar_factory.start()
    intruder = launch(sidecar_factory.workdir, journal=owner.journal, tag="-intruder")
    status = intruder.wait(timeout=120)
    message = (sidecar_factory.workdir / "stderr-intruder.log").read_text()
    assert status == 2
    assert "already owned by another active sidecar" in message and "Traceback" not in message
    async with owner.client() as client:
        assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 0), (signal.SIGHUP, 129)])
async def test_sigterm_cancels_jobs_past_the_grace_with_a_terminal_event(sidecar_factory, signum, status):
    """SIGTERM, or a closed terminal's SIGHUP once serving (exit 129; before, the start-up handler was still in
    place for it: the sidecar died at once, logged ``sidecar_stopped_starting`` and the client got an empty 500)."""
    first = sidecar_factory.start(args=["--shutdown-grace-seconds", "0.2"])
    async with first.client() as client:
        task = asyncio.create_task(client.post("/jobs", json=body("term-1", "slow"), headers={"Idempotency-Key": "k"}))
        await until_async(lambda: first.calls())
        assert first.kill(signum) == status
        answer = await task
    assert answer.status_code == 409 and answer.json()["status"] == "cancelled"
    assert first.log_events("sidecar_stopped") and not first.log_events("sidecar_stopped_starting")
    second = sidecar_factory.restart(first)
    async with second.client() as client:
        events = (await client.get("/jobs/term-1/events")).json()["events"]
    assert events[-1]["data"] == {"status": "cancelled", "reason": "sidecar_shutdown"}
    assert second.log_events("job_failed_by_restart") == []


async def test_a_second_sigint_during_the_shutdown_exits_130_at_once_and_ends_the_workers(sidecar_factory):
    """Ctrl-C, then Ctrl-C again while a job runs in its grace: the sidecar stops at once as the host does
    (exit 130, one line ``sidecar_exit_now``), its workers and fork server killed; before, the second one
    was ignored and the job ran on to its end (exit 0)."""
    sidecar = sidecar_factory.start(args=["--shutdown-grace-seconds", "120"])
    async with sidecar.client() as client:
        task = asyncio.create_task(client.post("/jobs", json=body("int-1", "slow"), headers={"Idempotency-Key": "k"}))
        await until_async(lambda: sidecar.calls())
        below = descendants(sidecar.process.pid)  # process isolation: the fork server and the job's worker
        sidecar.process.send_signal(signal.SIGINT)
        await until_async(lambda: sidecar.log_events("sidecar_stopping"), what="the first Ctrl-C's stop")
        calls = len(sidecar.calls())
        sidecar.process.send_signal(signal.SIGINT)
        status = await asyncio.to_thread(sidecar.process.wait, 10)
        with pytest.raises(httpx2.TransportError):  # never answered: the job did not run to its end
            await task
    assert status == 130
    (line,) = sidecar.log_events("sidecar_exit_now")
    assert line["signal"] == "SIGINT" and "Traceback" not in sidecar.stderr()
    assert not sidecar.log_events("sidecar_stopped")
    until(lambda: not any(alive(pid) for pid in below), timeout=10, what="the workers and the fork server gone")
    assert len(sidecar.calls()) <= calls + 1  # the job stopped with the process (a chunk may have been under way)


async def test_retained_run_limit_is_507_until_a_job_is_archived(sidecar_factory):
    sidecar = sidecar_factory.start(args=["--max-retained-runs", "1"])
    async with sidecar.client() as client:
        assert (await client.post("/jobs", json=body("keep-1"), headers={"Idempotency-Key": "k"})).status_code == 200
        full = await client.post("/jobs", json=body("keep-2"), headers={"Idempotency-Key": "k"})
        archived = await client.delete("/jobs/keep-1", headers={"X-AIP-Archive-Confirmation": "keep-1"})
        after = await client.post("/jobs", json=body("keep-2"), headers={"Idempotency-Key": "k"})
        health = (await client.get("/health")).json()
    assert full.status_code == 507 and archived.status_code == 200 and after.status_code == 200
    assert health["retained_runs"] == 1 and health["max_retained_runs"] == 1


async def test_systemd_gets_more_start_time_then_ready_once_the_sidecar_serves(sidecar_factory, tmp_path_factory):
    """Issue 17 item 6: EXTEND_TIMEOUT_USEC while the journal is checked and CrewAI imported, then READY=1."""
    path = str(sidecar_factory.workdir / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.settimeout(90)
        sidecar = sidecar_factory.start(env={"NOTIFY_SOCKET": path})
        before_ready = []
        while (message := listener.recv(1024)) != b"READY=1":
            before_ready.append(message)
        async with sidecar.client() as client:
            assert (await client.get("/health")).status_code == 200
        assert sidecar.kill(signal.SIGTERM) == 0
        stopping = listener.recv(1024)
    # one extension as the journal check starts and one as the CrewAI import starts, at least
    assert len(before_ready) >= 2 and set(before_ready) == {b"EXTEND_TIMEOUT_USEC=30000000"}
    assert stopping == b"STOPPING=1"


async def test_ephemeral_unauthenticated_mode_reports_a_non_durable_journal(sidecar_factory):
    workdir = sidecar_factory.workdir
    env = child_env(workdir / "calls.log")
    args = ["--registry", "aip_crewai.examples.testing:CREWS", "--allow-ephemeral", "--allow-unauthenticated"]
    refused = subprocess.run(
        sidecar_command(*args, "--host", "0.0.0.0"), cwd=workdir, env=env, capture_output=True, timeout=60, check=False
    )
    assert refused.returncode == 2 and refused.stdout == b""
    assert b"only allowed with a loopback --host" in refused.stderr
    with open(workdir / "eph.log", "wb") as log_file:
        process = subprocess.Popen(
            sidecar_command(*args, "--port", "0"),
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        base_url = wait_ready(process, workdir / "eph.log")
        async with httpx2.AsyncClient(base_url=base_url) as client:
            health = (await client.get("/health")).json()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert health["durable_journal"] is False and health["status"] == "ready"


async def test_an_insecure_journal_file_refuses_start_up(sidecar_factory):
    journal = sidecar_factory.workdir / "loose.db"
    journal.write_bytes(b"")
    journal.chmod(0o644)
    process = launch(sidecar_factory.workdir, journal=journal, tag="-loose")
    assert process.wait(timeout=120) == 2
    message = (sidecar_factory.workdir / "stderr-loose.log").read_text()
    assert "--journal (AIP_CREWAI_STATE_FILE)" in message and "must be 0600" in message


async def test_the_reference_sidecar_environment_starts_the_sidecar(sidecar_factory):
    """Issue 20 item 9: the reference's environment, unchanged, starts our sidecar (docs/operating.md "Migrating from the
    reference sidecar"); the inline token is warned about and never logged; an unknown operation is 422."""
    workdir = sidecar_factory.workdir / "reference-env"
    workdir.mkdir(mode=0o700)
    training = workdir / "training" / "artifacts"  # does not exist yet
    env = child_env(
        workdir / "calls.log",
        {
            "AIP_CREWAI_REGISTRY": "aip_crewai.examples.testing:CREWS",
            "AIP_CREWAI_HOST": "127.0.0.1",
            "AIP_CREWAI_BEARER_TOKEN": TOKEN,
            "AIP_CREWAI_STATE_FILE": str(workdir / "runs.db"),
            "AIP_CREWAI_ALLOWED_OPERATIONS": "run,train",
            "AIP_CREWAI_TRAINING_DIR": str(training),
            "AIP_CREWAI_MAX_EVENT_BYTES": "1024",
            "AIP_CREWAI_MAX_STATE_BYTES": "268435456",
            "AIP_CREWAI_ALLOW_UNAUTHENTICATED": "false",
            "AIP_CREWAI_ALLOW_EPHEMERAL": "false",
        },
    )
    stderr_path = workdir / "stderr.log"
    with open(stderr_path, "wb") as log_file:
        process = subprocess.Popen(
            sidecar_command("--port", "0"),
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        base_url = wait_ready(process, stderr_path)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx2.AsyncClient(base_url=base_url, headers=headers) as client:
            health = (await client.get("/health")).json()
            unknown = await client.post(
                "/jobs",
                json={"crew_id": "echo", "action_id": "a1", "operation": "deploy", "input": {}},
                headers={"Idempotency-Key": "k"},
            )
            unauthenticated = await client.get("/health", headers={"Authorization": "Bearer wrong"})
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    assert health["status"] == "ready" and "train" in health["operations"]
    assert unknown.status_code == 422 and unauthenticated.status_code == 401
    assert training.is_dir() and training.stat().st_mode & 0o777 == 0o700
    log = stderr_path.read_text()
    assert '"bearer_token_inline"' in log and "token file" in log
    assert TOKEN not in log


async def test_a_sidecar_serves_the_jobs_imported_from_a_reference_journal(sidecar_factory):
    """Issue 20 item 10: ``aip-crewai journal import`` then start on the new journal; the imported jobs answer
    as they ended (a running one as failed, uncertain), marked ``imported``, and an imported action id never
    runs again nor answers an admission, even one whose request hash the file precomputed (409)."""
    import json

    from aip_crewai.contracts.hashing import request_hash

    workdir = sidecar_factory.workdir / "imported"
    workdir.mkdir(mode=0o700)
    output = {"raw": "old answer", "token_usage": {}, "tasks_output": []}
    # The hash the sidecar computes for the resubmission below: a file naming it must still never answer it.
    same = request_hash(
        crew_id="echo", action_id="ref-done", operation="run", input={}, timeout_ms=None, idempotency_key="k"
    )
    runs = [
        {
            "action_id": "ref-done",
            "crew_id": "echo",
            "operation": "run",
            "input_hash": same,
            "status": "completed",
            "events": [
                {"event": "started", "sequence": 0, "data": {}},
                {"event": "completed", "sequence": 1, "data": output},
            ],
            "output": output,
        },
        {
            "action_id": "ref-running",
            "crew_id": "echo",
            "operation": "run",
            "input_hash": "h2",
            "status": "running",
            "events": [{"event": "started", "sequence": 0, "data": {}}],
            "output": None,
        },
    ]
    source = workdir / "runs.json"
    source.write_text(json.dumps(runs))
    source.chmod(0o600)
    imported = subprocess.run(
        sidecar_command()[:-1] + ["journal", "import", str(source)],
        cwd=workdir,
        env=child_env(workdir / "calls.log"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert imported.returncode == 0, imported.stderr
    sidecar = sidecar_factory.start(journal=workdir / "runs.db")
    async with sidecar.client() as client:
        done = (await client.get("/jobs/ref-done")).json()
        failed = (await client.get("/jobs/ref-running")).json()
        events = (await client.get("/jobs/ref-running/events")).json()
        again = await client.post(
            "/jobs", json={"crew_id": "echo", "action_id": "ref-done", "input": {}}, headers={"Idempotency-Key": "k"}
        )
    assert done["status"] == "completed" and done["output"] == output and done["event_count"] == 2
    assert failed["status"] == "failed" and events["events"][-1]["data"]["uncertain_outcome"] is True
    assert again.status_code == 409 and sidecar.calls() == []
    assert "imported from a reference journal" in again.json()["detail"]
    assert done["imported"] is True and failed["imported"] is True


async def test_sigusr1_drains_admitted_jobs_to_their_end_refuses_new_ones_then_exits_0(sidecar_factory):
    """A rolling upgrade loses no run: after SIGUSR1 (sent to every process of the sidecar, as `systemctl
    kill` does) the running job completes, a repeat of it is still answered, a new job gets 503
    `sidecar.draining` before admission, /health says `draining`, and the process exits 0 once idle."""
    sidecar = sidecar_factory.start()
    async with sidecar.client() as client:
        headers = {"Idempotency-Key": "k"}
        running = asyncio.create_task(client.post("/jobs", json=body("drain-1", "slow"), headers=headers))
        await until_async(lambda: sidecar.calls())
        signal_tree(sidecar.process.pid, signal.SIGUSR1)

        async def draining() -> bool:
            return bool((await client.get("/health")).json()["status"] == "draining")

        await until_async(draining, what="the sidecar says it drains")
        refused = await client.post("/jobs", json=body("drain-2"), headers=headers)
        repeat = await client.get("/jobs/drain-1")
        answer = await running
    assert refused.status_code == 503 and "draining" in refused.json()["detail"]
    assert repeat.status_code == 200
    assert answer.status_code == 200, answer.text
    assert sidecar.process.wait(timeout=60) == 0
    assert sidecar.log_events("sidecar_draining") and sidecar.log_events("sidecar_drained")
    restarted = sidecar_factory.restart(sidecar)
    async with restarted.client() as client:
        assert (await client.get("/jobs/drain-1")).json()["status"] == "completed"
        assert (await client.get("/jobs/drain-2")).status_code == 404  # refused before admission: nothing ran
