"""The host's Starlette application: state, lifespan, errors, middleware, foundation routes.

``create_app(settings)`` builds everything that does not need I/O (the
capability index, the authenticator, metrics) once; the lifespan opens the
store and the ONE ``httpx.AsyncClient`` for the sidecar, starts the readiness
poller, enters the extensions' lifespans and tells systemd ``READY=1``.

``app.state`` after startup:

| attribute | what |
|---|---|
| ``settings`` | :class:`~aip_crewai.host.config.Settings` |
| ``clock`` | ``() -> float`` epoch seconds (injectable) |
| ``metrics`` | :class:`~aip_crewai.host.metrics.Metrics` |
| ``crews`` | ``dict[crew_id, CrewDescriptor]`` (admitted, file order) |
| ``principals`` | ``dict[principal_id, PrincipalConfig]`` |
| ``capabilities`` | :class:`~aip_crewai.host.crews.manifest.CapabilityIndex` |
| ``authenticator`` | :class:`~aip_crewai.host.auth.principals.Authenticator` |
| ``store`` | :class:`~aip_crewai.host.store.store.Store` (lifespan) |
| ``http`` | ``httpx.AsyncClient`` for the sidecar (lifespan) |
| ``readiness`` | :class:`~aip_crewai.host.sidecars.readiness.Readiness` (lifespan) |

Extensions: the core modules of :data:`CORE_MODULES` (actions, action routes,
approval routes), then any ``extensions`` named to :func:`create_app`. Each
may define ``routes() -> list[BaseRoute]`` (appended after the foundation routes) and ``lifespan(app)`` (an async context manager
entered after the store and client are open, exited before they close).

Errors: every error response is an ``aip.core.v1.error`` envelope
(``{"aip_version": "1.0", "message_type": "aip.core.v1.error", "message_id",
"sent_at", "body": {"error": {"error": ProtocolError}}}``: the AIP 1.0
error body, an ErrorBody holding the ProtocolError), content type
``application/aip+json``, status from the error class (401 adds
``WWW-Authenticate: Bearer``). The same envelope is the ``data`` of an SSE
``error`` event, so one client decoder serves both. Routing 404/405 use it
too; any other exception is a 500 with a generic body and a logged traceback.

Source: ARCHITECTURE.md §6 (routes, errors), §7, ARCHITECTURE.md §2.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...asgi import (
    CLIENT_GONE_KEY,
    BodyDeadline,
    BoundedBody,
    ClientGone,
    CloseOnUnreadBody,
    InFlightLimit,
    RefuseAmbiguousFraming,
)
from ...contracts.aip import AIP_VERSION, CONTENT_TYPE, Body, Envelope, ErrorBody, protocol_error
from ...contracts.errors import (
    AipError,
    AmbiguousFraming,
    BodyTimeout,
    Category,
    MessageTooLarge,
    Overloaded,
    RouteNotFound,
    Unauthenticated,
)
from ...serving import BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S, MAX_IN_FLIGHT, PROBE_PATHS
from ..actions import service as actions
from . import approval_stream, approvals, console, openapi, routes as routes_actions
from ..crews import manifest
from ..auth import stream_tokens
from ..auth.principals import SCOPE_LOG_KEY, Authenticator, authenticate, require_role
from ..config import SidecarSettings, Settings
from .limits import body_limit
from ..crews.manifest import CapabilityIndex, to_wire
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import Metrics, method_label
from ..sidecars.readiness import Readiness, ReadinessGroup, notify_systemd
from ..store.store import Store, StoreError, ms_to_rfc3339

log = structlog.get_logger(__name__)

#: The core modules that add routes and lifespans, imported directly: a rename fails at import, never as 404s.
CORE_MODULES: tuple[Any, ...] = (actions, routes_actions, stream_tokens, approval_stream, approvals, console)
#: Sidecar connect timeout, seconds (ARCHITECTURE.md §7); reads are unbounded (streams).
SIDECAR_CONNECT_TIMEOUT_S = 10.0
#: How often expired message-id claims are purged, seconds.
PURGE_INTERVAL_S = 60.0
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")


class MethodNotAllowed(AipError):
    code = "route.method_not_allowed"
    category = Category.PERMANENT
    http_status = 405
    default_message = "method not allowed on this route"


class RequestRejected(AipError):
    """Any other HTTP-level refusal (rendered with the original status)."""

    code = "request.rejected"
    category = Category.PERMANENT
    default_message = "the request was rejected"


class InternalError(AipError):
    code = "host.internal_error"
    category = Category.PERMANENT
    http_status = 500
    default_message = "internal error"


# --- error rendering -----------------------------------------------------------


def error_envelope(exc: AipError, *, correlation_id: str | None = None, now_ms: int | None = None) -> Envelope:
    """The ``aip.core.v1.error`` envelope of ``exc`` (message and details as the class built them)."""
    error = ErrorBody(error=protocol_error(exc))
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return Envelope(aip_version=AIP_VERSION, message_type="aip.core.v1.error", message_id=f"msg_{uuid.uuid4().hex}",
                    sent_at=ms_to_rfc3339(now_ms), body=Body(error=error), correlation_id=correlation_id)


def error_response(exc: AipError, *, correlation_id: str | None = None, status: int | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    """An HTTP response carrying :func:`error_envelope` (``status`` defaults to ``exc.status``)."""
    merged = dict(headers or {})
    if isinstance(exc, Unauthenticated):
        merged.setdefault("WWW-Authenticate", "Bearer")
    if exc.retry_after_ms is not None:
        merged.setdefault("Retry-After", str(max(1, -(-exc.retry_after_ms // 1000))))
    body = msgspec.json.encode(to_wire(error_envelope(exc, correlation_id=correlation_id)))
    return Response(body, status_code=status or exc.status, media_type=CONTENT_TYPE, headers=merged)


def _correlation(request: Request) -> str | None:
    info = request.scope.get(SCOPE_LOG_KEY)
    value = info.get("correlation_id") if isinstance(info, dict) else None
    return value if isinstance(value, str) else None


async def _aip_error_handler(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, AipError):  # registered for AipError only
        raise exc
    log.info("request_rejected", code=exc.code, status=exc.status)
    return error_response(exc, correlation_id=_correlation(request))


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):
        raise exc
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return error_response(RouteNotFound(), headers=headers)
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(details={"allow": headers.get("Allow", "")}), headers=headers)
    return error_response(RequestRejected(str(exc.detail)[:256]), status=exc.status_code, headers=headers)


# --- middleware ----------------------------------------------------------------


class RequestContextMiddleware:
    """Pure ASGI middleware: binds ``request_id`` into structlog's contextvars
    (from a sane inbound ``X-Request-ID`` or a new ``req_<hex>``), echoes it
    in the response, renders unexpected exceptions as a generic 500 envelope
    (traceback logged once), counts the request and logs ONE summary line
    (``request_finished``: method, route template, status, duration_ms,
    response_bytes, tenant, principal; never headers, query or bodies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbound = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), "")
        request_id = inbound if _REQUEST_ID_RE.match(inbound) else f"req_{uuid.uuid4().hex}"
        info: dict[str, Any] = {"request_id": request_id}
        scope[SCOPE_LOG_KEY] = info
        saved = structlog.contextvars.get_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        outcome = {"status": 500, "started": False, "bytes": 0}
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                outcome["status"], outcome["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            elif message["type"] == "http.response.body":
                outcome["bytes"] = int(outcome["bytes"]) + len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            log.exception("request_failed")
            if outcome["started"]:
                raise
            response = error_response(InternalError(), correlation_id=info.get("correlation_id"))
            await response(scope, receive, send_wrapper)
        finally:
            if scope.get(CLIENT_GONE_KEY) and not outcome["started"]:
                outcome["status"] = 499  # the client closed the request (no answer was sent)
            duration = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = method_label(scope.get("method", ""))  # a closed set: never the raw request bytes
            metrics: Metrics | None = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
            if metrics is not None:
                metrics.observe_request(route, method, int(outcome["status"]), duration)
            extra = {k: info[k] for k in ("tenant", "principal") if k in info}
            (log.debug if route in PROBE_PATHS else log.info)(
                "request_finished", method=method, route=route, status=outcome["status"],
                     duration_ms=round(duration * 1000, 3), response_bytes=outcome["bytes"], **extra)
            structlog.contextvars.clear_contextvars()
            structlog.contextvars.bind_contextvars(**saved)


# --- foundation routes ---------------------------------------------------------


async def health(request: Request) -> Response:
    """``GET /health``: liveness, unauthenticated."""
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> Response:
    """``GET /ready``: 200 ``{"status":"ready"}`` or 503 ``{"status":"unready","reason"}``
    (re-checks the sidecar on demand while unready; ARCHITECTURE.md §7). Unready too while the
    store's last method found the database unreachable (``Store.unavailable``)."""
    store = getattr(request.app.state, "store", None)
    if store is not None and store.unavailable:
        return JSONResponse({"status": "unready", "reason": "the host store is unavailable"}, status_code=503)
    readiness: Readiness = request.app.state.readiness
    state = readiness.state if readiness.ready else await readiness.refresh()
    if state.ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "unready", "reason": state.reason}, status_code=503)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: Prometheus text; needs a principal with the ``operator`` role."""
    principal = await authenticate(request)
    require_role(principal, "operator")
    metrics: Metrics = request.app.state.metrics
    return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)


def foundation_routes() -> list[BaseRoute]:
    return [
        Route("/health", health, methods=["GET"], name="health"),
        Route("/ready", ready, methods=["GET"], name="ready"),
        Route("/metrics", metrics_endpoint, methods=["GET"], name="metrics"),
        *manifest.routes(),
    ]


def _extensions(names: Sequence[str]) -> list[Any]:
    """Import extra modules by name (tests add routes and lifespans this way).
    A missing module is an error, never skipped (ModuleNotFoundError)."""
    return [importlib.import_module(name) for name in names]


# --- CORS ----------------------------------------------------------------------

#: Request headers a browser may send cross-origin (the AIP routes' own, and an RFC 9421 signature's).
CORS_ALLOW_HEADERS = ("Authorization", "Content-Type", "Last-Event-ID", "Signature", "Signature-Input",
                      "Content-Digest")
#: Response headers a cross-origin script may read.
CORS_EXPOSE_HEADERS = ("X-Request-ID",)
#: How long a browser may cache a preflight answer, seconds.
CORS_MAX_AGE_S = 600


def _cors(settings: Settings) -> list[Middleware]:
    """Starlette's CORS middleware for ``[host] cors_origins``, or nothing when there are none.

    Exact origins only (no wildcard, no credentials: principals send a bearer
    token or a signature, never cookies). A preflight from another origin
    gets 400 and no ``Access-Control-Allow-*`` headers. Source: README "Browsers".
    """
    if not settings.cors_origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=list(CORS_ALLOW_HEADERS), expose_headers=list(CORS_EXPOSE_HEADERS),
                       allow_credentials=False, max_age=CORS_MAX_AGE_S)]


# --- lifespan ------------------------------------------------------------------


async def _purge_loop(store: Store) -> None:
    while True:
        await asyncio.sleep(PURGE_INTERVAL_S)
        try:
            await store.purge_message_ids()
        except Exception:  # keep purging later; never kill the host for housekeeping
            log.exception("message_id_purge_failed")


def _sidecars(settings: Settings) -> tuple[SidecarSettings, ...]:
    """The configured sidecars (settings built by hand in tests may name only the first one's fields)."""
    return settings.sidecars or (SidecarSettings("sidecar", settings.sidecar_url, settings.sidecar_token,
                                                 settings.sidecar_proxy, settings.sidecar_keepalive_s),)


def _sidecar_http(sidecar: SidecarSettings, transport: Any) -> httpx.AsyncClient:
    """The lifespan-owned client of one sidecar; ``transport``: one for every sidecar, or name -> transport
    (tests), or None (real HTTP)."""
    return httpx.AsyncClient(
        base_url=sidecar.url,
        headers={"Authorization": f"Bearer {sidecar.token}"},
        transport=transport.get(sidecar.name) if isinstance(transport, dict) else transport,
        follow_redirects=False,
        timeout=httpx.Timeout(None, connect=SIDECAR_CONNECT_TIMEOUT_S),
        # The environment's HTTP(S)_PROXY would receive the bearer token: only an explicit
        # sidecar.proxy is used (README "Security").
        trust_env=False,
        proxy=sidecar.proxy,
    )


def _readiness(app: Starlette, settings: Settings, clients: dict[str, httpx.AsyncClient]) -> ReadinessGroup:
    """One :class:`Readiness` per sidecar over the crews it serves, grouped (issue 21 item 3). Crew inputs
    reported by each sidecar are merged into the capability index; what each can cancel is published
    for its own crews."""
    capabilities = app.state.capabilities
    reported: dict[str, dict[str, Any]] = {}

    def inputs_of(name: str) -> Callable[[dict[str, Any]], None]:
        def update(found: dict[str, Any]) -> None:
            reported[name] = found
            capabilities.set_crew_inputs({crew: schema for inputs in reported.values() for crew, schema in inputs.items()})
        return update

    def cancellable_of(crew_ids: list[str]) -> Callable[[frozenset[str]], None]:
        return lambda cancellable: capabilities.set_cancellable(cancellable, crew_ids)

    members = []
    for sidecar in _sidecars(settings):
        crews = [crew for crew in settings.crews if sidecar.serves(crew.id)]
        members.append((sidecar.name, Readiness(
            clients[sidecar.name], crews, app.state.metrics, clock=app.state.clock, name=sidecar.name,
            on_crew_inputs=inputs_of(sidecar.name),
            on_cancellable=cancellable_of([crew.id for crew in crews]))))
    return ReadinessGroup(members)


def _lifespan(transport: httpx.AsyncBaseTransport | None, modules: list[Any]) -> Callable[[Starlette], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        settings: Settings = app.state.settings
        # Dispatch leases where hosts share the store (PostgreSQL); a SQLite store has one host (its lock file).
        shared = not isinstance(settings.store_path, Path)
        try:
            store = await Store.open(settings.store_path, clock=app.state.clock,
                                     owner=settings.host_id if shared else None,
                                     lease_ms=int(settings.lease_s * 1000), pool_size=settings.store_pool_size)
        except StoreError as exc:  # the process reports it in one line and exits 2 (host/main.py)
            app.state.startup_error = exc
            raise
        clients = {sidecar.name: _sidecar_http(sidecar, transport) for sidecar in _sidecars(settings)}
        http = next(iter(clients.values()))
        tasks: list[asyncio.Task[None]] = []
        try:
            app.state.store, app.state.http, app.state.sidecar_http = store, http, clients
            app.state.authenticator.claims = store
            app.state.readiness = _readiness(app, settings, clients)
            async with contextlib.AsyncExitStack() as stack:
                for module in modules:
                    if hasattr(module, "lifespan"):
                        await stack.enter_async_context(module.lifespan(app))
                tasks.append(asyncio.create_task(app.state.readiness.run(settings.readiness_interval_s)))
                tasks.append(asyncio.create_task(_purge_loop(store)))
                log.info("host_started", bind=settings.bind, crews=len(settings.crews),
                         tenants=len(settings.tenants), principals=len(settings.principals))
                notify_systemd(settings.notify_socket)
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            app.state.authenticator.claims = None
            for client in clients.values():
                await client.aclose()
            await store.close()
            log.info("host_stopped")

    return lifespan


def create_app(settings: Settings, *, sidecar_transport: httpx.AsyncBaseTransport | None = None,
               clock: Callable[[], float] = time.time, extensions: Sequence[str] = ()) -> Starlette:
    """Build the host app.

    Args:
        settings: validated configuration.
        sidecar_transport: transport of the sidecar client (tests pass an
            ``httpx.MockTransport``); None means real HTTP.
        clock: epoch seconds, used for signature freshness and store times.
        extensions: names of extra modules to import for routes/lifespans after
            the core ones (see module docstring); a missing one raises ModuleNotFoundError.

    Source: ARCHITECTURE.md §6.
    """
    modules = [*CORE_MODULES, *_extensions(extensions)]
    routes = foundation_routes()
    if settings.openapi:
        routes.extend(openapi.routes())
    # Extension routes (POST /aip/v1/messages, actions, approvals) go after the foundation.
    for module in modules:
        if hasattr(module, "routes"):
            routes.extend(module.routes())
    app = Starlette(
        routes=routes,
        middleware=[Middleware(CloseOnUnreadBody), Middleware(RequestContextMiddleware), *_cors(settings),
                    Middleware(InFlightLimit, limit=MAX_IN_FLIGHT, reject=lambda: error_response(Overloaded(MAX_IN_FLIGHT))),
                    Middleware(RefuseAmbiguousFraming, reject=lambda: error_response(AmbiguousFraming())),
                    Middleware(BodyDeadline, idle_s=BODY_IDLE_TIMEOUT_S, total_s=BODY_TOTAL_TIMEOUT_S,
                               timed_out=BodyTimeout),
                    Middleware(BoundedBody, limit_for=body_limit, too_large=MessageTooLarge), Middleware(ClientGone)],
        exception_handlers={AipError: _aip_error_handler, HTTPException: _http_error_handler},
        lifespan=_lifespan(sidecar_transport, modules),
    )
    metrics = Metrics()
    app.state.settings = settings
    app.state.stopping = asyncio.Event()  # set at SIGTERM by host.main (see host.stopping)
    app.state.clock = clock
    app.state.metrics = metrics
    app.state.crews = {crew.id: crew for crew in settings.crews}
    app.state.principals = {p.id: p for p in settings.principals}
    app.state.capabilities = CapabilityIndex(settings.crews, settings.tenants)
    app.state.authenticator = Authenticator(settings.principals, None, clock=clock)
    app.state.stream_token_key = stream_tokens.new_key()  # per process: tokens end with it (README "Stream tokens")
    return app
