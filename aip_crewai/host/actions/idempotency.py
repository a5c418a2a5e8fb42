"""The idempotency fence, the service's side: what a key may be, what it binds, and what a repeat means.

The key's reservation itself is written by :meth:`~aip_crewai.host.store.store.Store.create_action` in the
SAME transaction as the action row, and only when the row is created (a refused request reserves
nothing; a crash never leaves a key without its action). That call answers the EXISTING record when
the action id is taken or a live reservation of the key points at another action;
:func:`repeat_decision` says what the submission then gets.

Rules (ARCHITECTURE.md §7 "idempotency"; docs/security.md "Security"): scope (tenant, key); a key is 1..512
UTF-8 bytes without control characters; the same key and input mean the same action, another input
is a 409; a reservation lasts :data:`IDEMPOTENCY_TTL_MS`.
"""

from __future__ import annotations

from typing import Any

from ...contracts.errors import IdempotencyConflict, InvalidInput
from ...contracts.hashing import input_hash
from ...contracts.inputs import has_control_characters
from ...contracts.sidecar import MAX_IDEMPOTENCY_KEY_BYTES
from ..store.records import ActionRecord

__all__ = ["IDEMPOTENCY_TTL_MS", "fence_hash", "checked_key", "repeat_decision"]

#: How long a key's reservation lasts, ms (24 h).
IDEMPOTENCY_TTL_MS = 86_400_000


def fence_hash(capability_id: str, value: Any) -> str:
    """What the idempotency fence revalidates: the capability and the exact input (a hex SHA-256 of
    their canonical JSON, :func:`aip_crewai.contracts.hashing.input_hash`)."""
    return input_hash({"capability_id": capability_id, "input": value})


def checked_key(action_key: str | None, envelope_key: str | None) -> str | None:
    """The action's key (the envelope's as a fallback), or None when neither names one.

    Raises:
        InvalidInput: the two differ, or the key is not 1..512 UTF-8 bytes without control characters.
    """
    if action_key is not None and envelope_key is not None and action_key != envelope_key:
        raise InvalidInput("$.body.action.idempotency_key", "differs from the envelope idempotency_key")
    key = action_key if action_key is not None else envelope_key
    if key is None:
        return None
    if not key or len(key.encode("utf-8")) > MAX_IDEMPOTENCY_KEY_BYTES or has_control_characters(key):
        raise InvalidInput("$.idempotency_key", f"1..{MAX_IDEMPOTENCY_KEY_BYTES} UTF-8 bytes, no control characters")
    return key


def repeat_decision(record: ActionRecord, action_id: str, hashed: str, key: str | None) -> str:
    """The fence's decision for a submission that found ``record`` stored (its own action id, or the
    action a live reservation of its key points at): ``"replayed"`` when it is the same intent.

    Raises:
        IdempotencyConflict: the key is held by an action of another input, or the action id was
            already used with another input or key.
    """
    if record.action_id != action_id:  # the key is held by another action
        if record.input_hash != hashed:
            raise IdempotencyConflict(details={"idempotency_key": key})
    elif record.input_hash != hashed or record.idempotency_key != key:
        raise IdempotencyConflict("the action id was already used with a different input or key")
    return "replayed"
