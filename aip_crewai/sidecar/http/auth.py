"""Bearer authentication for every sidecar route (pure ASGI middleware).

``Authorization: Bearer <token>`` is compared in constant time: both sides
are hashed with SHA-256 first (fixed length, so not even the token length
leaks) and compared with :func:`hmac.compare_digest`. A missing or wrong
token answers 401 ``{"detail": ...}`` with ``WWW-Authenticate: Bearer``,
before routing (so unknown paths are 401 too, never 404). The token is never
logged. With no token (``--allow-unauthenticated`` on loopback) requests
pass through.

Source: ARCHITECTURE.md §4 (every route requires the bearer token).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from aip_crewai.plumbing.bearer import parse_bearer

_UNAUTHORIZED_BODY = b'{"detail":"missing or invalid bearer token"}'


class BearerAuth:
    """ASGI middleware: 401 unless the request carries the configured bearer token.

    Args:
        app: the wrapped ASGI app.
        token: the expected token, or None to disable authentication.
    """

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._digest = None if token is None else hashlib.sha256(token.encode("utf-8")).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._digest is None:
            await self.app(scope, receive, send)
            return
        presented = bearer_token(scope.get("headers") or [])
        digest = hashlib.sha256(presented or b"").digest()
        if presented is None or not hmac.compare_digest(digest, self._digest):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(_UNAUTHORIZED_BODY)).encode()),
                        (b"www-authenticate", b"Bearer"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _UNAUTHORIZED_BODY})
            return
        await self.app(scope, receive, send)


#: Longest token the sidecar accepts, characters (the token file bound, ARCHITECTURE.md §4).
MAX_TOKEN_CHARS = 16384


def bearer_token(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...]) -> bytes | None:
    """The token of the one ``Authorization`` header (:func:`aip_crewai.plumbing.bearer.parse_bearer`), or None:
    also for two or more such headers (the field is a singleton, RFC 9110 §11.6.2: which one counts would be
    a guess, and a proxy in front may have checked the other)."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return None
    token = parse_bearer(values[0], max_token_chars=MAX_TOKEN_CHARS)
    return None if token is None else token.encode("latin-1")
