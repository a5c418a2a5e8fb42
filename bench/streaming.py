"""Streaming: chunks per second of the ``chatty`` crew (1,000 chunks per run).

Live run, interleaved rounds (the sidecar runs with ``--max-events-per-run
2000`` so all 1,000 chunks are published):

- **sidecar**: ``POST /jobs/stream`` read directly.
- **host** (ours): submit ``cap:crewai:chatty`` (→ ``pending_approval``),
  approve, then ``POST /aip/v1/messages`` again with the same action id and
  key and ``Accept: text/event-stream``: the host follows the live action.
  On the way each sidecar event crosses the host's normalizer
  (``StreamNormalizer``), the host store and the follower.

Rate = data chunks / window, the window running from the first
data chunk received to the terminal event received (sidecar ``completed``,
host ``result``), so crew start-up and the approval are outside it.

Recorded replay (pipeline-bound: no crew runs): the sidecar's ``GET
/jobs/{id}/events`` SSE of a completed chatty job (1,002 events) versus the
host's ``cap:crewai:chatty:events`` action streamed with ``Accept:
text/event-stream`` (dispatch → normalizer → store → follower), timed from
the request to the terminal event.

Decoder alone: :class:`aip_crewai.sse.SSEDecoder` fed the recorded sidecar
stream in 16 KiB pieces, versus a bare frame split of the same bytes
(``bytes.split`` on blank lines, then lines; no CR handling, no bounds); and
the host's ``StreamNormalizer`` alone on the same bytes.

The host's own replay of a finished action: ``GET
/aip/v1/actions/{id}/events`` with ``Accept: text/event-stream`` of the live
round's action (the stored chunks; no sidecar involved), 1,004 events (ack,
1,001 chunks, result), whole AIP envelopes.

The sidecar's replay alone: the same recorded stream read
raw over one kept-alive connection, 40 requests, interleaved with the bare
server of :mod:`bench.bare` answering the very same bytes (this run's floor).

Targets: host live ≥ 0.9× the sidecar; host GET replay ≥ 0.8× the sidecar's
replay; the sidecar's replay alone ≥ 1.5× the reference sidecar's 67,900
events/s (measured once on this class of machine, bench/results/HISTORY.md; not re-measured here, its code is not in this
repository); decoder ≥ 100,000 events/s (the ``:events`` action and
normalizer rows are reported without a target).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx2

from aip_crewai.contracts import operations as ops
from aip_crewai.host.actions.normalize import StreamNormalizer
from aip_crewai.sse import SSEDecoder
from bench.common import (
    AIP_CONTENT_TYPE,
    SIDECAR_TOKEN,
    TENANT,
    BenchError,
    Governed,
    Section,
    Stack,
    Stats,
    async_client,
    envelope,
    new_id,
    rate_row,
)

LIVE_ROUNDS = 31
REPLAY_ROUNDS = 15
#: Requests of the sidecar-alone replay row (and of its bare baseline), after one warm-up each.
RAW_REPLAY_ROUNDS = 40
#: The reference sidecar's replay rate of the same job, measured once on this class of machine (bench/results/HISTORY.md) (its
#: code is not in this repository, so it cannot run here); item 1's target is 1.5× it.
REFERENCE_REPLAY_EVENTS_PER_S = 67_900
CHUNKS = 1000
PIECE_BYTES = 16 * 1024
DECODE_SECONDS = 1.0
MIN_DECODER_RATE = 100_000.0
MIN_RATIO = 0.9
#: Host replay of a finished action's stream (GET .../events) vs the sidecar's own replay.
MIN_REPLAY_RATIO = 0.8


async def _read_raw(client: httpx2.AsyncClient, url: str) -> int:
    """GET ``url`` as SSE and read the whole body without parsing it; returns its size in bytes."""
    size = 0
    async with client.stream("GET", url, headers={"Accept": "text/event-stream"}) as response:
        if response.status_code != 200:
            raise BenchError(f"GET {url} answered {response.status_code}")
        async for piece in response.aiter_raw():
            size += len(piece)
    return size


async def read_sse(
    client: httpx2.AsyncClient, method: str, url: str, **kwargs: Any
) -> tuple[list[tuple[str, float]], bytes]:
    """Stream an SSE response; return [(event name, perf_counter at receipt)] and the raw bytes."""
    decoder, events, raw = SSEDecoder(), [], bytearray()
    headers = {"Accept": "text/event-stream", **kwargs.pop("headers", {})}
    async with client.stream(method, url, headers=headers, **kwargs) as response:
        if response.status_code != 200:
            await response.aread()
            raise BenchError(f"{method} {url} answered {response.status_code}: {response.text[:200]}")
        async for piece in response.aiter_bytes():
            now = time.perf_counter()
            raw += piece
            events += [(event.event, now) for event in decoder.feed(piece)]
    decoder.close()
    return events, bytes(raw)


def _window(events: list[tuple[str, float]], first_data: int, terminal: str) -> tuple[int, float]:
    """(data chunks, seconds from the first data chunk to the terminal event)."""
    chunk_times = [t for name, t in events if name == "chunk"][first_data:]
    end = next((t for name, t in events if name == terminal), None)
    if not chunk_times or end is None:
        raise BenchError(f"stream without chunks or {terminal}: {[n for n, _ in events][:5]}…")
    return len(chunk_times), end - chunk_times[0]


def _decode_rate(raw: bytes, fn: Any) -> float:
    """Seconds per event of ``fn(pieces)`` (returns the event count), over DECODE_SECONDS."""
    pieces = [raw[i : i + PIECE_BYTES] for i in range(0, len(raw), PIECE_BYTES)]
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < DECODE_SECONDS:
        count += fn(pieces)
    return (time.perf_counter() - started) / count


def _sse_decoder(pieces: list[bytes]) -> int:
    decoder = SSEDecoder()
    count = sum(len(decoder.feed(piece)) for piece in pieces)
    return count + len(decoder.close())


def _bare_split(pieces: list[bytes]) -> int:
    frames = b"".join(pieces).split(b"\n\n")
    count = 0
    for frame in frames:
        fields = [line.partition(b":") for line in frame.split(b"\n")]
        if any(name == b"data" for name, _, _ in fields):
            count += 1
    return count


def _normalizer(pieces: list[bytes]) -> int:
    normalizer = StreamNormalizer("act_bench", ops.get("run"))
    count = sum(len(normalizer.feed(piece)) for piece in pieces)
    normalizer.close()
    return count


async def run() -> Section:
    section = Section("streaming", "3. Streaming: 1,000 chunks through the host's normalizer vs the sidecar")
    live: dict[str, list[float]] = {"sidecar": [], "host": []}
    replay: dict[str, list[float]] = {"sidecar": [], "host": [], "host_get": []}
    with Stack("stream") as stack:
        sidecar = stack.start_sidecar("--max-events-per-run", "2000")
        host = stack.start_host(sidecar, ["chatty"])
        governed = Governed(host)
        side = async_client(sidecar.base_url, SIDECAR_TOKEN)
        try:

            async def live_sidecar() -> str:
                job_id = f"direct:{uuid.uuid4().hex}"
                body = {"crew_id": "chatty", "action_id": job_id, "operation": "run", "input": {"topic": "rivers"}}
                events, _ = await read_sse(
                    side,
                    "POST",
                    "/jobs/stream",
                    json=body,
                    headers={"Idempotency-Key": new_id("key"), "X-AIP-Action-ID": job_id},
                )
                chunks, seconds = _window(events, 0, "completed")
                if chunks != CHUNKS:
                    raise BenchError(f"sidecar streamed {chunks} chunks, expected {CHUNKS}")
                live["sidecar"].append(seconds)
                return job_id

            async def live_host() -> str:
                body, approval_id = await governed.submit("chatty", {"topic": "rivers"})
                await governed.decide(approval_id)
                events, _ = await read_sse(
                    governed.app, "POST", "/aip/v1/messages", content=body, headers={"Content-Type": AIP_CONTENT_TYPE}
                )
                # host chunk events: the `started` progress chunk, then the data chunks; `done`; `result`
                chunks, seconds = _window(events, 1, "result")
                if chunks != CHUNKS:
                    raise BenchError(f"host streamed {chunks} data chunks, expected {CHUNKS}")
                live["host"].append(seconds)
                return str(json.loads(body)["body"]["action"]["id"])

            host_run = ""
            for i in range(LIVE_ROUNDS + 1):  # round 0 warms up
                if i % 2:
                    side_job, host_run = await live_sidecar(), await live_host()
                else:
                    host_run, side_job = await live_host(), await live_sidecar()
                if i == 0:
                    live["sidecar"].clear()
                    live["host"].clear()
            recorded: bytes = b""
            for i in range(REPLAY_ROUNDS + 1):
                started = time.perf_counter()
                events, recorded = await read_sse(side, "GET", f"/jobs/{side_job}/events")
                replay["sidecar"].append(time.perf_counter() - started)
                if [name for name, _ in events].count("chunk") != CHUNKS:
                    raise BenchError("recorded sidecar stream lost chunks")
                body = envelope("cap:crewai:chatty:events", {"run_action_id": host_run}, action_id=new_id("act"))
                started = time.perf_counter()
                events, _ = await read_sse(
                    governed.app, "POST", "/aip/v1/messages", content=body, headers={"Content-Type": AIP_CONTENT_TYPE}
                )
                replay["host"].append(time.perf_counter() - started)
                if [name for name, _ in events].count("chunk") != CHUNKS + 1 or events[-1][0] != "result":
                    raise BenchError("host replay did not deliver every chunk and the result")
                started = time.perf_counter()
                events, _ = await read_sse(governed.app, "GET", f"/aip/v1/actions/{host_run}/events")
                replay["host_get"].append(time.perf_counter() - started)
                if len(events) != CHUNKS + 4:
                    raise BenchError(f"host GET replay delivered {len(events)} events, expected {CHUNKS + 4}")
                if [name for name, _ in events].count("chunk") != CHUNKS + 1 or events[-1][0] != "result":
                    raise BenchError("host GET replay did not deliver every chunk and the result")
                if i == 0:
                    for samples in replay.values():
                        samples.clear()
            # Issue 22 item 1: the sidecar's replay on its own (raw bytes read, no client-side parsing), over
            # one kept-alive connection, interleaved with a bare server answering the very same bytes.
            bare = stack.start_bare(recorded)
            bare_client = async_client(bare.base_url)
            try:
                for i in range(RAW_REPLAY_ROUNDS + 1):
                    for name, client, url in (
                        ("sidecar_raw", side, f"/jobs/{side_job}/events"),
                        ("bare_raw", bare_client, f"/jobs/{side_job}"),
                    ):
                        started = time.perf_counter()
                        size = await _read_raw(client, url)
                        if i:
                            replay.setdefault(name, []).append(time.perf_counter() - started)
                        if size != len(recorded):
                            raise BenchError(f"{name} replay answered {size} bytes, expected {len(recorded)}")
            finally:
                await bare_client.aclose()
        finally:
            await side.aclose()
            await governed.aclose()
    decoder_s = _decode_rate(recorded, _sse_decoder)
    bare_s = _decode_rate(recorded, _bare_split)
    normalizer_s = _decode_rate(recorded, _normalizer)
    per_chunk = {k: Stats.of([s / CHUNKS for s in v]) for k, v in live.items()}
    # events per stream: the sidecar's 1,002; the host GET adds its ack and result frames to the 1,002
    events_of = {
        "sidecar": CHUNKS + 2,
        "host": CHUNKS + 2,
        "host_get": CHUNKS + 4,
        "sidecar_raw": CHUNKS + 2,
        "bare_raw": CHUNKS + 2,
    }
    per_event = {k: Stats.of([s / events_of[k] for s in v]) for k, v in replay.items()}
    section.rows += [
        rate_row(
            "live chatty run: host follower vs sidecar SSE",
            "chunks",
            per_chunk["host"],
            per_chunk["sidecar"],
            units=1,
            min_ratio=MIN_RATIO,
        ),
        rate_row(
            "recorded replay, sidecar alone (raw read) vs a bare server sending the same bytes",
            "events",
            per_event["sidecar_raw"],
            per_event["bare_raw"],
            units=1,
            min_ratio=None,
            min_rate=1.5 * REFERENCE_REPLAY_EVENTS_PER_S,
        ),
        rate_row(
            "recorded replay: host GET /aip/v1/actions/{id}/events vs sidecar events SSE",
            "events",
            per_event["host_get"],
            per_event["sidecar"],
            units=1,
            min_ratio=MIN_REPLAY_RATIO,
        ),
        rate_row(
            "recorded replay: host `:events` vs sidecar events SSE",
            "events",
            per_event["host"],
            per_event["sidecar"],
            units=1,
            min_ratio=None,
        ),
        rate_row(
            "SSEDecoder alone vs bare frame split",
            "events",
            Stats(1, decoder_s, decoder_s),
            Stats(1, bare_s, bare_s),
            units=1,
            min_ratio=None,
            min_rate=MIN_DECODER_RATE,
        ),
        rate_row(
            "StreamNormalizer alone vs SSEDecoder alone",
            "events",
            Stats(1, normalizer_s, normalizer_s),
            Stats(1, decoder_s, decoder_s),
            units=1,
            min_ratio=None,
        ),
    ]
    section.notes += [
        f"Sidecar alone: {RAW_REPLAY_ROUNDS} `GET /jobs/{{id}}/events` SSE requests of the completed "
        "chatty job (1,002 events) over one kept-alive connection, the body read raw (no client-side parsing), "
        "interleaved with a bare Starlette-on-Hypercorn server (`bench.bare`) answering the very same bytes in one "
        f"response. Target: 1.5× the reference sidecar's {REFERENCE_REPLAY_EVENTS_PER_S:,} events/s measured "
        "once on this class of machine (a fixed figure: the reference's code is not in this repository, so it "
        "is not re-measured here; the bare server is this run's floor).",
        f"Live: {len(live['host'])} interleaved rounds after one warm-up round; window from the first data chunk to "
        "the terminal event. The crew itself emits ~1,000 chunks in ~70–90 ms in-process, so the live rate is "
        "bounded by the crew on both paths; the recorded replay shows the pipelines' own ceiling.",
        f"Replay: {len(replay['host'])} interleaved rounds of 1,002 events each (host GET: 1,004, the ack "
        "and result frames included; rates per event, request to terminal event).",
        f"Decoder rows: the recorded sidecar stream ({len(recorded):,} bytes, 1,002 events) in "
        f"{PIECE_BYTES // 1024} KiB pieces, repeated for {DECODE_SECONDS:g} s each; p50 = p99 (one aggregate sample).",
        f"Tenant `{TENANT}`; the host SSE events are whole AIP envelopes (`chunk`, `done`, `result`).",
    ]
    return section
