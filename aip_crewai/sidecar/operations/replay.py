"""Operation ``replay``: re-run a crew from one task of a *retained* run.

Input ``{task_id, inputs?}``; output: the serialized CrewOutput (as ``run``).

Why not plain ``Crew.replay``: CrewAI 1.15.5 reads the stored task outputs
from one SQLite table for the whole storage dir
(``latest_kickoff_task_outputs.db``, ``KickoffTaskOutputsSQLiteStorage``);
every kickoff deletes and rewrites it, ``kickoff_for_each`` and
``reset_memories("kickoff_outputs")`` empty it, and ``replay`` never checks
that the task id belongs to the crew. So replay could only reach the latest
kickoff of the whole process and could silently replay another crew's run.

What we do instead:

1. ``await ctx.find_task_run(task_id)`` gives the serialized output of a
   retained run of THIS crew whose ``tasks_output`` holds ``task_id``; no such
   run (or a run whose task list no longer matches the crew's) is an
   :class:`InputRejected`, never a positional guess.
2. A fresh crew gets a job-private, in-memory :class:`RetainedRunStore` as its
   ``_task_output_handler`` (the private attribute ``Crew.replay`` loads from,
   ``crew.py::Crew.replay``/``_store_execution_log``), seeded from the
   retained run: entry *i* is ``tasks_output[i]`` (CrewAI stores one entry per
   task index, skipped conditional tasks included, so positions map 1:1).
   The shared table is never read or written by a replay.
3. ``crew.replay(task_id, inputs)`` runs in a worker thread inside the job
   scope (chunks, cooperative cancel before every model call). CrewAI emits
   ``crew_kickoff_completed`` without a started event on replay and prints a
   scope warning to stdout: harmless.

Inputs: the caller's ``inputs`` win; else the inputs the runtime kept with
the retained run (its ``inputs`` key: every run, batch item and replay keeps
them in the journal, 0600, until the job is archived; never logged); else
``{}``. Placeholders of the crew's
texts that the inputs do not cover are rejected up front (``Crew.replay``
skips interpolation for empty inputs, so the raw ``{x}`` text would reach the
model, and it never runs ``before_kickoff_callbacks`` that fill defaults).
The crew is built inside ``knowledge_query.knowledge_namespace``.

Crew definition: a retained run carries the fingerprint of the crew that
made it (``_common.crew_fingerprint``: task names, descriptions, expected
outputs and agent roles in order). If the crew's definition differs now, the
stored outputs would land on the wrong tasks, so the replay fails with a
:class:`SafeJobError` ``CrewDefinitionChanged`` naming what changed, before
any model call. (Runs retained before fingerprints were kept are checked by
task count only.)

Source: ARCHITECTURE.md §3 (replay input), §4 (outputs: run/replay), §5 (worker
thread, cooperative cancel; replay storage).
"""

from __future__ import annotations

from typing import Any

from aip_crewai.sidecar.jobs.context import InputRejected, JobContext, SafeJobError
from aip_crewai.sidecar.operations._common import (
    check_cancelled,
    crew_fingerprint,
    fingerprint_change,
    job_scope,
    serialize_crew_output,
)
from aip_crewai.sidecar.operations._maintenance import run_in_worker
from aip_crewai.sidecar.operations._task_outputs import RetainedRunStore
from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
from aip_crewai.sidecar.operations.startup.crew_checks import refuse_unusable_crew
from aip_crewai.sidecar.registry import CrewSource


