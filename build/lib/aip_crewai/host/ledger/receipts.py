"""Signed result receipts (pure): what a receipt binds, its canonical bytes, signing and verifying.

A receipt is one JSON document, served and stored as its RFC 8785 (JCS) canonical bytes::

    {"hash": "sha256:<hex>",
     "receipt": {claims, see :func:`claims`},
     "signature": {"alg": "Ed25519", "key_id": "rk_<hex>", "value": "<base64url, no padding>"}}

``hash`` is the SHA-256 of the JCS bytes of ``receipt``, and ``signature.value`` the Ed25519 signature
of those same bytes by the host's receipt key. :func:`verify` checks all of it and also that the
document is exactly its own canonical form, so any changed byte of a stored or downloaded receipt is
refused (a value changed breaks the hash, a byte outside the values breaks the canonical form).
A key id is ``rk_`` + the first 16 hex digits of the SHA-256 of the raw 32-byte public key, so
old public keys (``[host] receipt_previous_public_keys``) keep old receipts verifiable after a rotation.

Source: docs/observing.md "Observing actions" (receipts); AIP 1.0 ``ActionResult.receipt``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ...contracts.hashing import canonical_json, jcs
from ...plumbing.keys import SecretFileError, load_ed25519
from .usage import SettingError

#: ``receipt.type`` of a result receipt.
RECEIPT_TYPE = "aip-crewai.result-receipt.v1"
#: Largest receipt document :func:`verify` reads, bytes.
MAX_RECEIPT_BYTES = 65_536
#: The claims a receipt binds, in documentation order (every one is present; unknown ones are None).
CLAIMS = (
    "type",
    "id",
    "key_id",
    "tenant",
    "action_id",
    "capability_id",
    "crew_id",
    "operation",
    "principal_id",
    "input_hash",
    "idempotency_key_hash",
    "approval_id",
    "decision_proof_hash",
    "status",
    "error_code",
    "output_hash",
    "accepted_at",
    "finished_at",
)


class ReceiptInvalid(ValueError):
    """A receipt failed verification; ``reason`` says which check (stable text, no secret)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def sha256_ref(data: bytes) -> str:
    """``sha256:<lower-case hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def value_hash(value: Any) -> str:
    """``sha256:<hex>`` of the host's canonical JSON of ``value`` (sorted keys, compact, UTF-8: the form of
    the input hash), the receipt's ``output_hash``."""
    return sha256_ref(canonical_json(value))


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """``rk_`` + 16 hex digits of the SHA-256 of the raw public key."""
    return "rk_" + hashlib.sha256(raw_public(key)).hexdigest()[:16]


def parse_public_key(text: str) -> Ed25519PublicKey:
    """A public key as ``aip-crewai keys generate ed25519`` prints it (standard base64 of 32 raw bytes).

    Raises:
        ValueError: not base64 of 32 bytes.
    """
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True)
class ReceiptKeys:
    """The host's receipt key and every public key it publishes (current first, then previous ones)."""

    signer: Ed25519PrivateKey
    previous: tuple[Ed25519PublicKey, ...] = ()

    @property
    def key_id(self) -> str:
        return key_id(self.signer.public_key())

    def published(self) -> dict[str, Any]:
        """``GET /.well-known/aip-receipt-keys``: ``{"keys": [{key_id, alg, public_key, current}]}``."""
        keys = [(self.signer.public_key(), True), *((k, False) for k in self.previous)]
        return {
            "keys": [
                {
                    "key_id": key_id(k),
                    "alg": "Ed25519",
                    "public_key": base64.b64encode(raw_public(k)).decode(),
                    "current": current,
                }
                for k, current in keys
            ]
        }


def load_keys(path: Path | None, previous: Iterable[str]) -> ReceiptKeys | None:
    """``[host] receipt_key_file`` (an Ed25519 private key in a 0600 file, as ``aip-crewai keys generate
    ed25519`` writes it) and ``receipt_previous_public_keys`` (base64 public keys of earlier receipt
    keys) → :class:`ReceiptKeys`; None without a key file (no receipts). The one I/O of this module.

    Raises:
        SettingError: the file is unreadable, not private, not an Ed25519 key; a previous key is not a key.
    """
    old = []
    for index, text in enumerate(previous):
        try:
            old.append(parse_public_key(text))
        except ValueError as exc:
            raise SettingError(f"host.receipt_previous_public_keys[{index}]", str(exc)) from None
    if path is None:
        if old:
            raise SettingError("host.receipt_previous_public_keys", "needs host.receipt_key_file")
        return None
    try:
        signer = load_ed25519(path)
    except (SecretFileError, OSError, ValueError) as exc:
        raise SettingError("host.receipt_key_file", str(exc)) from None
    return ReceiptKeys(signer, tuple(old))


