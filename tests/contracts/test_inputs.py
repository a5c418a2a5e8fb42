"""Every input bound of ARCHITECTURE.md §3, at its limit and one past it."""

import re
from typing import Annotated

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.contracts import inputs
from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import InputTooLarge, InvalidInput
from aip_crewai.contracts.inputs import MAX_INPUT_BYTES, RunInput, convert_input


def ok(op, value):
    return convert_input(ops.get(op).input_type, value)


def bad(op, value):
    with pytest.raises(InvalidInput) as info:
        ok(op, value)
    return info.value


def test_run_properties_512_and_513():
    assert len(ok("run", {f"k{i}": i for i in range(512)})) == 512
    err = bad("run", {f"k{i}": i for i in range(513)})
    assert err.field == "$"


def test_run_accepts_unknown_fields_others_reject():
    assert ok("run", {"anything": {"nested": [1, 2]}}) == {"anything": {"nested": [1, 2]}}
    err = bad("status", {"run_action_id": "a", "extra": 1})
    assert "unknown field" in err.rule


def test_whole_input_one_mib_edge():
    overhead = len(b'{"k":""}')
    at_limit = {"k": "x" * (MAX_INPUT_BYTES - overhead)}
    assert len(msgspec.json.encode(at_limit)) == MAX_INPUT_BYTES
    ok("run", at_limit)
    over = {"k": "x" * (MAX_INPUT_BYTES - overhead + 1)}
    with pytest.raises(InputTooLarge) as info:
        ok("run", over)
    assert info.value.status == 413 and info.value.limit_bytes == MAX_INPUT_BYTES


@pytest.mark.parametrize("op", ["status", "events", "cancel"])
def test_run_action_id_bounds(op):
    ok(op, {"run_action_id": "a" * 256})
    assert bad(op, {"run_action_id": "a" * 257}).field == "$.run_action_id"
    bad(op, {"run_action_id": ""})
    bad(op, {"run_action_id": "a/b"})
    bad(op, {"run_action_id": "a\nb"})
    bad(op, {"run_action_id": "a\x7fb"})
    bad(op, {"run_action_id": "a\x85b"})
    bad(op, {"run_action_id": "résumé"})  # sent in an ASCII-only HTTP header
    bad(op, {"run_action_id": "a b"})
    ok(op, {"run_action_id": "act_01.x:y-z~"})
    bad(op, {})


def test_events_cursor_bounds_and_booleans():
    ok("events", {"run_action_id": "a", "cursor": 0})
    ok("events", {"run_action_id": "a", "cursor": 100_000})
    bad("events", {"run_action_id": "a", "cursor": 100_001})
    bad("events", {"run_action_id": "a", "cursor": -1})
    assert "bool" in bad("events", {"run_action_id": "a", "cursor": True}).rule
    bad("events", {"run_action_id": "a", "cursor": 1.5})


def test_cancel_reason_2048_chars():
    ok("cancel", {"run_action_id": "a", "reason": "é" * 2048})
    assert bad("cancel", {"run_action_id": "a", "reason": "é" * 2049}).field == "$.reason"


def test_batch_run_1_to_100_objects():
    ok("batch_run", {"inputs": [{}]})
    ok("batch_run", {"inputs": [{}] * 100})
    bad("batch_run", {"inputs": []})
    bad("batch_run", {"inputs": [{}] * 101})
    bad("batch_run", {"inputs": [1]})
    bad("batch_run", {"inputs": [{f"k{i}": 0 for i in range(513)}]})


def test_replay_task_id_counts_utf8_bytes():
    ok("replay", {"task_id": "a" * 256})
    bad("replay", {"task_id": "a" * 257})
    ok("replay", {"task_id": "é" * 128})  # 256 bytes
    err = bad("replay", {"task_id": "é" * 128 + "a"})  # 257 bytes, 129 chars
    assert err.field == "$.task_id" and "256 UTF-8 bytes" in err.rule
    bad("replay", {"task_id": ""})
    bad("replay", {"task_id": "a\tb"})
    ok("replay", {"task_id": "t", "inputs": {"x": 1}})
    bad("replay", {"task_id": "t", "inputs": []})


