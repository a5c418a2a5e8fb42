"""Start-up crew preflight, KnowledgeUnavailable at job start, and CrewAI's printed errors."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from aip_crewai.sidecar import operations
from aip_crewai.sidecar.crewai_env import (
    MAX_PRINTED_LINE_CHARS,
    LibraryLog,
    PrintedErrorLog,
    log_warning,
    printed_error_label,
)
from aip_crewai.sidecar.jobs.context import SafeJobError
from aip_crewai.sidecar.registry import CrewSource, load_registry

pytestmark = pytest.mark.timeout(120)

SECRET = "sk-test-SECRET-7f3a9c"


@pytest.fixture
def registry(crewai_state_dir: Path) -> dict[str, CrewSource]:
    return load_registry("aip_crewai.examples.maintenance_crews:CREWS")


def test_preflight_names_each_unusable_crew_and_only_those(registry) -> None:
    from aip_crewai.sidecar.operations.startup.preflight import crew_problems

    def explode() -> None:
        raise RuntimeError(f"factory broke with {SECRET}")

    registry = {**registry, "exploding": CrewSource(crew_id="exploding", factory=explode)}
    with capture_logs() as logs:
        problems = crew_problems(registry)
    assert problems == {
        "asks_human": ["human_input"],
        "broken_knowledge": ["knowledge_unavailable"],
        "exploding": ["build_failed"],
    }
    unusable = [e for e in logs if e["event"] == "crew_unusable"]
    assert sorted(e["crew_id"] for e in unusable) == ["asks_human", "broken_knowledge", "exploding"]
    assert SECRET not in repr(logs)


@pytest.mark.parametrize(
    "operation,input",
    [
        ("run", {"topic": "glacier"}),
        ("batch_run", {"inputs": [{"topic": "glacier"}]}),
        ("knowledge_query", {"query": ["glacier"]}),
        ("memory_reset", {"command_type": "all"}),
    ],
)
@pytest.mark.parametrize("returns", ["raises", "no crew"])
async def test_a_factory_that_fails_fails_the_job_typed_and_certain(make_ctx, operation, input, returns) -> None:
    """A factory that raises (or returns no crew) failed its job with the generic message and
    ``uncertain_outcome: true``, although nothing of the job ran: now ``CrewBuildFailed``, before any effect,
    naming only the exception's type (docs/security.md: ``build_failed`` crews fail typed at their start)."""

    def factory() -> object:
        if returns == "raises":
            raise RuntimeError(f"factory broke with {SECRET}")
        return {"not": "a crew"}

    ctx, recorder = make_ctx(operation)
    with pytest.raises(SafeJobError) as raised:
        await operations.execute(CrewSource(crew_id="bad", factory=factory), operation, input, ctx)
    assert raised.value.error_type == "CrewBuildFailed" and raised.value.before_any_effect
    assert ("RuntimeError" if returns == "raises" else "returned dict") in raised.value.message
    assert SECRET not in raised.value.message and len(recorder) == 0


@pytest.mark.parametrize(
    "operation,input",
    [
        ("run", {"topic": "glacier"}),
        ("knowledge_query", {"query": ["glacier"]}),
    ],
)
async def test_a_crew_whose_knowledge_cannot_be_built_fails_typed_before_any_model_call(
    registry, make_ctx, operation, input
) -> None:
    ctx, recorder = make_ctx(operation)
    with pytest.raises(SafeJobError) as raised:
        await operations.execute(registry["broken_knowledge"], operation, input, ctx)
    assert raised.value.error_type == "KnowledgeUnavailable"
    assert SECRET not in str(raised.value.message)
    assert len(recorder) == 0  # no model call streamed anything


def test_printed_error_lines_are_logged_by_label_only() -> None:
    sink = PrintedErrorLog()
    with capture_logs() as logs:
        sink.write("\x1b[31m╭──── Crew ────╮\x1b[0m\nFailed to init knowledge: embedding refused ")
        assert logs == []  # the error line is not complete yet
        sink.write(f"for key {SECRET}\n")
        sink.write("Task completed\n")
        sink.write(f"│ Error {SECRET} without a colon │\n")
        sink.write(f"RuntimeError: {SECRET}\n")
    assert [(e["event"], e["label"]) for e in logs] == [
        ("crewai_printed_error", "Failed to init knowledge"),
        ("crewai_printed_error", "withheld"),
        ("crewai_printed_error", "RuntimeError"),
    ]
    assert SECRET not in repr(logs)


def test_stderr_lines_and_warnings_of_crew_code_are_logged_without_their_text() -> None:
    sink = PrintedErrorLog(stream="stderr")
    with capture_logs() as logs:
        sink.write(f"stderr says api_key={SECRET}\nRuntimeError: {SECRET}\n")
        log_warning(UserWarning(f"deprecated call with key {SECRET}"), UserWarning, "/srv/crews/mine.py", 174)
    assert [{k: v for k, v in e.items() if k != "log_level"} for e in logs] == [
        {"event": "crewai_printed_error", "label": "RuntimeError", "stream": "stderr"},
        {"event": "python_warning", "category": "UserWarning", "at": "mine.py:174"},
    ]
    assert SECRET not in repr(logs)


