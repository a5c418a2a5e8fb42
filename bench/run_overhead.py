"""Run overhead: a governed ``run`` of the ``fast`` crew, three ways, interleaved.

- **host** (ours): the tenant submits ``cap:crewai:fast`` with an idempotency
  key and gets ``pending_approval`` (not timed: the approval wait is a
  human's). The sample is timed from sending the approver's decision
  (``POST /aip/v1/approvals/{id}/decision``, approved) until the tenant holds
  the ``completed`` result, fetched with the blocking re-call of the same
  action id and key (``POST /aip/v1/messages``, JSON), issued as soon as the
  decision is answered. In between the host dispatches in the background:
  ``POST /jobs/stream`` to the sidecar, normalizes and stores every chunk and
  the result.
- **sidecar**: ``POST /jobs`` (blocking, fresh action id and key) straight to
  the sidecar: admission committed before CrewAI starts, the run, the
  terminal event committed, the output answered.
- **in-process** (baseline): in this process, ``fast()`` (a fresh crew, as the
  sidecar builds per job) then ``await crew.akickoff(inputs)`` with agent
  streaming on, as the sidecar runs it.

- **host, a fresh worker per job**: the host sample again, through a second host whose sidecar runs with
  :data:`bench.common.FRESH_WORKERS` (the default sidecar's worker runs job after job of the tenant's crew;
  this one boots a new worker for every job).

Target: host adds at most 10 ms at p50 to the in-process run (judged at the default).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    FRESH,
    FRESH_WORKERS,
    SAMPLE_QUIET_S,
    SIDECAR_TOKEN,
    BenchError,
    Governed,
    Section,
    Stack,
    Stats,
    added_row,
    async_client,
    interleave,
    latency_row,
    new_id,
    settle,
)

ROUNDS = 150
WARMUP = 5
BUDGET_S = 60.0
MAX_ADDED_S = 0.010
INPUT = {"topic": "overhead"}


def in_process_kickoff(state_dir: Path) -> Any:
    """Prepare CrewAI's environment as the sidecar does (storage under ``state_dir``), import CrewAI and the
    bench registry, then return an async ``() -> seconds`` (wall time) running the ``fast`` crew in this
    process. Also the in-process baseline of :mod:`bench.footprint`."""
    from aip_crewai.sidecar.crewai_env import import_crewai, prepare_crewai_environment

    prepare_crewai_environment(state_dir)
    import_crewai()
    from crewai.crews.crew_output import CrewOutput
    from crewai.crews.utils import enable_agent_streaming

    from bench.crews import fast

    async def kickoff() -> float:
        started = time.perf_counter()
        crew = fast()
        crew.stream = False
        enable_agent_streaming(crew.agents)
        output = await crew.akickoff(inputs=dict(INPUT))
        elapsed = time.perf_counter() - started
        if not isinstance(output, CrewOutput):  # stream is off
            raise BenchError(f"a streaming output from a crew without stream: {output!r}")
        if "overhead" not in str(output.raw):
            raise BenchError(f"unexpected in-process output {output.raw!r}")
        return elapsed

    return kickoff


async def run() -> Section:
    section = Section("run_overhead", "2. Run overhead: governed `run` through the host vs in-process `akickoff`")
    with Stack("run") as stack:
        sidecar = stack.start_sidecar()
        host = stack.start_host(sidecar, ["fast"])
        fresh_sidecar = stack.start_sidecar(*FRESH_WORKERS, name="fresh-sidecar")
        fresh_host = stack.start_host(fresh_sidecar, ["fast"], name="fresh-host")
        in_process = in_process_kickoff(stack.workdir / "in-process")
        governed, fresh_governed = Governed(host), Governed(fresh_host)
        side = async_client(sidecar.base_url, SIDECAR_TOKEN)
        try:

            async def via_host() -> float:
                result, elapsed = await governed.governed_run("fast", INPUT)
                if "overhead" not in result["output"]["raw"]:
                    raise BenchError("unexpected output through the host")
                return elapsed

            async def via_fresh_host() -> float:
                result, elapsed = await fresh_governed.governed_run("fast", INPUT)
                if "overhead" not in result["output"]["raw"]:
                    raise BenchError("unexpected output through the host")
                return elapsed

            async def via_sidecar() -> float:
                job_id = f"direct:{uuid.uuid4().hex}"
                body = {"crew_id": "fast", "action_id": job_id, "operation": "run", "input": INPUT}
                started = time.perf_counter()
                response = await side.post(
                    "/jobs", json=body, headers={"Idempotency-Key": new_id("key"), "X-AIP-Action-ID": job_id}
                )
                elapsed = time.perf_counter() - started
                if response.status_code != 200 or "overhead" not in response.json()["raw"]:
                    raise BenchError(f"sidecar POST /jobs answered {response.status_code}: {response.text[:200]}")
                return elapsed

            async def quiet() -> None:
                for pid in (sidecar.pid, fresh_sidecar.pid):
                    await settle(pid, quiet_s=SAMPLE_QUIET_S)

            samples = await interleave(
                {"in_process": in_process, "sidecar": via_sidecar, "host": via_host, "fresh_host": via_fresh_host},
                rounds=ROUNDS,
                warmup=WARMUP,
                budget_s=BUDGET_S,
                before=quiet,
            )
        finally:
            await side.aclose()
            await governed.aclose()
            await fresh_governed.aclose()
    host_s, side_s, base_s, fresh_s = (Stats.of(samples[k]) for k in ("host", "sidecar", "in_process", "fresh_host"))
    section.rows += [
        added_row(
            "run `fast`: host (decision → result) vs in-process akickoff", host_s, base_s, max_added_s=MAX_ADDED_S
        ),
        added_row(
            f"run `fast` at {FRESH} (a fresh worker per job): host (decision → result) vs in-process akickoff",
            fresh_s,
            base_s,
            max_added_s=None,
        ),
        latency_row("run `fast`: sidecar POST /jobs vs in-process akickoff", side_s, base_s, max_ratio=None),
        latency_row("run `fast`: host (decision → result) vs sidecar POST /jobs", host_s, side_s, max_ratio=None),
    ]
    section.notes += [
        f"{host_s.n} interleaved rounds after {WARMUP} warm-up rounds, one run at a time; each sample starts once "
        f"both sidecars' process trees were still for {SAMPLE_QUIET_S * 1000:.0f} ms (the previous sample's "
        "replacement worker booted: on 2 cores its boot would otherwise slow whichever sample came next).",
        "Host sample: from sending the approval decision to holding the completed result (blocking re-call "
        "with the same action id and key). Submission (→ pending_approval) is not timed.",
        "In-process sample: a fresh crew from the same factory, then `akickoff` with agent streaming on "
        "(what the sidecar's `run` operation does, without journal, HTTP or SSE).",
    ]
    return section
