"""Load: 200 concurrent runs of the ``fast`` crew, sidecar ``--max-concurrency 64``.

- **host** (ours): 200 tenants at once each submit ``cap:crewai:fast``, get
  ``pending_approval``, have it approved (the approver principal, over HTTP,
  as soon as the pending answer arrives) and fetch the result with the
  blocking re-call. Latency per run: submission to result.
- **sidecar** (baseline): the same 200 runs at once as ``POST /jobs``
  (blocking) straight to the sidecar. Latency per run: request to answer.

Both phases start from the same warm processes (host phase first, then the
sidecar phase, then both once more; the two rounds are pooled). Throughput =
runs / wall time of the phase. Every run must complete (zero errors).
Memory of each process tree (PSS summed over the process and its descendants,
``/proc/<pid>/smaps_rollup``: the sidecar with its worker fork server and job
workers, where CrewAI lives; the host has none) is read at idle and sampled
every 2 s during each phase, in a thread (peak kept); CPU time per run of each tree
(``/proc/<pid>/stat``, the finished workers' included) is reported per phase.
The whole measure runs twice: on the default sidecar (warm workers), then on a second stack whose sidecar
runs a fresh worker per job (:data:`bench.common.FRESH_WORKERS`, no targets judged). Targets: zero errors (no run lost to load); host throughput ≥ 0.9× and p50
latency ≤ 1.3× the sidecar's (the host adds under 10 %); host peak memory ≤ 0.5×
the sidecar's.

The ``fast`` crew is the fastest real CrewAI crew we have (one task, one
chunk): about 23 ms of CrewAI CPU per run in-process on the 2-core bench
machine, so the sidecar is CPU-bound by CrewAI under this load.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from bench.common import (
    FRESH,
    FRESH_WORKERS,
    SIDECAR_TOKEN,
    BenchError,
    Governed,
    Process,
    Row,
    Section,
    Stack,
    Stats,
    TreeSampler,
    async_client,
    latency_row,
    new_id,
    rate_row,
    table,
    tree_cpu_seconds,
    tree_pss_kib,
)

RUNS = 200
ROUNDS = 2
MAX_CONCURRENCY = 64
#: The load's clients per phase, each holding at most ``2 * RUNS / CLIENTS`` connections; run ``i`` uses client
#: ``i % CLIENTS``. httpx's httpcore 1.0.9 pool walked every connection it held on each request it queued and
#: each connection it released (and polled every idle socket): one client of 400 connections cost this process 12
#: to 13 ms of CPU per governed run (3 requests) and 3 ms per direct run, on the 2 cores the host and the sidecar
#: share. 20 clients of 20: 3.2 and 1.4 ms (bench/results/HISTORY.md, session 31). httpx2's pool walks less;
#: the 20 clients stay, so that no client's pool size is part of the measurement.
CLIENTS = 20
INPUT = {"topic": "load"}
MAX_MEMORY_RATIO = 0.5
#: What the host may cost under load: throughput and p50 latency against the same jobs posted directly.
MIN_THROUGHPUT_RATIO = 0.9
MAX_LATENCY_RATIO = 1.3


#: The bench process (its clients, and the memory sampler's thread every 2 s) in the CPU table.
CLIENT = "bench client"


def _mib(kib: int) -> str:
    return f"{kib / 1024:.0f} MiB"


@dataclass
class _Phases:
    """What both phases of one stack measured (see the module docstring)."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {"host": [], "sidecar": []})
    walls: dict[str, list[float]] = field(default_factory=lambda: {"host": [], "sidecar": []})
    errors: dict[str, int] = field(default_factory=lambda: {"host": 0, "sidecar": 0})
    samples: list[str] = field(default_factory=list)
    peaks: dict[str, dict[str, int]] = field(default_factory=lambda: {"host": {}, "sidecar": {}})
    cpu: dict[str, dict[str, float]] = field(
        default_factory=lambda: {phase: {"host": 0.0, "sidecar": 0.0, CLIENT: 0.0} for phase in ("host", "sidecar")}
    )
    idle: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    resent: list[str] = field(default_factory=list)


async def run() -> Section:
    section = Section("load", f"5. Load: {RUNS} concurrent runs, sidecar max concurrency {MAX_CONCURRENCY}")
    measured = await _measure(())
    fresh = await _measure(FRESH_WORKERS)
    _report(section, measured, fresh)
    return section


