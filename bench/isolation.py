"""Process isolation (``--isolation process``): its cost and what it buys, each beside a baseline of the same run.

- **added latency**: a ``fast`` run (``POST /jobs``, blocking) on a sidecar
  with ``--isolation process`` vs one with ``--isolation inprocess``,
  interleaved. Target: at most +5 ms at p50.
- **/health while jobs block**: ``GET /health`` while 4 jobs each block 5 s
  in a synchronous call (the ``blocking`` crew's tool: ``time.sleep``),
  vs ``GET /health`` of the same idle sidecar. Target: p99 < 50 ms.
- **/health during a memory-save stall**: the same probe while a
  ``memory_stall`` job runs (CrewAI's ``akickoff`` waits on memory saves on
  its event loop, crewAI PR#6497), process vs inprocess sidecar.
- **hard cancel**: from ``POST /jobs/{id}/cancel`` of a job whose tool
  blocks in ``time.sleep`` to its worker's death: a ``test`` job (its crew
  runs in a thread that ignores the flag: killed after
  ``--cancel-grace-seconds 1``) vs a ``run`` job (its task stops at once).
  Target: < 1.5 s.
- **memory per idle worker**: proportional set size (PSS, shared pages
  split between their users) of the whole sidecar process tree with
  ``--max-concurrency 4`` vs ``--max-concurrency 1``, per extra worker, vs
  the resident size of the fork server (one CrewAI import). The worker's
  private memory (USS) is shown too.

Source: ARCHITECTURE.md §5 (isolation); docs/security.md "Process isolation".
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2

from bench.common import (
    SAMPLE_QUIET_S,
    SIDECAR_TOKEN,
    BenchError,
    Row,
    Section,
    Stack,
    Stats,
    added_row,
    async_client,
    interleave,
    pool_full,
    settle,
    sidecar_workers,
    smaps_rollup,
    tree_pss_kib,
    uss_kib,
)

ROUNDS = 150
WARMUP = 5
BUDGET_S = 45.0
MAX_ADDED_S = 0.005
BLOCKERS = 4
HEALTH_P99_S = 0.050
CANCEL_S = 1.5
CANCELS = 5


def _body(crew: str, job_id: str) -> dict[str, Any]:
    return {"crew_id": crew, "action_id": job_id, "operation": "run", "input": {"topic": "isolation"}}


async def _run(client: httpx2.AsyncClient, crew: str) -> float:
    job_id = f"bench:{uuid.uuid4().hex}"
    started = time.perf_counter()
    response = await client.post("/jobs", json=_body(crew, job_id), headers={"Idempotency-Key": job_id})
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise BenchError(f"POST /jobs answered {response.status_code}: {response.text[:200]}")
    return elapsed


async def _health_samples(
    client: httpx2.AsyncClient, *, count: int | None = None, while_running: asyncio.Future[Any] | None = None
) -> list[float]:
    samples: list[float] = []
    while (count is not None and len(samples) < count) or (while_running is not None and not while_running.done()):
        started = time.perf_counter()
        response = await client.get("/health")
        samples.append(time.perf_counter() - started)
        if response.status_code != 200:
            raise BenchError(f"/health answered {response.status_code}")
        await asyncio.sleep(0.01)
    return samples


async def _wait_markers(directory: Path, count: int, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while len(list(directory.glob("*.started"))) < count:
        if time.monotonic() > end:
            raise BenchError(f"{count} blocking tools did not start in time")
        await asyncio.sleep(0.01)


async def _idle_tree(stack: Stack, concurrency: int) -> tuple[int, int, int]:
    """(tree PSS KiB, fork server RSS KiB, mean worker USS KiB) of an idle process-mode sidecar."""
    sidecar = stack.start_sidecar(
        "--isolation", "process", "--max-concurrency", str(concurrency), name=f"sidecar-c{concurrency}"
    )
    try:
        async with async_client(sidecar.base_url, SIDECAR_TOKEN) as client:
            for _ in range(3):  # every worker has booted; one job per worker ran and was replaced
                await _run(client, "fast")
        await settle(sidecar.pid, ready=pool_full(sidecar.pid, concurrency))  # the replacements booted
        server, workers = sidecar_workers(sidecar.pid)
        pss = tree_pss_kib(sidecar.pid)
        uss = [uss_kib(p) for p in workers]
        rss = smaps_rollup(server).get("Rss", 0) if server is not None else 0
        return pss, rss, (sum(uss) // len(uss) if uss else 0)
    finally:
        sidecar.stop()


async def run() -> Section:
    section = Section("isolation", "6. Process isolation: cost and gains vs in-process jobs")
    with Stack("isolation") as stack:
        markers = stack.workdir / "markers"
        markers.mkdir(mode=0o700)
        process = stack.start_sidecar(
            "--isolation",
            "process",
            "--cancel-grace-seconds",
            "1",
            "--allowed-operations",
            "run,test",
            name="process",
            env={"AIP_CREWAI_TEST_MARKER_DIR": str(markers), "AIP_CREWAI_TEST_BLOCK_SECONDS": "5"},
        )
        inprocess = stack.start_sidecar("--isolation", "inprocess", name="inprocess")
        async with (
            async_client(process.base_url, SIDECAR_TOKEN) as iso,
            async_client(inprocess.base_url, SIDECAR_TOKEN) as inp,
        ):

            async def quiet() -> None:  # the previous sample's replacement worker booted (bench.run_overhead)
                for pid in (process.pid, inprocess.pid):
                    await settle(pid, quiet_s=SAMPLE_QUIET_S)

            samples = await interleave(
                {"process": lambda: _run(iso, "fast"), "inprocess": lambda: _run(inp, "fast")},
                rounds=ROUNDS,
                warmup=WARMUP,
                budget_s=BUDGET_S,
                before=quiet,
            )
            ours, base = Stats.of(samples["process"]), Stats.of(samples["inprocess"])
            section.rows.append(
                added_row(
                    "run `fast`: --isolation process vs inprocess (POST /jobs)", ours, base, max_added_s=MAX_ADDED_S
                )
            )

            idle = Stats.of(await _health_samples(iso, count=200))
            blockers = [asyncio.create_task(_run(iso, "blocking")) for _ in range(BLOCKERS)]
            await _wait_markers(markers, BLOCKERS)
            during = Stats.of(await _health_samples(iso, while_running=asyncio.gather(*blockers)))
            section.rows.append(
                _p99_row(
                    f"/health while {BLOCKERS} jobs block 5 s in a synchronous call vs idle", during, idle, HEALTH_P99_S
                )
            )

            iso_stall = Stats.of(
                await _health_samples(iso, while_running=asyncio.create_task(_run(iso, "memory_stall")))
            )
            inp_stall = Stats.of(
                await _health_samples(inp, while_running=asyncio.create_task(_run(inp, "memory_stall")))
            )
            section.rows.append(
                _p99_row("/health during a memory-save stall: process vs inprocess", iso_stall, inp_stall, HEALTH_P99_S)
            )

            hard, soft = [], []
            for _ in range(CANCELS):
                hard.append(await _cancel(iso, "test", {"n_iterations": 1, "eval_llm": "offline-blocking"}, markers))
                soft.append(await _cancel(iso, "run", {"topic": "isolation"}, markers))
            hard_s, soft_s = Stats.of(hard), Stats.of(soft)
            section.rows.append(
                Row(
                    "cancel → dead worker, tool blocked in `time.sleep`: `test` (killed after the "
                    "1 s grace) vs `run` (its task stops at once)",
                    f"{hard_s.p50 * 1000:.0f} ms / {hard_s.p99 * 1000:.0f} ms",
                    f"{soft_s.p50 * 1000:.0f} ms / {soft_s.p99 * 1000:.0f} ms",
                    f"{hard_s.p50 / soft_s.p50:.1f}×",
                    f"{hard_s.p99 / soft_s.p99:.1f}×",
                    f"< {CANCEL_S:g} s",
                    hard_s.p99 < CANCEL_S,
                )
            )
        process.stop()
        inprocess.stop()
        four, four_server, four_uss = await _idle_tree(stack, 4)
        one, _server, _uss = await _idle_tree(stack, 1)
        per_worker = (four - one) / 3
        section.rows.append(
            Row(
                "memory per idle worker (tree PSS, 4 vs 1 workers) vs a CrewAI import (fork server RSS)",
                f"{per_worker / 1024:.1f} MiB (USS {four_uss / 1024:.1f} MiB)",
                f"{four_server / 1024:.0f} MiB",
                f"{per_worker / max(1, four_server):.2f}×",
                "—",
                "well under a CrewAI import",
                per_worker < four_server / 4,
            )
        )
    section.notes += [
        f"Added latency: {ours.n} interleaved rounds after {WARMUP} warm-up rounds, one run at a time, two sidecars "
        f"side by side (4 workers each for process); each sample starts once both trees were still for "
        f"{SAMPLE_QUIET_S * 1000:.0f} ms (the previous sample's replacement worker booted).",
        f"/health: one probe every 10 ms; idle = 200 probes before the blocking jobs; while blocking: {during.n} probes.",
        f"Cancel: {CANCELS} rounds each; the request is sent once the tool wrote its marker file (it then blocks 5 s in "
        "`time.sleep`), timed until the worker process is gone (/proc). `test` runs the crew in a thread that "
        "ignores the cooperative flag: killed after the 1 s grace. `run`'s asyncio task is cancelled, the worker "
        "answers and exits (its blocked tool thread dies with it).",
        "Memory: PSS splits each shared page between the processes that map it; a worker shares CrewAI's pages "
        "with the fork server it was forked from.",
    ]
    return section


def _p99_row(metric: str, ours: Stats, baseline: Stats, max_p99_s: float) -> Row:
    return Row(
        metric,
        f"{ours.p50 * 1000:.2f} ms / {ours.p99 * 1000:.2f} ms",
        f"{baseline.p50 * 1000:.2f} ms / {baseline.p99 * 1000:.2f} ms",
        f"{ours.p50 / baseline.p50:.2f}×",
        f"{ours.p99 / baseline.p99:.2f}×",
        f"p99 < {max_p99_s * 1000:g} ms",
        ours.p99 < max_p99_s,
    )


async def _cancel(client: httpx2.AsyncClient, operation: str, input: dict[str, Any], markers: Path) -> float:
    """Seconds from the cancel request of a ``blocking`` job whose tool blocks to its worker's death."""
    job_id = f"bench:{uuid.uuid4().hex}"
    body = {"crew_id": "blocking", "action_id": job_id, "operation": operation, "input": input}
    job = asyncio.create_task(client.post("/jobs", json=body, headers={"Idempotency-Key": job_id}))
    marker = markers / f"{quote(job_id, safe='')}.started"
    end = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        if time.monotonic() > end:
            raise BenchError("the blocking tool did not start in time")
        await asyncio.sleep(0.005)
    pid = int(marker.read_text())
    started = time.perf_counter()
    answer = await client.post(f"/jobs/{job_id}/cancel", json={"crew_id": "blocking", "action_id": job_id})
    if answer.status_code != 200:
        raise BenchError(f"cancel answered {answer.status_code}: {answer.text[:200]}")
    while Path(f"/proc/{pid}").exists() and "zombie" not in _status(pid):
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - started
    await job
    return elapsed


def _status(pid: int) -> str:
    try:
        return next(
            (line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")), ""
        )
    except OSError:
        return "zombie"