@pytest.mark.parametrize("op,extra", [("train", {"artifact_name": "a"}), ("test", {"eval_llm": "m"})])
def test_iterations_1_to_100(op, extra):
    ok(op, {"n_iterations": 1, **extra})
    ok(op, {"n_iterations": 100, **extra})
    bad(op, {"n_iterations": 0, **extra})
    bad(op, {"n_iterations": 101, **extra})
    bad(op, {"n_iterations": True, **extra})
    bad(op, {"n_iterations": 2.0, **extra})


def test_artifact_name_pattern():
    ok("train", {"n_iterations": 1, "artifact_name": "a" * 128})
    bad("train", {"n_iterations": 1, "artifact_name": "a" * 129})
    for name in ["model.v1_x-2", "A", "9"]:
        ok("train", {"n_iterations": 1, "artifact_name": name})
    for name in ["", ".hidden", "-x", "a/b", "../x", "a b", "a\n"]:
        bad("train", {"n_iterations": 1, "artifact_name": name})


def test_eval_llm_1_to_256():
    ok("test", {"n_iterations": 1, "eval_llm": "m" * 256})
    bad("test", {"n_iterations": 1, "eval_llm": "m" * 257})
    bad("test", {"n_iterations": 1, "eval_llm": ""})


def test_knowledge_query_bounds():
    q = ok("knowledge_query", {"query": ["refund"]})
    assert (q.results_limit, q.score_threshold) == (3, 0.35)
    ok("knowledge_query", {"query": ["q"] * 100})
    bad("knowledge_query", {"query": ["q"] * 101})
    bad("knowledge_query", {"query": []})
    bad("knowledge_query", {"query": [""]})
    ok("knowledge_query", {"query": ["é" * 2048]})  # 4096 bytes
    err = bad("knowledge_query", {"query": ["ok", "é" * 2048 + "a"]})
    assert err.field == "$.query[1]"
    bad("knowledge_query", {"query": ["a\x00"]})
    for limit in (1, 100):
        ok("knowledge_query", {"query": ["q"], "results_limit": limit})
    for limit in (0, 101, True, 3.0):
        bad("knowledge_query", {"query": ["q"], "results_limit": limit})
    for score in (0, 1, 0.5):
        ok("knowledge_query", {"query": ["q"], "score_threshold": score})
    for score in (-0.0001, 1.0001, True, "0.5"):
        bad("knowledge_query", {"query": ["q"], "score_threshold": score})


def test_memory_reset_command_types():
    for ct in ["memory", "knowledge", "agent_knowledge", "kickoff_outputs", "all"]:
        ok("memory_reset", {"command_type": ct})
    bad("memory_reset", {"command_type": "everything"})
    bad("memory_reset", {})


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=20,
    )
)
def test_validation_never_raises_anything_but_invalid_input(value):
    for spec in ops.CATALOGUE:
        try:
            convert_input(spec.input_type, value)
        except InvalidInput:
            pass


@pytest.mark.parametrize("value", ["a\n", "a\r", "\n"])
def test_trailing_line_end_is_a_control_character(value):
    bad("status", {"run_action_id": value})
    bad("replay", {"task_id": value})
    bad("knowledge_query", {"query": [value]})


def _nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def test_one_nesting_bound_for_every_input_checked_without_recursion():
    """Issue 16 item 14: inputs nest at most MAX_INPUT_DEPTH levels; 10^5 levels are refused, not a RecursionError."""
    from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH, exceeds_depth

    assert not exceeds_depth(_nested(MAX_INPUT_DEPTH)) and exceeds_depth(_nested(MAX_INPUT_DEPTH + 1))
    assert not exceeds_depth({"a": 1, "b": [1, 2, {"c": "d"}]}) and not exceeds_depth(3)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert exceeds_depth(deep)
    convert_input(RunInput, _nested(MAX_INPUT_DEPTH))
    with pytest.raises(InvalidInput) as caught:
        convert_input(RunInput, {"x": deep})
    assert caught.value.field == "$.x" + "[0]" * (MAX_INPUT_DEPTH - 1) and str(MAX_INPUT_DEPTH) in caught.value.rule


