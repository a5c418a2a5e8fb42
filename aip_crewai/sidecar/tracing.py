"""The sidecar's spans: each job, and CrewAI's kickoff, tasks, LLM calls and tool calls in it.

- ``aip.sidecar.job`` (sidecar process, kind server): a job from its start to its end, child of the
  ``traceparent`` of the request that admitted it (the host's dispatch span).
- CrewAI's event bus mapped to spans (:class:`CrewSpans`), in the process that runs the job (its worker
  with ``--isolation process``): ``crewai.kickoff`` (``crewai.train``, ``crewai.test``), ``crewai.task``,
  ``crewai.llm``, ``crewai.tool``, each a child of the scope CrewAI emitted it in (the job span at the
  top). The events come through the per-job stream sink (``operations/_common.py``), so two jobs never
  mix. A worker builds its tracer provider after its fork, when its job starts (the fork server stays
  single-threaded), and flushes it before it exits and between two jobs (:data:`WORKER_FLUSH_MS`).

Attributes: ``aip.tenant``, ``aip.action_id``, ``aip.job_id``, ``aip.crew_id``, ``aip.operation``,
``aip.status`` and ``aip.error_code`` (a job's error type); on CrewAI spans ``crewai.task_id``,
``crewai.agent_id``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``/``output_tokens``,
``gen_ai.tool.name``. Task names and agent roles (CrewAI interpolates inputs into them), prompts,
answers, tool arguments and outputs only with content capture (``AIP_CREWAI_OTEL_CAPTURE_CONTENT=true``).

Source: docs/observing.md "Observing actions" (Traces); ARCHITECTURE.md §5 (per-job capture, isolation).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .. import tracing
from ..tracing import TraceSettings, Tracing
from .tenancy import tenant_of

__all__ = [
    "CrewSpans",
    "WORKER_FLUSH_MS",
    "configure",
    "crew_spans",
    "end_job",
    "install",
    "job_attributes",
    "job_failed",
    "job_span",
    "flush",
    "settings",
    "shutdown",
]

#: How long a worker waits for its spans to be exported before it exits, milliseconds.
WORKER_FLUSH_MS = 2000
#: At most this many CrewAI scopes open at once per job; later ones are not traced.
MAX_OPEN_SCOPES = 10_000

#: CrewAI scope-starting event type -> our span name (the others only give their children a parent).
SPANS = {
    "crew_kickoff_started": "crewai.kickoff",
    "crew_train_started": "crewai.train",
    "crew_test_started": "crewai.test",
    "task_started": "crewai.task",
    "llm_call_started": "crewai.llm",
    "tool_usage_started": "crewai.tool",
    "mcp_tool_execution_started": "crewai.tool",
}
#: Scope-ending event types that end their scope failed.
FAILED_ENDINGS = frozenset(
    {
        "crew_kickoff_failed",
        "crew_train_failed",
        "crew_test_failed",
        "task_failed",
        "llm_call_failed",
        "tool_usage_error",
        "mcp_tool_execution_failed",
        "agent_execution_error",
    }
)

_settings: TraceSettings | None = None
_active: Tracing | None = None


def configure(found: TraceSettings | None) -> None:
    """Remember the operator's tracing settings, read before CrewAI's environment is forced."""
    global _settings
    _settings = found


def settings() -> TraceSettings | None:
    """The settings :func:`configure` kept (None: off)."""
    return _settings


def install(service_name: str = "aip-crewai-sidecar") -> Tracing | None:
    """Build this process's provider when tracing is on (after any fork from this process). Idempotent."""
    global _active
    if _active is None and _settings is not None:
        _active = tracing.install(_settings, service_name)
    return _active


def shutdown(timeout_ms: int | None = None) -> None:
    """Flush (within ``timeout_ms`` when given) and stop this process's provider, if any."""
    global _active
    installed, _active = _active, None
    if installed is None:
        return
    if timeout_ms is not None:
        installed.flush(timeout_ms)
        return  # a worker leaves with os._exit: the exporter thread dies with it
    installed.shutdown()


