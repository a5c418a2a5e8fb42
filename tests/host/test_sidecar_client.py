"""The sidecar client maps statuses and transport failures to connector errors and records dispatch honestly."""

import asyncio
import contextlib
import json
import re
from typing import Any

import anyio
import httpx2
import pytest

from aip_crewai import package_version
from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import (
    ConnectorAuthentication,
    ConnectorConfigurationOrInput,
    ConnectorError,
    ConnectorInvalidStream,
    ConnectorRemoteRejected,
    ConnectorRemoteTemporary,
    ConnectorTransport,
)
from aip_crewai.host.actions.dispatch_task import retry_delay_s
from aip_crewai.host.actions.normalize import StreamNormalizer
from aip_crewai.host.sidecars.client import (
    DispatchProgress,
    SidecarClient,
    not_admitted,
    sidecar_job_id,
    silence_bound_s,
)
from aip_crewai.host.sidecars.connection import USER_AGENT, SidecarHttp
from aip_crewai.host.sidecars.readiness import published_keepalive_s
from aip_crewai.sse import encode_event

RUN, STATUS = ops.get("run"), ops.get("status")


def client(handler):
    return SidecarClient(
        SidecarHttp.of("http://127.0.0.1:1", transport=httpx2.MockTransport(handler)), max_response_bytes=1 << 20
    )


def test_job_ids_are_tenant_scoped_and_bounded():
    assert sidecar_job_id("acme", "act_1") == "acme:act_1"
    long_id = sidecar_job_id("acme", "a" * 256)
    assert long_id.startswith("acme:sha256:") and len(long_id) <= 256
    assert sidecar_job_id("acme", "x") != sidecar_job_id("beta", "x")


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (401, ConnectorAuthentication),
        (403, ConnectorAuthentication),
        (404, ConnectorConfigurationOrInput),
        (422, ConnectorConfigurationOrInput),
        (400, ConnectorRemoteRejected),
        (429, ConnectorRemoteTemporary),
        (500, ConnectorRemoteTemporary),
        (503, ConnectorRemoteTemporary),
    ],
)
async def test_status_mapping(status, error):
    c = client(lambda request: httpx2.Response(status, json={"detail": "nope"}))
    dispatch = DispatchProgress()
    with pytest.raises(error) as info:
        await c.get_job(STATUS, dispatch, job_id="t:a")
    assert info.value.details["remote_status"] == status
    assert info.value.details["remote_detail"] == "nope"
    assert dispatch.state == "acknowledged"
    assert info.value.retryable is (error is ConnectorRemoteTemporary)


@pytest.mark.parametrize("failure", [httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout])
async def test_a_request_that_got_no_connection_is_not_sent_and_retryable_only_for_reads(failure):
    """Refused, not connected in time, or no pooled connection free in time (a host running more jobs than its
    job connections): nothing reached the sidecar, so even a start is safely sent again."""

    def refuse(request):
        raise failure("no connection", request=request)

    dispatch = DispatchProgress()
    with pytest.raises(ConnectorTransport) as info:
        await client(refuse).get_job(STATUS, dispatch, job_id="t:a")
    assert dispatch.state == "not_sent" and info.value.details["dispatch"] == "not_sent"
    assert info.value.retryable
    start = DispatchProgress()
    with pytest.raises(ConnectorTransport) as info:
        await client(refuse).start_job(
            RUN, start, job_id="t:a", crew_id="c", input={}, idempotency_key="k", timeout_ms=None
        )
    assert start.state == "not_sent" and info.value.details["uncertain_outcome"] is False
    assert not_admitted(info.value)


async def test_read_error_after_send_is_sent_and_uncertain_for_mutations():
    def broken(request):
        raise httpx2.ReadError("reset", request=request)

    dispatch = DispatchProgress()
    with pytest.raises(ConnectorTransport) as info:
        await client(broken).start_job(
            RUN, dispatch, job_id="t:a", crew_id="c", input={}, idempotency_key="k", timeout_ms=None
        )
    assert info.value.details["dispatch"] == "sent"
    assert info.value.details["uncertain_outcome"] is True
    assert not info.value.retryable


