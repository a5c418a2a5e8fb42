"""aip_crewai/plumbing/asgi.py: the shared pure-ASGI guards (docs/security.md "Security")."""

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


class Exhausted(Exception):
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes


def test_a_body_budget_takes_up_to_its_limit_exactly_and_gives_back_what_each_request_held():
    """docs/security.md "Security" (bodies before authentication): the limit fits, limit + 1 does not; a refused
    take holds nothing; release gives back exactly a request's own share, once."""
    from aip_crewai.plumbing.asgi import BodyBudget

    budget = BodyBudget(100, Exhausted)
    first, second, third = _scope(), _scope(), _scope()
    budget.take(first, 60)
    budget.take(second, 40)
    assert budget.used_bytes == 100
    with pytest.raises(Exhausted) as refused:
        budget.take(third, 1)
    assert refused.value.limit_bytes == 100 and budget.used_bytes == 100
    budget.release(third)
    assert budget.used_bytes == 100
    budget.release(first)
    budget.release(first)
    assert budget.used_bytes == 40
    budget.take(third, 60)
    assert budget.used_bytes == 100


async def test_release_body_budget_gives_back_a_request_s_share_however_it_ends():
    from aip_crewai.plumbing.asgi import BodyBudget, ReleaseBodyBudget

    budget = BodyBudget(100, Exhausted)

    async def failing(scope, receive, send):
        budget.take(scope, 70)
        raise RuntimeError("the handler failed")

    with pytest.raises(RuntimeError):
        await ReleaseBodyBudget(failing, budget)(_scope(), None, None)
    assert budget.used_bytes == 0


def test_head_size_counts_a_head_as_written_on_the_wire():
    from aip_crewai.plumbing.asgi import head_size

    wire = b"POST /a/b?x=1 HTTP/1.1\r\nhost: h\r\nauthorization: Bearer t\r\n\r\n"
    scope = {
        "type": "http",
        "method": "POST",
        "http_version": "1.1",
        "raw_path": b"/a/b",
        "query_string": b"x=1",
        "headers": [(b"host", b"h"), (b"authorization", b"Bearer t")],
    }
    assert head_size(scope) == len(wire)
    assert head_size({**scope, "query_string": b""}) == len(wire) - len(b"?x=1")


@pytest.mark.parametrize("extra, refused", [(0, False), (1, True)])
async def test_bounded_head_serves_its_limit_and_refuses_one_byte_more_with_connection_close(extra, refused):
    from aip_crewai.plumbing.asgi import BoundedHead, head_size

    scope = {**_scope(), "raw_path": b"/", "http_version": "1.1", "headers": [(b"x-pad", b"p" * 100)]}
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        await PlainTextResponse("served")(scope, receive, send)

    guarded = BoundedHead(app, head_size(scope) - extra, lambda: PlainTextResponse("too large", status_code=431))
    await guarded(scope, None, send)
    assert sent[0]["status"] == (431 if refused else 200)
    assert ((b"connection", b"close") in sent[0]["headers"]) == refused
