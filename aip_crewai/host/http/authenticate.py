"""Authentication of an HTTP request: its credential (bearer token, Ed25519-signed envelope, RFC 9421
signed request) checked by the app's :class:`~aip_crewai.host.auth.principals.Authenticator`, or a
stream request's ``?stream_token=`` (the codec is :mod:`aip_crewai.host.auth.stream_tokens`); the
principal bound to the log context. Also the two routes that mint stream tokens.

Source: ARCHITECTURE.md §7 (authentication); docs/reference/http-api.md "Stream tokens".
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...contracts.errors import Unauthenticated
from ...plumbing.asgi import SCOPE_LOG_KEY
from ..auth.principals import Principal, can_read_approvals
from ..auth.signatures import signed_request
from ..auth.stream_tokens import APPROVALS_SCOPE, QUERY_PARAMETER, StreamToken, action_scope, check, mint
from ..store.records import ms_to_rfc3339
from .state import host_setup, host_state

log = structlog.get_logger(__name__)


async def authenticate(
    request: Request,
    raw_body: bytes | None = None,
    envelope_obj: dict[str, Any] | None = None,
    *,
    checked: Principal | None = None,
) -> Principal:
    """Authenticate an HTTP request with the app's :class:`Authenticator`.

    Args:
        request: the Starlette request (its ``Authorization`` and RFC 9421
            signature headers are read).
        raw_body: the body bytes the route read (an RFC 9421 signature's
            ``content-digest`` is checked against them); None for a route that
            reads no body (checked as empty).
        envelope_obj: the envelope as decoded JSON (a dict), when the request
            carries one; needed for Ed25519 signatures.
        checked: the principal this call already returned for the same request from its headers alone
            (a bearer token, no RFC 9421 signature), before its body was read: returned as it is unless
            ``envelope_obj`` carries a signature (``security``), which is then verified with everything else.

    Returns:
        The principal; its tenant and id are bound to the log context.

    Raises:
        Unauthenticated: 401 (``WWW-Authenticate: Bearer`` is added by the handler).

    Source: ARCHITECTURE.md §7.
    """
    if checked is not None and (envelope_obj is None or "security" not in envelope_obj):
        return checked  # the same headers, nothing signed in the body: the same principal, already bound
    setup = host_setup(request)
    authenticator = setup.authenticator
    try:
        principal = await authenticator.authenticate(
            _authorization(request), envelope_obj, signed_request(request, raw_body)
        )
    except Unauthenticated as exc:
        setup.metrics.auth_failures.inc()
        log.info("authentication_failed", reason=exc.message)
        raise
    return bind_principal(request, principal)


def _authorization(request: Request) -> str | None:
    """The value of the request's one ``Authorization`` header, or None without one.

    Raises:
        Unauthenticated: two or more of them (a singleton field, RFC 9110 §11.6.2: which one counts
            would be a guess, and a proxy in front may have checked the other).
    """
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise Unauthenticated("send one Authorization header, not several")
    return values[0] if values else None


def bind_principal(request: Request, principal: Principal) -> Principal:
    """Name ``principal`` and its tenant in the log context and the request's summary line; returns it.
    The request is authenticated: its body no longer counts against the budget of bodies read before
    authentication (docs/security.md "Security")."""
    host_setup(request).body_budget.release(request.scope)
    structlog.contextvars.bind_contextvars(tenant=principal.tenant, principal=principal.id)
    info = request.scope.get(SCOPE_LOG_KEY)
    if isinstance(info, dict):
        info.update(tenant=principal.tenant, principal=principal.id)
    return principal


async def authenticate_stream(request: Request, *, scope: str) -> Principal:
    """The principal of a stream request: from ``?stream_token=`` when present
    (for ``scope``; no other credential is looked at), else as any request
    (:func:`authenticate`).

    Raises:
        Unauthenticated: a bad token, or its principal is no longer configured in its tenant.
    """
    token = request.query_params.get(QUERY_PARAMETER)
    if token is None:
        return await authenticate(request)
    state = host_state(request)
    now_ms = int(state.clock() * 1000)
    try:
        claims = check(state.stream_token_key, token, scope=scope, now_ms=now_ms)
        config = state.principals.get(claims.principal_id)
        if config is None or config.tenant != claims.tenant:
            raise Unauthenticated("the stream token's principal is not configured")
    except Unauthenticated as exc:
        state.metrics.auth_failures.inc()
        log.info("authentication_failed", reason=exc.message)
        raise
    return bind_principal(request, Principal(config.id, config.tenant, config.roles, "stream_token"))


def _minted(request: Request, principal: Principal, scope: str, url: str) -> Response:
    state = host_state(request)
    expires = int(state.clock() * 1000) + state.settings.stream_token_ttl_s * 1000
    token = mint(state.stream_token_key, principal.id, principal.tenant, scope, expires)
    body = StreamToken(
        stream_token=token, expires_at=ms_to_rfc3339(expires), stream_url=f"{url}?{QUERY_PARAMETER}={token}"
    )
    return Response(msgspec.json.encode(body), media_type="application/json", headers={"Cache-Control": "no-store"})


async def post_action_stream_token(request: Request) -> Response:
    """``POST /aip/v1/actions/{id}/stream-token``: a token for that action's
    ``/events`` stream; the same access check as reading the events (404 for
    an action the caller may not read in full, 403 for an operator)."""
    principal = await authenticate(request)
    record = await host_state(request).actions.get(principal, request.path_params["action_id"])
    return _minted(request, principal, action_scope(record.action_id), f"/aip/v1/actions/{record.action_id}/events")


async def post_approvals_stream_token(request: Request) -> Response:
    """``POST /aip/v1/approvals/stream-token``: a token for ``/aip/v1/approvals/events``
    (approvers and operators; 403 otherwise)."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    return _minted(request, principal, APPROVALS_SCOPE, "/aip/v1/approvals/events")


def routes() -> list[Route]:
    """The mint routes (before ``/aip/v1/approvals/{id}``)."""
    return [
        Route("/aip/v1/actions/{action_id:str}/stream-token", post_action_stream_token, methods=["POST"]),
        Route("/aip/v1/approvals/stream-token", post_approvals_stream_token, methods=["POST"]),
    ]
