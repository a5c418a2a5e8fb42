"""CrewAI's events of a job as spans (``aip_crewai/sidecar/tracing.py``): the mapping, in-process.

The spans go to an in-memory exporter of the SDK; a real offline crew (``tool_user``: a kickoff, one
task, LLM calls and a tool call) runs through ``operations.execute`` with the job's ``CrewSpans``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.tracing import MAX_OPEN_SCOPES, CrewSpans, job_attributes

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ATTRIBUTES = job_attributes("acme:act_1", "tool_user", "run")


def _mapper(capture: bool = False) -> tuple[CrewSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    disabled = os.environ.pop("OTEL_SDK_DISABLED", None)  # set for CrewAI by the suite: it disables SDK providers
    try:
        provider = TracerProvider()
    finally:
        if disabled is not None:
            os.environ["OTEL_SDK_DISABLED"] = disabled
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from aip_crewai.tracing import context_of

    return CrewSpans(provider.get_tracer("test"), context_of(PARENT), ATTRIBUTES, capture), exporter


def _event(kind: str, event_id: str, parent: str | None = None, started: str | None = None, **fields: Any) -> Any:
    return SimpleNamespace(
        type=kind,
        event_id=event_id,
        parent_event_id=parent,
        started_event_id=started,
        timestamp=datetime.now(timezone.utc),
        **fields,
    )


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def test_job_attributes_split_the_tenant_from_the_action_id() -> None:
    assert job_attributes("acme:act_1", "c", "run") == {
        "aip.tenant": "acme",
        "aip.action_id": "act_1",
        "aip.job_id": "acme:act_1",
        "aip.crew_id": "c",
        "aip.operation": "run",
    }
    assert job_attributes("plain-id", "c", "run")["aip.action_id"] == "plain-id"  # a peer host's id: no tenant


def test_scopes_nest_through_untraced_scopes_and_end_by_their_start_id() -> None:
    spans, exporter = _mapper()
    spans.on_event(_event("crew_kickoff_started", "k"))
    spans.on_event(_event("task_started", "t", "k", task_id="task-uuid"))
    spans.on_event(_event("agent_execution_started", "a", "t"))  # not a span: its children skip it
    spans.on_event(_event("llm_call_started", "l", "a", model="m-1", messages="PROMPT"))
    spans.on_event(_event("llm_stream_chunk", "c", "l", chunk="x"))  # ignored
    spans.on_event(_event("llm_call_completed", "l2", "a", "l", usage={"prompt_tokens": 7, "completion_tokens": 3}))
    spans.on_event(_event("tool_usage_started", "u", "a", tool_name="word_counter", tool_args={"text": "ARGS"}))
    spans.on_event(_event("tool_usage_error", "u2", "a", "u", error="boom"))
    spans.on_event(_event("agent_execution_completed", "a2", "t", "a"))
    spans.on_event(_event("task_completed", "t2", "k", "t"))
    spans.on_event(_event("crew_kickoff_completed", "k2", None, "k"))
    found = _by_name(exporter.get_finished_spans())
    assert set(found) == {"crewai.kickoff", "crewai.task", "crewai.llm", "crewai.tool"}
    kickoff, task, llm, tool = (found[n] for n in ("crewai.kickoff", "crewai.task", "crewai.llm", "crewai.tool"))
    assert kickoff.parent is not None and format(kickoff.parent.span_id, "016x") == PARENT.split("-")[2]
    assert kickoff.context.trace_id == int(PARENT.split("-")[1], 16)
    assert task.parent is not None and task.parent.span_id == kickoff.context.span_id
    assert llm.parent is not None and llm.parent.span_id == task.context.span_id
    assert tool.parent is not None and tool.parent.span_id == task.context.span_id
    assert llm.attributes is not None and llm.attributes["gen_ai.request.model"] == "m-1"
    assert llm.attributes["gen_ai.usage.input_tokens"] == 7 and llm.attributes["gen_ai.usage.output_tokens"] == 3
    assert tool.attributes is not None and tool.attributes["gen_ai.tool.name"] == "word_counter"
    assert tool.status.status_code is StatusCode.ERROR and tool.attributes["aip.status"] == "failed"
    assert tool.attributes["aip.error_code"] == "tool_usage_error"
    assert task.attributes is not None and task.attributes["crewai.task_id"] == "task-uuid"
    for span in found.values():
        assert span.attributes is not None and {k: span.attributes[k] for k in ATTRIBUTES} == ATTRIBUTES
        assert "PROMPT" not in str(span.attributes) and "ARGS" not in str(span.attributes)


def test_content_capture_adds_prompts_answers_and_tool_arguments_bounded() -> None:
    spans, exporter = _mapper(capture=True)
    spans.on_event(_event("llm_call_started", "l", None, messages="P" * 10_000, agent_role="Writer"))
    spans.on_event(_event("llm_call_completed", "l2", None, "l", response="ANSWER"))
    (llm,) = exporter.get_finished_spans()
    assert llm.attributes is not None
    assert llm.attributes["gen_ai.prompt"] == "P" * 4096
    assert llm.attributes["gen_ai.completion"] == "ANSWER" and llm.attributes["crewai.agent.role"] == "Writer"


def test_close_ends_scopes_left_open_as_unfinished() -> None:
    spans, exporter = _mapper()
    spans.on_event(_event("crew_kickoff_started", "k"))
    spans.on_event(_event("task_started", "t", "k"))
    assert exporter.get_finished_spans() == ()
    spans.close()
    finished = exporter.get_finished_spans()
    assert len(finished) == 2
    assert all(
        s.status.status_code is StatusCode.ERROR and dict(s.attributes or {})["aip.status"] == "unfinished"
        for s in finished
    )
    spans.close()  # idempotent
    assert len(exporter.get_finished_spans()) == 2


def test_open_scopes_are_bounded_and_a_broken_event_never_raises() -> None:
    spans, exporter = _mapper()
    for n in range(MAX_OPEN_SCOPES + 1):
        spans.on_event(_event("task_started", f"t{n}"))
    spans.on_event(object())  # no type, no ids
    spans.on_event(_event("task_completed", "x", None, "unknown"))  # ends nothing
    spans.close()
    assert len(exporter.get_finished_spans()) == MAX_OPEN_SCOPES


@pytest.mark.usefixtures("crewai_state_dir")
def test_a_real_crew_run_gives_kickoff_task_llm_and_tool_spans_without_its_input(crewai_state_dir: Path) -> None:
    from aip_crewai.sidecar.operations import execute
    from aip_crewai.sidecar.registry import load_registry

    spans, exporter = _mapper()
    ctx = JobContext(
        action_id="acme:act_1",
        crew_id="tool_user",
        operation="run",
        emit_chunk=lambda _: None,
        cancel_flag=threading.Event(),
        state_dir=crewai_state_dir,
        spans=spans,
    )
    crews = load_registry("aip_crewai.examples.testing:CREWS")
    asyncio.run(execute(crews["tool_user"], "run", {"topic": "secret-zebra-words"}, ctx))
    spans.close()
    finished = exporter.get_finished_spans()
    names = [span.name for span in finished]
    assert {"crewai.kickoff", "crewai.task", "crewai.llm", "crewai.tool"} <= set(names), names
    assert all(span.context.trace_id == int(PARENT.split("-")[1], 16) for span in finished)
    assert all(span.attributes["aip.status"] == "completed" for span in finished)  # type: ignore[index]
    assert "secret-zebra" not in str([dict(span.attributes or {}) for span in finished])
    assert trace.get_current_span() is trace.INVALID_SPAN