def receipt_id(tenant: str, action_id: str) -> str:
    """The receipt id of an action's final result: ``rcpt_`` + 32 hex digits (one receipt per action)."""
    return "rcpt_" + hashlib.sha256(canonical_json([tenant, action_id])).hexdigest()[:32]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def sign(claims: Mapping[str, Any], signer: Ed25519PrivateKey) -> tuple[bytes, str]:
    """Sign ``claims`` (every name of :data:`CLAIMS`, strings or None) as a receipt document.

    Returns:
        ``(document, hash)``: the document's canonical bytes, and ``sha256:<hex>`` of the claims' JCS bytes.

    Raises:
        ValueError: a claim missing or unknown, or ``key_id`` not the signer's.
    """
    if set(claims) != set(CLAIMS):
        raise ValueError("a receipt binds exactly the CLAIMS")
    kid = key_id(signer.public_key())
    if claims["key_id"] != kid:
        raise ValueError("the receipt names another key")
    payload = jcs(dict(claims))
    digest = sha256_ref(payload)
    document = {
        "hash": digest,
        "receipt": dict(claims),
        "signature": {"alg": "Ed25519", "key_id": kid, "value": _b64url(signer.sign(payload))},
    }
    return jcs(document), digest


def verify(document: bytes, public_keys: Iterable[Ed25519PublicKey]) -> dict[str, Any]:
    """Verify a receipt document offline against ``public_keys``; return its claims.

    Raises:
        ReceiptInvalid: over :data:`MAX_RECEIPT_BYTES`, not JSON, not exactly its canonical form, a
            claim missing, the hash not the claims', an unknown key id, or a bad signature.
    """
    if len(document) > MAX_RECEIPT_BYTES:
        raise ReceiptInvalid(f"larger than {MAX_RECEIPT_BYTES} bytes")
    try:
        parsed = json.loads(document.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ReceiptInvalid("not JSON") from None
    if not isinstance(parsed, dict) or set(parsed) != {"hash", "receipt", "signature"}:
        raise ReceiptInvalid("not a receipt document (hash, receipt, signature)")
    try:
        canonical = jcs(parsed)
    except (ValueError, TypeError):
        raise ReceiptInvalid("not canonicalizable JSON") from None
    if canonical != document:
        raise ReceiptInvalid("not in its canonical form (RFC 8785): the document was changed")
    claims, signature = parsed["receipt"], parsed["signature"]
    if not isinstance(claims, dict) or set(claims) != set(CLAIMS) or claims.get("type") != RECEIPT_TYPE:
        raise ReceiptInvalid("the receipt's claims are not a result receipt's")
    payload = jcs(claims)
    if parsed["hash"] != sha256_ref(payload):
        raise ReceiptInvalid("the hash is not the claims' hash")
    if not isinstance(signature, dict) or set(signature) != {"alg", "key_id", "value"} or signature["alg"] != "Ed25519":
        raise ReceiptInvalid("the signature is not an Ed25519 signature object")
    if signature["key_id"] != claims["key_id"]:
        raise ReceiptInvalid("the signature's key id is not the receipt's")
    keys = {key_id(k): k for k in public_keys}
    key = keys.get(str(signature["key_id"]))
    if key is None:
        raise ReceiptInvalid(f"signed by key {signature['key_id']}, which is not among the public keys given")
    value = signature["value"]
    try:
        raw = base64.urlsafe_b64decode(str(value) + "=" * (-len(str(value)) % 4))
    except (binascii.Error, ValueError):
        raise ReceiptInvalid("the signature is not base64url") from None
    if _b64url(raw) != value:
        raise ReceiptInvalid("the signature is not canonical base64url")
    try:
        key.verify(raw, payload)
    except InvalidSignature:
        raise ReceiptInvalid("the signature does not verify") from None
    return claims
