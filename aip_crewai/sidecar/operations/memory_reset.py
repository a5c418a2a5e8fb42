"""Operation ``memory_reset``: reset one storage target of a crew, never more.

Input ``{command_type}``: ``memory``, ``knowledge``, ``agent_knowledge``,
``kickoff_outputs`` or ``all``. Output ``{"status": "completed",
"command_type", "reset_targets": [...]}``: the single target, or for ``all``
the initialized targets that were reset, in CrewAI's order (``memory``,
``kickoff_outputs``, ``knowledge``, ``agent_knowledge``).

CrewAI 1.15.5 ``Crew.reset_memories`` (``crew.py``) is used for
``kickoff_outputs``, ``knowledge`` and ``agent_knowledge``, with the crew
prepared so that none of them reaches beyond this crew:

- ``memory``: CrewAI calls ``Memory.reset_all()``, which drops the whole
  LanceDB table of the storage dir (``<storage>/memory``): every crew's
  memories. We call ``Memory.reset()`` instead, which deletes only the
  crew's ``root_scope`` (``/crew/<crew name>``; a user-supplied
  ``MemoryScope``/``MemorySlice`` resets its own scope). CrewAI scopes memory
  by crew *name* (default ``"crew"``): give registered crews distinct names.
- ``knowledge``/``agent_knowledge``: CrewAI's collection names (``crew``, the
  agent role) are shared by every crew of the storage dir; the crew is built
  inside ``knowledge_query.knowledge_namespace`` so its collections, and
  hence the reset, are private to the crew id.
- ``agent_knowledge``: CrewAI only builds agent knowledge at kickoff
  (``Agent.set_knowledge``), so on a fresh crew it would never be
  "initialized". Agents that declare ``knowledge_sources`` get it built here
  exactly as kickoff would (embedding their sources), then reset.
- ``kickoff_outputs``: CrewAI's shared replay table. Our ``replay`` never
  reads it (it replays retained runs from a job-private store), so resetting
  it cannot break replay.

A target that is not initialized fails the job with :class:`SafeJobError`
naming it (CrewAI's RuntimeError text is not published); nothing else is
reset in its place. Knowledge is re-embedded from the crew's sources whenever
a crew is built, so a knowledge reset lasts until the next job of the crew.

Source: ARCHITECTURE.md §3 (memory_reset input), §4 (outputs), §8 (not
cancellable); ARCHITECTURE.md §5 (reset_memories).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aip_crewai.sidecar.jobs.context import InputRejected, JobContext, SafeJobError
from aip_crewai.sidecar.operations._common import job_scope
from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
from aip_crewai.sidecar.registry import CrewSource

#: Single targets in CrewAI's ``_get_memory_systems`` order (``all`` resets them in turn).
TARGETS = ("memory", "kickoff_outputs", "knowledge", "agent_knowledge")
COMMAND_TYPES = frozenset((*TARGETS, "all"))


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Reset ``command_type`` of a fresh crew of ``source``.

    Args:
        source: the crew source.
        input: ``{"command_type": "memory"|"knowledge"|"agent_knowledge"|
            "kickoff_outputs"|"all"}``.
        ctx: the job context.

    Returns:
        ``{"status": "completed", "command_type": str, "reset_targets": [str]}``.

    Raises:
        InputRejected: unknown ``command_type``.
        SafeJobError: the target is not initialized for this crew (``all``
            skips such targets instead).
        Exception: a storage error during the reset, unchanged.
    """
    command_type = str(input["command_type"])
    if command_type not in COMMAND_TYPES:
        raise InputRejected(f"unknown memory_reset command_type {command_type!r}")
    with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant):
        targets = await asyncio.to_thread(_reset, source, command_type)
    return {"status": "completed", "command_type": command_type, "reset_targets": targets}


def _reset(source: CrewSource, command_type: str) -> list[str]:
    """Worker thread: build a fresh crew, prepare its targets, reset."""
    crew = source.job_crew()
    if command_type in ("knowledge", "agent_knowledge", "all"):
        _build_agent_knowledge(crew)
    initialized = [t for t in TARGETS if _initialized(crew, t)]
    if command_type != "all":
        if command_type not in initialized:
            raise SafeJobError(f"memory_reset target {command_type!r} is not initialized", before_any_effect=True)
        initialized = [command_type]
    for target in initialized:
        if target == "memory":
            crew._memory.reset()
        elif target == "agent_knowledge" and "knowledge" in initialized:
            continue  # CrewAI's "knowledge" reset already covers agent knowledge
        else:
            crew.reset_memories(target)
    return initialized


def _initialized(crew: Any, target: str) -> bool:
    if target == "memory":
        return getattr(crew, "_memory", None) is not None
    if target == "kickoff_outputs":
        return getattr(crew, "_task_output_handler", None) is not None
    agent_knowledge = any(getattr(a, "knowledge", None) is not None for a in crew.agents)
    if target == "agent_knowledge":
        return agent_knowledge
    return getattr(crew, "knowledge", None) is not None or agent_knowledge


def _build_agent_knowledge(crew: Any) -> None:
    """Initialize agent knowledge as kickoff would (``Agent.set_knowledge``).

    Embeds the agent's sources into its (namespaced) collection, so the
    collection exists when it is reset.
    """
    for agent in crew.agents:
        if getattr(agent, "knowledge", None) is None and getattr(agent, "knowledge_sources", None):
            agent.set_knowledge(crew_embedder=crew.embedder)