async def test_start_job_sends_headers_and_body():
    seen = {}

    def handler(request):
        seen["headers"] = request.headers
        seen["body"] = json.loads(request.content)
        return httpx2.Response(200, json={"raw": "ok"})

    status, body = await client(handler).start_job(
        RUN, DispatchProgress(), job_id="t:a", crew_id="c", input={"x": 1}, idempotency_key="key-1", timeout_ms=5000
    )
    assert (status, body) == (200, {"raw": "ok"})
    assert seen["headers"]["idempotency-key"] == "key-1" and seen["headers"]["x-aip-action-id"] == "t:a"
    assert seen["body"] == {
        "crew_id": "c",
        "action_id": "t:a",
        "operation": "run",
        "input": {"x": 1},
        "timeout_ms": 5000,
    }


def sse(*events):
    return b"".join(
        encode_event(json.dumps({"event": e, "sequence": i, "data": {}}), event=e, id=str(i))
        for i, e in enumerate(events)
    )


async def test_stream_delivers_chunks_then_terminal():
    got = []

    async def on_chunks(chunks):
        got.extend(chunks)

    c = client(
        lambda r: httpx2.Response(
            200, content=sse("started", "chunk", "completed"), headers={"content-type": "text/event-stream"}
        )
    )
    terminal = await c.start_stream(
        RUN,
        DispatchProgress(),
        StreamNormalizer("a", RUN),
        on_chunks,
        job_id="t:a",
        crew_id="c",
        input={},
        idempotency_key="k",
        timeout_ms=None,
    )
    assert terminal.event == "completed" and [g.kind for g in got] == ["progress", "progress", "done"]


async def test_stream_without_terminal_is_invalid():
    async def on_chunks(chunks):
        pass

    c = client(lambda r: httpx2.Response(200, content=sse("started")))
    with pytest.raises(ConnectorInvalidStream):
        await c.start_stream(
            RUN,
            DispatchProgress(),
            StreamNormalizer("a", RUN),
            on_chunks,
            job_id="t:a",
            crew_id="c",
            input={},
            idempotency_key="k",
            timeout_ms=None,
        )


# --- which refusals are provably before admission (ARCHITECTURE.md §9); silence bounds (§8) --------------------------------

KQ = ops.get("knowledge_query")


@pytest.mark.parametrize(
    ("status", "body", "admitted"),
    [
        (503, {"detail": "the sidecar is shutting down and admits no new jobs"}, False),
        (507, {"detail": "the job journal is full"}, False),
        (
            507,
            {"detail": "the job's terminal result could not be recorded", "status": "completed", "action_id": "t:a"},
            None,
        ),  # after admission: the job exists, its outcome is uncertain
        (500, {"detail": "internal error"}, None),
    ],
)
async def test_a_blocking_start_refused_before_admission_is_marked_not_admitted(status, body, admitted):
    c = client(lambda request: httpx2.Response(status, json=body))
    with pytest.raises(ConnectorError) as info:
        await c.start_job(
            KQ, DispatchProgress(), job_id="t:a", crew_id="c", input={}, idempotency_key="k", timeout_ms=None
        )
    assert info.value.details.get("admitted") is admitted
    assert not_admitted(info.value) is (admitted is False)


@pytest.mark.parametrize(("status", "admitted"), [(503, False), (507, False), (500, None), (502, None)])
async def test_a_stream_start_refused_before_admission_is_marked_not_admitted(status, admitted):
    c = client(lambda request: httpx2.Response(status, json={"detail": "no"}))
    with pytest.raises(ConnectorError) as info:
        await c.start_stream(
            RUN,
            DispatchProgress(),
            StreamNormalizer("a", RUN),
            _no_chunks,
            job_id="t:a",
            crew_id="c",
            input={},
            idempotency_key="k",
            timeout_ms=None,
        )
    assert info.value.details.get("admitted") is admitted
    if admitted is False:
        assert info.value.details["uncertain_outcome"] is False


