"""The host's Starlette application: errors, middleware, foundation routes, and :func:`create_app`.

``create_app(settings)`` builds everything that does not need I/O once (the
capability index, the authenticator, metrics: :class:`~.state.HostSetup`); the
lifespan (:mod:`.lifespan`) opens the store, the sidecar clients and the action
service, and sets the typed, frozen :class:`~.state.HostState` that every
handler reads through :func:`~.state.host_state`.

Extensions: the core modules of :data:`CORE_MODULES` (action routes, stream
tokens, approval routes, the console), then any ``extensions`` named to :func:`create_app`. Each
may define ``routes() -> list[BaseRoute]`` (appended after the foundation routes) and ``lifespan(app)`` (an async context manager
entered once HostState is set, exited before the store and clients close).

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
import importlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx2
import msgspec
import structlog
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from ...contracts.aip import AIP_VERSION, CONTENT_TYPE, Body, Envelope, ErrorBody, protocol_error
from ...contracts.errors import (
    AipError,
    AmbiguousFraming,
    BodyBudgetExhausted,
    BodyTimeout,
    Category,
    MessageTooLarge,
    Overloaded,
    RequestHeadTooLarge,
    RouteNotFound,
    Unauthenticated,
)
from ...plumbing.asgi import (
    SCOPE_LOG_KEY,
    BodyBudget,
    BodyDeadline,
    BoundedBody,
    BoundedHead,
    ClientGone,
    CloseOnUnreadBody,
    InFlightLimit,
    InternalErrors,
    RefuseAmbiguousFraming,
    ReleaseBodyBudget,
    RequestLog,
)
from ...plumbing.loopback import is_loopback
from ...plumbing.serving import (
    BODY_IDLE_TIMEOUT_S,
    BODY_TOTAL_TIMEOUT_S,
    MAX_HEADER_BYTES,
    MAX_IN_FLIGHT,
    PROBE_PATHS,
)
from ..auth import stream_tokens as stream_tokens_codec
from ..auth.principals import Authenticator, require_role
from ..auth.signatures import PublicAuthorities
from ..crews.manifest import CapabilityIndex, to_wire
from ..ledger.routes import routes as ledger_routes
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import Metrics
from ..settings import Settings
from ..sidecars.readiness import READY_WAIT_S
from ..store.records import ms_to_rfc3339
from ..webhooks.routes import routes as webhook_routes
from ..webhooks.safety import metadata_opened
from . import approval_stream, approvals, console, openapi
from . import authenticate as authentication
from . import routes as routes_actions
from .authenticate import authenticate
from .lifespan import app_lifespan
from .limits import body_limit
from .state import HostSetup, host_state

log = structlog.get_logger(__name__)

#: The core modules that add routes and lifespans, imported directly: a rename fails at import, never as 404s.
CORE_MODULES: tuple[Any, ...] = (routes_actions, authentication, approval_stream, approvals, console)


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
    return Envelope(
        aip_version=AIP_VERSION,
        message_type="aip.core.v1.error",
        message_id=f"msg_{uuid.uuid4().hex}",
        sent_at=ms_to_rfc3339(now_ms),
        body=Body(error=error),
        correlation_id=correlation_id,
    )


def error_response(
    exc: AipError,
    *,
    correlation_id: str | None = None,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
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


def _internal_error(info: dict[str, Any]) -> ASGIApp:
    """The generic 500 envelope of an unexpected exception (:class:`~aip_crewai.plumbing.asgi.RequestLog`)."""
    return error_response(InternalError(), correlation_id=info.get("correlation_id"))


# --- foundation routes ---------------------------------------------------------


async def health(request: Request) -> Response:
    """``GET /health``: liveness, unauthenticated."""
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> Response:
    """``GET /ready``: 200 ``{"status":"ready"}`` or 503 ``{"status":"unready","reason"}``
    (while unready, re-checks the sidecar on demand, waiting at most
    :data:`~aip_crewai.host.sidecars.readiness.READY_WAIT_S` for it; ARCHITECTURE.md §8). Unready too while the
    store cannot take a write (:meth:`~aip_crewai.host.store.store.Store.writable`: unreachable, stuck
    behind a held lock, read-only), answered within the store's call bound; ready again by itself once
    it can (docs/operating.md "Faults and their bounds")."""
    host = host_state(request)
    if not await host.store.writable():
        return JSONResponse({"status": "unready", "reason": "the host store is unavailable"}, status_code=503)
    readiness = host.readiness
    state = readiness.state if readiness.ready else await readiness.refresh(READY_WAIT_S)
    if state.ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "unready", "reason": state.reason}, status_code=503)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: Prometheus text; needs a principal with the ``operator`` role."""
    principal = await authenticate(request)
    require_role(principal, "operator")
    state = host_state(request)
    state.metrics.unauthenticated_body_bytes.set(state.body_budget.used_bytes)
    return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


