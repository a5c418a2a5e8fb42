"""A sidecar reached directly: its status reads and events pages go through the aiohttp pool of
:class:`SidecarReads` (aip_crewai/host/sidecars/connection.py), and they fail, bound and send exactly as the
httpx2 path does (ARCHITECTURE.md §8, the sidecar client's pools). Real HTTP to a loopback server in this process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2
import pytest
from kits.poll import until_async

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import (
    ConnectorConfigurationOrInput,
    ConnectorRemoteRejected,
    ConnectorResponseTooLarge,
    ConnectorTransport,
)
from aip_crewai.host.http.lifespan import REQUEST_LIMITS, _sidecar_http
from aip_crewai.host.settings import SidecarSettings
from aip_crewai.host.sidecars import client as client_module
from aip_crewai.host.sidecars.client import DispatchProgress, SidecarClient
from aip_crewai.host.sidecars.connection import USER_AGENT, SidecarHttp

pytestmark = pytest.mark.timeout(30)

STATUS = ops.get("status")
VIEW = {"action_id": "acme:act_1", "status": "running"}

#: One request's head as the server read it: (request line, lower-cased header name -> value).
Head = tuple[str, dict[str, str]]
Answer = Callable[[Head, asyncio.StreamWriter], Awaitable[None]]


async def _json_answer(head: Head, writer: asyncio.StreamWriter, body: bytes = json.dumps(VIEW).encode()) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()


@contextlib.asynccontextmanager
async def _sidecar(answer: Answer = _json_answer) -> AsyncIterator[tuple[str, list[Head]]]:
    """A loopback HTTP/1.1 server: every request's head is recorded and ``answer`` writes the response
    (keep-alive). Yields the base URL and the recorded heads."""
    heads: list[Head] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                raw = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                fields = dict(line.split(": ", 1) for line in raw[1:] if line)
                heads.append((raw[0], {name.lower(): value for name, value in fields.items()}))
                await answer(heads[-1], writer)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", heads
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1)


def _http(url: str, **settings: object) -> SidecarHttp:
    return _sidecar_http(SidecarSettings("sidecar", url, "t0k3n", **settings), None)  # type: ignore[arg-type]


async def _get_job(http: SidecarHttp, job_id: str = "acme:act_1") -> tuple[object, DispatchProgress]:
    """The status read's answer, or what it raised, and the request's dispatch progress."""
    dispatch = DispatchProgress()
    try:
        return await SidecarClient(http, max_response_bytes=1 << 20).get_job(STATUS, dispatch, job_id=job_id), dispatch
    except Exception as exc:  # the outcome is the assertion
        return exc, dispatch


async def _read_from(answer: Answer, *job_ids: str) -> tuple[list[tuple[object, DispatchProgress]], list[Head]]:
    """Each status read of ``job_ids`` (default: one) from a loopback sidecar answering with ``answer``: its
    outcome and dispatch, and the heads the sidecar read."""
    async with _sidecar(answer) as (url, heads):
        http = _http(url)
        try:
            return [await _get_job(http, job_id) for job_id in job_ids or ("acme:act_1",)], heads
        finally:
            await http.aclose()


async def test_status_reads_and_events_pages_of_a_direct_sidecar_go_through_the_reads_pool_as_httpx_would_send_them():
    job_id = "acme:a\"b<c>{d}|e^`f'g[h]"  # visible ASCII a job id may hold
    async with _sidecar() as (url, heads):
        http = _http(url + "/prefix")
        assert http.reads is not None
        try:
            client = SidecarClient(http, max_response_bytes=1 << 20)
            assert await client.get_job(STATUS, DispatchProgress(), job_id=job_id) == VIEW
            assert await client.get_events(STATUS, DispatchProgress(), job_id="acme:act_1", cursor=17) == VIEW
            # the same URLs as the httpx2 pool's requests (and so as httpx2.AsyncClient(base_url=...))
            expected = [
                http.request("GET", f"/jobs/{job_id}", headers={}).url.raw_path,
                http.request("GET", "/jobs/acme:act_1/events", headers={}, params={"cursor": 17}).url.raw_path,
            ]
            assert [line for line, _ in heads] == [f"GET {path.decode()} HTTP/1.1" for path in expected]
            for _, fields in heads:
                assert fields["authorization"] == "Bearer t0k3n" and fields["user-agent"] == USER_AGENT
                assert "accept-encoding" not in fields and "accept" not in fields and "cookie" not in fields
            assert [fields["x-aip-action-id"] for _, fields in heads] == [job_id, "acme:act_1"]
            assert len(heads) == 2
        finally:
            await http.aclose()
        assert http.reads._session is None  # closed with the other pools
        # a base the config refuses (an empty fragment) still has its reads built from its raw path
        http = SidecarHttp.of(url + "/prefix/#", token="t0k3n", limits=REQUEST_LIMITS, job_limits=REQUEST_LIMITS)
        try:
            assert (
                await SidecarClient(http, max_response_bytes=1 << 20).get_job(
                    STATUS, DispatchProgress(), job_id="acme:act_1"
                )
                == VIEW
            )
        finally:
            await http.aclose()
        assert heads[-1][0] == "GET /prefix/jobs/acme:act_1 HTTP/1.1"


async def test_a_transport_handed_in_or_a_proxy_keeps_every_request_on_httpx2():
    handed = SidecarHttp.of("http://127.0.0.1:8090", transport=httpx2.MockTransport(lambda r: httpx2.Response(200)))
    proxied = _http("http://127.0.0.1:8090", proxy="http://127.0.0.1:3128")
    try:
        assert handed.reads is None and proxied.reads is None
    finally:
        await proxied.aclose()


async def test_a_refused_connection_is_not_sent_and_a_redirect_is_not_followed():
    async with _sidecar() as (url, _):
        pass  # the port is free again: nothing listens
    http = _http(url)
    try:
        outcome, dispatch = await _get_job(http)
        assert isinstance(outcome, ConnectorTransport) and dispatch.state == "not_sent", outcome
        assert outcome.dispatch == "not_sent" and outcome.uncertain_outcome is False
    finally:
        await http.aclose()

    async def redirect(head: Head, writer: asyncio.StreamWriter) -> None:
        target = "/jobs/elsewhere" if "elsewhere" not in head[0] else None
        if target is None:
            await _json_answer(head, writer)
            return
        writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: %s\r\ncontent-length: 0\r\n\r\n" % target.encode())
        await writer.drain()

    [(outcome, dispatch)], heads = await _read_from(redirect)
    assert isinstance(outcome, ConnectorRemoteRejected) and outcome.remote_status == 307, outcome
    assert dispatch.state == "acknowledged" and len(heads) == 1


async def test_a_status_answer_keeps_its_code_and_a_silent_sidecar_is_a_transport_failure(monkeypatch):
    async def not_found(head: Head, writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"detail": "no such job", "code": "sidecar.job_not_found"}).encode()
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    [(outcome, _)], _ = await _read_from(not_found)
    assert isinstance(outcome, ConnectorConfigurationOrInput) and outcome.remote_status == 404, outcome
    assert outcome.details["remote_detail"] == "no such job"

    never = asyncio.Event()

    async def silent_after_the_first(head: Head, writer: asyncio.StreamWriter) -> None:
        if head[1]["x-aip-action-id"] == "acme:first":
            await _json_answer(head, writer)  # the connection the silent read then finds pooled
        else:
            await never.wait()

    async with _sidecar(silent_after_the_first) as (url, heads):
        http = _http(url)
        try:
            assert (await _get_job(http, "acme:first"))[0] == VIEW
            # the short bound only once the connection is made (aiohttp's pool wait covers a connect too)
            monkeypatch.setattr(client_module, "JSON_READ_TIMEOUT_S", 0.2)
            outcome, dispatch = await _get_job(http, "acme:silent")
        finally:
            await http.aclose()
    assert isinstance(outcome, ConnectorTransport) and "ReadTimeout" in str(outcome), outcome
    assert dispatch.state == "sent" and len(heads) == 2  # it may have reached the sidecar


async def test_a_body_over_the_bound_and_a_cut_body_fail_after_the_head(monkeypatch):
    monkeypatch.setattr(client_module, "MAX_JSON_RESPONSE_BYTES", 64)
    answers = {"edge": b"x" * 64, "over": b"x" * 65}

    async def sized(head: Head, writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"status": "running", "pad": ""}).encode()
        name = head[1]["x-aip-action-id"].split(":")[1]
        if name in answers:
            body = b'{"pad":"' + answers[name][: len(answers[name]) - 10] + b'"}'
        assert name != "edge" or len(body) == 64
        if name == "cut":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + body[:10])
            await writer.drain()
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    [(edge, _), (over, over_dispatch), (cut, cut_dispatch)], _ = await _read_from(
        sized, "acme:edge", "acme:over", "acme:cut"
    )
    assert edge == {"pad": "x" * 54}
    assert isinstance(over, ConnectorResponseTooLarge) and over.details["limit_bytes"] == 64, over
    assert over_dispatch.state == "acknowledged"
    assert isinstance(cut, ConnectorTransport) and cut_dispatch.state == "acknowledged", cut


async def test_a_read_waiting_past_its_bound_for_a_pooled_connection_is_not_sent(monkeypatch):
    """Every connection of the pool is busy: the read waits at most its bound for one, then fails
    ``not_sent`` (nothing reached the sidecar)."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def held(head: Head, writer: asyncio.StreamWriter) -> None:
        arrived.set()
        await release.wait()
        await _json_answer(head, writer)

    monkeypatch.setattr(client_module, "JSON_READ_TIMEOUT_S", 5.0)
    async with _sidecar(held) as (url, heads):
        http = SidecarHttp.of(
            url, token="t", limits=httpx2.Limits(max_connections=1, keepalive_expiry=2.0), job_limits=REQUEST_LIMITS
        )
        try:
            first = asyncio.create_task(_get_job(http, "acme:first"))
            await arrived.wait()
            monkeypatch.setattr(client_module, "JSON_READ_TIMEOUT_S", 0.2)
            outcome, dispatch = await _get_job(http, "acme:second")
            release.set()
            assert (await first)[0] == VIEW
        finally:
            await http.aclose()
    assert isinstance(outcome, ConnectorTransport) and dispatch.state == "not_sent", outcome
    assert [fields["x-aip-action-id"] for _, fields in heads] == ["acme:first"]


