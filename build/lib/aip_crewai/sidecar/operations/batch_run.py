"""Operation ``batch_run``: one fresh crew per input item, run one after another.

Input: ``{"inputs": [object, ...]}`` (1..100 items). Output:
``{"results": [serialized CrewOutput, ...], "count": n}`` in input order.

Every item gets its own crew from the source (``akickoff_for_each`` is not
used: its per-item ``Crew.copy()`` shallow-copies the LLM objects, so the
items would share, and double count, token usage). Items run sequentially: a
failing item stops the batch with its exception and no sibling is left
running; cancelling the job cancels the item in flight (see ``run``). Chunks of
all items go to this job, each carrying its own ``task_id`` and ``batch_item``
(the item's index in ``inputs``, from 0).

Source: ARCHITECTURE.md §3 (batch_run input), §4 (outputs), §5 (never share one
Crew object between batch items).
"""

from __future__ import annotations

from typing import Any

from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.operations._common import crew_fingerprint, serialize_crew_output
from aip_crewai.sidecar.operations.run import kickoff, new_job_crew
from aip_crewai.sidecar.registry import CrewSource


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Run each ``input["inputs"][i]`` on a fresh crew.

    Args:
        source: the crew source.
        input: ``{"inputs": list[dict]}``.
        ctx: the job context.

    Returns:
        ``{"results": list[dict], "count": int}``.

    Raises:
        ValueError: ``inputs`` is not a non-empty list of objects.
        asyncio.CancelledError: the job was cancelled.
        Exception: the first failing item's exception.
    """
    items = input.get("inputs")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ValueError("batch_run input 'inputs' must be a non-empty array of objects")
    results = []
    for index, item in enumerate(items):
        ctx.extra["batch_item"] = index  # each chunk names its item (``_common.chunk_data``'s ``batch_item``)
        crew = await new_job_crew(source, ctx)
        ctx.run_state[index] = {"inputs": dict(item), "fingerprint": crew_fingerprint(crew)}
        output = await kickoff(crew, item, ctx)
        results.append(serialize_crew_output(output, crew))
    return {"results": results, "count": len(results)}