async def manifest_endpoint(request: Request) -> Response:
    """``GET /aip/v1/manifest`` and ``/aip/v1/capabilities``: the caller's tenant manifest."""
    principal = await authenticate(request)
    return Response(host_state(request).capabilities.manifest_bytes(principal.tenant), media_type=CONTENT_TYPE)


def foundation_routes() -> list[BaseRoute]:
    return [
        Route("/health", health, methods=["GET"], name="health"),
        Route("/ready", ready, methods=["GET"], name="ready"),
        Route("/metrics", metrics_endpoint, methods=["GET"], name="metrics"),
        Route("/aip/v1/manifest", manifest_endpoint, methods=["GET"], name="manifest"),
        Route("/aip/v1/capabilities", manifest_endpoint, methods=["GET"], name="capabilities"),
        *ledger_routes(),
        *webhook_routes(),
    ]


def _extensions(names: Sequence[str]) -> list[Any]:
    """Import extra modules by name (tests add routes and lifespans this way).
    A missing module is an error, never skipped (ModuleNotFoundError)."""
    return [importlib.import_module(name) for name in names]


# --- CORS ----------------------------------------------------------------------

#: Request headers a browser may send cross-origin (the AIP routes' own, and an RFC 9421 signature's).
CORS_ALLOW_HEADERS = (
    "Authorization",
    "Content-Type",
    "Last-Event-ID",
    "Signature",
    "Signature-Input",
    "Content-Digest",
)
#: Response headers a cross-origin script may read.
CORS_EXPOSE_HEADERS = ("X-Request-ID",)
#: How long a browser may cache a preflight answer, seconds.
CORS_MAX_AGE_S = 600