async def _measure(sidecar_args: tuple[str, ...]) -> _Phases:
    m = _Phases()
    latencies, walls, errors, samples, peaks, cpu = m.latencies, m.walls, m.errors, m.samples, m.peaks, m.cpu
    with Stack("load") as stack:
        sidecar = stack.start_sidecar("--max-concurrency", str(MAX_CONCURRENCY), *sidecar_args)
        host = stack.start_host(sidecar, ["fast"])
        processes: list[Process] = [host, sidecar]
        per_client = 2 * RUNS // CLIENTS
        governed = [Governed(host, connections=per_client) for _ in range(CLIENTS)]
        sides = [async_client(sidecar.base_url, SIDECAR_TOKEN, connections=per_client) for _ in range(CLIENTS)]
        try:
            for _ in range(3):  # warm both paths
                await governed[0].governed_run("fast", INPUT)
                await sides[0].post(
                    "/jobs",
                    json={"crew_id": "fast", "action_id": f"warm:{uuid.uuid4().hex}", "input": INPUT},
                    headers={"Idempotency-Key": new_id("key")},
                )
            await asyncio.sleep(0.5)
            m.idle = {p.name: tree_pss_kib(p.pid) for p in processes}

            async def host_run(i: int) -> float:
                tenant = governed[i % CLIENTS]
                started = time.perf_counter()
                body, approval_id = await tenant.submit("fast", INPUT)
                await tenant.decide(approval_id)
                result = await tenant.post(body)
                if result["status"] != "completed":
                    raise BenchError(f"run ended {result['status']}: {json.dumps(result.get('error'))[:800]}")
                return time.perf_counter() - started

            async def sidecar_run(i: int) -> float:
                job_id = f"load:{uuid.uuid4().hex}"
                started = time.perf_counter()
                response = await sides[i % CLIENTS].post(
                    "/jobs",
                    json={"crew_id": "fast", "action_id": job_id, "input": INPUT},
                    headers={"Idempotency-Key": new_id("key"), "X-AIP-Action-ID": job_id},
                )
                if response.status_code != 200:
                    raise BenchError(f"POST /jobs answered {response.status_code}")
                return time.perf_counter() - started

            phases = {"host": host_run, "sidecar": sidecar_run}
            for _ in range(ROUNDS):
                for name, one in phases.items():
                    cpu_before = {p.name: tree_cpu_seconds(p.pid) for p in processes}
                    client_before = time.process_time()
                    async with TreeSampler(processes) as sampler:
                        started = time.perf_counter()
                        outcomes = await asyncio.gather(*[one(i) for i in range(RUNS)], return_exceptions=True)
                        walls[name].append(time.perf_counter() - started)
                    cpu[name][CLIENT] += time.process_time() - client_before
                    for process in processes:
                        cpu[name][process.name] += tree_cpu_seconds(process.pid) - cpu_before[process.name]
                    for outcome in outcomes:
                        if isinstance(outcome, BaseException):
                            errors[name] += 1
                            if len(samples) < 3:
                                samples.append(f"{name}: {type(outcome).__name__}: {str(outcome)[:900]}")
                        else:
                            latencies[name].append(outcome)
                    for process_name, peak in sampler.peak.items():
                        peaks[name][process_name] = max(peaks[name].get(process_name, 0), peak)
                    await asyncio.sleep(0.5)
            m.after = {p.name: tree_pss_kib(p.pid) for p in processes}
            m.resent = [kind for tenant in governed for kind in tenant.resent]
        finally:
            for client in sides:
                await client.aclose()
            for tenant in governed:
                await tenant.aclose()
    if not latencies["host"] or not latencies["sidecar"]:
        raise BenchError(f"no run completed: errors {errors}")
    return m


