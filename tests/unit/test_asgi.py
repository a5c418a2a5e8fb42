"""aip_crewai/plumbing/asgi.py: the shared pure-ASGI guards (README "Security")."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import PlainTextResponse

from aip_crewai.plumbing.asgi import BodyDeadline, InFlightLimit


class TooSlow(Exception):
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s


def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/", "headers": []}


async def test_body_deadline_times_out_a_stalled_body_but_never_a_response_after_the_body():
    """A pause inside the body fails the read; once the body is complete, waiting for a disconnect
    (what an SSE response does for its whole life) is never timed out."""
    reads: list[str] = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            reads.append(message["type"])
            if message["type"] == "http.disconnect":
                return

    async def complete_then_late_disconnect():
        if not reads:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(0.3)  # longer than idle_s: the client is quietly reading a stream
        return {"type": "http.disconnect"}

    guarded = BodyDeadline(app, idle_s=0.05, total_s=30.0, timed_out=TooSlow)
    await guarded(_scope(), complete_then_late_disconnect, None)
    assert reads == ["http.request", "http.disconnect"]

    async def stalls():
        if not reads[2:]:
            reads.append("first")
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.Event().wait()  # the client never sends the rest
        return {"type": "http.request", "body": b"}", "more_body": False}

    with pytest.raises(TooSlow) as caught:
        await guarded(_scope(), stalls, None)
    assert caught.value.limit_s == 0.05


async def test_in_flight_limit_refuses_one_more_request_with_503_and_close():
    release = asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()
        await PlainTextResponse("ok")(scope, receive, send)

    guarded = InFlightLimit(app, limit=1, reject=lambda: PlainTextResponse("busy", status_code=503))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    first = asyncio.create_task(guarded(_scope(), receive, send))
    await asyncio.sleep(0)
    await guarded(_scope(), receive, send)
    assert sent[0]["status"] == 503 and (b"connection", b"close") in sent[0]["headers"]
    release.set()
    await first
    assert sent[-2]["status"] == 200 and guarded.in_flight == 0
