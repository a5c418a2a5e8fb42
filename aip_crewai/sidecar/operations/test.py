"""Operation ``test``: evaluate a crew for ``n_iterations`` and return the scores.

Input ``{n_iterations, eval_llm, inputs?}``; output ``{"status":
"completed", "n_iterations", "eval_llm", "scores": [{"iteration": 1..n,
"task_index": int, "quality": float (1..10), "execution_duration": float
seconds or null, "model": str}]}``.

CrewAI 1.15.5 ``Crew.test`` (``crew.py``) returns None: the scores exist only
as ``CrewTestResultEvent(quality, execution_duration, model)`` emitted on the
process-wide event bus by ``CrewEvaluator.evaluate`` (a task callback of the
copied test crew) with the *copy* as source, and it prints a rich table to
stdout. We run the same steps (``create_llm`` is replaced by
:func:`resolve_eval_llm`; the stdout table is skipped) so we hold the test
crew, and collect the events with a stream sink installed in the job's own
context (``crewai.events.stream_context``: called synchronously in the
emitting thread, so no other job's events can reach it), accepting only
events whose source *is* our test crew.

Eval LLM (a model name string): resolved, in order, by the crew option
``eval_llm`` (a callable ``name -> BaseLLM``, or a mapping name -> BaseLLM;
see ``_maintenance.crew_option``); then by an agent LLM of the crew whose ``model``
equals the name (a shallow copy with its own token counters: the
deployment's own provider settings); then by CrewAI's ``create_llm(name)``
(a real provider: network). Offline, ``aip_crewai/examples/maintenance_crews.py`` crews
resolve every name through their option, and ``aip_crewai/examples/testing.py`` crews
resolve their own model name (e.g. ``"offline-echo"``).

Source: ARCHITECTURE.md §3 (test input), §4 (outputs: test), §5 (events captured
per job by source identity; worker thread; cooperative cancel).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog
from crewai.events.event_bus import crewai_event_bus
from crewai.events.stream_context import add_stream_sink, reset_stream_sinks
from crewai.events.types.crew_events import (
    CrewTestCompletedEvent,
    CrewTestFailedEvent,
    CrewTestResultEvent,
    CrewTestStartedEvent,
)
from crewai.llms.base_llm import BaseLLM
from crewai.utilities.evaluators.crew_evaluator_handler import CrewEvaluator
from crewai.utilities.llm_utils import create_llm

from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.operations._common import check_cancelled, job_scope
from aip_crewai.sidecar.operations._maintenance import crew_option, run_in_worker
from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
from aip_crewai.sidecar.operations.startup.crew_checks import refuse_unusable_crew
from aip_crewai.sidecar.registry import CrewSource

log = structlog.get_logger(__name__)

EVAL_LLM_OPTION = "eval_llm"

_task_index: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "aip_crewai_evaluated_task_index", default=None
)


def resolve_eval_llm(source: CrewSource, crew: Any, name: str) -> BaseLLM:
    """Build the evaluation LLM for model name ``name`` (see module docstring).

    Raises:
        ValueError: no LLM could be built.
    """
    option = crew_option(source, EVAL_LLM_OPTION)
    llm: Any = None
    if isinstance(option, Mapping):
        llm = option.get(name)
    elif callable(option):
        llm = option(name)
    if llm is None:
        llm = _agent_llm_named(crew, name)
    if llm is None:
        llm = create_llm(name)
    if not isinstance(llm, BaseLLM):
        raise ValueError("the evaluation LLM could not be built")
    return llm


def _agent_llm_named(crew: Any, name: str) -> BaseLLM | None:
    for agent in getattr(crew, "agents", None) or []:
        llm = getattr(agent, "llm", None)
        if isinstance(llm, BaseLLM) and llm.model == name:
            copy = llm.model_copy()
            private = getattr(copy, "__pydantic_private__", None)
            if isinstance(private, dict) and isinstance(private.get("_token_usage"), dict):
                private["_token_usage"] = dict.fromkeys(private["_token_usage"], 0)
            return copy
    return None


class _JobEvaluator(CrewEvaluator):
    """CrewEvaluator that marks which task is being scored (for the score list)."""

    def evaluate(self, task_output: Any) -> None:
        index = next(
            (i for i, t in enumerate(self.crew.tasks) if t.description == task_output.description),
            None,
        )
        token = _task_index.set(index)
        try:
            super().evaluate(task_output)
        finally:
            _task_index.reset(token)


@contextmanager
def _collect_scores(test_crew: Any, evaluator: CrewEvaluator, scores: list[dict[str, Any]]) -> Iterator[None]:
    """Append this job's ``CrewTestResultEvent`` data to ``scores`` while open."""

    def sink(event_source: Any, event: Any) -> None:
        if not isinstance(event, CrewTestResultEvent) or event_source is not test_crew:
            return
        try:
            scores.append(
                {
                    "iteration": evaluator.iteration,
                    "task_index": _task_index.get(),
                    "quality": float(event.quality),
                    "execution_duration": event.execution_duration,
                    "model": str(event.model),
                }
            )
        except Exception as exc:  # a sink must never raise into CrewAI's emit
            log.warning("test_score_dropped", error_type=type(exc).__name__)

    token = add_stream_sink(sink)
    try:
        yield
    finally:
        reset_stream_sinks(token)


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Evaluate a fresh crew ``n_iterations`` times with the evaluation LLM.

    Args:
        source: the crew source (its ``eval_llm`` option is used).
        input: ``{"n_iterations": 1..100, "eval_llm": str, "inputs"?: dict}``.
        ctx: the job context.

    Returns:
        ``{"status": "completed", "n_iterations", "eval_llm", "scores": [...]}``
        (shape in the module docstring; one score per task per iteration).

    Raises:
        JobCancelled: the cancel flag was seen before a model call or an
            iteration.
        Exception: CrewAI or provider errors, unchanged.
    """
    n_iterations = int(input["n_iterations"])
    eval_llm = str(input["eval_llm"])
    inputs = dict(input.get("inputs") or {})
    scores: list[dict[str, Any]] = []
    with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant):
        await run_in_worker(ctx, _test, source, eval_llm, n_iterations, inputs, scores)
    return {
        "status": "completed",
        "n_iterations": n_iterations,
        "eval_llm": eval_llm,
        "scores": scores,
    }


def _test(
    source: CrewSource,
    eval_llm: str,
    n_iterations: int,
    inputs: dict[str, Any],
    scores: list[dict[str, Any]],
) -> None:
    """Worker thread: ``Crew.test`` of CrewAI 1.15.5 on a fresh crew, minus the table."""
    crew = source.job_crew()
    refuse_unusable_crew(crew)
    llm = resolve_eval_llm(source, crew, eval_llm)

    def emit(event: Any) -> None:
        crewai_event_bus.emit(crew, event)

    try:
        emit(CrewTestStartedEvent(crew_name=crew.name, n_iterations=n_iterations, eval_llm=llm, inputs=inputs))
        test_crew = crew.copy()
        evaluator = _JobEvaluator(test_crew, llm)
        with _collect_scores(test_crew, evaluator, scores):
            for iteration in range(1, n_iterations + 1):
                check_cancelled()
                evaluator.set_iteration(iteration)
                test_crew.kickoff(inputs=inputs)
        emit(CrewTestCompletedEvent(crew_name=crew.name))
    except Exception as exc:
        emit(CrewTestFailedEvent(error=type(exc).__name__, crew_name=crew.name))
        raise
