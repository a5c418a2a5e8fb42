"""Canonical JSON and the hashes built on it.

Two canonical forms exist on purpose:
- :func:`canonical_json`: sorted keys, compact separators, UTF-8 (no ASCII
  escaping); used for the sidecar request hash and the host input hash
  (ARCHITECTURE.md §4, §7).
- :func:`jcs`: RFC 8785 (JSON Canonicalization Scheme) for signed envelopes
  (ARCHITECTURE.md §7), via the ``rfc8785`` library.

:func:`number_problem` finds a number whose decoded value is not what its
RFC 8785 form decodes to (``1.0``, ``1e0`` and ``-0.0`` all sign as ``1`` or
``0`` but run as floats), or that RFC 8785 cannot represent (integers beyond
±(2^53−1)): a signed envelope must run exactly what was signed.
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


#: RFC 8785 (I-JSON) integer range.
JCS_INT_MAX = 2**53 - 1


def _child_path(path: str, key: object) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}"


def number_problem(value: Any) -> tuple[str, str] | None:
    """The first number of decoded JSON ``value`` that its RFC 8785 form does
    not reproduce exactly, as ``(JSON path, rule)``; None when every number is canonical.

    A number is canonical when ``json.loads(jcs(n))`` equals ``n`` with the
    same type: ``1.0``, ``1e0`` or ``-0.0`` (floats, signed as the integers
    ``1``/``0``) are not; integers beyond ±(2^53−1) cannot be canonicalized at
    all. Iterative (no recursion limit). Booleans are not numbers.

    Source: RFC 8785 §3.2.2.3; docs/security.md "Security" (signed envelopes).
    """
    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((_child_path(path, k), v) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((_child_path(path, i), v) for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, bool):
            continue
        elif isinstance(node, int):
            if abs(node) > JCS_INT_MAX:
                return path, "is an integer of magnitude 2^53 or more, which RFC 8785 cannot canonicalize"
        elif isinstance(node, float):
            try:
                canonical = rfc8785.dumps(node)
            except ValueError:
                return path, "is not a finite number"
            back = json.loads(canonical)
            if type(back) is not float or back != node or str(back) != str(node):
                return path, f"is not in canonical form; send it as {canonical.decode()}"
    return None
