"""The sidecar client maps statuses and transport failures to connector errors and records dispatch honestly."""

import json

import httpx
import pytest

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import (
    ConnectorAuthentication,
    ConnectorConfigurationOrInput,
    ConnectorInvalidStream,
    ConnectorRemoteRejected,
    ConnectorRemoteTemporary,
    ConnectorTransport,
)
from aip_crewai.host.normalize import StreamNormalizer
from aip_crewai.host.sidecar_client import DispatchProgress, SidecarClient, sidecar_job_id
from aip_crewai.sse import encode_event

RUN, STATUS = ops.get("run"), ops.get("status")


def client(handler):
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1:1")
    return SidecarClient(http, max_response_bytes=1 << 20)


def test_job_ids_are_tenant_scoped_and_bounded():
    assert sidecar_job_id("acme", "act_1") == "acme:act_1"
    long_id = sidecar_job_id("acme", "a" * 256)
    assert long_id.startswith("acme:sha256:") and len(long_id) <= 256
    assert sidecar_job_id("acme", "x") != sidecar_job_id("beta", "x")


@pytest.mark.parametrize(
    ("status", "error"),
    [(401, ConnectorAuthentication), (403, ConnectorAuthentication), (404, ConnectorConfigurationOrInput),
     (422, ConnectorConfigurationOrInput), (400, ConnectorRemoteRejected), (429, ConnectorRemoteTemporary),
     (500, ConnectorRemoteTemporary), (503, ConnectorRemoteTemporary)],
)
async def test_status_mapping(status, error):
    c = client(lambda request: httpx.Response(status, json={"detail": "nope"}))
    dispatch = DispatchProgress()
    with pytest.raises(error) as info:
        await c.get_job(STATUS, dispatch, job_id="t:a")
    assert info.value.details["remote_status"] == status
    assert info.value.details["remote_detail"] == "nope"
    assert dispatch.state == "acknowledged"
    assert info.value.retryable is (error is ConnectorRemoteTemporary)


async def test_connect_error_is_not_sent_and_retryable_only_for_reads():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    dispatch = DispatchProgress()
    with pytest.raises(ConnectorTransport) as info:
        await client(refuse).get_job(STATUS, dispatch, job_id="t:a")
    assert dispatch.state == "not_sent" and info.value.details["dispatch"] == "not_sent"
    assert info.value.retryable


async def test_read_error_after_send_is_sent_and_uncertain_for_mutations():
    def broken(request):
        raise httpx.ReadError("reset", request=request)

    dispatch = DispatchProgress()
    with pytest.raises(ConnectorTransport) as info:
        await client(broken).start_job(RUN, dispatch, job_id="t:a", crew_id="c", input={},
                                       idempotency_key="k", timeout_ms=None)
    assert info.value.details["dispatch"] == "sent"
    assert info.value.details["uncertain_outcome"] is True
    assert not info.value.retryable


async def test_start_job_sends_headers_and_body():
    seen = {}

    def handler(request):
        seen["headers"] = request.headers
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json={"raw": "ok"})

    status, body = await client(handler).start_job(RUN, DispatchProgress(), job_id="t:a", crew_id="c",
                                                   input={"x": 1}, idempotency_key="key-1", timeout_ms=5000)
    assert (status, body) == (200, {"raw": "ok"})
    assert seen["headers"]["idempotency-key"] == "key-1" and seen["headers"]["x-aip-action-id"] == "t:a"
    assert seen["body"] == {"crew_id": "c", "action_id": "t:a", "operation": "run", "input": {"x": 1},
                            "timeout_ms": 5000}


def sse(*events):
    return b"".join(encode_event(json.dumps({"event": e, "sequence": i, "data": {}}), event=e, id=str(i))
                    for i, e in enumerate(events))


async def test_stream_delivers_chunks_then_terminal():
    got = []

    async def on_chunks(chunks):
        got.extend(chunks)

    c = client(lambda r: httpx.Response(200, content=sse("started", "chunk", "completed"),
                                        headers={"content-type": "text/event-stream"}))
    terminal = await c.start_stream(RUN, DispatchProgress(), StreamNormalizer("a", RUN), on_chunks, job_id="t:a",
                                    crew_id="c", input={}, idempotency_key="k", timeout_ms=None)
    assert terminal.event == "completed" and [g.kind for g in got] == ["progress", "progress", "done"]


async def test_stream_without_terminal_is_invalid():
    async def on_chunks(chunks):
        pass

    c = client(lambda r: httpx.Response(200, content=sse("started")))
    with pytest.raises(ConnectorInvalidStream):
        await c.start_stream(RUN, DispatchProgress(), StreamNormalizer("a", RUN), on_chunks, job_id="t:a",
                             crew_id="c", input={}, idempotency_key="k", timeout_ms=None)
