"""What each operation says it does for a crew (the operation table's sentence), and schema text
made plain (no doc markup) before a manifest shows it (docs/reference/http-api.md "Capabilities")."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.contracts.artifacts import capabilities_document, input_schema, plain_schema, plain_text
from aip_crewai.contracts.errors import MANIFEST_POINTER, ActionNotFound, ApprovalNotFound, CapabilityNotFound
from aip_crewai.contracts.operations import CATALOGUE, get

# Restated here on purpose: the test checks the table's wording, one sentence per operation.
WORDING = {
    "run": "Run crew 'echo' once with the given inputs (its CrewAI kickoff inputs).",
    "status": "Read the status of a job of crew 'echo', named by its run_action_id.",
    "events": "Read the recorded events of a job of crew 'echo', from a cursor.",
    "cancel": "Cancel a queued or running job of crew 'echo', named by its run_action_id.",
    "batch_run": "Run crew 'echo' once per input object (1..100), results in input order.",
    "replay": "Re-run crew 'echo' from one task of a retained run.",
    "train": "Train crew 'echo' for n_iterations and write a training artifact.",
    "test": "Evaluate crew 'echo' for n_iterations with an evaluator model (eval_llm).",
    "knowledge_query": "Search the knowledge sources of crew 'echo'.",
    "memory_reset": "Reset one memory domain of crew 'echo', or all of them.",
}


@pytest.mark.parametrize("name", list(WORDING))
def test_each_operation_says_what_it_does_for_the_crew(name: str) -> None:
    assert get(name).describe("echo") == WORDING[name]


def test_the_ten_sentences_are_distinct_plain_and_name_the_crew() -> None:
    sentences = [spec.describe("support-triage") for spec in CATALOGUE]
    assert len(set(sentences)) == len(CATALOGUE) == 10
    for sentence in sentences:
        assert "'support-triage'" in sentence
        assert "`" not in sentence and "{crew}" not in sentence
        assert sentence.endswith(".")


def test_the_machine_snapshot_publishes_each_template() -> None:
    records = {record["operation"]: record for record in capabilities_document()["operations"]}
    assert records["status"]["description_template"] == WORDING["status"].replace("echo", "<crew_id>")


@pytest.mark.parametrize(
    ("marked", "plain"),
    [
        ("``status``: read one job's status.", "status: read one job's status."),
        ("see :class:`Job` and :py:func:`~aip_crewai.x.run`", "see Job and run"),
        (":ref:`the tour <tour-anchor>` first", "the tour first"),
        (":data:`!MAX` bytes", "MAX bytes"),
        ("`inline` code", "inline code"),
        ("nothing to clean: {placeholder} 1..100 <b>", "nothing to clean: {placeholder} 1..100 <b>"),
        ("a stray ` backtick", "a stray  backtick"),
    ],
)
def test_plain_text_drops_roles_and_backticks(marked: str, plain: str) -> None:
    assert plain_text(marked) == plain


@given(st.text())
def test_plain_text_leaves_no_markup_and_is_stable(text: str) -> None:
    cleaned = plain_text(text)
    assert "`" not in cleaned
    assert plain_text(cleaned) == cleaned
    if "`" not in text:
        assert cleaned == text


@given(st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.]{0,20}\Z"), st.sampled_from(["class", "func", "py:meth", "data"]))
def test_a_role_reads_as_its_text(name: str, role: str) -> None:
    assert plain_text(f"see :{role}:`{name}`.") == f"see {name}."


def test_plain_schema_cleans_descriptions_not_names_or_data() -> None:
    schema = {
        "description": "``x``",
        "properties": {
            "description": {"type": "string", "description": ":class:`Y`", "default": "``kept``"},
            "mode": {"enum": ["`a`"], "const": "`b`", "examples": ["``c``"], "title": "``T``"},
        },
        "anyOf": [{"description": "`z`"}],
        "$defs": {"D": {"items": {"description": "``w``"}}},
    }
    assert plain_schema(schema) == {
        "description": "x",
        "properties": {
            "description": {"type": "string", "description": "Y", "default": "``kept``"},
            "mode": {"enum": ["`a`"], "const": "`b`", "examples": ["``c``"], "title": "T"},
        },
        "anyOf": [{"description": "z"}],
        "$defs": {"D": {"items": {"description": "w"}}},
    }


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda spec: spec.name)
def test_no_input_schema_text_holds_markup(spec) -> None:
    """The input types' docstrings say ``status`` and so on; their schemas say status."""
    assert "`" not in json.dumps(input_schema(spec))
    assert input_schema(spec).get("description", "").startswith(spec.name) or spec.name == "run"


# --- capability.not_found names the id and the fix --------------------------------------------


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        ("cap:crewai:nope", 'capability "cap:crewai:nope" not found; ' + MANIFEST_POINTER),
        (
            "cap:crewai:echo:run",
            'capability "cap:crewai:echo:run" not found; a crew\'s run is "cap:crewai:echo" (no :run suffix); '
            + MANIFEST_POINTER,
        ),
        ("echo", 'capability "echo" not found; capability ids start with cap:crewai:; ' + MANIFEST_POINTER),
        ("cap:crewai:a\u202eb", 'capability "cap:crewai:a\\u202eb" not found; ' + MANIFEST_POINTER),
    ],
)
def test_capability_not_found_names_the_id_and_the_manifest(asked: str, message: str) -> None:
    error = CapabilityNotFound(asked)
    assert (error.code, error.status, error.message) == ("capability.not_found", 404, message)
    assert error.details == {"capability_id": asked}


@pytest.mark.parametrize("length", [200, 201, 1024, 1025])
def test_capability_not_found_bounds_the_id_it_repeats(length: int) -> None:
    asked = "cap:crewai:" + "x" * (length - len("cap:crewai:"))
    error = CapabilityNotFound(asked)
    shown = error.message.split('"')[1]
    assert shown == (asked if length <= 200 else asked[:200] + "…")
    assert error.details["capability_id"] == asked[:1024]


@pytest.mark.parametrize("length", [200, 201, 1024, 1025])
def test_action_and_approval_not_found_name_the_id_bounded(length: int) -> None:
    asked = "a" * (length - 1) + "\u200b"
    for error, key in (
        (ActionNotFound(asked), "action_id"),
        (ActionNotFound(run_action_id=asked), "run_action_id"),
        (ApprovalNotFound(asked), "approval_id"),
    ):
        shown = error.message.split('"')[1]
        assert shown == ("a" * 199 + "\\u200b" if length <= 200 else "a" * 200 + "…"), error.message
        assert error.details == {key: asked[:1024]} and error.status == 404


def test_not_found_messages_say_what_to_check() -> None:
    assert ActionNotFound("act_1").message == (
        "action \"act_1\" not found for this credential's tenant; check the id (the envelope's id) and the credential"
    )
    assert "names no run of this crew" in ActionNotFound(run_action_id="act_1").message
    assert ApprovalNotFound("apv_1").message.endswith(
        "`aip-crewai approvals list` (GET /aip/v1/approvals) lists the pending ones"
    )
    assert ActionNotFound().message == "action not found" and ApprovalNotFound().details == {}
