"""The signed forms of a credential, as the host reads them (pure, no I/O; verified by
:class:`~.principals.Authenticator`): the bytes an Ed25519-signed envelope's signature covers, the
signature's own shape, and an HTTP request as its RFC 9421 signature covers it.

Source: ARCHITECTURE.md §7 (authentication); README "Signed requests".
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

__all__ = ["NONCE_CLAIM_PREFIX", "SignedRequest", "envelope_signature", "signed_bytes", "signed_request"]


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
    return SignedRequest(request.method, url, headers, body or b"")
