"""A corpus of sidecar event streams, malformed and valid, and two fake sidecars that serve them.

Each case of :data:`CASES` is a list of ``(bytes, delay seconds)`` pieces the
fake writes in order (delays make TCP deliver pieces separately), and the
expected AIP outcome: ``"completed"`` (the stream is valid) or an error code
(ARCHITECTURE.md §8: ``connector.crewai.invalid_stream`` /
``connector.crewai.response_too_large``). The case is chosen by the run
input's ``topic``.

- :class:`StreamingTransport`: an ``httpx`` transport for the in-process host
  (``relkit.inproc_app``); every other route is :class:`FakeSidecar`'s.
- :class:`FakeSidecarServer`: a real HTTP/1.1 server on loopback (a thread with
  its own event loop) for a real host process; it serves ``/health`` as a
  ready sidecar for the host configuration of ``relkit`` and answers cancels.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx2
from kits.poll import until

from aip_crewai.sse import encode_event

INVALID = "connector.crewai.invalid_stream"
TOO_LARGE = "connector.crewai.response_too_large"
Pieces = list[tuple[bytes, float]]


def frame(event: str, sequence: int, data: dict[str, Any]) -> bytes:
    body = json.dumps({"event": event, "sequence": sequence, "data": data}, separators=(",", ":"), ensure_ascii=False)
    return encode_event(body, event=event, id=str(sequence))


def good(text: tuple[str, ...] = ("Hel", "lo")) -> bytes:
    """started, one llm chunk per text, completed."""
    frames = [frame("started", 0, {"status": "running", "operation": "run"})]
    frames += [frame("chunk", i + 1, {"content": t, "channel": "llm"}) for i, t in enumerate(text)]
    frames.append(frame("completed", len(text) + 1, {"raw": "".join(text), "tasks_output": []}))
    return b"".join(frames)


def whole(data: bytes) -> Pieces:
    return [(data, 0.0)]


def split_after(data: bytes, marker: bytes, delay: float = 0.005) -> Pieces:
    """Pieces that end right after each ``marker`` (so the next byte arrives in another read)."""
    pieces, start = [], 0
    while (index := data.find(marker, start)) != -1:
        pieces.append((data[start : index + len(marker)], delay))
        start = index + len(marker)
    pieces.append((data[start:], 0.0))
    return [p for p in pieces if p[0]]


def trickle(data: bytes, delay: float = 0.01) -> Pieces:
    return [(data[i : i + 1], delay) for i in range(len(data))]


def oversize(total: int, piece: int = 65536) -> Pieces:
    """A started event, then one frame that never ends: ``total`` bytes without a line end."""
    head = frame("started", 0, {"status": "running", "operation": "run"}) + b"data: "
    return [(head, 0.0)] + [(b"x" * piece, 0.0) for _ in range(total // piece)]


def too_many(events: int) -> Pieces:
    """``events`` chunk events after started, then completed (in pieces of 1000 frames)."""
    frames = [frame("started", 0, {"status": "running", "operation": "run"})]
    frames += [frame("chunk", i, {"content": "x", "channel": "llm"}) for i in range(1, events + 1)]
    frames.append(frame("completed", events + 1, {"raw": "x"}))
    return [(b"".join(frames[i : i + 1000]), 0.0) for i in range(0, len(frames), 1000)]


def nested_past_the_decoders_bound(depth: int = 100_000) -> bytes:
    """started, a chunk event whose data nests ``depth`` arrays deep (past msgspec's bound on every supported
    Python, well under the host's 1 MiB frame bound), then a completed event: only the deep frame is wrong."""
    deep = b'{"event":"chunk","sequence":1,"data":{"x":' + b"[" * depth + b"]" * depth + b"}}"
    started = frame("started", 0, {"status": "running", "operation": "run"})
    return started + b"event: chunk\nid: 1\ndata: " + deep + b"\n\n" + frame("completed", 2, {"raw": ""})


def crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


@dataclass(frozen=True)
class Case:
    pieces: Pieces
    expect: str  # "completed" or an error code
    text: str | None = None  # expected concatenated chunk text when completed


_U2028 = "a\u2028b"
_SPLIT_UTF8 = good(("h\u00e9", "llo"))
CASES: dict[str, Case] = {
    "crlf_split_between_cr_and_lf": Case(split_after(crlf(good()), b"\r"), "completed", "Hello"),
    "bom_at_start": Case(whole(b"\xef\xbb\xbf" + good()), "completed", "Hello"),
    "u2028_inside_data": Case(whole(good((_U2028,))), "completed", _U2028),
    "utf8_split_across_reads": Case(
        [(_SPLIT_UTF8[: _SPLIT_UTF8.index(b"\xc3") + 1], 0.005), (_SPLIT_UTF8[_SPLIT_UTF8.index(b"\xc3") + 1 :], 0.0)],
        "completed",
        "h\u00e9llo",
    ),
    "keepalive_comments_between_events": Case(
        whole(good().replace(b"\n\n", b"\n\n: keep-alive\n\n")), "completed", "Hello"
    ),
    "invalid_utf8_in_a_string": Case(whole(good().replace(b"Hel", b"H\xffl")), "completed", "H\ufffdllo"),
    "invalid_utf8_breaking_json": Case(whole(frame("started", 0, {}) + b"data: {\xff}\n\n"), INVALID),
    "no_terminal_event": Case(whole(good()[: good().index(b"event: completed")]), INVALID),
    "sequence_gap": Case(whole(frame("started", 0, {}) + frame("completed", 2, {})), INVALID),
    "sequence_repeat": Case(
        whole(frame("started", 0, {}) + frame("started", 0, {}) + frame("completed", 1, {})), INVALID
    ),
    "event_after_terminal": Case(whole(good() + frame("chunk", 4, {"content": "late", "channel": "llm"})), INVALID),
    "oversize_frame": Case(oversize(8 * 1024 * 1024), INVALID),
    "trickle_one_byte_per_10ms": Case(trickle(good()), "completed", "Hello"),
    "empty_body": Case([], INVALID),
    "frame_nested_past_the_decoders_bound": Case(whole(nested_past_the_decoders_bound()), INVALID),
}
#: Cases cheap enough for the in-process host (the trickle runs over real HTTP only).
INPROC = [name for name in CASES if not name.startswith("trickle")]
#: Cases where a real socket adds something (read boundaries, timing, process memory).
OVER_HTTP = [
    "crlf_split_between_cr_and_lf",
    "bom_at_start",
    "u2028_inside_data",
    "utf8_split_across_reads",
    "trickle_one_byte_per_10ms",
    "no_terminal_event",
    "oversize_frame",
    "invalid_utf8_in_a_string",
]


def stream_case(name: str, *, big: bool = False) -> Case:
    """The case ``name``; ``big`` makes the oversize frame 64 MiB (a real process's memory check)."""
    if big and name == "oversize_frame":
        return Case(oversize(64 * 1024 * 1024), INVALID)
    if name == "too_many_events":
        return Case(too_many(100_000), INVALID)
    if name == "alive_for_30s":  # a long job: started, keep-alives for 30 s, then completed
        pieces = [(frame("started", 0, {"status": "running", "operation": "run"}), 0.1)]
        pieces += [(b": keep-alive\n\n", 0.1)] * 300
        return Case(pieces + [(frame("completed", 1, {"raw": ""}), 0.0)], "completed")
    if name == "response_too_large":  # with the host's max_response_bytes set to 65536
        return Case(whole(good(tuple("y" * 1000 for _ in range(100)))), TOO_LARGE)
    return CASES[name]


# ------------------------------------------------------- in-process fake


class StreamingTransport(httpx2.AsyncBaseTransport):
    """``POST /jobs/stream`` streams the case named by the input topic; the rest is ``fake``'s."""

    def __init__(self, fake: Any) -> None:
        from kits import hostapp as hostkit

        self.fake = fake
        self.cancels: list[str] = []
        self.health = hostkit.HealthSidecar().health  # ready for the hostkit crews

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/health":
            return httpx2.Response(200, json=self.health)
        if request.url.path == "/jobs/stream":
            await request.aread()
            body = json.loads(request.content)
            case = stream_case(str(body["input"].get("topic")))
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=_play(case.pieces))
        if request.url.path.endswith("/cancel"):
            self.cancels.append(request.url.path)
            await request.aread()
            job_id = json.loads(request.content)["action_id"]
            return httpx2.Response(
                200,
                json={
                    "action_id": job_id,
                    "status": "cancelled",
                    "event_count": 1,
                    "output": None,
                    "provider_stop_observed": True,
                },
            )
        response = self.fake.handle(request)
        return response


