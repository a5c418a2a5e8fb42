"""Stream tokens: how a browser's ``EventSource`` (which cannot send headers)
authenticates an SSE stream. docs/reference/http-api.md "Stream tokens".

An authenticated request mints a short-lived token bound to ONE principal,
its tenant and ONE stream (a scope): ``action:<action id>`` for
``GET /aip/v1/actions/{id}/events``, ``approvals`` for
``GET /aip/v1/approvals/events``. The stream accepts it as the query
parameter ``stream_token`` instead of any ``Authorization`` header.

The token is stateless: ``ast1.<payload>.<mac>``, both parts unpadded
base64url; the payload is the JSON ``{"p": principal id, "t": tenant, "s":
scope, "e": expiry (epoch ms)}`` and the mac its HMAC-SHA256 under a key
drawn at random when the process starts (:func:`new_key`), compared in
constant time. So tokens do NOT survive a host restart (the client mints a
new one: the stream answers 401 ``auth.unauthenticated``), and one host
process cannot check another's. A token is valid until its expiry even
after use (EventSource reconnects with the same URL); its lifetime is
``[host] stream_token_ttl_seconds`` (default 300). The principal's roles
are read from the configuration at each use, and the stream's own access
check runs as for any credential.

Never logged: the request log line carries the route template, never the
query string (:class:`~aip_crewai.plumbing.asgi.RequestLog`), and
hypercorn's access log is off (:mod:`aip_crewai.plumbing.serving`).

Source: docs/reference/http-api.md "Stream tokens"; RFC 2104 (HMAC).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from ...contracts.errors import Unauthenticated

#: The query parameter that carries a token.
QUERY_PARAMETER = "stream_token"
#: Scope of the approval stream.
APPROVALS_SCOPE = "approvals"
#: Prefix (and version) of every token.
PREFIX = "ast1"
#: Bound on a token's payload, characters: room for the longest principal id (256 characters)
#: and action id (256), each of 4-byte UTF-8 characters, in base64url.
MAX_PAYLOAD_CHARS = 4096
#: Bound on a presented token, characters: ``ast1.`` + payload + ``.`` + 43 MAC characters.
MAX_TOKEN_CHARS = len(PREFIX) + 1 + MAX_PAYLOAD_CHARS + 1 + 43
log = structlog.get_logger(__name__)
_TOKEN_RE = re.compile(rf"^ast1\.([A-Za-z0-9_-]{{1,{MAX_PAYLOAD_CHARS}}})\.([A-Za-z0-9_-]{{43}})\Z")


def new_key() -> bytes:
    """A fresh random HMAC key (32 bytes) for one host process."""
    return secrets.token_bytes(32)


def action_scope(action_id: str) -> str:
    """The scope of one action's event stream."""
    return f"action:{action_id}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(key: bytes, principal_id: str, tenant: str, scope: str, expires_ms: int) -> str:
    """A token for ``principal_id`` of ``tenant`` on stream ``scope`` until ``expires_ms``. Pure."""
    payload = _b64(
        json.dumps(
            {"p": principal_id, "t": tenant, "s": scope, "e": expires_ms},
            separators=(",", ":"),
            sort_keys=True,
            ensure_ascii=False,
        ).encode("utf-8")
    )
    mac = hmac.new(key, f"{PREFIX}.{payload}".encode("ascii"), hashlib.sha256).digest()
    return f"{PREFIX}.{payload}.{_b64(mac)}"


@dataclass(frozen=True)
class TokenClaims:
    """What a valid token says: its principal, tenant, stream scope and expiry (epoch ms)."""

    principal_id: str
    tenant: str
    scope: str
    expires_ms: int


def check(key: bytes, token: str, *, scope: str, now_ms: int) -> TokenClaims:
    """The claims of a valid token for ``scope`` at ``now_ms``. Pure.

    Raises:
        Unauthenticated: malformed, forged (MAC), expired, or for another stream.
    """
    match = _TOKEN_RE.match(token) if len(token) <= MAX_TOKEN_CHARS else None
    if match is None:
        raise Unauthenticated("the stream token is malformed")
    expected = hmac.new(key, f"{PREFIX}.{match.group(1)}".encode("ascii"), hashlib.sha256).digest()
    try:
        presented = _unb64(match.group(2))
    except (binascii.Error, ValueError):
        raise Unauthenticated("the stream token is malformed") from None
    if not hmac.compare_digest(expected, presented):  # before the payload is parsed at all
        raise Unauthenticated("the stream token is not valid (forged, or minted by another host process)")
    try:
        claims: Any = json.loads(_unb64(match.group(1)))
    except (binascii.Error, ValueError):
        raise Unauthenticated("the stream token is malformed") from None
    if (
        not isinstance(claims, dict)
        or not all(isinstance(claims.get(k), str) for k in ("p", "t", "s"))
        or not isinstance(claims.get("e"), int)
    ):
        raise Unauthenticated("the stream token is malformed")
    if now_ms >= claims["e"]:
        raise Unauthenticated("the stream token has expired; mint a new one")
    if claims["s"] != scope:
        raise Unauthenticated("the stream token is for another stream")
    return TokenClaims(claims["p"], claims["t"], claims["s"], claims["e"])


class StreamToken(msgspec.Struct, frozen=True):
    """Answer of the mint routes: the token, its expiry (RFC 3339) and the stream URL carrying it."""

    stream_token: str
    expires_at: str
    stream_url: str
