"""Authentication of an HTTP request: its credential (bearer token, Ed25519-signed envelope, RFC 9421
signed request) checked by the app's :class:`~aip_crewai.host.auth.principals.Authenticator`, the
principal bound to the log context.

Source: ARCHITECTURE.md §7 (authentication).
"""

from __future__ import annotations

from typing import Any

import structlog
from starlette.requests import Request

from ...contracts.errors import Unauthenticated
from ...plumbing.asgi import SCOPE_LOG_KEY
from ..auth.principals import Principal
from ..auth.signatures import signed_request
from .state import host_setup

log = structlog.get_logger(__name__)


async def authenticate(request: Request, raw_body: bytes | None = None,
                       envelope_obj: dict[str, Any] | None = None) -> Principal:
    """Authenticate an HTTP request with the app's :class:`Authenticator`.

    Args:
        request: the Starlette request (its ``Authorization`` and RFC 9421
            signature headers are read).
        raw_body: the body bytes the route read (an RFC 9421 signature's
            ``content-digest`` is checked against them); None for a route that
            reads no body (checked as empty).
        envelope_obj: the envelope as decoded JSON (a dict), when the request
            carries one; needed for Ed25519 signatures.

    Returns:
        The principal; its tenant and id are bound to the log context.

    Raises:
        Unauthenticated: 401 (``WWW-Authenticate: Bearer`` is added by the handler).

    Source: ARCHITECTURE.md §7.
    """
    setup = host_setup(request)
    authenticator = setup.authenticator
    try:
        principal = await authenticator.authenticate(request.headers.get("authorization"), envelope_obj,
                                                     signed_request(request, raw_body))
    except Unauthenticated as exc:
        setup.metrics.auth_failures.inc()
        log.info("authentication_failed", reason=exc.message)
        raise
    return bind_principal(request, principal)


def bind_principal(request: Request, principal: Principal) -> Principal:
    """Name ``principal`` and its tenant in the log context and the request's summary line; returns it."""
    structlog.contextvars.bind_contextvars(tenant=principal.tenant, principal=principal.id)
    info = request.scope.get(SCOPE_LOG_KEY)
    if isinstance(info, dict):
        info.update(tenant=principal.tenant, principal=principal.id)
    return principal