async def _play(pieces: Pieces) -> AsyncIterator[bytes]:
    for data, delay in pieces:
        yield data
        if delay:
            await asyncio.sleep(delay)


# ---------------------------------------------------------- real HTTP fake


class FakeSidecarServer:
    """A loopback HTTP/1.1 sidecar serving :data:`CASES` (one request per connection)."""

    def __init__(self, token: str, crews: list[str], operations: list[str], *, big: bool = True) -> None:
        self.token = token
        self.health = {
            "status": "ready",
            "crews": sorted(crews),
            "active_runs": 0,
            "retained_runs": 0,
            "max_retained_runs": 2000,
            "durable_journal": True,
            "stream_checkpoint_events": 128,
            "operations": sorted(operations),
            "training_directory": False,
        }
        self.big = big
        self.requests: list[tuple[str, str]] = []
        #: ``"METHOD /path-prefix"`` entries this server receives but never answers (a frozen sidecar).
        self.frozen: set[str] = set()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(started,), daemon=True, name="fake-sidecar")
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake sidecar did not start")
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((method, path))
            if any(f"{method} {path}".startswith(prefix) for prefix in self.frozen):
                await asyncio.Event().wait()  # never answers (until the server closes)
            if headers.get("authorization") != f"Bearer {self.token}":
                await self._json(writer, 401, {"detail": "missing or invalid bearer token"})
            elif method == "GET" and path == "/health":
                await self._json(writer, 200, self.health)
            elif method == "POST" and path == "/jobs/stream":
                case = stream_case(str(json.loads(body)["input"].get("topic")), big=self.big)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    b"Connection: close\r\n\r\n"
                )
                for data, delay in case.pieces:
                    writer.write(data)
                    await writer.drain()
                    if delay:
                        await asyncio.sleep(delay)
            elif method == "GET" and path.startswith("/jobs/") and path.count("/") == 2:
                await self._json(
                    writer,
                    200,
                    {
                        "action_id": path[6:],
                        "crew_id": "beta",
                        "operation": "run",
                        "status": "completed",
                        "event_count": 4,
                        "output": {"raw": "Hello"},
                    },
                )
            elif method == "POST" and path.endswith("/cancel"):
                job_id = json.loads(body)["action_id"]
                await self._json(
                    writer,
                    200,
                    {
                        "action_id": job_id,
                        "status": "cancelled",
                        "event_count": 1,
                        "output": None,
                        "provider_stop_observed": True,
                    },
                )
            else:
                await self._json(writer, 404, {"detail": "not found"})
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _json(writer: asyncio.StreamWriter, status: int, value: Any) -> None:
        data = json.dumps(value).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