async def test_a_read_whose_connection_broke_is_sent_once_and_stays_sent():
    """aiohttp would try an idempotent request a second time after its connection broke; the host sends a
    read once (as httpx2 does), so a read that reached the sidecar is never reported ``not_sent``."""

    async def hang_up(head: Head, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    [(outcome, dispatch)], heads = await _read_from(hang_up)
    assert isinstance(outcome, ConnectorTransport) and dispatch.state == "sent", outcome
    assert outcome.dispatch == "sent" and len(heads) == 1


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


async def test_no_exception_of_a_failed_read_holds_the_bearer_and_closed_pools_send_nothing():
    async def garbled(head: Head, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()

    [(outcome, dispatch)], _ = await _read_from(garbled)
    assert isinstance(outcome, ConnectorTransport) and dispatch.state == "sent", outcome
    for exc in _chain(outcome):
        assert "t0k3n" not in repr(exc) and "t0k3n" not in repr(vars(exc)), repr(exc)

    async with _sidecar() as (url, heads):
        http = _http(url)
        await http.aclose()
        outcome, dispatch = await _get_job(http)
    assert isinstance(outcome, ConnectorTransport) and dispatch.state == "not_sent", outcome
    assert heads == [] and http.reads is not None and http.reads._session is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() (Python 3.11) tells the two apart")
async def test_a_read_waiting_for_a_pooled_connection_when_the_pools_close_is_not_sent_and_a_cancel_still_cancels():
    """Every connection of the pool is busy and a read waits for one when the host closes its pools (its
    shutdown): aiohttp's connector cancels the waiting requests; the read fails ``not_sent`` instead of ending
    in a cancellation its task never asked for. A read whose task is cancelled as the pools close is still
    cancelled."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def held(head: Head, writer: asyncio.StreamWriter) -> None:
        arrived.set()
        await release.wait()  # answers only once the pools are closed
        await _json_answer(head, writer)

    async with _sidecar(held) as (url, heads):
        http = SidecarHttp.of(
            url, token="t", limits=httpx2.Limits(max_connections=1, keepalive_expiry=2.0), job_limits=REQUEST_LIMITS
        )
        assert http.reads is not None
        first = asyncio.create_task(_get_job(http, "acme:first"))
        await arrived.wait()
        cancelled = asyncio.create_task(_get_job(http, "acme:cancelled"))
        waiting = asyncio.create_task(_get_job(http, "acme:waiting"))
        session = http.reads._session
        assert session is not None
        await until_async(
            lambda: sum(len(waiters) for waiters in session.connector._waiters.values()) == 2,
            what="both reads waiting for the one connection",
        )
        cancelled.cancel()  # its task's own cancellation, as the pools close
        await http.aclose()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        outcome, dispatch = await waiting
        release.set()
        await first
    assert isinstance(outcome, ConnectorTransport) and dispatch.state == "not_sent", outcome
    assert [fields["x-aip-action-id"] for _, fields in heads] == ["acme:first"]
