"""Process isolation through the real sidecar (``--isolation process``; docs/security.md "Process isolation").

One sidecar serves the module (:func:`isolated`): it is started with ``--isolation process`` explicitly (a flag
wins over ``AIP_CREWAI_ISOLATION``), so these run whichever mode the suite runs in, and with the union of what
the tests need (the operations, a training directory, debug logs); every test has job ids of its own and reads
the log events, markers and workers of its own jobs. The crews are ``aip_crewai.examples.isolation_crews``;
their tools leave marker files (``<job>.started`` holds the pid of the process running the tool) in the
module's marker directory. Only the refused start-up launches a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from kits.poll import until_async
from kits.sidecar import ISOLATION_REGISTRY, Sidecar, SidecarFactory, process_isolation_only

from aip_crewai.sidecar.options import DEFAULT_PRELOAD_MODULES

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    # these pin --isolation process themselves: the default pass of the suite has run them already
    process_isolation_only("process isolation tests run in the default (process) pass"),
]

REGISTRY = ISOLATION_REGISTRY
#: aip_crewai.examples.isolation_crews.PROBE_SECRET (not imported: that would import CrewAI into the test process).
PROBE_SECRET = "sk-live-PROBE-STDERR-4242"
#: Seconds a ``block_then_write`` tool blocks: long enough for a cancel to find every job still blocked on a
#: loaded machine, and for 40 ``/health`` probes while four jobs block; the sigkill test's bystander waits it out.
BLOCK_SECONDS = 15.0
#: Seconds each memory drain of ``memory_stall`` takes.
DRAIN_SECONDS = 3.0
#: ``--idle-workers`` of the module's sidecar, one under its ``--max-concurrency`` (4): the four jobs at once of
#: the /health test boot one worker on demand.
IDLE_WORKERS = 3
#: What the fork server imports besides CrewAI and our operations, so that no worker imports it on a job's time.
PRELOADED = [*DEFAULT_PRELOAD_MODULES, "aip_crewai.examples.offline_llm"]


#: The module's sidecar runs from this script, as the ``aip-crewai`` console script runs it (a script as
#: ``__main__``); each run of the script's body appends ``<__name__> <pid> <1 if aip_crewai.cli was imported
#: already> <1 if every module of PRELOADED was>`` to the file named in its environment. multiprocessing runs a child's main module again before its
#: target (Python < 3.13 even when the fork server preloaded ``__main__``: CPython gh-126631).
MAIN_SCRIPT = """\
import os, sys
with open(os.environ["AIP_CREWAI_TEST_MAIN_RUNS"], "a") as runs:
    preloaded = all(name in sys.modules for name in os.environ["AIP_CREWAI_TEST_PRELOADED"].split(","))
    runs.write(f"{__name__} {os.getpid()} {int('aip_crewai.cli' in sys.modules)} {int(preloaded)}\\n")
from aip_crewai.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""


@dataclass
class Isolated:
    """The module's sidecar, its marker directory, its training directory, and the runs of its main script."""

    sidecar: Sidecar
    markers: Path
    training: Path
    main_runs: Path


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Isolated]:
    """One ``--isolation process`` sidecar for every test of the module: the operations and the training
    directory of the cancel test, debug logs (``worker_ready``) for the process-state test, one idle worker
    fewer than its concurrency."""
    workdir = tmp_path_factory.mktemp("isolation-sidecar")
    workdir.chmod(0o700)
    markers, training = workdir / "markers", workdir / "training"
    markers.mkdir()
    training.mkdir(mode=0o700)
    main, main_runs = workdir / "sidecar_main.py", workdir / "main-runs"
    main.write_text(MAIN_SCRIPT)
    factory = SidecarFactory(workdir)
    try:
        sidecar = factory.start(
            args=[
                "--registry",
                REGISTRY,
                "--allowed-operations",
                "run,batch_run,replay,train,test",
                "--isolation",
                "process",
                "--cancel-grace-seconds",
                "0.5",
                "--training-dir",
                str(training),
                "--log-level",
                "debug",
                "--idle-workers",
                str(IDLE_WORKERS),
            ],
            env={
                "AIP_CREWAI_TEST_MARKER_DIR": str(markers),
                "AIP_CREWAI_TEST_BLOCK_SECONDS": str(BLOCK_SECONDS),
                "AIP_CREWAI_TEST_DRAIN_SECONDS": str(DRAIN_SECONDS),
                "AIP_CREWAI_TEST_MAIN_RUNS": str(main_runs),
                "AIP_CREWAI_TEST_PRELOADED": ",".join(PRELOADED),
            },
            main=main,
        )
        yield Isolated(sidecar, markers, training, main_runs)
    finally:
        factory.close()