class _CORS(CORSMiddleware):
    """Starlette's CORS middleware, except that a refused preflight (400: another or a ``null`` origin, a
    method or header not allowed) carries no CORS header at all (docs/reference/configuration.md "Browsers")."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 200:
            for name in [k for k in response.headers if k.lower().startswith("access-control-")]:
                del response.headers[name]
        return response


def _cors(settings: Settings) -> list[Middleware]:
    """Starlette's CORS middleware for ``[host] cors_origins``, or nothing when there are none.

    Exact origins only (no wildcard, no credentials: principals send a bearer
    token or a signature, never cookies). A preflight from another origin
    gets 400 and no CORS header at all (:class:`_CORS`). Source: docs/reference/configuration.md "Browsers".
    """
    if not settings.cors_origins:
        return []
    return [
        Middleware(
            _CORS,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=list(CORS_ALLOW_HEADERS),
            expose_headers=list(CORS_EXPOSE_HEADERS),
            allow_credentials=False,
            max_age=CORS_MAX_AGE_S,
        )
    ]


# --- the app -------------------------------------------------------------------


def create_app(
    settings: Settings,
    *,
    sidecar_transport: httpx2.AsyncBaseTransport | None = None,
    clock: Callable[[], float] = time.time,
    extensions: Sequence[str] = (),
) -> Starlette:
    """Build the host app.

    Args:
        settings: validated configuration.
        sidecar_transport: transport of the sidecar client (tests pass an
            ``httpx2.MockTransport``); None means real HTTP.
        clock: epoch seconds, used for signature freshness and store times.
        extensions: names of extra modules to import for routes/lifespans after
            the core ones (see module docstring); a missing one raises ModuleNotFoundError.

    Source: ARCHITECTURE.md §6.
    """
    modules = [*CORE_MODULES, *_extensions(extensions)]
    bind_host = settings.bind.rsplit(":", 1)[0].strip("[]")
    if settings.public_authorities is None and not is_loopback(bind_host):
        if any(p.ed25519_public_key is not None for p in settings.principals):
            log.warning(
                "public_authorities_default",
                message="signed requests must name the bind address as their Host; "
                "behind a proxy or a DNS name set [host] public_authorities",
            )
    for index, entry, address in metadata_opened(settings.webhooks.allow_cidrs):
        log.warning(
            "webhook_allow_cidr_covers_metadata",
            key=f"host.webhook_allow_cidrs[{index}]",
            entry=str(entry),
            address=str(address),
            message="webhook deliveries may reach this cloud metadata address: the destination filter is off "
            "for this network; list only the private networks receivers are in (docs/webhooks.md)",
        )
    metrics = Metrics()
    body_budget = BodyBudget(settings.body_budget_bytes, BodyBudgetExhausted)
    routes = foundation_routes()
    if settings.openapi:
        routes.extend(openapi.routes())
    # Extension routes (POST /aip/v1/messages, actions, approvals) go after the foundation.
    for module in modules:
        if hasattr(module, "routes"):
            routes.extend(module.routes())
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(CloseOnUnreadBody),
            Middleware(
                RequestLog,
                probe_paths=PROBE_PATHS,
                echo_request_id=True,
                observe=metrics.observe_request,
                on_error=_internal_error,
            ),
            Middleware(
                BoundedHead,
                limit_bytes=MAX_HEADER_BYTES,
                reject=lambda: error_response(RequestHeadTooLarge(MAX_HEADER_BYTES)),
            ),
            *_cors(settings),
            Middleware(InternalErrors, render=_internal_error),  # inside CORS: a 500 carries its headers too
            Middleware(InFlightLimit, limit=MAX_IN_FLIGHT, reject=lambda: error_response(Overloaded(MAX_IN_FLIGHT))),
            Middleware(RefuseAmbiguousFraming, reject=lambda: error_response(AmbiguousFraming())),
            Middleware(BodyDeadline, idle_s=BODY_IDLE_TIMEOUT_S, total_s=BODY_TOTAL_TIMEOUT_S, timed_out=BodyTimeout),
            Middleware(BoundedBody, limit_for=body_limit, too_large=MessageTooLarge),
            Middleware(ReleaseBodyBudget, budget=body_budget),
            Middleware(ClientGone),
        ],
        exception_handlers={AipError: _aip_error_handler, HTTPException: _http_error_handler},
        lifespan=app_lifespan(sidecar_transport, modules),
    )
    app.state.setup = HostSetup(
        settings=settings,
        clock=clock,
        metrics=metrics,
        crews={crew.id: crew for crew in settings.crews},
        principals={p.id: p for p in settings.principals},
        capabilities=CapabilityIndex(settings.crews, settings.tenants),
        authenticator=Authenticator(
            settings.principals,
            None,
            clock=clock,
            authorities=PublicAuthorities(settings.public_authorities, bind_host),
        ),
        stopping=asyncio.Event(),  # set at SIGTERM by host.main (see .stopping)
        stream_token_key=stream_tokens_codec.new_key(),  # per process: tokens end with it (docs/reference/http-api.md "Stream tokens")
        body_budget=body_budget,
    )
    return app