async def test_a_refused_connection_is_not_admitted():
    def refuse(request):
        raise httpx2.ConnectError("refused", request=request)

    with pytest.raises(ConnectorTransport) as info:
        await client(refuse).start_stream(
            RUN,
            DispatchProgress(),
            StreamNormalizer("a", RUN),
            _no_chunks,
            job_id="t:a",
            crew_id="c",
            input={},
            idempotency_key="k",
            timeout_ms=None,
        )
    assert not_admitted(info.value) and info.value.details["uncertain_outcome"] is False


async def _no_chunks(chunks):
    return None


def test_silence_bound_counts_missed_keepalives_with_a_floor():
    assert silence_bound_s(15.0) == 45.0
    assert silence_bound_s(0.2) == 2.0
    with pytest.raises(ValueError):
        silence_bound_s(0)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"sse_keepalive_seconds": 0.2}, 0.2),
        ({"sse_keepalive_seconds": 15}, 15.0),
        ({}, None),
        ({"sse_keepalive_seconds": True}, None),
        ({"sse_keepalive_seconds": "15"}, None),
        ({"sse_keepalive_seconds": 0}, None),
        ({"sse_keepalive_seconds": 10_000}, None),
        ([], None),
    ],
)
def test_the_published_keepalive_is_optional_and_bounded(body, expected):
    assert published_keepalive_s(body) == expected