def seed_records(run: dict[str, Any], inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn a retained run's serialized output into replay records.

    Args:
        run: serialized CrewOutput (``_common.serialize_crew_output``), its
            ``tasks_output`` in task-index order.
        inputs: the inputs recorded with every entry.

    Returns:
        One :class:`RetainedRunStore` record per ``tasks_output`` entry.
        ``pydantic`` is dropped (only its JSON survived retention; CrewAI
        builds the replay context from ``raw``).
    """
    records = []
    for index, item in enumerate(run.get("tasks_output") or []):
        records.append(
            {
                "task_id": str(item.get("task_id")),
                "expected_output": item.get("expected_output"),
                "output": {
                    "description": str(item.get("description") or ""),
                    "summary": item.get("summary"),
                    "raw": str(item.get("raw") or ""),
                    "pydantic": None,
                    "json_dict": item.get("json_dict") if isinstance(item.get("json_dict"), dict) else None,
                    "output_format": item.get("output_format") or "raw",
                    "agent": str(item.get("agent") or ""),
                    "messages": [],
                },
                "task_index": index,
                "inputs": dict(inputs),
                "was_replayed": False,
            }
        )
    return records


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Replay a fresh crew from ``task_id`` of a retained run of this crew.

    Args:
        source: the crew source.
        input: ``{"task_id": str, "inputs"?: dict}`` (validated, ARCHITECTURE.md §3).
        ctx: the job context; ``ctx.find_task_run`` is required.

    Returns:
        ``{"raw", "token_usage", "tasks_output": [{"task_id", ...}],
        "json_dict", "pydantic"}``; the task ids are the fresh crew's, so a
        replay's output can itself be replayed once retained.

    Raises:
        InputRejected: no retained run of this crew holds ``task_id``; the
            run's task count differs from the crew's; the crew needs inputs
            and none are known.
        SafeJobError: ``CrewDefinitionChanged``, the crew's definition
            differs from the run's fingerprint (the message says how).
        RuntimeError: the runtime gave no ``find_task_run``.
        JobCancelled: the cancel flag was seen before a model call.
        Exception: CrewAI or provider errors, unchanged.
    """
    task_id = str(input["task_id"])
    if ctx.find_task_run is None:
        raise RuntimeError("replay needs ctx.find_task_run")
    run = await ctx.find_task_run(task_id)
    tasks_output = (run or {}).get("tasks_output") or []
    if not run or not any(str(t.get("task_id")) == task_id for t in tasks_output):
        raise InputRejected(f"task_id {task_id!r} is not a task of a retained run of this crew")
    with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant):
        crew, output = await run_in_worker(ctx, _replay, source, task_id, input, run, ctx)
    return serialize_crew_output(output, crew)


def _replay_inputs(input: dict[str, Any], run: dict[str, Any], crew: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for candidate in (input.get("inputs"), run.get("inputs")):
        if isinstance(candidate, dict):
            inputs = dict(candidate)
            break
    missing = sorted(crew.fetch_inputs() - set(inputs))
    if missing:
        raise InputRejected(
            f"replay of this crew needs 'inputs' with {missing} (the retained run was made without them)"
        )
    return inputs


def _replay(
    source: CrewSource, task_id: str, input: dict[str, Any], run: dict[str, Any], ctx: JobContext
) -> tuple[Any, Any]:
    """Worker thread: build the crew, check its definition, seed its private store, ``crew.replay``."""
    crew = source.job_crew()
    refuse_unusable_crew(crew)
    fingerprint = crew_fingerprint(crew)
    change = fingerprint_change(run.get("fingerprint"), fingerprint)
    if change is not None:
        raise SafeJobError(
            f"the crew's definition changed since the run of task_id {task_id!r}: {change}; "
            "replay it from a run made with the current definition",
            error_type="CrewDefinitionChanged",
            before_any_effect=True,
        )
    tasks_output = run.get("tasks_output") or []
    if len(tasks_output) != len(crew.tasks):
        raise InputRejected(
            f"the retained run of task_id {task_id!r} has {len(tasks_output)} tasks, this crew has {len(crew.tasks)}"
        )
    inputs = _replay_inputs(input, run, crew)
    ctx.run_state[None] = {"inputs": dict(inputs), "fingerprint": fingerprint}
    crew._task_output_handler = RetainedRunStore(seed_records(run, inputs))
    check_cancelled()
    return crew, crew.replay(task_id, inputs=inputs)
