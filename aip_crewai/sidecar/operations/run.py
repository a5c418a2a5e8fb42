"""Operation ``run``: one ``akickoff`` on a fresh crew, chunks streamed per job.

Input: the free-form object passed as CrewAI ``inputs``. Output: the
serialized CrewOutput (:func:`_common.serialize_crew_output`).

The crew is built by :func:`new_job_crew` (worker thread, crew-private
knowledge collections).

Streaming: chunks reach the job only through the per-job stream sink of
:func:`_common.job_scope` (the dispatcher enters it). The crew runs with
``stream=False`` while every agent LLM gets ``stream=True``: CrewAI's own
``CrewStreamingOutput`` would add a process-wide event-bus handler per run and
a second path for the same chunks, so it is not used.

Cancellation: the runtime cancels the asyncio task; ``asyncio.CancelledError``
propagates. CrewAI 1.15 runs each agent step (a sync Flow method) through
``asyncio.to_thread``, so the model call in flight keeps running in its worker
thread after the task is cancelled; :func:`kickoff` therefore also sets
``ctx.cancel_flag``, which makes that call stop at its next chunk or model call
(offline LLM, global ``before_llm_call`` hook) and mutes its chunks.

Replay state: the job's inputs and the crew's fingerprint
(``_common.crew_fingerprint``, taken before kickoff interpolates the texts)
go to ``ctx.run_state``; the runtime keeps them with the completed job for
``replay``.

Source: ARCHITECTURE.md §4 (outputs: run), §5 (fresh crew per job; run is
cancelled through its asyncio task).
"""

from __future__ import annotations

import asyncio
from typing import Any

from crewai import CrewOutput
from crewai.crews.utils import enable_agent_streaming

from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.operations._common import crew_fingerprint, serialize_crew_output
from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
from aip_crewai.sidecar.operations.startup.crew_checks import refuse_unusable_crew
from aip_crewai.sidecar.registry import CrewSource


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Kick off a fresh crew with ``input`` as CrewAI inputs.

    Args:
        source: the crew source (factory or template).
        input: CrewAI ``inputs`` (an object, at most 512 properties).
        ctx: the job context.

    Returns:
        ``{"raw", "token_usage", "tasks_output": [{"task_id", ...}],
        "json_dict", "pydantic"}``.

    Raises:
        asyncio.CancelledError: the job was cancelled.
        SafeJobError: ``HumanInputUnsupported``: a task has ``human_input=True``
            (before any model call).
        Exception: the crew failed (CrewAI or provider error, unchanged).
    """
    crew = await new_job_crew(source, ctx)
    ctx.run_state[None] = {"inputs": dict(input), "fingerprint": crew_fingerprint(crew)}
    output = await kickoff(crew, input, ctx)
    return serialize_crew_output(output, crew)


async def new_job_crew(source: CrewSource, ctx: JobContext) -> Any:
    """Build the job's fresh crew in a worker thread, knowledge private to the crew id.

    A factory may embed knowledge (Chroma I/O) at construction, so it does not
    run on the event loop; ``knowledge_namespace`` gives the ``Knowledge``
    objects CrewAI builds from ``knowledge_sources`` a collection private to
    ``ctx.crew_id`` (see ``knowledge_query``).
    """

    def build() -> Any:
        with knowledge_namespace(ctx.crew_id, ctx.tenant):
            crew = source.job_crew()
        refuse_unusable_crew(crew)
        return crew

    return await asyncio.to_thread(build)


async def kickoff(crew: Any, inputs: dict[str, Any], ctx: JobContext) -> Any:
    """``await crew.akickoff(inputs)`` with per-job streaming and a clean cancel.

    Args:
        crew: a crew no other job uses.
        inputs: CrewAI inputs (copied; the caller's dict is not modified).
        ctx: the job context; its ``cancel_flag`` is set if the task is cancelled.

    Returns:
        The ``CrewOutput``.

    Raises:
        asyncio.CancelledError: propagated after setting ``ctx.cancel_flag``.
        TypeError: CrewAI returned something other than a CrewOutput.
    """
    crew.stream = False
    enable_agent_streaming(crew.agents)
    try:
        output = await crew.akickoff(inputs=dict(inputs))
    except asyncio.CancelledError:
        ctx.cancel_flag.set()
        raise
    if not isinstance(output, CrewOutput):
        raise TypeError(f"akickoff returned {type(output).__name__}, not CrewOutput")
    return output
