"""Conformance suite fixtures: the host in-process over the scripted fake
sidecar, behind an httpx transport that validates EVERY response body (JSON,
and each SSE ``data:`` payload) against the official AIP 1.0 schemas before
the test sees it. Skips the directory with one line when the schemas are absent, and fails it instead
when ``AIP_CREWAI_REQUIRE_SCHEMAS=1`` (CI)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import pytest
from aipschemas import SCHEMAS_DIR, Schemas, Violation, check_envelope, require
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, clock, host_files, make_app, running, settings, sidecar  # noqa: F401

from aip_crewai.sse import SSEDecoder

require(SCHEMAS_DIR, os.environ)  # absent: skip the directory, or fail it under AIP_CREWAI_REQUIRE_SCHEMAS=1

#: (method, path pattern) -> schema of a 2xx JSON body. Error statuses are always error envelopes.
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"^/aip/v1/(manifest|capabilities)$"), "manifest"),
    ("POST", re.compile(r"^/aip/v1/messages$"), "envelope"),
    ("GET", re.compile(r"^/aip/v1/actions/[^/]+$"), "action_status"),
    ("GET", re.compile(r"^/aip/v1/actions/[^/]+/result$"), "envelope"),
    ("GET", re.compile(r"^/aip/v1/actions/[^/]+/(events|chunks)$"), "action_events"),
    ("POST", re.compile(r"^/aip/v1/actions/[^/]+/cancel$"), "envelope"),
    ("GET", re.compile(r"^/aip/v1/approvals$"), "approval_list"),
    ("GET", re.compile(r"^/aip/v1/approvals/[^/]+$"), "approval_record_view"),
    ("POST", re.compile(r"^/aip/v1/approvals/[^/]+/decision$"), "approval_decision"),
]


#: Routes under /aip/ whose 2xx answers are this host's own JSON, not AIP objects (docs/reference/http-api.md "Stream
#: tokens", "Signed requests"): their errors are still checked as AIP error envelopes.
NOT_AIP = [
    re.compile(r"^/aip/v1/(actions/[^/]+|approvals)/stream-token$"),
    re.compile(r"^/aip/v1/approvals/[^/]+/(proof|display)$"),
]


def schema_for(method: str, path: str) -> str | None:
    return next((name for m, pattern, name in ROUTES if m == method and pattern.match(path)), None)


class ValidatingTransport(httpx2.AsyncBaseTransport):
    """Reads each response whole and validates it; a violation fails the request."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, schemas: Schemas) -> None:
        self.inner = inner
        self.schemas = schemas
        self.routes_seen: set[str] = set()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        route = f"{request.method} {request.url.path} -> {response.status_code}"
        self.routes_seen.add(route)
        ctype = response.headers.get("content-type", "")
        path = request.url.path
        own = response.status_code < 400 and any(pattern.match(path) for pattern in NOT_AIP)
        if (path.startswith("/aip/") and not own) or response.status_code >= 400:
            self.validate(route, request.method, path, response.status_code, ctype, body)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            content=body,
            request=request,
            extensions=response.extensions,
        )

    def validate(self, route: str, method: str, path: str, status: int, ctype: str, body: bytes) -> None:
        if ctype.startswith("text/event-stream"):
            decoder = SSEDecoder()
            frames = [*decoder.feed(body), *decoder.close()]
            if not frames:
                raise Violation(f"{route}: an SSE body without a frame")
            for n, frame in enumerate(frames):
                check_envelope(self.schemas, f"{route} SSE frame {n} ({frame.event})", json.loads(frame.data))
            return
        if not ctype.startswith("application/aip+json"):
            raise Violation(f"{route}: content type {ctype!r}, expected application/aip+json")
        document: Any = json.loads(body)
        if status >= 400:
            check_envelope(self.schemas, route, document)
            if document["message_type"] != "aip.core.v1.error":
                raise Violation(f"{route}: an error status carries {document['message_type']}")
            return
        name = schema_for(method, path)
        if name is None:
            raise Violation(f"{route}: no AIP schema is mapped to this route")
        if name == "envelope":
            check_envelope(self.schemas, route, document)
        else:
            self.schemas.check(route, name, document)


@pytest.fixture(scope="session")
def schemas() -> Schemas:
    assert SCHEMAS_DIR is not None
    return Schemas(SCHEMAS_DIR)


@pytest.fixture
def fake() -> FakeSidecar:
    return FakeSidecar(SIDECAR_TOKEN)


@pytest.fixture
async def aip(make_app: Any, fake: FakeSidecar, schemas: Schemas) -> AsyncIterator[httpx2.AsyncClient]:
    """An AIP client of the in-process host whose every answer is schema-checked."""
    app = make_app(sidecar_transport=fake.transport())
    async with running(app):
        transport = ValidatingTransport(httpx2.ASGITransport(app=app), schemas)
        async with httpx2.AsyncClient(transport=transport, base_url="http://host.test") as client:
            client.validating = transport
            client.app = app  # for endless streams (tests/kits/asgi_stream.py)
            yield client