def marker(markers: Path, job: str, suffix: str) -> Path:
    """``aip_crewai.examples.isolation_crews.marker`` in the marker directory ``markers`` (not imported: that
    would import CrewAI into the test process)."""
    return markers / f"{quote(job, safe='')}.{suffix}"


async def submit(
    client: httpx2.AsyncClient, action_id: str, crew: str, operation: str = "run", input: Any = None
) -> httpx2.Response:
    body = {"crew_id": crew, "action_id": action_id, "operation": operation, "input": input or {}}
    return await client.post("/jobs", json=body, headers={"Idempotency-Key": f"key-{action_id}"}, timeout=120)


async def wait_for(predicate: Any, what: str, deadline_s: float = 60.0) -> Any:
    return await until_async(predicate, timeout=deadline_s, what=what)


def started_pid(markers: Path, job: str) -> int | None:
    path = marker(markers, job, "started")
    return int(path.read_text()) if path.exists() and path.read_text() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def view(client: httpx2.AsyncClient, job: str) -> dict[str, Any]:
    response = await client.get(f"/jobs/{job}")
    assert response.status_code == 200
    data: dict[str, Any] = response.json()
    return data


async def test_cancel_of_a_job_blocked_in_a_tool_kills_its_worker_before_the_side_effect(isolated: Isolated) -> None:
    """run, batch_run, replay, train and test: a cancel while the tool blocks stops the worker (killed after
    the grace where the flag cannot stop it); the tool's file is never written, the stop is confirmed, and the
    request-to-dead-worker time is under 1.5 s."""
    sidecar, markers, training = isolated.sidecar, isolated.markers, isolated.training
    jobs = {"t1:to-replay"}
    async with sidecar.client() as client:
        (markers / "no-block").touch()  # a run that completes, to replay from
        try:
            done = await submit(client, "t1:to-replay", "blocking_trainable")
        finally:
            (markers / "no-block").unlink()
        assert done.status_code == 200
        task_id = done.json()["tasks_output"][0]["task_id"]
        for operation, input in (
            ("run", {}),
            ("batch_run", {"inputs": [{"topic": "a"}]}),
            ("replay", {"task_id": task_id, "inputs": {"topic": "again"}}),
            ("train", {"n_iterations": 1, "artifact_name": "a.pkl"}),
            ("test", {"n_iterations": 1, "eval_llm": "offline-blocking"}),
        ):
            job = f"t1:cancel-{operation}"
            jobs.add(job)
            blocked = asyncio.create_task(submit(client, job, "blocking_trainable", operation, input))
            pid = await wait_for(lambda job=job: started_pid(markers, job), f"{operation}'s tool to start")
            asked = time.monotonic()
            cancel = await client.post(f"/jobs/{job}/cancel", json={"crew_id": "blocking_trainable", "action_id": job})
            assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
            await wait_for(lambda pid=pid: not alive(pid), "the worker to die", deadline_s=10)
            assert time.monotonic() - asked < 1.5
            answer = await blocked
            assert answer.status_code == 409

            async def stop_observed(job: str = job) -> dict[str, Any] | None:
                record = await view(client, job)
                return record if record.get("provider_stop_observed") is True else None

            record = await until_async(stop_observed, timeout=10, what="the provider's stop observed")
            assert record["status"] == "cancelled"
            assert record["provider_stop_observed"] is True and record["uncertain_outcome"] is False
            assert not marker(markers, job, "after").exists()  # and never will: its process is gone
    # this test's jobs only (the sidecar serves the module): the completed run stopped no worker
    stops = {e["action_id"]: e["how"] for e in sidecar.log_events("job_worker_stopped") if e["action_id"] in jobs}
    # run/batch_run end on their cancelled task (the worker then exits, its tool thread with it);
    # replay/train/test run CrewAI in a thread whose blocked tool ignores the flag: killed after the grace.
    assert stops == {
        "t1:cancel-run": "stopped",
        "t1:cancel-batch_run": "stopped",
        "t1:cancel-replay": "killed",
        "t1:cancel-train": "killed",
        "t1:cancel-test": "killed",
    }
    assert not list(training.rglob("a.pkl"))


