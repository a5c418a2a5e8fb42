"""Control-path overhead: one blocking ``:status`` read, five ways, interleaved.

- **host**: ``POST /aip/v1/messages`` with an ``aip.core.v1.action`` envelope
  for ``cap:crewai:fast:status`` (bearer of the invoker, a fresh action id per
  call, no idempotency key: optional for status). Every call is itself an
  action: the host authenticates, resolves, checks the target run and stores
  the action with its result in one write. The run is completed, so its job
  view is final and, after the first call, comes from the host's cache of
  final views (the default, ``status_cache_entries = 1024``): no sidecar hop.
- **host, cache off**: the same on a second host (same sidecar, its own store
  and its own completed run) started with ``status_cache_entries = 0``: every
  call also asks the sidecar's ``GET /jobs/{id}``, as a running job's status
  always does. Target: ≤ 2.5× bare (the key-less status of a running job).
- **sidecar**: the same ``GET /jobs/bench:<run id>`` straight to the sidecar
  with its bearer.
- **bare**: a Starlette-on-Hypercorn handler in its own process
  (:mod:`bench.bare`) answering the very bytes the sidecar answered.
- **bare proxy**: the proxy of :mod:`bench.bare` in front of the same
  sidecar: ``POST /aip/v1/messages`` answered with the sidecar's
  ``GET /jobs/bench:<run id>`` through aiohttp, as the cache-off host asks
  it, and nothing of a governed read. No target: it shows the floor of the
  cache-off host's path, and so what the host's own work may cost within
  the target.

Each sample is one request on a kept-alive connection from one httpx client,
measured from sending to the whole body read. Targets (p50): host ≤ 2.5× bare, cache-off host ≤ 2.5× bare,
sidecar ≤ 1.3× bare (its view costs at most 30 % over a handler answering the same bytes).
"""

from __future__ import annotations

import time

from bench.common import (
    SIDECAR_TOKEN,
    TENANT,
    BenchError,
    Governed,
    Section,
    Stack,
    Stats,
    Timed,
    async_client,
    envelope,
    interleave,
    latency_row,
    new_id,
)

ROUNDS = 600
WARMUP = 40
BUDGET_S = 45.0
MAX_RATIO = 2.5
#: The sidecar's own ``GET /jobs/{id}`` against the bare hop.
MAX_SIDECAR_RATIO = 1.3


