"""HTTP Message Signatures (RFC 9421) with Ed25519, as the host accepts them
from principals that hold only a key (approvers, readers). Pure: no clock, no
store, no logging; the caller passes the time and claims the nonce.

The profile (docs/approvals.md "Signed requests"):

- one signature (any label), algorithm ``ed25519`` (the ``alg`` parameter
  must be present and say so), ``keyid`` = the principal id;
- covered components, at least: ``@method`` and the whole target, either as
  ``@target-uri`` or as ``@authority`` + ``@path`` + ``@query`` (what this
  package's client signs: it survives a TLS-terminating proxy, whose scheme
  the host does not see), and ``content-digest`` (RFC 9530, ``sha-256`` or
  ``sha-512``) whenever the request has a body; the digest must match the
  body bytes;
- parameters ``created`` (integer seconds, within ±300 s of the host clock),
  ``nonce`` (:data:`NONCE_RE`: 16..128 characters of base64 or base64url,
  ``A-Za-z0-9+/_-`` and ``=``; the caller claims it once per key), optional
  ``expires`` (must be in the future), nothing else but ``tag``;
- ``Signature-Input`` and ``Signature`` at most :data:`MAX_SIGNATURE_HEADER_CHARS`
  characters each.

The crypto and the RFC 9421 signature base are the well-kept
``http-message-signatures`` library's; this module fixes the profile on top
and keeps what a decision record needs to prove who signed what
(:class:`VerifiedSignature`: the signature base, the signature and its input).

Source: RFC 9421 §2 (components), §2.3 (parameters), §3.2 (verifying),
§7.2.2 (replay: nonce); RFC 9530 (Content-Digest); ARCHITECTURE.md §7.
"""

from __future__ import annotations

import base64
import datetime
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import http_sf
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from http_message_signatures import (
    HTTPMessageSignaturesException,
    HTTPMessageSigner,
    HTTPMessageVerifier,
    HTTPSignatureKeyResolver,
    InvalidSignature,
    algorithms,
)

#: The algorithm, as RFC 9421 §6.2.2 names it.
ALGORITHM = "ed25519"
#: The label this package's clients use (any label is accepted).
LABEL = "aip"
#: Components this package's client covers (one of the :data:`TARGET_COVERAGES`).
REQUIRED_COMPONENTS = ("@method", "@authority", "@path", "@query")
#: Every signature covers ``@method`` and one of these sets (the whole request target).
TARGET_COVERAGES = (frozenset({"@target-uri"}), frozenset({"@authority", "@path", "@query"}))
#: Accepted distance between ``created`` and the host clock, seconds (as for signed envelopes).
MAX_CLOCK_SKEW_S = 300
#: Bound on each of ``Signature-Input`` and ``Signature``, characters.
MAX_SIGNATURE_HEADER_CHARS = 4096
#: A nonce: 16..128 characters of base64 or base64url (16 random bytes are 22 or 24 of them).
NONCE_RE = re.compile(r"^[A-Za-z0-9+/_=-]{16,128}\Z")
MIN_NONCE_CHARS, MAX_NONCE_CHARS = 16, 128
_COVERAGE = (
    "the signature must cover @method and @target-uri (or @authority, @path and @query), and content-digest with a body"
)
_ALLOWED_PARAMETERS = frozenset({"created", "keyid", "alg", "nonce", "expires", "tag"})
#: Headers that mark a request as signed.
SIGNATURE_HEADERS = ("signature-input", "signature")


