"""Shared plumbing for the operation modules: per-job scope, cancel check, output shapes.

- :func:`job_scope` binds one job to the current execution context: a
  contextvar holding its :class:`JobContext` and a CrewAI *stream sink* that
  turns the job's ``LLMStreamChunkEvent`` into ``ctx.emit_chunk`` calls.
  Both live in ``contextvars``, so they follow ``await``, ``asyncio.create_task``
  and ``asyncio.to_thread`` started inside the scope, and nothing else: two
  concurrent jobs never see each other's chunks (CrewAI calls stream sinks
  synchronously from ``crewai_event_bus.emit`` in the emitter's context;
  ``crewai/events/stream_context.py``, ``event_bus.py::_prepare_event``).
- :func:`check_cancelled` is the cooperative stop for worker-thread work. It is
  called by the offline LLM before each model call and, through a global
  ``before_llm_call`` hook, before every agent model call of any LLM.
- :class:`NoHumanInput` (:func:`no_human_input`) fails any human-input prompt of a job.
- :func:`crew_fingerprint` and :func:`fingerprint_change`: the crew definition a replay relies on.
- :func:`serialize_crew_output` and :func:`to_bounded_json` give the wire
  shapes of ARCHITECTURE.md §4 (Outputs).

The checks that make a crew unusable (human input, models, knowledge, memory) are
:mod:`~aip_crewai.sidecar.operations.startup.crew_checks`.

Source: ARCHITECTURE.md §4 (events, outputs), §5 (per-job capture, cancellation).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog
from crewai.core.providers.human_input import SyncHumanInputProvider, reset_provider, set_provider
from crewai.events.stream_context import add_stream_sink, reset_stream_sinks
from crewai.events.types.llm_events import LLMCallStartedEvent, LLMStreamChunkEvent
from crewai.hooks.dispatch import HookAborted
from crewai.hooks.llm_hooks import (
    get_before_llm_call_hooks,
    register_before_llm_call_hook,
)
from crewai.hooks.tool_hooks import get_before_tool_call_hooks, register_before_tool_call_hook
from crewai.utilities.i18n import I18N_DEFAULT

from aip_crewai.sidecar.jobs.context import JobCancelled, JobContext, SafeJobError
from aip_crewai.sidecar.operations import _swallowed
from aip_crewai.sidecar.operations.startup.crew_checks import HUMAN_INPUT_MESSAGE

log = structlog.get_logger(__name__)

_current_job: contextvars.ContextVar[JobContext | None] = contextvars.ContextVar("aip_crewai_current_job", default=None)

DEFAULT_MAX_DEPTH = 8
DEFAULT_MAX_ITEMS = 200
#: The chunk channel of CrewAI's own model calls (no task): published as ``progress`` (:func:`chunk_data`).
INTERNAL_CHANNEL = "internal"


# --------------------------------------------------------------------------- scope


def current_job() -> JobContext | None:
    """Return the JobContext of the job running in this context, or None."""
    return _current_job.get()


@contextmanager
def job_scope(ctx: JobContext) -> Iterator[JobContext]:
    """Bind ``ctx`` to the current context for the duration of the block.

    Installs the per-job stream sink and the current-job contextvar. Re-entering
    with the job that is already current is a no-op (so an operation module may
    wrap its own work without doubling chunks). Use it in the job's own asyncio
    task; work started inside with ``asyncio.to_thread`` or ``create_task``
    inherits it.

    Args:
        ctx: the job's context; ``ctx.emit_chunk`` receives
            ``{"content": str, "channel": "llm"|"tools", "task_id"?, "agent_role"?}``.

    Yields:
        ``ctx``.

    Source: ARCHITECTURE.md §5 (events are captured per job).
    """
    if _current_job.get() is ctx:
        yield ctx
        return
    job_token = _current_job.set(ctx)
    sink_token = add_stream_sink(_make_sink(ctx))
    try:
        yield ctx
    finally:
        reset_stream_sinks(sink_token)
        _current_job.reset(job_token)


def _make_sink(ctx: JobContext) -> Any:
    """Build the stream sink of one job: chunk events in, ``emit_chunk`` out.

    CrewAI calls it for *every* event emitted in the job's context; only
    stream chunks are forwarded (never failure events: their text may hold
    provider secrets), and none once the job's cancel flag is set (a worker
    thread may still finish its chunk after the job ended). Every event goes to
    the job's span mapper first when it is traced (``ctx.spans``, a
    :class:`~aip_crewai.sidecar.tracing.CrewSpans`). Every other event
    goes to ``_swallowed.note``, which records the failures CrewAI carries on
    from (a knowledge search, memory, a tool). It never raises (an exception
    would break the emitter).
    """

    spans = ctx.spans  # the job's CrewAI spans (docs/observing.md "Observing actions"), or None
    forced: set[str] = set()  # model calls CrewAI makes, outside a task, for an agent's forced final answer

    def sink(_source: Any, event: Any) -> None:
        try:
            if spans is not None:
                spans.on_event(event)
            if isinstance(event, LLMCallStartedEvent) and not event.task_id and forces_final_answer(event.messages):
                forced.add(event.call_id)
            if not isinstance(event, LLMStreamChunkEvent):
                _swallowed.note(ctx, event)  # a failure CrewAI emits and carries on from
                return
            if ctx.cancel_flag.is_set():
                return
            data = chunk_data(event, answer=event.call_id in forced)
            if data is not None:
                if "batch_item" in ctx.extra:  # batch_run: which item the chunk belongs to
                    data["batch_item"] = ctx.extra["batch_item"]
                ctx.emit_chunk(data)
        except Exception as exc:  # the sink must never raise into CrewAI
            try:
                log.warning("stream_sink_failed", error_type=type(exc).__name__)
            except Exception:  # noqa: S110 - a broken log sink must not break the job either
                pass

    return sink


#: What CrewAI appends to an agent's conversation once it reached ``max_iter`` (``crewai/utilities/agent_utils.py``
#: ``handle_max_iterations_exceeded``): the model call after it is the agent's final answer, made without its task.
_FORCE_FINAL_ANSWER = I18N_DEFAULT.errors("force_final_answer")


def forces_final_answer(messages: Any) -> bool:
    """Whether a model call's ``messages`` (``LLMCallStartedEvent.messages``) end with CrewAI's demand for an
    agent's final answer after ``max_iter`` iterations (:data:`_FORCE_FINAL_ANSWER`). Pure."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    content = last.get("content") if isinstance(last, dict) else None
    return isinstance(content, str) and _FORCE_FINAL_ANSWER in content