async def run() -> Section:
    section = Section("control_path", "1. Control path: `:status` through host and sidecar")
    with Stack("control") as stack:
        sidecar = stack.start_sidecar()
        host = stack.start_host(sidecar, ["fast"])
        uncached_host = stack.start_host(sidecar, ["fast"], name="host-nocache", host_keys=["status_cache_entries = 0"])
        governed, uncached = Governed(host), Governed(uncached_host)
        side = async_client(sidecar.base_url, SIDECAR_TOKEN)
        try:
            result, _ = await governed.governed_run("fast", {"topic": "status"})
            run_id = result["action_id"]
            uncached_run_id = (await uncached.governed_run("fast", {"topic": "status"}))[0]["action_id"]
            job_path = f"/jobs/{TENANT}:{run_id}"
            view = await side.get(job_path)
            bare = stack.start_bare(view.content)
            bare_client = async_client(bare.base_url)
            proxy = stack.start_proxy(sidecar, f"/jobs/{TENANT}:{uncached_run_id}")
            proxy_client = async_client(proxy.base_url)
            try:

                def via(through: Governed, run: str) -> Timed:
                    async def timed() -> float:
                        body = envelope("cap:crewai:fast:status", {"run_action_id": run}, action_id=new_id("act"))
                        started = time.perf_counter()
                        answer = await through.post(body)
                        elapsed = time.perf_counter() - started
                        if answer["status"] != "completed" or answer["output"]["status"] != "completed":
                            raise BenchError(f"status through the host answered {answer}")
                        return elapsed

                    return timed

                async def via_sidecar() -> float:
                    started = time.perf_counter()
                    response = await side.get(job_path)
                    elapsed = time.perf_counter() - started
                    if response.status_code != 200:
                        raise BenchError(f"sidecar answered {response.status_code}")
                    return elapsed

                async def via_bare() -> float:
                    started = time.perf_counter()
                    response = await bare_client.get(job_path)
                    elapsed = time.perf_counter() - started
                    if response.status_code != 200 or response.content != view.content:
                        raise BenchError("bare server answered something else")
                    return elapsed

                async def via_proxy() -> float:
                    # the same envelope as the host's, so that both read and decode as many bytes
                    body = envelope(
                        "cap:crewai:fast:status", {"run_action_id": uncached_run_id}, action_id=new_id("act")
                    )
                    started = time.perf_counter()
                    response = await proxy_client.post("/aip/v1/messages", content=body)
                    elapsed = time.perf_counter() - started
                    if response.status_code != 200 or response.json()["output"]["status"] != "completed":
                        raise BenchError(f"the bare proxy answered {response.status_code}: {response.text[:200]}")
                    return elapsed

                samples = await interleave(
                    {
                        "host": via(governed, run_id),
                        "host_uncached": via(uncached, uncached_run_id),
                        "sidecar": via_sidecar,
                        "bare": via_bare,
                        "proxy": via_proxy,
                    },
                    rounds=ROUNDS,
                    warmup=WARMUP,
                    budget_s=BUDGET_S,
                )
            finally:
                await bare_client.aclose()
                await proxy_client.aclose()
        finally:
            await side.aclose()
            await governed.aclose()
            await uncached.aclose()
    host_s, uncached_s, side_s, bare_s, proxy_s = (
        Stats.of(samples[k]) for k in ("host", "host_uncached", "sidecar", "bare", "proxy")
    )
    section.rows += [
        latency_row("status: host path vs bare hop", host_s, bare_s, max_ratio=MAX_RATIO),
        latency_row("status (cache off): host path vs bare hop", uncached_s, bare_s, max_ratio=MAX_RATIO),
        latency_row("status: sidecar direct vs bare hop", side_s, bare_s, max_ratio=MAX_SIDECAR_RATIO),
        latency_row("status: host path vs sidecar direct", host_s, side_s, max_ratio=None),
        latency_row("status: bare proxy of the sidecar's answer vs bare hop", proxy_s, bare_s, max_ratio=None),
        latency_row("status (cache off): host path vs bare proxy", uncached_s, proxy_s, max_ratio=None),
    ]
    allowed = MAX_RATIO * bare_s.p50 - proxy_s.p50
    section.notes += [
        f"{host_s.n} interleaved rounds after {WARMUP} warm-up rounds; one request at a time, kept-alive "
        "connections, the same httpx client code for all five paths.",
        "The host path answers the completed run's final job view from its cache (no sidecar hop; the read is "
        "still recorded as an action); the cache-off host (`status_cache_entries = 0`) asks the sidecar on "
        "every call, as any status of a running job does.",
        f"Response body: {len(view.content)} bytes (the sidecar's job view of a completed `fast` run).",
        "The bare proxy (`bench.bare --proxy`, Starlette on Hypercorn) answers the same envelope with the sidecar's "
        "answer, asked through aiohttp as the cache-off host asks it: two Hypercorn servers and one client hop "
        "with nothing of a governed read (no authentication, fence, action record or AIP envelope).",
        f"Floor of a host that asks the sidecar: the bare proxy, {proxy_s.p50 * 1000:.2f} ms = "
        f"{proxy_s.p50 / bare_s.p50:.2f}× the bare hop. The target ({MAX_RATIO:g}× = "
        f"{MAX_RATIO * bare_s.p50 * 1000:.2f} ms) leaves {allowed * 1000:.2f} ms for the host's own work "
        f"(authentication, fences, the action record, the AIP envelope, logging); the cache-off host's takes "
        f"{(uncached_s.p50 - proxy_s.p50) * 1000:.2f} ms, the cached host's "
        f"{(host_s.p50 - bare_s.p50) * 1000:.2f} ms over the one hop.",
    ]
    return section