def test_retry_delays_double_to_a_cap():
    assert [retry_delay_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay_s(50) == 30.0
    with pytest.raises(ValueError):
        retry_delay_s(0)


async def test_a_crew_busy_refusal_is_typed_retryable_and_certain_for_blocking_and_stream_starts():
    """409 sidecar.crew_busy says "try later", never a permanent configuration error."""
    from aip_crewai.contracts.errors import ConnectorCrewBusy

    busy = {"code": "sidecar.crew_busy", "detail": "crew 'c' has 1 job(s) queued or running for this tenant"}
    c = client(lambda request: httpx2.Response(409, json=busy))
    spec = ops.get("memory_reset")
    with pytest.raises(ConnectorCrewBusy) as raised:
        await c.start_job(
            spec, DispatchProgress(), job_id="acme:r", crew_id="c", input={}, idempotency_key="k", timeout_ms=None
        )
    error = raised.value
    assert error.retryable and error.category.value == "temporary" and error.remote_status == 409
    assert error.details["uncertain_outcome"] is False and not not_admitted(error)  # the tenant retries, not the host
    assert "queued or running" in error.details["remote_detail"]
    with pytest.raises(ConnectorCrewBusy):
        await c.start_stream(
            RUN,
            DispatchProgress(),
            StreamNormalizer("a", RUN),
            lambda chunks: None,
            job_id="acme:r2",
            crew_id="c",
            input={},
            idempotency_key="k",
            timeout_ms=None,
        )
    plain = client(lambda request: httpx2.Response(409, json={"detail": "cancelled"}))  # no code: as before
    status, _ = await plain.start_job(
        spec, DispatchProgress(), job_id="acme:r3", crew_id="c", input={}, idempotency_key="k", timeout_ms=None
    )
    assert status == 409


async def test_sidecar_pools_keep_few_connections_and_reuse_them_only_well_before_the_sidecar_closes_them():
    """Short requests have a pool of 16 connections, all kept alive; requests that run a job one of 100, 16 kept (httpcore's
    upkeep of 100 kept ones cost a loaded host more CPU than opening a connection per run). An idle connection is
    not reused past well before the sidecar's own idle bound (``keep_alive_timeout`` = HEADER_TIMEOUT_S), so a
    start is not sent on a connection being closed."""
    from aip_crewai.host.http.lifespan import _sidecar_http
    from aip_crewai.host.settings import SidecarSettings
    from aip_crewai.plumbing.serving import HEADER_TIMEOUT_S

    client = _sidecar_http(SidecarSettings("sidecar", "http://127.0.0.1:8090", "token"), None)
    try:
        requests, streams = client.transport._pool, client.job_transport._pool
        assert requests is not streams
        assert (requests._max_connections, requests._max_keepalive_connections) == (16, 16)
        assert (streams._max_connections, streams._max_keepalive_connections) == (100, 16)
        for pool in (requests, streams):
            assert 0 < pool._keepalive_expiry <= HEADER_TIMEOUT_S / 2
    finally:
        await client.aclose()
    with pytest.raises(ValueError, match="limits"):  # real pools are never built on httpx's defaults by accident
        SidecarHttp.of("http://127.0.0.1:8090", token="token")


@pytest.mark.parametrize("job", ["stream", "blocking start"])
async def test_status_reads_and_cancels_do_not_wait_behind_jobs_holding_every_job_connection(job):
    """A host running as many jobs as its job connections (a run's stream, or a blocking start such as a
    ``knowledge_query``, each open until its job ends) still reads a job's status and cancels at once: short
    requests have their own pool (ARCHITECTURE.md §8)."""
    from aip_crewai.host.http.lifespan import SIDECAR_CONNECTIONS, _sidecar_http
    from aip_crewai.host.settings import SidecarSettings

    opened, release = asyncio.Semaphore(0), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                length = re.search(r"(?im)^content-length:\s*(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if head.startswith(("POST /jobs/stream ", "POST /jobs ")):  # a job: open until released
                    if head.startswith("POST /jobs/stream "):
                        writer.write(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                        )
                        await writer.drain()
                    opened.release()
                    await release.wait()
                    return
                body = json.dumps({"job_id": "acme:x", "status": "running"}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    http = _sidecar_http(SidecarSettings("sidecar", url, "token"), None)
    c = SidecarClient(http, max_response_bytes=1 << 20)

    async def run(n: int) -> None:
        start: dict[str, Any] = {
            "job_id": f"acme:r{n}",
            "crew_id": "c",
            "input": {},
            "idempotency_key": f"k{n}",
            "timeout_ms": None,
        }
        if job == "stream":
            await c.start_stream(RUN, DispatchProgress(), StreamNormalizer(f"r{n}", RUN), _ignore, **start)
        else:
            await c.start_job(ops.get("knowledge_query"), DispatchProgress(), **start)

    jobs = [asyncio.create_task(run(n)) for n in range(SIDECAR_CONNECTIONS)]
    try:
        with anyio.fail_after(20):
            for _ in range(SIDECAR_CONNECTIONS):
                await opened.acquire()
        with anyio.fail_after(5):  # before: waited for a job's connection, up to JSON_READ_TIMEOUT_S (30 s)
            assert (await c.get_job(STATUS, DispatchProgress(), job_id="acme:x"))["status"] == "running"
            await c.cancel(ops.get("cancel"), DispatchProgress(), job_id="acme:x", crew_id="c", reason=None)
    finally:
        release.set()
        for task in jobs:
            task.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await http.aclose()
        server.close()
        await server.wait_closed()


async def _ignore(chunks) -> None:
    return None


@pytest.mark.parametrize("base", ["http://127.0.0.1:8090", "http://127.0.0.1:8090/", "https://gw.example/sidecar/a"])
@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/jobs/acme:act_1", None),
        ("/jobs/acme:a\"b<c>{d}|e^`f'g[h]", None),  # visible ASCII a job id may hold, percent-encoded as httpx does
        ("/jobs/acme:sha256:" + "0" * 64 + "/events", {"cursor": 17}),
        ("/jobs/stream", None),
        ("/jobs/a?b", None),  # a query in the path is kept (no caller sends one: job ids holding "?" are hashed)
    ],
)
def test_requests_go_to_the_url_and_carry_the_headers_httpx_client_would_have_sent(base, path, params):
    """The host hands requests to the transport itself (:class:`SidecarHttp`): the URL (base path prefix,
    percent-encoding, query) and the bearer are those ``httpx2.AsyncClient(base_url=...)`` built, and the
    read bound covers read, write and the pool wait, the connect bound its own."""
    jobs = SidecarHttp.of(base, token="t0k", connect_timeout_s=10.0, transport=httpx2.MockTransport(lambda r: None))
    client = httpx2.AsyncClient(base_url=base, headers={"Authorization": "Bearer t0k"})
    expected = client.build_request("GET", path, params=params)
    request = jobs.request("GET", path, headers={"X-AIP-Action-ID": "acme:act_1"}, params=params, read_timeout_s=30.0)
    assert request.url == expected.url and request.url.raw_path == expected.url.raw_path
    assert request.headers["authorization"] == "Bearer t0k" and request.headers["x-aip-action-id"] == "acme:act_1"
    assert request.headers["user-agent"] == USER_AGENT == f"aip-crewai-host/{package_version()}"
    assert request.extensions["timeout"] == {"connect": 10.0, "read": 30.0, "write": 30.0, "pool": 30.0}
    assert "t0k" not in repr(jobs)  # the bearer stays out of reprs (and so of logs and tracebacks)
    unbounded = jobs.request("GET", path, headers={}, params=params)
    assert unbounded.extensions["timeout"] == {"connect": 10.0, "read": None, "write": None, "pool": None}


async def test_a_json_body_is_sent_as_httpx_encodes_it():
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json={"status": "completed"})

    status, body = await client(handler).start_job(
        RUN,
        DispatchProgress(),
        job_id="acme:act_1",
        crew_id="c",
        input={"q": "é"},
        idempotency_key="k",
        timeout_ms=None,
    )
    assert (status, body) == (200, {"status": "completed"})
    sent = seen[0]
    assert sent.headers["content-type"] == "application/json" and sent.headers["idempotency-key"] == "k"
    assert json.loads(sent.content) == {
        "crew_id": "c",
        "action_id": "acme:act_1",
        "operation": "run",
        "input": {"q": "é"},
    }
    assert sent.headers["content-length"] == str(len(sent.content))