def chunk_data(event: Any, *, answer: bool = False) -> dict[str, Any] | None:
    """Convert one ``LLMStreamChunkEvent`` to chunk data, or None when empty.

    Args:
        event: the CrewAI event (``chunk``, ``tool_call``, ``task_id``,
            ``agent_role``).
        answer: the chunk is of an agent's forced final answer (:func:`forces_final_answer`: CrewAI makes that
            call without the task, so it has no ``task_id``): channel ``llm``, as any answer to a task.

    Returns:
        ``{"content", "channel", "task_id"?, "agent_role"?}`` (the job's sink adds
        ``batch_item``, the item's index, to a ``batch_run`` chunk); channel ``tools``
        when the chunk is part of a native tool call (content: the arguments
        fragment, or the tool name when the fragment is empty); ``llm`` for an
        agent's answer to its task; :data:`INTERNAL_CHANNEL` for a model call
        CrewAI makes for itself, outside any task (the knowledge query rewrite,
        ``agent/core.py::_get_knowledge_search_query``; memory analysis), which
        the host publishes as ``progress``, never as the answer's ``data``.
    """
    content = event.chunk or ""
    channel = "llm" if event.task_id or answer else INTERNAL_CHANNEL
    if event.tool_call is not None:
        channel = "tools"
        if not content:
            content = event.tool_call.function.name or ""
    if not content:
        return None
    data: dict[str, Any] = {"content": content, "channel": channel}
    if event.task_id:
        data["task_id"] = str(event.task_id)
    if event.agent_role:
        data["agent_role"] = str(event.agent_role)
    return data


# ------------------------------------------------------------------ cancellation


def check_cancelled() -> None:
    """Raise :class:`JobCancelled` if the current job's cancel flag is set.

    No-op outside any job. Sets ``ctx.stop_observed = True`` before raising.
    The flag stays set, so agent retries (``max_retry_limit``) stop too.

    Raises:
        JobCancelled: the current job was cancelled.

    Source: ARCHITECTURE.md §5 (a per-job flag checked before every model call).
    """
    ctx = _current_job.get()
    if ctx is not None and ctx.cancel_flag.is_set():
        ctx.stop_observed = True
        raise JobCancelled(f"job {ctx.action_id} was cancelled")


