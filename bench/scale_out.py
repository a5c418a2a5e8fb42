"""Scale-out: the host store on PostgreSQL, one host against two, and against SQLite.

A throwaway PostgreSQL cluster (Debian's binaries, ``tests/pgserver.py``, ``fsync=off`` like a tmpfs test
cluster: the ratios compare code paths, not disks) and one sidecar (``--max-concurrency 64``, the ``fast``
crew) serve:

- **throughput, 1 vs 2 hosts on PostgreSQL**: 120 governed runs at once (submit → approve → blocking
  re-call for the result), spread round-robin over the hosts of the phase; runs / wall time; interleaved
  phases (1, 2, 1, 2), pooled.
- **one host, SQLite vs PostgreSQL**: ``:status`` (one blocking read at a time, 300 interleaved rounds) and
  the run overhead (decision → result of one governed ``fast`` run, 60 interleaved rounds), each through a
  host on its own store in front of the same sidecar.

Reported as ratios, no targets. Without PostgreSQL the section says so and has no rows.
"""

from __future__ import annotations

import asyncio
import sys
import time

from bench.common import (
    ROOT,
    BenchError,
    Governed,
    Section,
    Stack,
    Stats,
    envelope,
    latency_row,
    new_id,
    rate_row,
)

RUNS = 120
PHASES = 4
STATUS_ROUNDS = 300
RUN_ROUNDS = 60


async def _throughput(hosts: list[Governed]) -> float:
    """Seconds for RUNS concurrent governed runs spread over ``hosts``."""
    started = time.perf_counter()
    results = await asyncio.gather(
        *[hosts[i % len(hosts)].governed_run("fast", {"topic": f"t{i}"}) for i in range(RUNS)]
    )
    if any(result["status"] != "completed" for result, _ in results):
        raise BenchError("a run did not complete")
    return time.perf_counter() - started


async def _status_s(governed: Governed, run_id: str) -> float:
    body = envelope("cap:crewai:fast:status", {"run_action_id": run_id}, action_id=new_id("act"))
    started = time.perf_counter()
    result = await governed.post(body)
    elapsed = time.perf_counter() - started
    if result["status"] != "completed":
        raise BenchError(f"status answered {result['status']}")
    return elapsed


async def run() -> Section:
    section = Section("scale_out", "7. Scale-out: the host store on PostgreSQL (1 vs 2 hosts, SQLite vs PostgreSQL)")
    sys.path.insert(0, str(ROOT / "tests"))
    import pgserver

    bin_dir = pgserver.find_bin_dir()
    if bin_dir is None:
        section.notes.append(pgserver.SKIP_REASON.replace("tests skipped", "benchmark not run"))
        return section
    server = pgserver.PostgresServer(bin_dir)
    try:
        with Stack("scale") as stack:
            sidecar = stack.start_sidecar("--max-concurrency", "64")
            shared = server.create_database("bench_shared")
            pg_hosts = [
                Governed(stack.start_host(sidecar, ["fast"], name=f"pg-{i}", store=shared), connections=64)
                for i in (1, 2)
            ]
            sqlite_host = Governed(stack.start_host(sidecar, ["fast"], name="sqlite"), connections=16)
            solo = Governed(
                stack.start_host(sidecar, ["fast"], name="pg-solo", store=server.create_database("bench_solo")),
                connections=16,
            )
            try:
                await _throughput(pg_hosts)  # warm-up
                one: list[float] = []
                two: list[float] = []
                for phase in range(PHASES):
                    (one if phase % 2 == 0 else two).append(
                        await _throughput(pg_hosts[:1] if phase % 2 == 0 else pg_hosts)
                    )
                run_on = {}
                for name, governed in (("sqlite", sqlite_host), ("postgresql", solo)):
                    result, _ = await governed.governed_run("fast", {"topic": "status"})
                    run_on[name] = result["action_id"]
                status: dict[str, list[float]] = {"sqlite": [], "postgresql": []}
                for i in range(STATUS_ROUNDS + 20):
                    order = (
                        (("sqlite", sqlite_host), ("postgresql", solo))
                        if i % 2
                        else (("postgresql", solo), ("sqlite", sqlite_host))
                    )
                    for name, governed in order:
                        elapsed = await _status_s(governed, run_on[name])
                        if i >= 20:
                            status[name].append(elapsed)
                overhead: dict[str, list[float]] = {"sqlite": [], "postgresql": []}
                for i in range(RUN_ROUNDS + 3):
                    order = (
                        (("sqlite", sqlite_host), ("postgresql", solo))
                        if i % 2
                        else (("postgresql", solo), ("sqlite", sqlite_host))
                    )
                    for name, governed in order:
                        _, elapsed = await governed.governed_run("fast", {"topic": f"r{i}"})
                        if i >= 3:
                            overhead[name].append(elapsed)
            finally:
                for governed in (*pg_hosts, sqlite_host, solo):
                    await governed.aclose()
    finally:
        server.stop()
    section.rows += [
        rate_row(
            "governed runs: 2 hosts vs 1 host on one PostgreSQL",
            "runs",
            Stats.of(two),
            Stats.of(one),
            units=RUNS,
            min_ratio=None,
        ),
        latency_row(
            "status: host on PostgreSQL vs host on SQLite",
            Stats.of(status["postgresql"]),
            Stats.of(status["sqlite"]),
            max_ratio=None,
        ),
        latency_row(
            "run `fast` (decision → result): PostgreSQL vs SQLite",
            Stats.of(overhead["postgresql"]),
            Stats.of(overhead["sqlite"]),
            max_ratio=None,
        ),
    ]
    section.notes += [
        f"Throughput: {RUNS} concurrent governed runs per phase, {PHASES} interleaved phases (1 host, 2 hosts, …) "
        "after one warm-up phase on 2 hosts; the sidecar (one process, `--max-concurrency 64`) runs every crew, so "
        "on this 2-core machine it bounds both phases: the row shows what a second host costs or saves, not a "
        "machine-wide scale-out.",
        f"Status: {STATUS_ROUNDS} interleaved rounds after 20 warm-up rounds; run overhead: {RUN_ROUNDS} interleaved "
        "rounds after 3; one host per store, same sidecar.",
        "PostgreSQL: a throwaway local cluster (`fsync=off`); each write transaction takes the store's advisory lock.",
    ]
    return section
