"""Canonical JSON and the hashes built on it.

Two canonical forms exist on purpose:
- :func:`canonical_json`: sorted keys, compact separators, UTF-8 (no ASCII
  escaping); used for the sidecar request hash and the host input hash
  (ARCHITECTURE.md §4, §7).
- :func:`jcs`: RFC 8785 (JSON Canonicalization Scheme) for signed envelopes
  (ARCHITECTURE.md §7), via the ``rfc8785`` library.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785


def canonical_json(value: Any) -> bytes:
    """Encode ``value`` as sorted-key compact UTF-8 JSON (bytes).

    Raises ValueError for NaN/Infinity (not JSON) and TypeError for
    non-JSON types.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    """Lower-case hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def input_hash(value: Any) -> str:
    """SHA-256 hex of the canonical JSON of an action input (ARCHITECTURE.md §7)."""
    return sha256_hex(canonical_json(value))


def request_hash(
    *,
    crew_id: str,
    action_id: str,
    operation: str,
    input: Any,
    timeout_ms: int | None,
    idempotency_key: str,
) -> str:
    """The sidecar's admission hash (ARCHITECTURE.md §4).

    SHA-256 hex of the canonical JSON of ``{crew_id, action_id, operation,
    input, timeout_ms, idempotency_key}``; the same action id with a different
    hash is a 409.
    """
    return input_hash(
        {
            "crew_id": crew_id,
            "action_id": action_id,
            "operation": operation,
            "input": input,
            "timeout_ms": timeout_ms,
            "idempotency_key": idempotency_key,
        }
    )


def jcs(value: Any) -> bytes:
    """RFC 8785 canonical bytes of ``value`` (signed envelopes, ARCHITECTURE.md §7)."""
    return rfc8785.dumps(value)
