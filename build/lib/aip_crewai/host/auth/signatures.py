"""The signed forms of a credential, as the host reads them (pure, no I/O; verified by
:class:`~.principals.Authenticator`): the bytes an Ed25519-signed envelope's signature covers, the
signature's own shape, and an HTTP request as its RFC 9421 signature covers it.

Source: ARCHITECTURE.md §7 (authentication); docs/approvals.md "Signed requests".
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from ...contracts.hashing import jcs
from ...plumbing import httpsig
from ...plumbing.loopback import is_loopback

__all__ = [
    "NONCE_CLAIM_PREFIX",
    "PublicAuthorities",
    "SignedRequest",
    "envelope_signature",
    "signed_bytes",
    "signed_request",
]


_SIGNATURE_RE = re.compile(r"^[A-Za-z0-9_-]{86}\Z")


def envelope_signature(text: Any) -> bytes | None:
    """The 64 signature bytes of an envelope's ``security.signature`` (base64url, no padding), or None
    when it is not one."""
    if not isinstance(text, str) or not _SIGNATURE_RE.match(text):
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "==")
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 64 else None


def signed_bytes(envelope_obj: dict[str, Any]) -> bytes:
    """RFC 8785 bytes an Ed25519 signature covers: the received envelope
    object with ``security.signature`` removed (``scheme``/``key_id`` kept)."""
    security = dict(envelope_obj["security"])
    security.pop("signature", None)
    return jcs({**envelope_obj, "security": security})


@dataclass(frozen=True)
class SignedRequest:
    """What an RFC 9421 verifier needs of an HTTP request (built by :func:`signed_request`)."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    #: The ``Host`` header as received (the signature's ``@authority``, also inside ``@target-uri``).
    authority: str = ""
    #: The local address and port the connection arrived at (ASGI ``server``), or None.
    server: tuple[str, int] | None = None


@dataclass(frozen=True)
class PublicAuthorities:
    """The authorities a signed request may name (``[host] public_authorities``), a pure rule.

    ``listed``: the configured authorities (``host`` or ``host:port``, lower-case), exactly; None: the
    default, the forms of the address the host listens on: the connection's local address and the bind
    address, each with the port the connection arrived at (``[v6]:port`` in brackets), and for a loopback
    one also ``localhost``, ``127.0.0.1`` and ``[::1]``; a port of 80 may be left out, as clients do.

    Source: docs/approvals.md "Signed requests" (the authority rule, and a reverse proxy in front).
    """

    listed: tuple[str, ...] | None = None
    bind_host: str = ""

    def allows(self, authority: str, server: tuple[str, int] | None) -> bool:
        """Whether a signed request naming ``authority`` (its ``Host``) may be served on ``server``."""
        authority = authority.lower()
        if self.listed is not None:
            return authority in self.listed
        if server is None:
            return False
        host, port = server
        names = {str(host).lower(), self.bind_host.lower()}
        if any(is_loopback(name) for name in names if name):
            names |= {"localhost", "127.0.0.1", "::1"}
        forms = {f"[{name}]" if ":" in name else name for name in names if name}
        return authority in {f"{form}:{port}" for form in forms} or (port == 80 and authority in forms)


#: Prefix of an HTTP signature's nonce in the claim store (beside envelope message ids).
NONCE_CLAIM_PREFIX = "httpsig:"


def signed_request(request: Request, body: bytes | None) -> SignedRequest | None:
    """The request as signed, when it carries ``Signature-Input``/``Signature``; else None.

    The URL is rebuilt from what the host received: the ASGI scheme, the
    ``Host`` header, the raw (still percent-encoded) path and query string.
    ``body`` None means the route does not read one: verified as empty.
    """
    if not httpsig.is_signed(request.headers.keys()):
        return None
    scope = request.scope
    host = request.headers.get("host") or "{}:{}".format(*(scope.get("server") or ("localhost", 80)))
    raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
    query = scope.get("query_string") or b""
    url = f"{scope.get('scheme', 'http')}://{host}{raw_path.decode('latin-1')}"
    if query:
        url += "?" + query.decode("latin-1")
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", [])]
    server = scope.get("server")  # (host, port); a port None is the scheme's default
    default_port = 443 if scope.get("scheme") == "https" else 80
    local = (str(server[0]), default_port if server[1] is None else int(server[1])) if server else None
    return SignedRequest(request.method, url, headers, body or b"", authority=host, server=local)