class SignatureRejected(ValueError):
    """A signed request breaks the profile or does not verify; ``reason`` is
    safe to show the caller (it never holds key material)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class VerifiedSignature:
    """What a verified signature proves.

    Attributes:
        key_id: the ``keyid`` parameter (a principal id).
        created: the ``created`` parameter, epoch seconds.
        nonce: the ``nonce`` parameter.
        signature_input: the signature's ``Signature-Input`` member, serialized
            (``("@method" ...);created=...;keyid=...``).
        signature_base: the RFC 9421 signature base the signature covers (ASCII).
        signature: the 64 signature bytes.
        covered: component id -> signed value (``"content-digest"`` included when covered).
    """

    key_id: str
    created: int
    nonce: str
    signature_input: str
    signature_base: str
    signature: bytes
    covered: dict[str, str] = field(default_factory=dict)

    def proof(self) -> dict[str, Any]:
        """The JSON-able proof to keep with a decision: anyone holding the
        public key re-verifies ``signature`` over ``signature_base``."""
        return {
            "scheme": "http-message-signature",
            "alg": ALGORITHM,
            "key_id": self.key_id,
            "created": self.created,
            "nonce": self.nonce,
            "signature_input": self.signature_input,
            "signature_base": self.signature_base,
            "signature": base64.b64encode(self.signature).decode("ascii"),
        }


class _Headers:
    """Read-only header lines (name, value) in wire order, as the library reads them."""

    def __init__(self, lines: Iterable[tuple[str, str]]) -> None:
        self._lines = list(lines)

    def items(self) -> list[tuple[str, str]]:
        return self._lines

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for name, _ in self._lines))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and any(n.lower() == name.lower() for n, _ in self._lines)


class _WritableHeaders(dict[str, str]):
    """A plain dict the signer adds ``Content-Digest``, ``Signature-Input`` and ``Signature`` to."""


@dataclass
class _Message:
    method: str
    url: str
    headers: Any


class _Keys(HTTPSignatureKeyResolver):
    def __init__(
        self, public: Callable[[str], Ed25519PublicKey | None] | None = None, private: Ed25519PrivateKey | None = None
    ) -> None:
        self._public, self._private = public, private

    def resolve_public_key(self, key_id: str) -> Ed25519PublicKey | None:
        return self._public(key_id) if self._public is not None else None

    def resolve_private_key(self, key_id: str) -> Ed25519PrivateKey:
        if self._private is None:
            raise KeyError(key_id)
        return self._private


class _Verifier(HTTPMessageVerifier):
    # Freshness is checked by verify_request against the caller's clock, not the library's.
    max_clock_skew = datetime.timedelta(days=365 * 100)


def new_nonce() -> str:
    """A fresh nonce: 16 random bytes in unpadded base64url (22 characters)."""
    return secrets.token_urlsafe(16)


def sign_request(
    method: str, url: str, body: bytes, key: Ed25519PrivateKey, key_id: str, *, created: int, nonce: str | None = None
) -> dict[str, str]:
    """The headers that sign one request in this profile.

    Args:
        method: upper-case HTTP method.
        url: the absolute, encoded URL the request goes to (scheme, host,
            port, path, query exactly as sent).
        body: the body bytes (``b""`` for none: no ``Content-Digest``).
        key / key_id: the Ed25519 private key and the principal id it belongs to.
        created: epoch seconds.
        nonce: None for a fresh one (:func:`new_nonce`).

    Returns:
        ``{"Signature-Input", "Signature"}`` plus ``Content-Digest`` when ``body``.

    Raises:
        SignatureRejected: the URL cannot be signed (not absolute, or not encoded).
    """
    headers = _WritableHeaders()
    signer = HTTPMessageSigner(signature_algorithm=algorithms.ED25519, key_resolver=_Keys(private=key))
    try:
        signer.sign(
            _Message(method, url, headers),
            key_id=key_id,
            label=LABEL,
            nonce=nonce or new_nonce(),
            created=datetime.datetime.fromtimestamp(created, tz=datetime.timezone.utc),
            covered_component_ids=REQUIRED_COMPONENTS,
            body=body or None,
        )
    except HTTPMessageSignaturesException as exc:
        raise SignatureRejected(f"cannot sign this request: {exc}") from exc
    return dict(headers)


def is_signed(header_names: Iterable[str]) -> bool:
    """Whether a request carries RFC 9421 signature headers (either one)."""
    return any(name.lower() in SIGNATURE_HEADERS for name in header_names)


def verify_request(
    method: str,
    url: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    public_key: Callable[[str], Ed25519PublicKey | None],
    now_s: float,
) -> VerifiedSignature:
    """Verify one signed request against the profile (module docstring).

    Args:
        method: the request method as received.
        url: the absolute URL the host was asked for: ``<scheme>://<Host header><raw path>[?<raw query>]``.
        headers: every header line ``(name, value)`` as received (latin-1 decoded).
        body: the body bytes as received (``b""`` for none).
        public_key: principal id -> its Ed25519 public key, None when it has none.
        now_s: the host clock, epoch seconds.

    Returns:
        The :class:`VerifiedSignature` (the caller claims its nonce for its key).

    Raises:
        SignatureRejected: naming the first rule the request breaks.
    """
    lines = [(n, v) for n, v in headers]
    for name in SIGNATURE_HEADERS:
        values = [v for n, v in lines if n.lower() == name]
        if not values:
            raise SignatureRejected(f"a signed request needs both Signature-Input and Signature (no {name})")
        if sum(len(v) for v in values) > MAX_SIGNATURE_HEADER_CHARS:
            raise SignatureRejected(f"{name} is longer than {MAX_SIGNATURE_HEADER_CHARS} characters")
    verifier = _Verifier(signature_algorithm=algorithms.ED25519, key_resolver=_Keys(public=public_key))
    message = _Message(method, url, _Headers(lines))
    try:
        results = verifier.verify(message, max_age=None, require_components=("@method",), body=body)
    except InvalidSignature as exc:
        raise SignatureRejected(_reason(exc)) from None
    except HTTPMessageSignaturesException as exc:
        raise SignatureRejected(f"the signature cannot be checked: {exc}") from None
    if len(results) != 1:  # the library refuses several without a tag; a tag could still select several
        raise SignatureRejected("a request carries exactly one signature")
    result = results[0]
    covered = {key.strip('"') for key in result.covered_components if ";" not in key}
    if not any(target <= covered for target in TARGET_COVERAGES):
        raise SignatureRejected(_COVERAGE)
    params = result.parameters
    extra = set(params) - _ALLOWED_PARAMETERS
    if extra:
        raise SignatureRejected(f"unexpected signature parameter {sorted(extra)[0]!r}")
    if params.get("alg") != ALGORITHM:
        raise SignatureRejected('the signature must name alg="ed25519"')
    nonce = params.get("nonce")
    if not isinstance(nonce, str) or not NONCE_RE.match(nonce):
        raise SignatureRejected(
            f"the signature needs a nonce of {MIN_NONCE_CHARS}..{MAX_NONCE_CHARS} characters A-Z a-z 0-9 + / _ - ="
        )
    created = params.get("created")
    if not isinstance(created, int) or abs(now_s - created) > MAX_CLOCK_SKEW_S:
        raise SignatureRejected(f"created is more than {MAX_CLOCK_SKEW_S} s away from the host clock")
    expires = params.get("expires")
    if expires is not None and (not isinstance(expires, int) or expires <= now_s):
        raise SignatureRejected("the signature has expired")
    signature_input = result.covered_components.get('"@signature-params"', "")
    base = "\n".join(f"{k}: {v}" for k, v in result.covered_components.items())
    raw = next((v for n, v in lines if n.lower() == "signature"), "")
    return VerifiedSignature(
        key_id=str(params["keyid"]),
        created=created,
        nonce=nonce,
        signature_input=signature_input,
        signature_base=base,
        signature=_signature_bytes(raw, result.label),
        covered=dict(result.covered_components),
    )


def _signature_bytes(header: str, label: str) -> bytes:
    """The bytes of member ``label`` of a ``Signature`` header the library already parsed and verified."""
    parsed: Any = http_sf.parse(header.encode("ascii", "replace"), tltype="dictionary")
    member = parsed.get(label) if isinstance(parsed, dict) else None
    value = member[0] if isinstance(member, tuple) else None
    return value if isinstance(value, bytes) else b""


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "resolve verification key" in text:
        return "unknown signing key (keyid names no principal with an ed25519_public_key)"
    if "Content-Digest" in text or "content-digest" in text.lower():
        return f"content digest: {text}"
    if "Required component" in text:
        return _COVERAGE
    if isinstance(exc.__cause__, Exception) or "verify" in text.lower() or not text:
        return "the signature does not verify"
    return text[:200]
