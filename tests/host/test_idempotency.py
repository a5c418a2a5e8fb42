"""The idempotency fence's rules (``host/actions/idempotency.py``; docs/ARCHITECTURE.md §7 "idempotency"):
what a key may be, what it binds, and what a repeat means."""

from __future__ import annotations

import dataclasses

import pytest

from aip_crewai.contracts.errors import IdempotencyConflict, InvalidInput
from aip_crewai.host.actions.idempotency import checked_key, fence_hash, repeat_decision
from aip_crewai.host.store.records import ActionRecord

RECORD = ActionRecord(
    "acme",
    "a1",
    "cap:crewai:support",
    "support",
    "run",
    "{}",
    fence_hash("cap:crewai:support", {}),
    "p",
    "k1",
    "running",  # type: ignore[arg-type]  # a row's strings, as the store passes them (__post_init__: enums)
    "sent",  # type: ignore[arg-type]
    None,
    None,
    None,
    None,
    0,
    1,
    1,
)


def test_a_key_is_one_to_512_bytes_without_control_characters_and_both_places_agree():
    assert checked_key(None, None) is None
    assert checked_key("k", None) == "k" and checked_key(None, "k") == "k" and checked_key("k", "k") == "k"
    assert checked_key("é" * 256, None) == "é" * 256  # 512 UTF-8 bytes
    for bad in ("", "é" * 256 + "x", "a\nb", "a\x00b"):
        with pytest.raises(InvalidInput):
            checked_key(bad, None)
    with pytest.raises(InvalidInput, match="differs"):
        checked_key("a", "b")


def test_the_fence_binds_the_capability_and_the_exact_input():
    assert fence_hash("cap:crewai:a", {"x": 1}) == fence_hash("cap:crewai:a", {"x": 1})
    assert fence_hash("cap:crewai:a", {"x": 1}) != fence_hash("cap:crewai:b", {"x": 1})
    assert fence_hash("cap:crewai:a", {"x": 1}) != fence_hash("cap:crewai:a", {"x": 2})


def test_a_repeat_of_the_same_intent_replays_and_any_other_is_a_conflict():
    same = RECORD.input_hash
    assert repeat_decision(RECORD, "a1", same, "k1") == "replayed"  # the same action id, input and key
    assert repeat_decision(RECORD, "a2", same, "k1") == "replayed"  # the key's holder, the same input
    with pytest.raises(IdempotencyConflict):
        repeat_decision(RECORD, "a2", "other", "k1")  # the key held by another input
    with pytest.raises(IdempotencyConflict):
        repeat_decision(RECORD, "a1", "other", "k1")  # the action id used with another input
    with pytest.raises(IdempotencyConflict):
        repeat_decision(dataclasses.replace(RECORD, idempotency_key="k2"), "a1", same, "k1")  # another key


def test_a_record_carries_the_lifecycle_enums_that_read_as_their_values():
    assert RECORD.status == "running" and f"{RECORD.status}" == "running" and str(RECORD.dispatch) == "sent"
    assert {RECORD.status: 1}["running"] == 1