def _cancel_hook(_context: Any) -> None:
    """Global ``before_llm_call`` hook: abort the model call of a cancelled job.

    CrewAI swallows ordinary exceptions raised by hooks (fail-open) and only
    honours :class:`HookAborted` (``crewai/hooks/dispatch.py::_invoke_hook``);
    the agent then raises ``ValueError("LLM call blocked by before_llm_call
    hook")``, so the job ends with that error, not :class:`JobCancelled`.
    """
    try:
        check_cancelled()
    except JobCancelled as exc:
        raise HookAborted(str(exc), source="aip_crewai_cancel") from exc


def _cancel_tool_hook(_context: Any) -> None:
    """Global ``before_tool_call`` hook: never run a tool for a cancelled job.

    A model call that was already in flight when the job was cancelled (a
    blocked provider call cannot be interrupted in-process) may still answer
    with a tool call; without this hook that tool would run after the stop
    was recorded. Blocking it (``HookAborted``; CrewAI hands the agent a
    "blocked" result, and its next model call is blocked by
    :func:`_cancel_hook`) keeps the rule: once the flag is set, no model call
    starts and no tool runs, so ``stop_observed`` is a confirmed stop.
    """
    try:
        check_cancelled()
    except JobCancelled as exc:
        raise HookAborted(str(exc), source="aip_crewai_cancel") from exc


def install_cancel_hook() -> None:
    """Register :func:`_cancel_hook` and :func:`_cancel_tool_hook` once, globally (idempotent).

    Agent executors snapshot the global hook list when they are created (per
    task execution), so registering at import time covers every job.
    """
    if _cancel_hook not in get_before_llm_call_hooks():
        register_before_llm_call_hook(_cancel_hook)
    if _cancel_tool_hook not in get_before_tool_call_hooks():
        register_before_tool_call_hook(_cancel_tool_hook)


install_cancel_hook()


# ------------------------------------------------------------------- human input


class NoHumanInput(SyncHumanInputProvider):
    """Job-scoped human-input provider of every operation but ``train``: never
    reads stdin (CrewAI's default provider calls ``input()``, which blocks a
    sidecar until its execution bound); any prompt fails the job with a
    typed ``HumanInputUnsupported`` error instead."""

    def _prompt_input(self, crew: Any = None) -> str:  # type: ignore[override]
        raise SafeJobError(HUMAN_INPUT_MESSAGE, error_type="HumanInputUnsupported")

    async def _prompt_input_async(self, crew: Any = None) -> str:  # type: ignore[override]
        raise SafeJobError(HUMAN_INPUT_MESSAGE, error_type="HumanInputUnsupported")


@contextmanager
def no_human_input() -> Iterator[None]:
    """Install :class:`NoHumanInput` for the current context (follows threads started inside)."""
    token = set_provider(NoHumanInput())
    try:
        yield
    finally:
        reset_provider(token)


# ------------------------------------------------------------------- fingerprint

#: The fields of one task in a crew fingerprint, in order.
FINGERPRINT_FIELDS = ("name", "description", "expected_output", "agent_role")


def crew_fingerprint(crew: Any) -> list[dict[str, str | None]]:
    """The definition of a crew that a replay relies on, task by task, in order.

    Args:
        crew: a crew (texts before interpolation are used when CrewAI kept
            them: ``Task._original_description``/``_original_expected_output``,
            ``BaseAgent._original_role``).

    Returns:
        ``[{"name", "description", "expected_output", "agent_role"}]`` (str or
        None each), one entry per task.

    Source: docs/security.md ("Tenant-scoped crew state": replay).
    """
    out = []
    for task in list(getattr(crew, "tasks", None) or []):
        agent = getattr(task, "agent", None)
        role = getattr(agent, "_original_role", None) or getattr(agent, "role", None)
        out.append(
            {
                "name": _text(getattr(task, "name", None)),
                "description": _text(
                    getattr(task, "_original_description", None) or getattr(task, "description", None)
                ),
                "expected_output": _text(
                    getattr(task, "_original_expected_output", None) or getattr(task, "expected_output", None)
                ),
                "agent_role": _text(role),
            }
        )
    return out


def fingerprint_change(stored: Any, current: list[dict[str, str | None]]) -> str | None:
    """Say how a crew's definition changed since a run, or None when it did not.

    Args:
        stored: the fingerprint kept with the run (:func:`crew_fingerprint`).
        current: the fingerprint of the crew now.

    Returns:
        E.g. ``"the run had 2 tasks, the crew now has 3"`` or ``"task 1:
        description, agent_role changed; task 2: name changed"`` (1-based
        task positions, field names only: never the texts).
    """
    if not isinstance(stored, list):
        return None
    if len(stored) != len(current):
        return f"the run had {len(stored)} tasks, the crew now has {len(current)}"
    changes = []
    for position, (old, new) in enumerate(zip(stored, current, strict=True), start=1):
        fields = [f for f in FINGERPRINT_FIELDS if not isinstance(old, dict) or old.get(f) != new.get(f)]
        if fields:
            changes.append(f"task {position}: {', '.join(fields)} changed")
    return "; ".join(changes) or None


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


