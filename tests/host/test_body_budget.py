"""The host's budget of request bodies read before authentication (docs/security.md "Security": bodies before
authentication): many slow unauthenticated bodies fill it, one more is 503 with ``Retry-After`` and a typed
body, a bearer-authenticated body still goes through, and everything is given back when they end."""

from __future__ import annotations

import asyncio
import dataclasses

from kits.hostapp import bearer, envelope, running
from kits.poll import until_async

from aip_crewai.host.http.state import host_state
from aip_crewai.host.settings import MIN_BODY_BUDGET_BYTES

PIECE = 20 * 1024
SLOW_BODIES = 100


async def test_slow_unauthenticated_bodies_are_bounded_in_total_and_authenticated_ones_keep_their_share(
    make_app, settings
):
    app = make_app(dataclasses.replace(settings, body_budget_bytes=MIN_BODY_BUDGET_BYTES))
    gate = asyncio.Event()

    async def slow_body(first: int):
        yield b" " * first  # JSON whitespace: the envelope comes after the gate
        await gate.wait()
        yield b"{}"

    async with running(app) as http:
        budget = host_state(app).body_budget
        assert budget.limit_bytes == 2 * 1024 * 1024
        post = "/aip/v1/messages"
        slow = [
            asyncio.create_task(http.post(post, content=slow_body(PIECE), headers={"Content-Type": "application/json"}))
            for _ in range(SLOW_BODIES)
        ]
        await until_async(lambda: budget.used_bytes == SLOW_BODIES * PIECE, what="the slow bodies to hold the budget")
        refused = await http.post(post, content=slow_body(64 * 1024), headers={"Content-Type": "application/json"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["body"]["error"]["error"]
        assert error["code"] == "server.body_budget_exhausted" and error["details"] == {
            "budget_bytes": MIN_BODY_BUDGET_BYTES
        }
        assert budget.used_bytes == SLOW_BODIES * PIECE  # the refused body holds nothing
        authenticated = await http.post(post, json=envelope("msg_budget"), headers=bearer("acme-invoker"))
        assert authenticated.status_code != 503 and budget.used_bytes == SLOW_BODIES * PIECE
        gate.set()
        answers = await asyncio.gather(*slow)
        assert {a.status_code for a in answers} == {401}  # read in full, then unauthenticated
        assert budget.used_bytes == 0
        again = await http.post(post, content=b" " * 64 * 1024 + b"{}", headers={"Content-Type": "application/json"})
        assert again.status_code == 401


async def test_a_declared_length_is_taken_whole_and_given_back_once_the_signer_is_authenticated(make_app, settings):
    """A declared body takes its whole ``Content-Length`` at its first read; the budget is given back when
    the request is authenticated (not when it ends: a blocking call may last long after)."""
    app = make_app(dataclasses.replace(settings, body_budget_bytes=MIN_BODY_BUDGET_BYTES))
    async with running(app) as http:
        budget = host_state(app).body_budget
        body = b" " * (MIN_BODY_BUDGET_BYTES - 10) + b"{}"
        fits = await http.post("/aip/v1/messages", content=body, headers={"Content-Type": "application/json"})
        assert fits.status_code == 401 and budget.used_bytes == 0
        seen: list[int] = []
        original = budget.take

        def spy(scope, size):
            seen.append(size)
            original(scope, size)

        budget.take = spy
        await http.post("/aip/v1/messages", content=body, headers={"Content-Type": "application/json"})
        assert seen == [len(body)]


async def test_the_budget_is_read_from_host_toml(host_files):
    from kits.hostapp import base_document

    from aip_crewai.host.config import HostConfigError, load_settings

    doc = base_document()
    assert load_settings(host_files.write(doc)).body_budget_bytes == 64 * 1024 * 1024
    doc["host"]["unauthenticated_body_budget_bytes"] = MIN_BODY_BUDGET_BYTES
    assert load_settings(host_files.write(doc)).body_budget_bytes == MIN_BODY_BUDGET_BYTES
    doc["host"]["unauthenticated_body_budget_bytes"] = MIN_BODY_BUDGET_BYTES - 1
    try:
        load_settings(host_files.write(doc))
    except HostConfigError as exc:
        assert "unauthenticated_body_budget_bytes" in str(exc)
    else:
        raise AssertionError("a budget below one message body was accepted")


def test_the_budget_floor_is_one_whole_message_body():
    from aip_crewai.host.http.routes import MAX_MESSAGE_BYTES

    assert MIN_BODY_BUDGET_BYTES == MAX_MESSAGE_BYTES