async def test_a_cancel_a_frozen_sidecar_never_answers_fails_within_its_own_bound():
    """A sidecar that takes the cancel and answers nothing (SIGSTOP, hung): the cancel fails typed (the
    tenant then gets ``cancelled_unconfirmed``, corrected later) within the cancel's bound, not after
    the 30 s of other JSON reads."""
    from aip_crewai.host.http.lifespan import _sidecar_http
    from aip_crewai.host.settings import SidecarSettings
    from aip_crewai.host.sidecars.client import CANCEL_READ_TIMEOUT_S, JSON_READ_TIMEOUT_S

    assert CANCEL_READ_TIMEOUT_S * 3 < JSON_READ_TIMEOUT_S
    taken, release = asyncio.Event(), asyncio.Event()

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            taken.set()
            await release.wait()
        writer.close()

    server = await asyncio.start_server(frozen, "127.0.0.1", 0)
    http = _sidecar_http(
        SidecarSettings("sidecar", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "t"), None
    )
    c = SidecarClient(http, max_response_bytes=1 << 20)
    try:
        with anyio.fail_after(CANCEL_READ_TIMEOUT_S + 10):  # slack for a slow machine; before: 30 s
            with pytest.raises(ConnectorError) as raised:
                await c.cancel(RUN, DispatchProgress(), job_id="acme:x", crew_id="c", reason=None)
        assert taken.is_set() and raised.value.uncertain_outcome
    finally:
        release.set()
        await http.aclose()
        server.close()
        await server.wait_closed()
