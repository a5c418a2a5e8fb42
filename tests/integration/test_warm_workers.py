"""Warm workers (``--worker-jobs`` N above 1; ARCHITECTURE.md §5 "Warm workers"): a real sidecar, the
offline isolation crews, jobs over HTTP.

A worker whose job ended on its own runs its owner's next job (the same tenant, crew and training
directory), at most N in all, with the environment, working directory and standard streams put back;
another tenant's or crew's job never runs in it, and a cancelled job's worker runs nothing more. Once no job
started for ``--idle-shrink-seconds``, warm workers are retired with the idle ones beyond the first.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from kits.poll import until_async
from kits.sidecar import ISOLATION_REGISTRY, Sidecar, SidecarFactory, alive, process_isolation_only

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    process_isolation_only("process isolation tests run in the default (process) pass"),
]

REGISTRY = ISOLATION_REGISTRY
#: ``isolation_crews.STRAY_CHUNK`` (not imported: that would import CrewAI into the test process).
STRAY_CHUNK = "stray chunk of an ended job"
#: ``--worker-jobs`` of the module's sidecar.
JOBS = 3


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Sidecar, Path]]:
    """One sidecar with ``--worker-jobs 3``, ``--max-concurrency 2``, ``--idle-workers 1``."""
    workdir = tmp_path_factory.mktemp("warm-sidecar")
    workdir.chmod(0o700)
    markers = workdir / "markers"
    markers.mkdir()
    factory = SidecarFactory(workdir)
    try:
        sidecar = start_warm(
            factory,
            markers,
            ["--max-concurrency", "2", "--idle-workers", "1", "--cancel-grace-seconds", "5"],
            AIP_CREWAI_TEST_BLOCK_SECONDS="60",
        )
        yield sidecar, markers
    finally:
        factory.close()


def start_warm(factory: SidecarFactory, markers: Path, args: list[str], **env: str) -> Sidecar:
    """A process-isolation sidecar on the isolation crews with ``--worker-jobs`` :data:`JOBS` and ``args``, its
    probe markers in ``markers``."""
    return factory.start(
        args=["--registry", REGISTRY, "--isolation", "process", "--worker-jobs", str(JOBS), *args],
        env={"AIP_CREWAI_TEST_MARKER_DIR": str(markers), **env},
    )


async def probe(
    client: httpx2.AsyncClient, markers: Path, job: str, crew: str = "probe", **input: str
) -> dict[str, Any]:
    """Run ``job`` (``tenant:name``) on ``crew`` with ``input`` and return what its probe tool found in its
    process."""
    body = {"crew_id": crew, "action_id": job, "operation": "run", "input": input}
    answer = await client.post("/jobs", json=body, headers={"Idempotency-Key": f"key-{job}"}, timeout=120)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = json.loads((markers / f"{quote(job, safe='')}.probe").read_text())
    return found


async def test_an_owners_jobs_share_a_warm_worker_up_to_worker_jobs_with_its_process_state_put_back(warm):
    """Three jobs of tenant t1 on ``probe`` run in one worker: the second and third find the environment
    variable, ``os.environ`` (rebound), working directory, ``sys.stdout`` and ``sys.stdin`` the first changed
    put back, and see (the documented
    trade) the module state the earlier ones left; the fourth runs in a new worker (N = 3 reached)."""
    sidecar, markers = warm
    async with sidecar.client() as client:
        reports = [await probe(client, markers, f"t1:same-{n}") for n in range(JOBS + 1)]
    pids = [r["pid"] for r in reports]
    assert pids[0] == pids[1] == pids[2] != pids[3]
    for report in reports:
        assert (report["env"], report["cwd"], report["stdout"]) == (None, str(sidecar.state_dir), "PrintedErrorLog")
        assert (report["environ"], report["stdin"]) == ("_Environ", reports[0]["stdin"]) != ("dict", "StringIO")
    jobs_seen = [[s for s in r["seen"] if not s.startswith("event-after:")] for r in reports]
    assert jobs_seen == [[], ["t1:same-0"], ["t1:same-0", "t1:same-1"], []]
    # the umask, SIGINT (ignored: a stop is the sidecar's), SIGPIPE, the process group, the blocked signals, a
    # pending alarm, the recursion and open-files limits and the time zone each job changed, put back too
    states = [json.loads((markers / f"{quote(f't1:same-{n}', safe='')}.process").read_text()) for n in range(JOBS)]
    assert states[0]["sigint"] == states[0]["sigpipe"] == "SIG_IGN" and states[0]["own_group"] is True
    assert (states[0]["blocked"], states[0]["alarm"], states[0]["recursion"]) == ([], False, 1000)
    assert states[0]["zone"] != "JST" and states[0]["open_files"] > 511
    assert states == [states[0]] * JOBS
    async with sidecar.client() as client:
        metrics = (await client.get("/metrics")).text
    reused = re.search(r"^aip_crewai_sidecar_worker_jobs_reused_total (\d+)$", metrics, re.MULTILINE)
    assert reused is not None and int(reused.group(1)) >= 2, metrics  # the second and third jobs ran warm
    assert re.search(r"^aip_crewai_sidecar_workers_warm \d+$", metrics, re.MULTILINE), metrics


async def test_a_job_that_left_its_process_beyond_repair_retires_the_worker(warm):
    """A job that blocked SIGUSR2 and left it pending: unblocking it would end the worker, so the job
    completes and its worker runs nothing more (the owner's next job runs in another process, and completes:
    before, the next job ran in it and the worker died of the signal)."""
    sidecar, markers = warm
    async with sidecar.client() as client:
        left = await probe(client, markers, "t5:pending-0", topic="pending")
        after = await probe(client, markers, "t5:pending-1")
    assert left["pid"] != after["pid"]
    assert sidecar.log_events("warm_worker_state_not_restored")


async def pid_of(client: httpx2.AsyncClient, markers: Path, job: str, crew: str, **input: str) -> tuple[int, int]:
    """Run ``job`` on ``crew`` (one that writes ``<job>.pid``: ``reach``, ``flaky_build``, ``hog``) with the
    topic ``a`` and ``input``; its answer's status and the pid its crew wrote."""
    body = {"crew_id": crew, "action_id": job, "operation": "run", "input": {"topic": "a", **input}}
    answer = await client.post("/jobs", json=body, headers={"Idempotency-Key": f"key-{job}"}, timeout=120)
    return answer.status_code, int((markers / f"{quote(job, safe='')}.pid").read_text())


