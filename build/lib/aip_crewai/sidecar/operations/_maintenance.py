"""Helpers shared by the maintenance operations (replay, train, test, knowledge_query, memory_reset).

- :func:`crew_option`: deployment options carried by a registry entry.
- :func:`run_in_worker`: run synchronous CrewAI work in a worker thread of
  the job's context and report a cooperative stop as :class:`JobCancelled`.

Source: ARCHITECTURE.md §5 (worker threads, cooperative cancel).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from aip_crewai.sidecar.jobs.context import JobCancelled, JobContext
from aip_crewai.sidecar.registry import CrewSource

T = TypeVar("T")

#: Attribute of a registry entry (factory function or template crew) holding its options.
OPTIONS_ATTRIBUTE = "aip_crewai_options"


def crew_option(source: CrewSource, name: str, default: Any = None) -> Any:
    """Read a deployment option of a crew.

    Options live in a mapping attribute ``aip_crewai_options`` of the
    registry entry: the factory function, or the template crew (a ``Crew``
    subclass declaring that field). Keys used: ``training_feedback`` (str,
    ``train``) and ``eval_llm`` (``test``); see ``aip_crewai/examples/maintenance_crews.py``.

    Returns:
        The option's value, or ``default`` when absent.
    """
    holder = source.factory if source.factory is not None else source.template
    options = getattr(holder, OPTIONS_ATTRIBUTE, None)
    if isinstance(options, dict) and name in options:
        return options[name]
    return default


async def run_in_worker(ctx: JobContext, fn: Callable[..., T], *args: Any) -> T:
    """``await asyncio.to_thread(fn, *args)``, with a cooperative stop made explicit.

    Call it inside ``job_scope(ctx)`` (the thread inherits the context: chunk
    sink, cancel check). When the worker stopped because the job was
    cancelled, CrewAI usually wraps that stop in its own error (the agent
    retries the call, the ``before_llm_call`` hook blocks it, and the agent
    raises ``ValueError("LLM call blocked by before_llm_call hook")``); that
    error is re-raised as :class:`JobCancelled`.

    Raises:
        JobCancelled: the job's cancel flag was set and a stop was observed.
        Exception: anything else ``fn`` raised, unchanged.
    """
    try:
        return await asyncio.to_thread(fn, *args)
    except JobCancelled:
        raise
    except Exception as exc:
        if ctx.cancel_flag.is_set() and ctx.stop_observed:
            raise JobCancelled(f"job {ctx.action_id} was cancelled") from exc
        raise
