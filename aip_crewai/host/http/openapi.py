"""The host's OpenAPI 3.1 document, generated: every schema comes from the
msgspec types the routes encode and decode (``msgspec.json.schema_components``),
never written by hand. Served at ``GET /openapi.json`` (``[host] openapi``).

What is written here is the table of operations (:data:`OPERATIONS`): for
each route of the app, its summary, request body type, and the types of its
answers per status. :func:`undocumented` compares it with the app's routes
(a test keeps both in step). Every operation also documents its error
answers: ``4XX`` and ``503``, the ``aip.core.v1.error`` envelope.

No ``/docs`` renderer is shipped: a well-kept one (Swagger UI, Redoc) would
be a vendored JavaScript bundle inside the package; point any OpenAPI viewer
at ``/openapi.json`` instead (docs/reference/http-api.md "OpenAPI"). ``aip-crewai contracts --write``
also commits it as ``contracts/openapi.host.json`` (a test fails on drift).

Source: OpenAPI 3.1.0 (its Schema Object is JSON Schema 2020-12, which
msgspec generates); docs/reference/http-api.md "OpenAPI".
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ...contracts.aip import (
    CONTENT_TYPE,
    ActionEvents,
    ActionStatus,
    ApprovalDecision,
    ApprovalList,
    ApprovalRecordView,
    DecisionRequest,
    Envelope,
    Manifest,
)
from ..auth.stream_tokens import QUERY_PARAMETER, StreamToken
from ..webhooks.notifications import ApprovalNotifications
from ..webhooks.routes import DeliveryList
from .approvals import DecisionProof, DisplayFindings

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"
SSE = "text/event-stream"
JSON = "application/json"


class Alive(msgspec.Struct, frozen=True):
    """``GET /health``."""

    status: Literal["alive"]


class Readiness(msgspec.Struct, frozen=True):
    """``GET /ready``: ``ready``, or ``unready`` with the kind of disagreement."""

    status: Literal["ready", "unready"]
    reason: str | None = None


@dataclass(frozen=True)
class Answer:
    """One documented answer: ``type`` (a msgspec type, ``str`` for text, None for no body) per content type."""

    description: str
    content: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    """One documented route: its summary, answers by status (``"200"``, ``"204"``; the error
    answers are added for every route), request body type, query and header parameters
    (name, description), and who may call it (``public``: no credential; ``stream_token``:
    also a stream token)."""

    summary: str
    answers: dict[str, Answer]
    body: Any = None
    body_content_type: str = JSON
    query: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    public: bool = False
    stream_token: bool = False


_ENVELOPE = {CONTENT_TYPE: Envelope}
_LAST_EVENT_ID = ("Last-Event-ID", "resume after this stream position")

#: (method, path) -> its documentation. Paths as Starlette writes them.
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/health"): Operation("Liveness", {"200": Answer("alive", {JSON: Alive})}, public=True),
    ("GET", "/ready"): Operation(
        "Readiness (the sidecar agrees)",
        {"200": Answer("ready", {JSON: Readiness}), "503": Answer("unready", {JSON: Readiness})},
        public=True,
    ),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics (operator role)", {"200": Answer("Prometheus text", {"text/plain": str})}
    ),
    ("GET", "/openapi.json"): Operation("This document", {"200": Answer("OpenAPI 3.1", {JSON: dict})}, public=True),
    ("GET", "/console"): Operation(
        "The approval console: a redirect to /console/",
        {"308": Answer("to /console/"), "404": Answer("the console is disabled", _ENVELOPE)},
        public=True,
    ),
    ("GET", "/console/"): Operation(
        "The approval console's page",
        {"200": Answer("index.html", {"text/html": str}), "404": Answer("the console is disabled", _ENVELOPE)},
        public=True,
    ),
    ("GET", "/console/{name:str}"): Operation(
        "One of the console's files (index.html, console.js, console.css)",
        {
            "200": Answer("the file", {"text/html": str, "text/javascript": str, "text/css": str}),
            "404": Answer("no such file, or the console is disabled", _ENVELOPE),
        },
        public=True,
    ),
    ("GET", "/aip/v1/manifest"): Operation(
        "The caller's tenant manifest", {"200": Answer("Manifest", {CONTENT_TYPE: Manifest})}
    ),
    ("GET", "/aip/v1/capabilities"): Operation(
        "The caller's tenant manifest (alias)", {"200": Answer("Manifest", {CONTENT_TYPE: Manifest})}
    ),
    ("POST", "/aip/v1/messages"): Operation(
        "Submit an aip.core.v1.action or aip.core.v1.cancel envelope",
        {
            "200": Answer("action_result envelope, or the SSE stream", {**_ENVELOPE, SSE: str}),
            "202": Answer("ack, or a pending_approval action_result", _ENVELOPE),
        },
        body=Envelope,
        body_content_type=CONTENT_TYPE,
    ),
    ("GET", "/aip/v1/actions/{action_id:str}"): Operation(
        "ActionStatus",
        {"200": Answer("ActionStatus", {CONTENT_TYPE: ActionStatus})},
        query=(("include_receipts", "true: with the receipt chain"),),
    ),
    ("GET", "/aip/v1/actions/{action_id:str}/result"): Operation(
        "The stored result",
        {"200": Answer("action_result envelope", _ENVELOPE), "202": Answer("ack or pending result", _ENVELOPE)},
    ),
    ("GET", "/aip/v1/actions/{action_id:str}/events"): Operation(
        "The action's history: SSE with Accept: text/event-stream, else one ActionEvents page",
        {
            "200": Answer("ActionEvents page or SSE stream", {CONTENT_TYPE: ActionEvents, SSE: str}),
            "204": Answer("the stream already ended at Last-Event-ID"),
        },
        query=(("cursor", "position to resume after (sse_<n>, sse_<n>.<k>, or the same without sse_)"),),
        headers=(_LAST_EVENT_ID,),
        stream_token=True,
    ),
    ("GET", "/aip/v1/actions/{action_id:str}/chunks"): Operation(
        "Stored chunks from a sequence",
        {"200": Answer("ActionEvents", {CONTENT_TYPE: ActionEvents})},
        query=(("cursor", "first chunk sequence"),),
    ),
    ("POST", "/aip/v1/actions/{action_id:str}/cancel"): Operation(
        "Cancel the action", {"200": Answer("action_result envelope", _ENVELOPE)}
    ),
    ("POST", "/aip/v1/actions/{action_id:str}/stream-token"): Operation(
        "Mint a stream token for this action's events (EventSource)", {"200": Answer("token", {JSON: StreamToken})}
    ),
    ("POST", "/aip/v1/approvals/stream-token"): Operation(
        "Mint a stream token for the approval stream (EventSource)", {"200": Answer("token", {JSON: StreamToken})}
    ),
    ("GET", "/aip/v1/approvals/events"): Operation(
        "The tenant's approval events (SSE)",
        {"200": Answer("SSE stream", {SSE: str})},
        query=(("cursor", "position to resume after (apv_<n>)"),),
        headers=(_LAST_EVENT_ID,),
        stream_token=True,
    ),
    ("GET", "/aip/v1/approvals"): Operation(
        "One page of the tenant's approvals",
        {"200": Answer("ApprovalList", {CONTENT_TYPE: ApprovalList})},
        query=(
            ("status", "pending | decided (any but pending) | approved | denied | expired | withdrawn"),
            ("order", "oldest (default) | newest first"),
            ("cursor", "next page (in the same order)"),
            ("limit", "1..200"),
        ),
    ),
    ("GET", "/aip/v1/approvals/{approval_id:str}"): Operation(
        "One approval (approvers: with its input)",
        {"200": Answer("ApprovalRecordView", {CONTENT_TYPE: ApprovalRecordView})},
        query=(("include_receipts", "true: with the receipt chain of its action"),),
    ),
    ("GET", "/aip/v1/receipts/{receipt_id:str}"): Operation(
        "A signed result receipt, byte for byte as signed (RFC 8785 JSON)", {"200": Answer("receipt", {JSON: dict})}
    ),
    ("GET", "/.well-known/aip-receipt-keys"): Operation(
        "The receipt public keys (current and previous)", {"200": Answer("keys", {JSON: dict})}, public=True
    ),
    ("GET", "/aip/v1/usage"): Operation(
        "The tenant's usage per crew (operator role)",
        {"200": Answer("usage report", {JSON: dict})},
        query=(("from", "RFC 3339, inclusive (default: the start)"), ("to", "RFC 3339, exclusive (default: now)")),
    ),
    ("GET", "/aip/v1/webhooks/deliveries"): Operation(
        "The tenant's webhook deliveries and their attempts, newest first (operator role)",
        {"200": Answer("DeliveryList", {JSON: DeliveryList})},
        query=(
            ("endpoint", "an endpoint id (whe_ and 24 hex digits)"),
            (
                "event_type",
                "approval.requested | approval.decided | action.completed | action.failed | action.cancelled",
            ),
            ("status", "pending | delivered | expired"),
            ("action_id", "the action the events are about"),
            ("cursor", "next page"),
            ("limit", "1..200 (default 50)"),
        ),
    ),
    ("GET", "/aip/v1/approvals/{approval_id:str}/notifications"): Operation(
        "The delivery state of an approval's approval.requested webhooks (approvers and operators; no URL)",
        {"200": Answer("ApprovalNotifications", {JSON: ApprovalNotifications})},
    ),
    ("GET", "/aip/v1/approvals/{approval_id:str}/display"): Operation(
        "The code points of an approval's input a person would misread",
        {"200": Answer("DisplayFindings", {JSON: DisplayFindings})},
    ),
    ("GET", "/aip/v1/approvals/{approval_id:str}/proof"): Operation(
        "The proof of a signed decision", {"200": Answer("DecisionProof", {JSON: DecisionProof})}
    ),
    ("POST", "/aip/v1/approvals/{approval_id:str}/decision"): Operation(
        "Decide an approval",
        {"200": Answer("ApprovalDecision", {CONTENT_TYPE: ApprovalDecision})},
        body=DecisionRequest,
    ),
}

_PARAM_RE = re.compile(r"\{([a-z_]+)(?::[a-z]+)?\}")


def openapi_path(path: str) -> str:
    """Starlette's ``/a/{x:str}`` → OpenAPI's ``/a/{x}``."""
    return _PARAM_RE.sub(r"{\1}", path)


def _types() -> list[Any]:
    found: list[Any] = []
    for operation in OPERATIONS.values():
        if operation.body is not None:
            found.append(operation.body)
        for answer in operation.answers.values():
            found += [
                kind for kind in answer.content.values() if isinstance(kind, type) and issubclass(kind, msgspec.Struct)
            ]
    found.append(Envelope)
    return list(dict.fromkeys(found))


def _schema(kind: Any, refs: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    if kind is str:
        return {"type": "string"}
    if kind is dict:
        return {"type": "object"}
    return refs[kind]


def document(*, title: str = "aip-crewai host", version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-able dict). Pure, and the same on every call."""
    types = _types()
    refs_list, components = msgspec.json.schema_components(types, ref_template=_REF)
    refs = dict(zip(types, refs_list, strict=False))
    error = {
        "description": 'an aip.core.v1.error envelope (docs/reference/http-api.md "AIP 1.0 conformance")',
        "content": {CONTENT_TYPE: {"schema": refs[Envelope]}},
    }
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), operation in OPERATIONS.items():
        responses: dict[str, Any] = {}
        for status, answer in operation.answers.items():
            entry: dict[str, Any] = {"description": answer.description}
            if answer.content:
                entry["content"] = {ctype: {"schema": _schema(kind, refs)} for ctype, kind in answer.content.items()}
            responses[status] = entry
        if not operation.public:
            responses.setdefault("4XX", error)
        responses.setdefault("503", error)
        parameters = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in _PARAM_RE.findall(path)
        ]
        parameters += [
            {"name": name, "in": "query", "required": False, "description": text, "schema": {"type": "string"}}
            for name, text in operation.query
        ]
        parameters += [
            {"name": name, "in": "header", "required": False, "description": text, "schema": {"type": "string"}}
            for name, text in operation.headers
        ]
        item: dict[str, Any] = {
            "summary": operation.summary,
            "operationId": _operation_id(method, path),
            "responses": responses,
        }
        if parameters:
            item["parameters"] = parameters
        if operation.body is not None:
            item["requestBody"] = {
                "required": True,
                "content": {operation.body_content_type: {"schema": refs[operation.body]}},
            }
        if operation.public:
            item["security"] = []
        elif operation.stream_token:
            item["security"] = [{"bearer": []}, {"httpSignature": []}, {"streamToken": []}]
        paths.setdefault(openapi_path(path), {})[method.lower()] = item
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": "AIP 1.0 host of aip-crewai. Generated from the code's msgspec types.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a principal's token (host.toml token_sha256)",
                },
                "httpSignature": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Signature",
                    "description": "RFC 9421 HTTP Message Signature with Signature-Input (Ed25519; "
                    'docs/approvals.md "Signed requests")',
                },
                "streamToken": {
                    "type": "apiKey",
                    "in": "query",
                    "name": QUERY_PARAMETER,
                    "description": 'a stream token (docs/reference/http-api.md "Stream tokens")',
                },
            },
        },
        "security": [{"bearer": []}, {"httpSignature": []}],
    }