async def test_a_chunk_a_jobs_thread_emits_after_the_job_ended_is_in_no_later_jobs_events(warm):
    """A thread the first job left behind (in that job's context) emits a model chunk while the owner's next
    job runs in the same warm worker: the chunk is dropped, not published as the next job's (before, the
    next job's events held it)."""
    sidecar, markers = warm
    async with sidecar.client() as client:
        left, left_pid = await pid_of(client, markers, "t7:stray-leave", "lingering")
        waited, waited_pid = await pid_of(client, markers, "t7:stray-wait", "lingering")
        events = await client.get(f"/jobs/{quote('t7:stray-wait', safe='')}/events")
    assert (left, waited) == (200, 200)
    assert left_pid == waited_pid, "the owner's second job ran in its warm worker"
    assert (markers / "stray-sent").exists(), "the first job's thread emitted its chunk while the second ran"
    contents = [event["data"]["content"] for event in events.json()["events"] if event["event"] == "chunk"]
    assert contents and STRAY_CHUNK not in contents, contents


async def test_another_tenants_or_crews_job_never_runs_in_a_warm_worker(warm):
    """t2's job after t1's, and t1's job on another crew, each run in a worker that never ran anything of
    t1's ``probe``; with two slots both held, a job of a third owner retires the oldest warm worker."""
    sidecar, markers = warm
    async with sidecar.client() as client:
        first = await probe(client, markers, "t1:owner-a")
        other_tenant = await probe(client, markers, "t2:owner-b")
        other_crew = await probe(client, markers, "t1:owner-c", crew="probe_other")
        again = await probe(client, markers, "t2:owner-d")
    assert other_tenant["pid"] != first["pid"] and other_tenant["seen"] == []
    assert other_crew["pid"] not in {first["pid"], other_tenant["pid"]} and other_crew["seen"] == []
    assert all("t1:" not in seen for seen in again["seen"])  # t2's warm worker (unless retired) or a fresh one
    retired = sidecar.log_events("warm_worker_retired")
    assert retired, "two slots, three owners: a warm worker made room"


async def test_a_hard_cancel_also_kills_the_processes_its_job_started(warm):
    """A cancelled job's worker is killed with its process group: a child process the job started (still in
    the group) dies with it, so its later side effects never happen (docs/security.md "Hard cancel"); before,
    it was reparented and ran on."""
    sidecar, markers = warm
    job = "t6:spawned"
    async with sidecar.client() as client:
        body = {"crew_id": "spawner", "action_id": job, "operation": "run", "input": {"topic": "a b"}}
        run = asyncio.ensure_future(client.post("/jobs", json=body, headers={"Idempotency-Key": "key-sp"}, timeout=120))
        started, child = (markers / f"{quote(job, safe='')}.{suffix}" for suffix in ("started", "child"))
        await until_async(lambda: started.exists() and started.read_text(), timeout=60, what="the tool started")
        pid = int(child.read_text())
        assert alive(pid)
        cancel = await client.post(f"/jobs/{job}/cancel", json={"crew_id": "spawner", "action_id": job})
        assert cancel.status_code == 200
        await run
    await until_async(lambda: not alive(pid), timeout=30, what="the job's child process gone with its worker")