async def test_health_stays_fast_while_four_jobs_block(isolated: Isolated) -> None:
    """Four jobs blocked in a synchronous call (:data:`BLOCK_SECONDS`) leave ``/health`` answering: each of
    40 probes within 2 s, a bound that a loop blocked by a job could not meet and a slow, loaded machine does
    not miss (the speed itself is measured by ``bench/isolation.py``). The four are the sidecar's only runs:
    every other test of the module waits for its jobs to end."""
    sidecar, markers = isolated.sidecar, isolated.markers
    async with sidecar.client() as client:
        jobs = [f"t1:block-{i}" for i in range(4)]
        running = [asyncio.create_task(submit(client, job, "blocking_tool")) for job in jobs]
        await wait_for(lambda: all(started_pid(markers, job) for job in jobs), "all four tools to block")
        worst = 0.0
        for _ in range(40):
            before = time.monotonic()
            health = await client.get("/health")
            worst = max(worst, time.monotonic() - before)
            assert health.status_code == 200 and health.json()["active_runs"] == 4
        assert worst < 2.0, f"/health took {worst * 1000:.0f} ms while jobs blocked"
        for job in jobs:
            await client.post(f"/jobs/{job}/cancel", json={"crew_id": "blocking_tool", "action_id": job})
        await asyncio.gather(*running)


async def test_a_sigkilled_worker_fails_only_its_own_job(isolated: Isolated) -> None:
    """SIGKILL to one job's worker: that job fails ``WorkerDied`` (signal SIGKILL, uncertain), the job
    beside it completes, and later jobs run in replacement workers; ``os._exit`` in a tool likewise."""
    sidecar, markers = isolated.sidecar, isolated.markers
    async with sidecar.client() as client:
        victim = asyncio.create_task(submit(client, "t1:victim", "blocking_tool"))
        bystander = asyncio.create_task(submit(client, "t1:bystander", "blocking_tool"))
        pid = await wait_for(lambda: started_pid(markers, "t1:victim"), "the victim's tool")
        await wait_for(lambda: started_pid(markers, "t1:bystander"), "the bystander's tool")
        os.kill(pid, signal.SIGKILL)
        failed = await victim
        assert failed.status_code == 502
        detail = failed.json()
        assert detail["error_type"] == "WorkerDied" and detail["uncertain_outcome"] is True
        assert "signal SIGKILL" in detail["message"]
        assert (await bystander).status_code == 200
        exited = await submit(client, "t1:exits", "exits")
        assert exited.status_code == 502
        assert exited.json()["error_type"] == "WorkerDied" and "exit status 7" in exited.json()["message"]
        after = await submit(client, "t1:after", "echo")
        assert after.status_code == 200 and after.json()["raw"]
        health = (await client.get("/health")).json()
        assert health["status"] == "ready" and health["active_runs"] == 0
    assert sidecar.process.poll() is None


