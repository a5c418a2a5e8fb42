"""What CrewAI swallows during a job becomes a typed failure (``operations/_swallowed.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import openai
import pytest

from aip_crewai.sidecar.jobs.context import JobContext, SafeJobError

#: CrewAI is imported by the tests, once its environment is prepared (``conftest.crewai_state_dir``).
pytestmark = pytest.mark.usefixtures("crewai_state_dir")


def _ctx() -> JobContext:
    return JobContext(
        action_id="a",
        crew_id="c",
        operation="run",
        emit_chunk=lambda _: None,
        cancel_flag=threading.Event(),
        state_dir=Path("."),
    )


def _wrapped(inner: BaseException) -> Exception:
    """As CrewAI raises it: ``ConnectionError(...) from APIConnectionError``, then re-raised by the agent."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise ConnectionError("Failed to connect to OpenAI API: key sk-secret") from exc
    except ConnectionError as outer:
        try:
            raise RuntimeError("agent failed") from outer
        except RuntimeError as top:
            return top


REQUEST = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")


@pytest.mark.parametrize(
    ("inner", "error_type", "words"),
    [
        (openai.APIConnectionError(request=REQUEST), "ProviderUnreachable", "could not be reached (connection failed"),
        (openai.APITimeoutError(request=REQUEST), "ProviderUnreachable", "did not answer in time"),
        (
            openai.InternalServerError("boom sk-secret", response=httpx.Response(503, request=REQUEST), body=None),
            "ProviderError",
            "answered HTTP 503",
        ),
    ],
)
def test_a_provider_error_anywhere_in_the_chain_is_named_without_its_text(inner, error_type, words):
    from aip_crewai.sidecar.operations import _swallowed

    typed = _swallowed.failure(_wrapped(inner), _ctx())
    assert isinstance(typed, SafeJobError) and typed.error_type == error_type and words in typed.message
    assert "sk-secret" not in typed.message and typed.uncertain is False


def test_an_error_without_a_provider_cause_is_left_alone():
    from aip_crewai.sidecar.operations import _swallowed

    assert _swallowed.failure(ValueError("x"), _ctx()) is None


def test_a_swallowed_knowledge_failure_fails_the_job_even_after_an_output():
    from crewai.events.types.knowledge_events import KnowledgeSearchQueryFailedEvent

    from aip_crewai.sidecar.operations import _swallowed

    ctx = _ctx()
    _swallowed.note(ctx, KnowledgeSearchQueryFailedEvent(query="q", error="TypeError: asearch"))
    degraded = _swallowed.degraded_error(ctx)
    assert degraded is not None and degraded.error_type == "KnowledgeSearchFailed" and "asearch" not in degraded.message


def test_tool_errors_are_listed_by_tool_and_type_and_a_started_tool_makes_a_failure_uncertain():
    from crewai.events.types.tool_usage_events import ToolUsageErrorEvent, ToolUsageStartedEvent

    from aip_crewai.sidecar.operations import _swallowed

    ctx = _ctx()
    _swallowed.note(ctx, ToolUsageStartedEvent(tool_name="lookup", tool_args={}))
    _swallowed.note(ctx, ToolUsageErrorEvent(tool_name="lookup", tool_args={}, error=KeyError("sk-secret")))
    assert _swallowed.tool_errors(ctx) == [{"tool": "lookup", "error_type": "KeyError"}]
    typed = _swallowed.failure(RuntimeError("agent gave up"), ctx)
    assert typed is not None and typed.message.endswith("; tool 'lookup' raised KeyError") and typed.uncertain is None