async def test_a_cancelled_jobs_worker_runs_nothing_more(warm):
    """A job cancelled while its tool blocks: its worker is not kept warm; the owner's next job runs in
    another process."""
    sidecar, markers = warm
    job = "t3:blocked"
    async with sidecar.client() as client:
        body = {"crew_id": "blocking_tool", "action_id": job, "operation": "run", "input": {"topic": "a b"}}
        run = asyncio.ensure_future(
            client.post("/jobs", json=body, headers={"Idempotency-Key": "key-blocked"}, timeout=120)
        )
        started = markers / f"{quote(job, safe='')}.started"
        await until_async(lambda: started.exists() and started.read_text(), timeout=60, what="the tool started")
        cancel = await client.post(f"/jobs/{job}/cancel", json={"crew_id": "blocking_tool", "action_id": job})
        assert cancel.status_code == 200
        await run
        (markers / "no-block").touch()
        try:
            body = {**body, "action_id": "t3:after"}
            after = await client.post("/jobs", json=body, headers={"Idempotency-Key": "key-after"}, timeout=120)
        finally:
            (markers / "no-block").unlink()
    assert after.status_code == 200, after.text
    assert (markers / f"{quote('t3:after', safe='')}.started").read_text() != started.read_text()


async def test_a_job_that_failed_in_its_crews_code_leaves_no_warm_worker(warm, tmp_path: Path):
    """``reach`` fails in its ``before_kickoff`` callback when its input names a missing file: each such job
    of t4 runs in a worker of its own (the crew broke off half-way; its process is not trusted with another
    job), while two of t4's jobs that complete share one."""
    sidecar, markers = warm
    missing = str(tmp_path / "missing")

    async with sidecar.client() as client:
        failed = [await pid_of(client, markers, f"t4:fails-{n}", "reach", path=missing) for n in range(2)]
        completed = [await pid_of(client, markers, f"t4:completes-{n}", "reach") for n in range(2)]
    assert [status for status, _ in failed] == [502, 502]
    assert failed[0][1] != failed[1][1]
    assert [status for status, _ in completed] == [200, 200]
    assert completed[0][1] == completed[1][1] not in {failed[0][1], failed[1][1]}


async def test_a_job_whose_crew_factory_failed_leaves_no_warm_worker(warm):
    """``flaky_build``'s factory raises while ``fail-build`` exists: the job fails ``CrewBuildFailed`` (before any
    effect of the run, but after the crew's own factory code ran), and the owner's next job runs in another
    worker."""
    sidecar, markers = warm

    async with sidecar.client() as client:
        built = await pid_of(client, markers, "t6:builds-0", "flaky_build")
        (markers / "fail-build").touch()
        try:
            failed = await pid_of(client, markers, "t6:builds-1", "flaky_build")
        finally:
            (markers / "fail-build").unlink()
        after = await pid_of(client, markers, "t6:builds-2", "flaky_build")
        view = (await client.get("/jobs/t6:builds-1")).json()
    assert (built[0], failed[0], after[0]) == (200, 502, 200)
    assert view["error"]["error_type"] == "CrewBuildFailed", view
    assert built[1] == failed[1] != after[1]


async def test_a_warm_worker_that_grew_past_the_bound_runs_no_more_jobs(warm):
    """``hog`` keeps 72 MiB more per job: its worker's growth is measured from its first job's end, so the
    second job still runs warm, but its 72 MiB exceed the 64 MiB bound (``warm_worker_outgrown``) and the third
    job runs in a fresh worker, before ``--worker-jobs`` (3) was reached."""
    sidecar, markers = warm

    async with sidecar.client() as client:
        runs = [await pid_of(client, markers, f"t5:hog-{n}", "hog") for n in range(3)]
    assert [status for status, _ in runs] == [200, 200, 200]
    pids = [pid for _, pid in runs]
    assert pids[0] == pids[1] != pids[2]
    (outgrown,) = [e for e in sidecar.log_events("warm_worker_outgrown") if e["pid"] == pids[0]]
    assert outgrown["jobs"] == 2 and outgrown["grown_bytes"] > 64 * 1024 * 1024


def job_workers(sidecar: Sidecar) -> list[int]:
    """The live job workers of ``sidecar``: the children of its worker fork server (``/proc``)."""

    def children(pid: int) -> list[int]:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    (server,) = [
        pid for pid in children(sidecar.process.pid) if "forkserver" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    return children(server)


async def test_a_quiet_sidecar_keeps_one_idle_worker_and_retires_its_warm_ones(tmp_path: Path):
    """``--idle-shrink-seconds``: once no job started or ended for that long, a sidecar keeping two idle workers and a warm
    one is down to one idle worker (the log says how many ended); the warm worker's owner then gets a fresh
    worker, and the job completes."""
    markers = tmp_path / "markers"
    markers.mkdir()
    factory = SidecarFactory(tmp_path)
    try:
        sidecar = start_warm(
            factory, markers, ["--max-concurrency", "3", "--idle-workers", "2", "--idle-shrink-seconds", "0.5"]
        )
        async with sidecar.client() as client:
            first = await probe(client, markers, "t1:before-quiet")
            await until_async(
                lambda: (workers := job_workers(sidecar)) and len(workers) == 1 and first["pid"] not in workers,
                what="one fresh job worker left",
            )
            assert sidecar.log_events("idle_workers_shrunk")
            after = await probe(client, markers, "t1:after-quiet")
        assert after["pid"] != first["pid"] and after["seen"] == []
    finally:
        factory.close()