def flush(timeout_ms: int) -> None:
    """Export the spans ended so far (within ``timeout_ms``), keeping this process's provider (a worker
    between two jobs)."""
    if _active is not None:
        _active.flush(timeout_ms)


def job_attributes(job_id: str, crew_id: str, operation: str) -> dict[str, str]:
    """The attributes naming a job: tenant, action id (the job id without its tenant), job id, crew, operation."""
    tenant = tenant_of(job_id)
    action_id = job_id[len(tenant) + 1 :] if tenant and job_id.startswith(tenant + ":") else job_id
    return {
        "aip.tenant": tenant,
        "aip.action_id": action_id,
        "aip.job_id": job_id,
        "aip.crew_id": crew_id,
        "aip.operation": operation,
    }


@contextmanager
def job_span(job_id: str, crew_id: str, operation: str) -> Iterator[Span | None]:
    """The ``aip.sidecar.job`` span (current for the block), or None when tracing is off."""
    if _active is None:
        yield None
        return
    with _active.tracer.start_as_current_span(
        "aip.sidecar.job",
        kind=SpanKind.SERVER,
        attributes=job_attributes(job_id, crew_id, operation),
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def end_job(span: Span | None, status: str) -> None:
    """Set a job span's ``aip.status`` (the job's status when its execution ended)."""
    if span is not None and span.is_recording():
        span.set_attribute("aip.status", status)


def job_failed(error_type: str) -> None:
    """Set ``aip.error_code`` (and an error status) on the current span when it is a job's."""
    span = trace.get_current_span()
    if span.is_recording() and getattr(span, "name", None) == "aip.sidecar.job":
        span.set_attribute("aip.error_code", error_type)
        span.set_status(Status(StatusCode.ERROR))


def crew_spans(traceparent: str | None, attributes: dict[str, str]) -> CrewSpans | None:
    """A :class:`CrewSpans` of this process's tracer under ``traceparent``, or None when tracing is off."""
    if _active is None:
        return None
    return CrewSpans(_active.tracer, tracing.context_of(traceparent), attributes, _active.capture_content)


class CrewSpans:
    """CrewAI's events of one job, as spans. Thread-safe; :meth:`on_event` never raises.

    A scope-starting event (``SCOPE_STARTING_EVENTS`` of ``crewai/events/event_context.py``) whose
    type is in :data:`SPANS` opens a span whose parent is the span of its nearest traced enclosing scope
    (``parent_event_id``, followed through untraced scopes such as an agent's execution), else the job's
    parent context; the ending event naming it (``started_event_id``) ends it, failed for
    :data:`FAILED_ENDINGS`. :meth:`close` ends what is left open (a cancelled job), with an error status.

    Args:
        tracer: the process's tracer.
        parent: the context of the job span (None: a new trace).
        attributes: set on every span (:func:`job_attributes`).
        capture_content: add names, roles, prompts, answers, tool arguments and outputs.
    """

    def __init__(self, tracer: trace.Tracer, parent: Any, attributes: dict[str, str], capture_content: bool) -> None:
        self._tracer = tracer
        self._parent = parent
        self._attributes = attributes
        self._capture = capture_content
        self._lock = threading.Lock()
        self._open: dict[str, Span] = {}
        self._scope_parent: dict[str, str | None] = {}

    def on_event(self, event: Any) -> None:
        """Take one CrewAI event (any type; most are ignored at once)."""
        kind = getattr(event, "type", None)
        try:
            if kind in SPANS:
                self._start(SPANS[kind], event)
            elif isinstance(kind, str) and kind.endswith("_started"):
                with self._lock:
                    if len(self._scope_parent) < MAX_OPEN_SCOPES:
                        self._scope_parent[str(event.event_id)] = getattr(event, "parent_event_id", None)
            elif getattr(event, "started_event_id", None):
                self._end(event, failed=kind in FAILED_ENDINGS)
        except Exception:  # noqa: BLE001, S110 - tracing must never break a job
            pass

    def close(self) -> None:
        """End every span still open (its scope never ended: the job stopped first)."""
        with self._lock:
            left, self._open = list(self._open.values()), {}
            self._scope_parent.clear()
        for span in left:
            span.set_status(Status(StatusCode.ERROR))
            span.set_attribute("aip.status", "unfinished")
            span.end()

    def _start(self, name: str, event: Any) -> None:
        with self._lock:
            if len(self._open) >= MAX_OPEN_SCOPES:
                return
            parent_span = self._enclosing(getattr(event, "parent_event_id", None))
            context = trace.set_span_in_context(parent_span) if parent_span is not None else self._parent
            span = self._tracer.start_span(
                name,
                context=context,
                attributes={**self._attributes, **self._describe(event)},
                start_time=_ns(getattr(event, "timestamp", None)),
            )
            self._open[str(event.event_id)] = span
            self._scope_parent[str(event.event_id)] = getattr(event, "parent_event_id", None)

    def _enclosing(self, event_id: str | None) -> Span | None:
        seen = 0
        while event_id is not None and seen < 256:
            span = self._open.get(event_id)
            if span is not None:
                return span
            event_id = self._scope_parent.get(event_id)
            seen += 1
        return None

    def _end(self, event: Any, *, failed: bool) -> None:
        started = str(event.started_event_id)
        with self._lock:
            self._scope_parent.pop(started, None)
            span = self._open.pop(started, None)
        if span is None:
            return
        span.set_attributes(self._outcome(event))
        span.set_attribute("aip.status", "failed" if failed else "completed")
        if failed:
            span.set_attribute("aip.error_code", str(event.type))
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=_ns(getattr(event, "timestamp", None)))

    def _describe(self, event: Any) -> dict[str, Any]:
        """Attributes of a starting event: identifiers and configuration, never content (unless captured)."""
        found: dict[str, Any] = {}
        for attribute, field in (("crewai.task_id", "task_id"), ("crewai.agent_id", "agent_id")):
            value = getattr(event, field, None)
            if value:
                found[attribute] = str(value)
        model = getattr(event, "model", None)
        if model:
            found["gen_ai.request.model"] = str(model)
        tool = getattr(event, "tool_name", None)
        if tool:
            found["gen_ai.tool.name"] = str(tool)
        if self._capture:
            for attribute, field in (
                ("crewai.task.name", "task_name"),
                ("crewai.agent.role", "agent_role"),
                ("gen_ai.prompt", "messages"),
                ("gen_ai.tool.arguments", "tool_args"),
            ):
                value = getattr(event, field, None)
                if value:
                    found[attribute] = tracing.bounded(value)
        return found

    def _outcome(self, event: Any) -> dict[str, Any]:
        """Attributes of an ending event: token counts; the answer or tool output only when captured."""
        found: dict[str, Any] = {}
        usage = getattr(event, "usage", None)
        if isinstance(usage, dict):
            for attribute, key in (
                ("gen_ai.usage.input_tokens", "prompt_tokens"),
                ("gen_ai.usage.output_tokens", "completion_tokens"),
            ):
                if isinstance(usage.get(key), int):
                    found[attribute] = usage[key]
        if self._capture:
            for attribute, field in (("gen_ai.completion", "response"), ("gen_ai.tool.output", "output")):
                value = getattr(event, field, None)
                if value is not None:
                    found[attribute] = tracing.bounded(value)
        return found


def _ns(timestamp: Any) -> int | None:
    """A CrewAI event's ``timestamp`` (aware datetime) in ns since the epoch, or None (now)."""
    return int(timestamp.timestamp() * 1_000_000_000) if isinstance(timestamp, datetime) else None