def _report(section: Section, m: _Phases, fresh: _Phases) -> None:
    latencies, walls, errors, samples, peaks, cpu = m.latencies, m.walls, m.errors, m.samples, m.peaks, m.cpu
    idle, after, resent = m.idle, m.after, m.resent
    total = {name: RUNS * ROUNDS for name in ("host", "sidecar")}
    fresh_throughput = {name: Stats(len(w), sum(w) / total[name], max(w) / RUNS) for name, w in fresh.walls.items()}
    throughput = {name: Stats(len(w), sum(w) / total[name], max(w) / RUNS) for name, w in walls.items()}
    host_peak = max(peaks["host"]["host"], peaks["sidecar"]["host"])
    sidecar_peak = max(peaks["host"]["sidecar"], peaks["sidecar"]["sidecar"])
    section.rows += [
        rate_row(
            f"throughput: {RUNS} concurrent governed runs via host vs POST /jobs",
            "runs",
            throughput["host"],
            throughput["sidecar"],
            units=1,
            min_ratio=MIN_THROUGHPUT_RATIO,
        ),
        latency_row(
            "latency per run: host (submit → result) vs sidecar POST /jobs",
            Stats.of(latencies["host"]),
            Stats.of(latencies["sidecar"]),
            max_ratio=MAX_LATENCY_RATIO,
        ),
        Row(
            "errors (failed or not completed runs)",
            f"{errors['host']} of {total['host']}",
            f"{errors['sidecar']} of {total['sidecar']}",
            "—",
            "—",
            "0 errors",
            errors["host"] == 0 and errors["sidecar"] == 0,
        ),
        rate_row(
            f"at {FRESH} (a fresh worker per job): throughput, {RUNS} governed runs via host vs POST /jobs",
            "runs",
            fresh_throughput["host"],
            fresh_throughput["sidecar"],
            units=1,
            min_ratio=None,
        ),
        latency_row(
            f"at {FRESH} (a fresh worker per job): latency per run, host vs sidecar POST /jobs",
            Stats.of(fresh.latencies["host"]),
            Stats.of(fresh.latencies["sidecar"]),
            max_ratio=None,
        ),
        Row(
            f"at {FRESH} (a fresh worker per job): errors",
            f"{fresh.errors['host']} of {total['host']}",
            f"{fresh.errors['sidecar']} of {total['sidecar']}",
            "—",
            "—",
            "0 errors",
            fresh.errors["host"] == 0 and fresh.errors["sidecar"] == 0,
        ),
        Row(
            "peak memory under load (process tree PSS): host vs sidecar",
            _mib(host_peak),
            _mib(sidecar_peak),
            f"{host_peak / sidecar_peak:.2f}×",
            "—",
            f"≤ {MAX_MEMORY_RATIO:g}×",
            host_peak / sidecar_peak <= MAX_MEMORY_RATIO,
        ),
    ]
    section.extra += table(
        [
            "process tree",
            "PSS idle (warm)",
            "peak during host phase",
            "peak during sidecar phase",
            "PSS after",
            "CPU per run, host phase",
            "CPU per run, sidecar phase",
        ],
        [
            [
                p,
                _mib(idle[p]),
                _mib(peaks["host"][p]),
                _mib(peaks["sidecar"][p]),
                _mib(after[p]),
                f"{cpu['host'][p] / total['host'] * 1000:.1f} ms",
                f"{cpu['sidecar'][p] / total['sidecar'] * 1000:.1f} ms",
            ]
            for p in ("host", "sidecar")
        ]
        + [
            [
                CLIENT,
                *["—"] * 4,
                f"{cpu['host'][CLIENT] / total['host'] * 1000:.1f} ms",
                f"{cpu['sidecar'][CLIENT] / total['sidecar'] * 1000:.1f} ms",
            ]
        ],
    )
    section.notes += [f"error: {sample}" for sample in [*samples, *fresh.samples]]
    if resent:
        kinds = ", ".join(f"{n} {name}" for name, n in sorted(Counter(resent).items()))
        section.notes.append(
            f"{len(resent)} host-phase requests resent once ({kinds}): sent on a kept-alive connection the host "
            "had just closed as idle (its 5 s keep-alive bound, counted from its side while this client's loop "
            "lagged); they never reached the host's application, and each is safe to resend (bench.common."
            "STALE_CONNECTION). Not errors: no run was lost."
        )
    section.notes += [
        f"{ROUNDS} rounds of each phase ({RUNS} runs at once each), pooled; throughput p50 = mean over rounds, "
        "p99 = the slowest round.",
        f"The runs are spread over {CLIENTS} clients of {2 * RUNS // CLIENTS} connections in each phase (an HTTP "
        "client's pool can cost CPU per request in proportion to the connections it holds; the bench process shares "
        f"the 2 cores): the `{CLIENT}` row is this process's CPU per run.",
        "Host phase per run: submit (→ pending_approval), approve (approver, HTTP), blocking re-call (same id and "
        "key) → completed. The sidecar phase skips governance entirely: the ratio is what approval, idempotency, "
        "two extra round trips and the host store cost under load.",
        f"The rows at {FRESH}: the same two phases on a second stack whose sidecar runs "
        "every job in a fresh worker (the default runs up to 100 jobs of one tenant's crew in one; "
        'docs/operating.md "Warm workers"), measured after the first stack stopped; their throughput and latency '
        "are shown, not judged (the targets apply to the default). CPU per run there: host "
        f"{fresh.cpu['host']['host'] / total['host'] * 1000:.1f} ms, sidecar tree "
        f"{fresh.cpu['host']['sidecar'] / total['host'] * 1000:.1f} ms (host phase); sidecar tree "
        f"{fresh.cpu['sidecar']['sidecar'] / total['sidecar'] * 1000:.1f} ms (sidecar phase).",
    ]