async def test_the_memory_save_stall_no_longer_blocks_the_sidecar(isolated: Isolated) -> None:
    """A crew whose akickoff waits synchronously on memory saves (crewAI PR#6497) no longer stalls
    ``/health``: every probe while it runs answers within half the stall (3 s), which a loop blocked by the
    stall could not do (the speed itself is measured by ``bench/isolation.py``)."""
    sidecar = isolated.sidecar

    def started() -> bool:
        return any(e["action_id"] == "t1:memory" for e in sidecar.log_events("job_started"))

    async with sidecar.client() as client:
        job = asyncio.create_task(submit(client, "t1:memory", "memory_stall"))
        await wait_for(started, "the job to start")
        worst, probes = 0.0, 0
        while not job.done():
            before = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - before)
            probes += 1
            await asyncio.sleep(0.02)
        assert (await job).status_code == 200
        assert probes > 10 and worst < 1.5, f"/health took {worst * 1000:.0f} ms during memory saves"


async def test_a_job_never_sees_the_process_state_another_tenants_job_left(isolated: Isolated) -> None:
    """At the default ``--worker-jobs`` (warm workers, one owner each): environment, working directory, stdout,
    event-bus handlers and module state a job changes are gone for the next tenant's job, CrewAI's shared
    replay table is never written (by these jobs or any job the
    module's sidecar ran before), and two concurrent jobs run in two processes (each booted from a fork
    server that had imported CrewAI: no job pays the import)."""
    sidecar, markers = isolated.sidecar, isolated.markers
    clean: dict[str, Any] = {
        "env": None,
        "cwd": str(sidecar.state_dir),
        "stdout": "PrintedErrorLog",
        "stderr": "PrintedErrorLog",
        "bus_handlers": 0,
        "seen": [],
        "replay_rows": 0,
    }
    async with sidecar.client() as client:
        reports = []
        for job in ("t1:probe-1", "t2:probe-2"):
            assert (await submit(client, job, "probe")).status_code == 200
            reports.append(json.loads(marker(markers, job, "probe").read_text()))
        both = await asyncio.gather(submit(client, "t3:probe-3", "probe"), submit(client, "t4:probe-4", "probe"))
        assert [r.status_code for r in both] == [200, 200]
        for job in ("t3:probe-3", "t4:probe-4"):
            reports.append(json.loads(marker(markers, job, "probe").read_text()))
    for report in reports:
        assert {k: report[k] for k in clean} == clean
    # What the probe wrote to sys.stderr and warned with quotes a key: a labelled event at most, never the text.
    assert PROBE_SECRET not in sidecar.stderr()
    warned = sidecar.log_events("python_warning")
    assert any(e["category"] == "UserWarning" and e["at"].startswith("isolation_crews.py:") for e in warned), warned
    pids = {r["pid"] for r in reports}
    assert len(pids) == 4
    assert sidecar.process.pid not in pids
    booted = sidecar.log_events("worker_ready")
    assert all(e["crewai_preloaded"] for e in booted)
    # the four workers that ran the probes (booted for them or ahead of them) did not pay the import: each
    # found CrewAI already imported (a boot's time is no proof: a loaded machine took 3.4 s for one once)
    probed = [e for e in booted if e["pid"] in pids]
    assert len(probed) == 4 and all(e["crewai_preloaded"] for e in probed), probed


