"""Footprint: the CPU one job costs the sidecar's whole process tree, and the memory an idle sidecar holds,
each against one plain process that runs the same crew in-process.

- **CPU per ``fast`` job**: blocking ``POST /jobs`` runs of the ``fast`` crew on a sidecar with
  ``--isolation process``. Per batch of :data:`JOBS` runs: (tree CPU after − tree CPU before) / JOBS, where
  tree CPU is the user + system time (``/proc/<pid>/stat``) of the sidecar and every descendant (the worker
  fork server, its job workers, multiprocessing's resource tracker) plus the CPU of the children each of them
  reaped (``cutime`` + ``cstime``: a finished worker's time lands in the fork server's). Both readings are
  taken once the sidecar is idle again: every worker of the pool alive and the tree's CPU still for
  :data:`QUIET_S`, so the boot of the replacement worker (fork, registry import, warm-up kickoff) is charged
  to the job that used its predecessor. Baseline: a separate process (``python -m bench.footprint
  reference``) that runs the same batches of the same crew with ``akickoff`` in-process
  (:func:`bench.run_overhead.in_process_kickoff`), read the same way (a process of its own: this one never
  imports CrewAI, so it shares no pages with either side). One batch per side per round, the order switched
  every round; p50 and p99 are over the batches. Target: ≤ 1.3× at p50. The sidecar runs the default
  ``--worker-jobs`` (warm workers: a worker runs job after job of the tenant's crew). A third side, a sidecar
  with a fresh worker per job (:data:`bench.common.FRESH_WORKERS`), runs the same batches in the same
  rounds.
- **memory**: the proportional set size (PSS, ``/proc/<pid>/smaps_rollup``: shared pages split between the
  processes mapping them) summed over the idle sidecar tree after the runs, vs the PSS of one process that
  has imported CrewAI and the bench registry (``bench.crews``, the registry the bench sidecar loads) and
  waits, read before the sidecar starts (the tree is read after that process stopped), so neither shares
  pages with the other. Target: ≤ 1.5×, read at the defaults once the sidecar was quiet for
  ``--idle-shrink-seconds`` (30 s: the pool then keeps one idle worker), and also right after the runs, with
  ``--max-concurrency`` workers alive (the warm one and the spares booted ahead of need): each idle worker's private memory (USS) is what one
  more or one fewer costs.

- **a real crew's job and ``--preload-modules``**: the memory rows' sidecars run ``--preload-modules none``
  (:data:`NO_PRELOAD`: the bench crews use no OpenAI-compatible model), the others the default. Two more
  sidecars serve
  the example deployment's ``plain`` crew (``examples/realcrews``: one agent on an OpenAI-compatible model,
  CrewAI's native provider) against the real-crew suite's fake provider on loopback, one at the default
  ``--preload-modules`` and one at ``none``, one idle worker each: CPU per job (tree, read as above, per job)
  and ``POST /jobs`` latency, interleaved. And the idle tree PSS of the ``--idle-workers`` :data:`LEAN_IDLE`
  sidecar at the default, read with no other sidecar up: what the preloaded modules cost a registry that
  does not use them.

Source: the performance targets' row "CPU and memory per job"; ARCHITECTURE.md §5 (isolation);
docs/operating.md "Preloaded modules".
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2

from aip_crewai.sidecar.options import DEFAULT_PRELOAD_MODULES, OPTIONS
from bench.common import (
    FRESH,
    FRESH_WORKERS,
    QUIET_S,
    REGISTRY,
    ROOT,
    SIDECAR_TOKEN,
    BenchError,
    Process,
    Row,
    Section,
    Stack,
    Stats,
    async_client,
    cpu_seconds,
    interleave,
    latency_row,
    pool_full,
    process_tree,
    settle,
    sidecar_workers,
    smaps_rollup,
    tree_cpu_seconds,
    tree_pss_kib,
    uss_kib,
)
from bench.run_overhead import INPUT, in_process_kickoff

#: Runs per batch, measured batches per side, and unmeasured warm-up batches before them.
JOBS = 10
BATCHES = 4
WARMUP_BATCHES = 1
#: ``--max-concurrency`` of the measured sidecar: its default, the workers booted ahead of need.
POOL = 4
#: ``--idle-workers`` of the lean sidecar (the memory row at fewer idle workers), and the rounds of the
#: latency row comparing a job that boots its worker with one that finds it idle.
LEAN_IDLE = 1
ON_DEMAND_ROUNDS = 15
ON_DEMAND_WARMUP = 1
#: ``--worker-jobs`` of the third sidecar (the CPU row with a fresh worker per job: each job pays a boot).
#: The rows of what a fresh worker costs (the idle-workers trade, the preloaded modules): every job in a fresh worker.
#: The memory rows' ``--preload-modules``: the bench crews use no OpenAI-compatible model (docs/operating.md
#: "Preloaded modules"); the other rows run the default.
NO_PRELOAD = ("--preload-modules", "none")
#: The real crew of the preload rows (``examples/realcrews``), its rounds (one job per sidecar each) and warm-up.
REAL_CREW = "plain"
REAL_ROUNDS = 9
REAL_WARMUP = 1
MAX_CPU_RATIO = 1.3
#: ``--idle-shrink-seconds`` at its default, and how long the quiet sidecar may take to shrink (its last job may
#: have been a batch ago) and settle.
SHRINK_S = float(next(o.default for o in OPTIONS if o.dest == "idle_shrink_seconds"))
SHRINK_WAIT_S = SHRINK_S + 30.0
MAX_PSS_RATIO = 1.5
START_S = 120.0
#: The reference process's stderr lines: ready (CrewAI and the registry imported), and each batch done.
READY = "footprint_reference_ready"
BATCH_DONE = "footprint_reference_batch"


def _by_role(sidecar: int) -> dict[str, float]:
    """CPU seconds of the sidecar's tree by role: the sidecar, the fork server itself, the job workers (the
    finished ones it reaped and the live ones), the other processes (multiprocessing's resource tracker)."""
    server, workers = sidecar_workers(sidecar)
    own = cpu_seconds(sidecar, reaped=True)
    server_own = cpu_seconds(server) if server is not None else 0.0
    reaped = cpu_seconds(server, reaped=True) - server_own if server is not None else 0.0
    live = sum(cpu_seconds(pid, reaped=True) for pid in workers)
    known = {sidecar, server, *workers}
    other = sum(cpu_seconds(pid, reaped=True) for pid in process_tree(sidecar) if pid not in known)
    return {"sidecar": own, "fork server": server_own, "job workers": reaped + live, "other": other}


async def _job(client: httpx2.AsyncClient) -> float:
    """One blocking ``POST /jobs`` of the ``fast`` crew; seconds until its answer."""
    job_id = f"footprint:{uuid.uuid4().hex}"
    body = {"crew_id": "fast", "action_id": job_id, "operation": "run", "input": INPUT}
    started = time.perf_counter()
    response = await client.post("/jobs", json=body, headers={"Idempotency-Key": job_id})
    elapsed = time.perf_counter() - started
    if response.status_code != 200 or INPUT["topic"] not in response.json().get("raw", ""):
        raise BenchError(f"POST /jobs answered {response.status_code}: {response.text[:200]}")
    return elapsed


async def _wait_line(process: Process, line: str) -> None:
    """Wait until ``process`` wrote ``line`` to its stderr (at most :data:`START_S`)."""
    end = time.monotonic() + START_S
    while line not in process.stderr_path.read_text(errors="replace").splitlines():
        if process.popen.poll() is not None:
            raise BenchError(f"{process.name} exited with {process.popen.returncode}:\n{process.stderr_tail()}")
        if time.monotonic() > end:
            raise BenchError(f"{process.name} did not write {line!r} in time:\n{process.stderr_tail()}")
        await asyncio.sleep(0.01)


def _mib(kib: float) -> str:
    return f"{kib / 1024:.0f} MiB"


async def run() -> Section:
    section = Section("footprint", "6b. Footprint: CPU and memory per job, sidecar process tree vs in-process CrewAI")
    samples: dict[str, list[float]] = {"ours": [], "baseline": [], "fresh": []}
    roles: dict[str, float] = {}
    with Stack("footprint") as stack:
        reference = stack.start_module("reference", "bench.footprint", "reference", str(stack.workdir / "reference"))
        await _wait_line(reference, READY)
        await settle(reference.pid)
        reference_pss = smaps_rollup(reference.pid).get("Pss", 0)
        if not reference_pss:
            raise BenchError("no PSS for the reference process (/proc/<pid>/smaps_rollup unreadable)")
        sidecar = stack.start_sidecar("--isolation", "process", "--max-concurrency", str(POOL), *NO_PRELOAD)
        fresh = stack.start_sidecar(
            "--isolation", "process", "--max-concurrency", str(POOL), *FRESH_WORKERS, name="fresh"
        )
        booted, fresh_booted = pool_full(sidecar.pid, POOL), pool_full(fresh.pid, POOL)
        batches = itertools.count(1)

        async with (
            async_client(sidecar.base_url, SIDECAR_TOKEN) as client,
            async_client(fresh.base_url, SIDECAR_TOKEN) as fresh_client,
        ):

            async def ours() -> float:
                before, role_before = await settle(sidecar.pid, ready=booted), _by_role(sidecar.pid)
                for _ in range(JOBS):
                    await _job(client)
                after, role_after = await settle(sidecar.pid, ready=booted), _by_role(sidecar.pid)
                for role, seconds in role_after.items():
                    roles[role] = roles.get(role, 0.0) + seconds - role_before[role]
                return (after - before) / JOBS

            async def ours_fresh() -> float:
                before = await settle(fresh.pid, ready=fresh_booted)
                for _ in range(JOBS):
                    await _job(fresh_client)
                return (await settle(fresh.pid, ready=fresh_booted) - before) / JOBS

            async def baseline() -> float:
                before = await settle(reference.pid)
                reference.popen.send_signal(signal.SIGUSR1)
                await _wait_line(reference, f"{BATCH_DONE} {next(batches)}")
                return (await settle(reference.pid) - before) / JOBS

            sides = {"ours": ours, "baseline": baseline, "fresh": ours_fresh}
            for batch in range(WARMUP_BATCHES + BATCHES):
                if batch == WARMUP_BATCHES:
                    roles.clear()
                for name in sorted(sides, reverse=batch % 2 == 1):
                    per_job = await sides[name]()
                    if batch >= WARMUP_BATCHES:
                        samples[name].append(per_job)
        reference.stop()
        fresh.stop()
        await settle(sidecar.pid, ready=booted)
        tree_pss = tree_pss_kib(sidecar.pid)
        server, workers = sidecar_workers(sidecar.pid)
        server_pss = smaps_rollup(server).get("Pss", 0) if server is not None else 0
        worker_pss = [smaps_rollup(pid).get("Pss", 0) for pid in workers]
        worker_uss = [uss_kib(pid) for pid in workers]
        boot_s = [cpu_seconds(pid) for pid in workers]  # an idle worker has spent only its boot
        sidecar_pss = smaps_rollup(sidecar.pid).get("Pss", 0)
        quiet_at = time.monotonic()
        await settle(sidecar.pid, ready=pool_full(sidecar.pid, 1), deadline_s=SHRINK_WAIT_S)  # the quiet shrink
        quiet_s, quiet_pss = time.monotonic() - quiet_at, tree_pss_kib(sidecar.pid)
        sidecar.stop()
        lean_pss, preloaded_pss, on_demand = await _fewer_idle_workers(stack)
        real = await _real_crew(stack)

    ours_s, base_s = Stats.of(samples["ours"]), Stats.of(samples["baseline"])
    section.rows.append(
        latency_row(
            "CPU per `fast` job: sidecar process tree vs in-process akickoff", ours_s, base_s, max_ratio=MAX_CPU_RATIO
        )
    )
    section.rows.append(
        latency_row(
            f"CPU per `fast` job at {FRESH} (a fresh worker per job): sidecar process tree vs in-process akickoff",
            Stats.of(samples["fresh"]),
            base_s,
            max_ratio=None,
        )
    )
    ratio = quiet_pss / reference_pss
    section.rows.append(
        Row(
            f"memory ({' '.join(NO_PRELOAD)}): sidecar tree PSS idle, once quiet for --idle-shrink-seconds "
            f"(default {SHRINK_S:g} s), vs one process with CrewAI and the registry imported",
            f"{_mib(quiet_pss)} (--max-concurrency {POOL})",
            _mib(reference_pss),
            f"{ratio:.2f}×",
            "—",
            f"≤ {MAX_PSS_RATIO:g}×",
            ratio <= MAX_PSS_RATIO,
        )
    )
    section.rows.append(
        Row(
            f"memory ({' '.join(NO_PRELOAD)}): the same sidecar right after its runs ({POOL} idle or warm workers, before "
            "the shrink) vs one process with CrewAI and the registry imported",
            _mib(tree_pss),
            _mib(reference_pss),
            f"{tree_pss / reference_pss:.2f}×",
            "—",
            "—",
            None,
        )
    )
    lean_ratio = lean_pss / reference_pss
    section.rows.append(
        Row(
            f"memory at --idle-workers {LEAN_IDLE} (of --max-concurrency {POOL}; {' '.join((*NO_PRELOAD, *FRESH_WORKERS))}): "
            "sidecar "
            "tree PSS after runs, idle, vs one process with CrewAI and the registry imported",
            _mib(lean_pss),
            _mib(reference_pss),
            f"{lean_ratio:.2f}×",
            "—",
            f"≤ {MAX_PSS_RATIO:g}×",
            lean_ratio <= MAX_PSS_RATIO,
        )
    )
    section.rows.append(
        latency_row(
            f"run `fast` (POST /jobs, {FRESH}): a job that waits for its worker's boot (--idle-workers 0) "
            "vs one that finds it idle (--idle-workers 1)",
            Stats.of(on_demand["boots"]),
            Stats.of(on_demand["idle"]),
            max_ratio=None,
        )
    )
    section.rows.append(
        latency_row(
            f"CPU per job of a real crew on an OpenAI-compatible model (`{REAL_CREW}`, provider on loopback, "
            f"{FRESH}): sidecar tree at the default --preload-modules vs none",
            Stats.of(real["default"]["cpu"]),
            Stats.of(real["none"]["cpu"]),
            max_ratio=None,
        )
    )
    section.rows.append(
        latency_row(
            f"run `{REAL_CREW}`, the same real crew (POST /jobs, {FRESH}): the default --preload-modules vs none",
            Stats.of(real["default"]["latency"]),
            Stats.of(real["none"]["latency"]),
            max_ratio=None,
        )
    )
    jobs = BATCHES * JOBS
    where = ", ".join(f"{role} {seconds / jobs * 1000:.0f} ms" for role, seconds in roles.items())
    boot = sum(boot_s) / len(boot_s) if boot_s else 0.0
    in_worker = roles.get("job workers", 0.0) / jobs
    uss = sum(worker_uss) / len(worker_uss) if worker_uss else 0.0
    one = tree_pss - (POOL - 1) * uss
    section.notes += [
        f"CPU: {BATCHES} batches of {JOBS} runs per side after {WARMUP_BATCHES} warm-up batch, alternating which "
        "side goes first; p50 and p99 are over the batches' per-job CPU. Readings from /proc in clock ticks "
        f"(10 ms), each taken once the tree's CPU was still for {QUIET_S:g} s (the sidecar: also all {POOL} workers "
        "alive), so a replacement worker's boot is charged to the jobs. Runs one at a time.",
        f"Where a job's CPU goes at the default (per job, mean of the measured batches): {where}: the workers' "
        f"share is {in_worker * 1000:.0f} ms, the job in its warm worker (in-process: {base_s.p50 * 1000:.0f} ms). "
        f"A fresh worker's boot (fork, registry import, warm-up kickoff: what an idle worker has spent) is "
        f"{boot * 1000:.0f} ms, off the job's path, and at {FRESH} every job pays one.",
        f"Memory at --max-concurrency {POOL} (the default), right after the runs: sidecar {_mib(sidecar_pss)}, "
        f"fork server {_mib(server_pss)}, {len(worker_pss)} idle or warm workers {_mib(sum(worker_pss))} "
        f"(each {_mib(min(worker_pss, default=0))}–{_mib(max(worker_pss, default=0))}), total {_mib(tree_pss)}. "
        f"The pool was down to one idle worker {quiet_s:.0f} s later (its last job ran before the other sides' "
        f"last batches): {_mib(quiet_pss)}.",
        f"Worker-pool setting: `--idle-workers` (env AIP_CREWAI_IDLE_WORKERS, default `--max-concurrency`, "
        f"{POOL} here) is the workers kept booted ahead of need, the memory traded for start latency, while jobs "
        f"come; `--idle-shrink-seconds` (default {SHRINK_S:g}) without a job starting or ending leaves one (the next job's "
        f"start boots the others back). Each idle worker holds {_mib(uss)} of its own "
        f"(USS; the rest of its PSS is pages shared with the fork server), so one fewer saves about that much "
        f"(at {LEAN_IDLE}, about {_mib(one)} was expected; measured {_mib(lean_pss)}, on a sidecar of its own after the "
        f"first stopped). A job that finds no worker idle waits for one to boot ({boot * 1000:.0f} ms of CPU here): "
        f"the last row, {ON_DEMAND_ROUNDS} interleaved rounds of one job on each of two sidecars (idle workers 0 and "
        f"{LEAN_IDLE}) after {ON_DEMAND_WARMUP} warm-up round.",
        f"Preloaded modules: the memory rows' sidecars run `{' '.join(NO_PRELOAD)}`, the setting docs/operating.md "
        f"gives a registry like the bench's, with no OpenAI-compatible model (the other sections run the default). "
        f"At the default (`{','.join(DEFAULT_PRELOAD_MODULES)}`: the OpenAI client and ChromaDB's telemetry client, "
        f"imported once by the fork server) the idle sidecar at --idle-workers {LEAN_IDLE} held "
        f"{_mib(preloaded_pss)}, against {_mib(lean_pss)} at `none` (each measured alone, the same way). "
        f"The real-crew rows: the example deployment's `{REAL_CREW}` crew "
        f"(examples/realcrews, CrewAI's native OpenAI provider) against the real-crew suite's fake provider on "
        f"loopback, two sidecars with one idle worker each, {len(real['none']['cpu'])} interleaved rounds after "
        f"{REAL_WARMUP}; each job's CPU is read like the rows above (the replacement worker's boot included).",
        "PSS splits a shared page between the processes mapping it: the reference is read before the sidecar "
        "starts and the tree after the reference stopped; other processes mapping the same libraries (the bench "
        "process itself once `run_overhead` imported CrewAI in it, in a full run) lower both sides.",
    ]
    return section


async def _fewer_idle_workers(stack: Stack) -> tuple[int, int, dict[str, list[float]]]:
    """The trade ``--idle-workers`` makes: (the idle tree PSS of a sidecar keeping :data:`LEAN_IDLE` workers
    after a few runs, :data:`NO_PRELOAD`, KiB; the same at the default ``--preload-modules``, KiB, read first,
    with no other sidecar up; ``fast`` run latencies, seconds, on a sidecar keeping none (``"boots"``) and on
    the first one (``"idle"``), interleaved)."""
    # a fresh worker per job: the idle-workers trade alone (a warm worker would serve these jobs without a boot)
    args = ["--isolation", "process", "--max-concurrency", str(POOL), *FRESH_WORKERS, "--idle-workers"]
    preloaded = stack.start_sidecar(*args, str(LEAN_IDLE), name="lean-preloaded")
    preloaded_pss = await _idle_pss(preloaded)
    preloaded.stop()
    lean = stack.start_sidecar(*args, str(LEAN_IDLE), *NO_PRELOAD, name="lean")
    pss = await _idle_pss(lean)
    none = stack.start_sidecar(*args, "0", name="no-idle")
    async with (
        async_client(lean.base_url, SIDECAR_TOKEN) as idle_client,
        async_client(none.base_url, SIDECAR_TOKEN) as boot_client,
    ):
        await _job(boot_client)  # the one worker it boots at start: used up, none replaces it

        async def idle() -> float:
            await settle(lean.pid, ready=pool_full(lean.pid, LEAN_IDLE))  # its spare booted: found idle
            return await _job(idle_client)

        async def boots() -> float:
            await settle(none.pid, ready=pool_full(none.pid, 0))  # none kept: the job boots its own
            return await _job(boot_client)

        samples = await interleave(
            {"idle": idle, "boots": boots}, rounds=ON_DEMAND_ROUNDS, warmup=ON_DEMAND_WARMUP, budget_s=60.0
        )
    return pss, preloaded_pss, samples


async def _idle_pss(sidecar: Process) -> int:
    """A few ``fast`` runs on ``sidecar`` (``--idle-workers`` :data:`LEAN_IDLE`), then its idle tree PSS, KiB."""
    async with async_client(sidecar.base_url, SIDECAR_TOKEN) as client:
        for _ in range(3):
            await _job(client)
    await settle(sidecar.pid, ready=pool_full(sidecar.pid, LEAN_IDLE))
    return tree_pss_kib(sidecar.pid)


async def _real_crew(stack: Stack) -> dict[str, dict[str, list[float]]]:
    """The preload rows: ``{"default" | "none": {"cpu": [s per job], "latency": [s]}}`` of :data:`REAL_CREW` jobs
    on two sidecars of the example deployment's registry (one idle worker each) against the real-crew suite's
    fake OpenAI-compatible provider on loopback, at the default ``--preload-modules`` and at ``none``."""
    sys.path.insert(0, str(ROOT / "tests" / "realcrews"))
    from fake_provider import FakeProvider  # the suite's provider: stdlib only, in this process

    provider = FakeProvider().start()
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "examples" / "realcrews"), str(ROOT)]),
        "REALCREWS_BASE_URL": provider.base_url,
        "REALCREWS_API_KEY": "sk-bench-fake",
    }
    settings = {"default": ",".join(DEFAULT_PRELOAD_MODULES), "none": "none"}
    sidecars = {
        name: stack.start_sidecar(
            "--registry",
            "realcrews:CREWS",
            "--idle-workers",
            "1",
            *FRESH_WORKERS,
            "--preload-modules",
            modules,
            name=f"real-{name}",
            env=env,
        )
        for name, modules in settings.items()
    }
    cpu: dict[str, list[float]] = {name: [] for name in sidecars}
    try:
        async with contextlib.AsyncExitStack() as exits:
            clients = {
                name: await exits.enter_async_context(async_client(sidecar.base_url, SIDECAR_TOKEN))
                for name, sidecar in sidecars.items()
            }

            def one(name: str) -> Callable[[], Awaitable[float]]:
                sidecar, ready = sidecars[name], pool_full(sidecars[name].pid, 1)

                async def job() -> float:
                    for other in sidecars.values():
                        await settle(other.pid, ready=pool_full(other.pid, 1))
                    before = tree_cpu_seconds(sidecar.pid)
                    job_id = f"footprint-real:{uuid.uuid4().hex}"
                    body = {"crew_id": REAL_CREW, "action_id": job_id, "operation": "run", "input": {"prompt": "hi"}}
                    started = time.perf_counter()
                    response = await clients[name].post("/jobs", json=body, headers={"Idempotency-Key": job_id})
                    elapsed = time.perf_counter() - started
                    if response.status_code != 200 or not response.json().get("raw"):
                        raise BenchError(
                            f"{REAL_CREW}: POST /jobs answered {response.status_code}: {response.text[:200]}"
                        )
                    cpu[name].append(await settle(sidecar.pid, ready=ready) - before)
                    return elapsed

                return job

            latency = await interleave(
                {name: one(name) for name in sidecars}, rounds=REAL_ROUNDS, warmup=REAL_WARMUP, budget_s=120.0
            )
    finally:
        for sidecar in sidecars.values():
            sidecar.stop()
        provider.stop()
    return {name: {"cpu": cpu[name][REAL_WARMUP:], "latency": latency[name]} for name in sidecars}


async def _reference(state_dir: Path) -> None:
    """The baseline process: import CrewAI and the bench registry as the sidecar's workers do, say
    :data:`READY`, then run one batch of :data:`JOBS` in-process ``fast`` kickoffs per SIGUSR1, saying
    :data:`BATCH_DONE` and the batch number after each; SIGTERM ends it."""
    kickoff = in_process_kickoff(state_dir)
    module, _, attribute = REGISTRY.partition(":")
    getattr(importlib.import_module(module), attribute)
    go = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, go.set)
    print(READY, file=sys.stderr, flush=True)
    for batch in itertools.count(1):
        await go.wait()
        go.clear()
        for _ in range(JOBS):
            await kickoff()
        print(f"{BATCH_DONE} {batch}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "reference":
        sys.exit("usage: python -m bench.footprint reference STATE_DIR (the footprint benchmark starts it)")
    asyncio.run(_reference(Path(sys.argv[2])))