#: Where ``aip-crewai contracts --write`` commits the document (under ``contracts/``).
ARTIFACT_PATH = "openapi.host.json"


def artifact() -> tuple[str, str]:
    """``(relative path under contracts/, text)`` of the committed document (drift-tested)."""
    return ARTIFACT_PATH, json.dumps(document(), indent=2, ensure_ascii=False) + "\n"


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", openapi_path(path).replace("/aip/v1/", "/")).strip("_")
    return f"{method.lower()}_{words or 'root'}"


def undocumented(routes: list[BaseRoute]) -> set[tuple[str, str]]:
    """The ``(method, path)`` pairs served by ``routes`` that :data:`OPERATIONS` lacks,
    plus those it documents that no route serves (HEAD is implied by GET)."""
    served = {
        (method, route.path)
        for route in routes
        if isinstance(route, Route)
        for method in (route.methods or ())
        if method != "HEAD"
    }
    return served ^ set(OPERATIONS)


async def openapi_endpoint(request: Request) -> Response:
    """``GET /openapi.json``: the generated document (no authentication: it holds no tenant data)."""
    return Response(_document_bytes(), media_type=JSON)


@functools.lru_cache(maxsize=1)
def _document_bytes() -> bytes:
    """:func:`document` encoded once per process (it depends on no configuration)."""
    return msgspec.json.encode(document())


def routes() -> list[Route]:
    """``/openapi.json`` (the app mounts it only when ``[host] openapi`` is on)."""
    return [Route("/openapi.json", openapi_endpoint, methods=["GET"])]