async def test_the_sidecar_process_never_imports_crewai_and_still_checks_the_registry(
    isolated: Isolated, tmp_path: Path
) -> None:
    """With process isolation CrewAI is imported once per sidecar, in the worker fork server: the sidecar
    process itself maps none of CrewAI's compiled dependencies (pydantic's core), nor cryptography's (a sidecar
    reads only its token file: about 8 MiB of resident memory it never uses), yet it knows the crews and
    the preflight's facts (from the registry check forked from the fork server), and a registry attribute
    that does not exist is still refused at start with exit 2 and one line naming ``--registry``."""
    sidecar = isolated.sidecar
    maps = Path(f"/proc/{sidecar.process.pid}/maps").read_text()
    assert "pydantic_core" not in maps and "crewai" not in maps and "/cryptography/" not in maps
    async with sidecar.client() as client:
        health = (await client.get("/health")).json()
    assert "blocking_tool" in health["crews"] and "crew_problems" in health
    ready = sidecar.log_events("crewai_ready")
    assert ready and ready[0]["isolation"] == "process" and ready[0]["crews"] == len(health["crews"])

    from kits.sidecar import launch

    workdir = tmp_path / "refused"
    workdir.mkdir(mode=0o700)
    process = launch(
        workdir,
        args=["--registry", "aip_crewai.examples.isolation_crews:NO_SUCH_CREWS", "--isolation", "process"],
        tag="-refused",
    )
    assert process.wait(timeout=120) == 2
    lines = [line for line in (workdir / "stderr-refused.log").read_text().splitlines() if "--registry" in line]
    assert len(lines) == 1 and "NO_SUCH_CREWS" in lines[0] and "Traceback" not in lines[0]


async def test_a_worker_finds_the_command_line_and_the_provider_clients_imported_by_its_fork_server(
    isolated: Isolated,
) -> None:
    """A job's worker (and the start-up registry check) re-runs the sidecar's main script before its target,
    but finds the command line it imports already imported by the fork server: a worker used to import it
    itself, about 10 ms of CPU per job. So are the OpenAI client's resources and transport and the offline
    model (``fork_server.PRELOAD``), which a fresh worker used to import on each job's time (about 390 ms of
    CPU for a crew on an OpenAI-compatible model) or boot; the sidecar process itself imports none of them."""
    async with isolated.sidecar.client() as client:
        for job in ("t1:main-1", "t1:main-2"):
            assert (await submit(client, job, "probe")).status_code == 200
    runs = [line.split() for line in isolated.main_runs.read_text().splitlines()]
    sidecar = isolated.sidecar.process.pid
    assert ["__main__", str(sidecar), "0", "0"] in runs
    servers = [pid for pid in children(sidecar) if "forkserver" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(servers) == 1
    forked = [run[2:] for run in runs if run[0] == "__mp_main__" and int(run[1]) != servers[0]]
    assert len(forked) >= 3 and all(loaded == ["1", "1"] for loaded in forked), runs


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (``/proc/*/stat``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


async def test_the_sidecar_boots_its_idle_workers_and_a_job_beyond_them_boots_its_own(isolated: Isolated) -> None:
    """``--idle-workers 3`` of ``--max-concurrency 4``: three workers boot at start; four jobs sent at once all
    complete, each in a worker of its own (at least one booted for it)."""
    sidecar = isolated.sidecar
    (ready,) = sidecar.log_events("workers_ready")
    assert (ready["workers"], ready["max_workers"]) == (IDLE_WORKERS, 4)
    jobs = [f"t1:idle-{n}" for n in range(4)]
    async with sidecar.client() as client:
        answers = await asyncio.gather(*(submit(client, job, "probe") for job in jobs))
    assert [a.status_code for a in answers] == [200] * 4
    pids = {json.loads(marker(isolated.markers, job, "probe").read_text())["pid"] for job in jobs}
    assert len(pids) == 4


async def test_a_job_runs_at_the_worker_nice_above_its_sidecar(isolated: Isolated) -> None:
    """``--worker-nice`` (default 10): a job's code runs 10 steps nicer than its sidecar, whose own priority is
    untouched, so under CPU contention the sidecar's loop (and a host beside it) runs first."""
    sidecar = isolated.sidecar.process.pid
    async with isolated.sidecar.client() as client:
        assert (await submit(client, "t1:nice", "probe")).status_code == 200
    probed = json.loads(marker(isolated.markers, "t1:nice", "probe").read_text())
    assert os.getpriority(os.PRIO_PROCESS, sidecar) == os.getpriority(os.PRIO_PROCESS, 0)
    assert probed["nice"] == min(19, os.getpriority(os.PRIO_PROCESS, sidecar) + 10)