def test_library_log_records_are_logged_by_label_only() -> None:
    logger = logging.getLogger("aip_crewai_tests.library")
    logger.handlers, logger.propagate = [LibraryLog()], False
    try:
        with capture_logs() as logs:
            logger.error(
                "OpenAI API call failed: Error code: 401 - {'message': 'Incorrect API key provided: %s'}", SECRET
            )
            logger.warning("Retrying: %s\nsecond line", SECRET)
            logger.error("%s leaked first", SECRET)
    finally:
        logger.handlers = []
    assert [(e["event"], e["library"], e["label"], e["log_level"]) for e in logs] == [
        ("library_log", "aip_crewai_tests.library", "OpenAI API call failed", "error"),
        ("library_log", "aip_crewai_tests.library", "Retrying", "warning"),
        ("library_log", "aip_crewai_tests.library", "withheld", "error"),
    ]
    assert SECRET not in repr(logs)


def test_a_printed_line_is_bounded_while_it_waits_for_its_newline() -> None:
    sink = PrintedErrorLog()
    with capture_logs() as logs:
        assert sink.write("x" * (MAX_PRINTED_LINE_CHARS * 3)) == MAX_PRINTED_LINE_CHARS * 3
        assert len(sink._pending) == MAX_PRINTED_LINE_CHARS
        sink.write(" failed: the end of the long line is past the bound\n")
        sink.write("Failed to save: x\n")
    assert [e["label"] for e in logs] == ["Failed to save"]


@pytest.mark.parametrize(
    "line,label",
    [
        ("Failed to init knowledge: boom", "Failed to init knowledge"),
        ("[2026-12-01 04:14:29][WARNING]: Failed to init knowledge: boom", "Failed to init knowledge"),
        ("[ERROR]: Failed to upsert documents: key", "Failed to upsert documents"),
        ("Error: key=abc", "Error"),
        ("Error in /etc/secret: x", "withheld"),
        ("Error 42: x", "withheld"),
        ("no colon error", "withheld"),
        ("A" * 80 + ": failed", "A" * 80),
        ("A" * 81 + ": failed", "withheld"),
    ],
)
def test_printed_error_label_keeps_plain_words_only(line, label) -> None:
    assert printed_error_label(line) == label


def test_preflight_reports_each_buildable_crews_placeholders_and_whether_it_fills_defaults(crewai_state_dir) -> None:
    from aip_crewai.sidecar.operations.startup.preflight import preflight

    registry = load_registry("aip_crewai.examples.testing:CREWS")
    found = preflight(registry)
    assert set(found.inputs) == set(registry)  # every test crew builds
    assert found.inputs["echo"] == {"placeholders": ["topic"], "defaults": True, "memory_domains": ["kickoff_outputs"]}
    assert all(facts["placeholders"] == sorted(facts["placeholders"]) for facts in found.inputs.values())
    # the memory_reset targets each crew has (a crew without memory has no "memory")
    assert found.inputs["knowledge_a"]["memory_domains"] == ["kickoff_outputs", "knowledge"]


async def test_a_real_model_without_its_key_is_named_at_start_up_and_fails_jobs_certainly(
    crewai_state_dir, make_ctx, monkeypatch
) -> None:
    """Issue 20 item 6: a crew on gpt-4o-mini without OPENAI_API_KEY is reported, and its jobs fail certainly."""
    from crewai import LLM

    from aip_crewai.examples.testing import build_crew
    from aip_crewai.sidecar.operations.startup.preflight import preflight

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    registry = {
        # build_crew is typed for the offline model; any LLM works (the agent takes it as is)
        "real": CrewSource(
            crew_id="real",
            factory=lambda: build_crew(LLM(model="gpt-4o-mini"), ["Summarize {topic}."]),  # type: ignore[arg-type]
        )
    }
    assert preflight(registry).problems == {"real": ["llm_unconfigured"]}
    ctx, recorder = make_ctx("run")
    with pytest.raises(SafeJobError) as raised:
        await operations.execute(registry["real"], "run", {"topic": "t"}, ctx)
    assert raised.value.error_type == "LlmUnconfigured" and raised.value.before_any_effect
    assert "openai/gpt-4o-mini" in raised.value.message and len(recorder) == 0
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-used")
    assert preflight(registry).problems == {}  # with a key: nothing to report (no call is made)


def test_memory_domains_name_only_the_reset_targets_a_crew_has() -> None:
    from types import SimpleNamespace

    from aip_crewai.sidecar.operations.startup.preflight import memory_domains

    bare = SimpleNamespace(agents=[SimpleNamespace()], _memory=None, _task_output_handler=None, knowledge=None)
    assert memory_domains(bare) == []
    full = SimpleNamespace(
        agents=[SimpleNamespace(knowledge=None, knowledge_sources=["s"])],
        _memory=object(),
        _task_output_handler=object(),
        knowledge=None,
    )
    assert memory_domains(full) == ["memory", "kickoff_outputs", "knowledge", "agent_knowledge"]
    crew_only = SimpleNamespace(agents=[], _memory=None, _task_output_handler=object(), knowledge_sources=["s"])
    assert memory_domains(crew_only) == ["kickoff_outputs", "knowledge"]