# ----------------------------------------------------------------- runner


Request = Any  # (method, url, **kwargs) -> (status, headers, content bytes)


@dataclass(frozen=True)
class Principals:
    """Who calls and who approves on a given host, and the run capability to use."""

    invoker: dict[str, str]
    approver: dict[str, str]
    capability: str


def run_case(request: Request, who: Principals, name: str, action_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """Run the stream case ``name`` as a governed run through a host; return
    ``{"status", "code", "text", "details"}`` of the stored result."""

    from aip_crewai.client import now_rfc3339

    env = {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": f"msg_{action_id}",
        "sent_at": now_rfc3339(),
        "body": {
            "action": {
                "id": action_id,
                "capability_id": who.capability,
                "input": {"topic": name},
                "idempotency_key": action_id,
            }
        },
    }
    status, _, content = request("POST", "/aip/v1/messages", json=env, headers=who.invoker)
    assert status == 202, content[:300]
    approval_id = json.loads(content)["body"]["action_result"]["output"]["approval_id"]
    status, _, content = request(
        "POST",
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=who.approver,
        json={"decision": "approved", "reason": "stream corpus"},
    )
    assert status == 200, content[:300]

    def settled() -> bool:
        _, _, content = request("GET", f"/aip/v1/actions/{action_id}", headers=who.invoker)
        return json.loads(content)["state"] not in ("queued", "running", "pending_approval")

    until(settled, timeout=timeout, what=f"{name}: the action settled")
    _, _, content = request("GET", f"/aip/v1/actions/{action_id}/result", headers=who.invoker)
    result = json.loads(content)["body"]["action_result"]
    texts, cursor = [], 0
    while True:
        _, _, content = request("GET", f"/aip/v1/actions/{action_id}/chunks?cursor={cursor}", headers=who.invoker)
        page = json.loads(content)
        texts += [c["part"]["text"] for c in page["chunks"] if c.get("kind") == "data" and c.get("part")]
        if page.get("cursor") is None or not page["chunks"]:
            break
        cursor = int(page["cursor"])
    error = result.get("error") or {}
    return {
        "status": result["status"],
        "code": error.get("code"),
        "text": "".join(texts),
        "details": error.get("details") or {},
    }


def check_case(name: str, outcome: dict[str, Any], case: Case) -> None:
    """Raise AssertionError unless ``outcome`` is what ``case`` documents."""
    if case.expect == "completed":
        assert outcome["status"] == "completed", f"{name}: {outcome}"
        if case.text is not None:
            assert outcome["text"] == case.text, f"{name}: text {outcome['text']!r} != {case.text!r}"
    else:
        assert outcome["status"] == "failed" and outcome["code"] == case.expect, f"{name}: {outcome}"
        assert outcome["details"].get("cancel_confirmed") is True, f"{name}: no cancel after the failure: {outcome}"