def test_the_depth_refusal_names_the_first_container_past_the_bound_at_and_past_the_limit():
    """The refusal named ``$`` whatever nested too deep; it names the first container (in document order)
    nested deeper than the bound: none at the limit, the one at limit + 1 past it."""
    from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH, too_deep

    assert too_deep(_nested(MAX_INPUT_DEPTH)) is None
    convert_input(RunInput, _nested(MAX_INPUT_DEPTH))
    deepest = "$" + ".a" * MAX_INPUT_DEPTH  # the 65th level: 64 steps below the input object
    assert too_deep(_nested(MAX_INPUT_DEPTH + 1)) == deepest
    with pytest.raises(InvalidInput) as caught:
        convert_input(RunInput, {"fine": {"x": 1}, "a": _nested(MAX_INPUT_DEPTH)})
    assert caught.value.field == deepest and caught.value.details["field"] == deepest
    assert caught.value.message.startswith(f"invalid input at {deepest}: nested deeper than {MAX_INPUT_DEPTH}")


@pytest.mark.parametrize(
    ("value", "limit", "path"),
    [
        ({"x": [1, {"y": [[[]]]}], "z": {}}, 3, "$.x[1].y"),
        ({"x": [1, {"y": [[[]]]}], "z": {}}, 4, "$.x[1].y[0]"),
        ({"x": [1, {"y": [[[]]]}], "z": {}}, 5, "$.x[1].y[0][0]"),
        ({"x": [1, {"y": [[[]]]}], "z": {}}, 6, None),
        ({"first": [[[1]]], "second": [[[[2]]]]}, 3, "$.first[0][0]"),  # the first in document order
        ({"first": [[[1]]], "second": [[[[2]]]]}, 4, "$.second[0][0][0]"),
        ([{}, [{"a b": {'é"': [[]]}}]], 4, '$[1][0]["a b"]["é\\""]'),
        ({}, 0, "$"),
        (5, 0, None),
    ],
)
def test_the_path_of_the_first_container_too_deep_in_a_value_and_in_its_text(value, limit, path):
    """``too_deep`` (decoded values) and ``too_deep_text`` (text a decoder cannot nest into) agree."""
    import json

    from aip_crewai.contracts.inputs import too_deep, too_deep_text

    assert too_deep(value, limit) == path
    assert too_deep_text(json.dumps(value).encode(), limit) == path
    assert too_deep_text(json.dumps(value, indent=1, ensure_ascii=False).encode(), limit) == path


def test_a_path_of_long_keys_is_cut_and_broken_text_names_nothing():
    from aip_crewai.contracts.inputs import MAX_SHOWN_PATH, too_deep, too_deep_text

    value: dict = {}
    for _ in range(10):
        value = {"k" * 500: value}
    shown = too_deep(value, 3)
    assert shown is not None and len(shown) == MAX_SHOWN_PATH and shown.endswith("…")
    assert too_deep_text(b"[" * 2000, 67) == "$" + "[0]" * 67
    assert too_deep_text(b"{" * 100, 3) is None  # an object without a key: not JSON enough to name a path


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [
        (inputs.ACTION_ID_PATTERN, "a/b"),
        (inputs.ACTION_ID_PATTERN, "a b"),
        (inputs.NO_CONTROL, "a\x01b"),
        (inputs.RFC3339_PATTERN, "2026-12-02T08:30:00"),
        (inputs.RFC3339_PATTERN, "２０２６-12-02T08:30:00Z"),  # digits of another script
    ],
)
def test_plain_rule_names_each_pattern_in_words(pattern, refused):
    value_type = Annotated[str, msgspec.Meta(pattern=pattern)]
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.convert({"field": refused}, dict[str, value_type])
    text = inputs.plain_rule(str(raised.value))
    assert text == f"Expected {inputs.PATTERN_MEANINGS[pattern]} - at `$[...]`", text


def test_plain_rule_leaves_other_messages_alone():
    assert inputs.plain_rule("Expected `int`, got `str` - at `$.n`") == "Expected `int`, got `str` - at `$.n`"


@pytest.mark.parametrize(
    "accepted", ["2026-12-02T08:30:00Z", "2026-12-02t08:30:00.123456789z", "2026-12-02 08:30:00-05:30"]
)
def test_the_rfc_3339_pattern_takes_t_or_space_any_fraction_and_either_offset(accepted):
    assert re.match(inputs.RFC3339_PATTERN, accepted)