# ------------------------------------------------------------------------ output


def serialize_crew_output(output: Any, crew: Any = None) -> dict[str, Any]:
    """Serialize a CrewOutput to the run/replay output shape.

    Args:
        output: a ``crewai.CrewOutput``.
        crew: the crew that produced it; its ``tasks`` give each entry's
            ``task_id`` (a TaskOutput does not carry the task id: CrewAI sets
            ``task.output`` to the same object it appends to ``tasks_output``,
            so entries are matched by identity, then by position when the
            counts agree). Without it ``task_id`` is None.

    Returns:
        ``{"raw": str, "token_usage": {...}, "tasks_output": [{"task_id",
        "name", "description", "expected_output", "summary", "raw", "agent",
        "output_format", "json_dict", "pydantic"}], "json_dict", "pydantic"}``.
        The per-task ``messages`` prompt histories are omitted (large).

    Source: ARCHITECTURE.md §4 (Outputs: run/replay).
    """
    tasks_output = list(getattr(output, "tasks_output", None) or [])
    task_ids = _task_ids(tasks_output, crew)
    return {
        "raw": str(getattr(output, "raw", "") or ""),
        "token_usage": to_bounded_json(getattr(output, "token_usage", None)) or {},
        "tasks_output": [
            _serialize_task_output(item, task_id) for item, task_id in zip(tasks_output, task_ids, strict=True)
        ],
        "json_dict": to_bounded_json(getattr(output, "json_dict", None)),
        "pydantic": to_bounded_json(getattr(output, "pydantic", None)),
    }


def _task_ids(tasks_output: list[Any], crew: Any) -> list[str | None]:
    tasks = list(getattr(crew, "tasks", None) or [])
    by_output = {id(t.output): str(t.id) for t in tasks if getattr(t, "output", None)}
    ids: list[str | None] = [by_output.get(id(item)) for item in tasks_output]
    if None in ids and len(tasks) == len(tasks_output):
        ids = [str(t.id) for t in tasks]
    return ids


def _serialize_task_output(item: Any, task_id: str | None) -> dict[str, Any]:
    output_format = getattr(item, "output_format", None)
    return {
        "task_id": task_id,
        "name": getattr(item, "name", None),
        "description": str(getattr(item, "description", "") or ""),
        "expected_output": getattr(item, "expected_output", None),
        "summary": getattr(item, "summary", None),
        "raw": str(getattr(item, "raw", "") or ""),
        "agent": str(getattr(item, "agent", "") or ""),
        "output_format": getattr(output_format, "value", output_format),
        "json_dict": to_bounded_json(getattr(item, "json_dict", None)),
        "pydantic": to_bounded_json(getattr(item, "pydantic", None)),
    }


def to_bounded_json(
    value: Any,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> Any:
    """Convert an arbitrary value to JSON-compatible data, bounded in size.

    Args:
        value: anything. Pydantic models become ``model_dump(mode="json")``;
            mappings (keys as ``str``), lists/tuples/sets and JSON primitives
            stay themselves; non-finite floats and any other object become
            ``str(value)``.
        max_depth: containers nested deeper than this become the string
            ``"…"``.
        max_items: each container keeps at most this many entries (the first
            ones, in iteration order).

    Returns:
        A value ``json.dumps`` accepts.
    """
    return _bound(value, max_depth, max_items)


def _bound(value: Any, depth: int, max_items: int) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and not isinstance(value, type):
        try:
            value = model_dump(mode="json")
        except Exception:  # a model that cannot dump itself is shown as text
            return str(value)
        if not isinstance(value, Mapping | list):
            return _bound(value, depth, max_items)
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        if depth <= 0:
            return "…"
        if isinstance(value, Mapping):
            return {str(k): _bound(v, depth - 1, max_items) for k, v in _take(value.items(), max_items)}
        return [_bound(v, depth - 1, max_items) for v in _take(value, max_items)]
    return str(value)


def _take(items: Any, limit: int) -> Iterator[Any]:
    for index, item in enumerate(items):
        if index >= limit:
            return
        yield item
