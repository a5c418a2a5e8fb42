"""What CrewAI swallows during a job, made visible: knowledge, memory and tool failures, provider errors.

CrewAI 1.15.5 keeps a run going through failures it only logs or emits as
events: a knowledge search that raises (``agent/utils.py::ahandle_knowledge_retrieval``
catches it, emits ``KnowledgeSearchQueryFailedEvent`` and runs without the
knowledge), a failed knowledge query rewrite (``KnowledgeQueryFailedEvent``),
a memory query or save that fails (``Memory*FailedEvent``), a tool that raises
(``ToolUsageErrorEvent``; the model gets the error text and carries on). A
job that ends ``completed`` after the first two kinds ran silently degraded.

The job's stream sink (``_common.job_scope``) hands every event emitted in the
job's context to :func:`note`, which records in ``ctx.extra``:

- a knowledge or memory failure (:data:`DEGRADING_EVENTS`): the operation
  then fails with :func:`degraded_error` (``KnowledgeSearchFailed`` /
  ``MemoryFailed``, a fixed message) even if CrewAI returned an output;
- a tool error: ``{"tool", "error_type"}``, added to a completed output as
  ``tool_errors`` and named by a failure's message (:func:`tool_error_summary`);
- that a tool started (a failure after it may have had an effect).

:func:`provider_error` turns the model provider's exceptions (the OpenAI SDK's
status and connection errors, CrewAI's ``ConnectionError`` wrapping them,
httpx's) into a :class:`SafeJobError` whose message names the HTTP status or
the connection failure, never the provider's text (it can quote keys).

Source: docs/tutorial.md ("Real crews": what a run never hides); ARCHITECTURE.md §5 (CrewAI knowledge).
"""

from __future__ import annotations

from typing import Any

from crewai.events.types.knowledge_events import KnowledgeQueryFailedEvent, KnowledgeSearchQueryFailedEvent
from crewai.events.types.memory_events import (
    MemoryQueryFailedEvent,
    MemoryRetrievalFailedEvent,
    MemorySaveFailedEvent,
)
from crewai.events.types.tool_usage_events import ToolUsageErrorEvent, ToolUsageStartedEvent

from aip_crewai.sidecar.jobs.context import JobCancelled, JobContext, SafeJobError

#: Event class -> the error type a job fails with when CrewAI emitted it and carried on.
DEGRADING_EVENTS: dict[type, str] = {
    KnowledgeSearchQueryFailedEvent: "KnowledgeSearchFailed",
    KnowledgeQueryFailedEvent: "KnowledgeSearchFailed",
    MemoryQueryFailedEvent: "MemoryFailed",
    MemoryRetrievalFailedEvent: "MemoryFailed",
    MemorySaveFailedEvent: "MemoryFailed",
}
DEGRADED_MESSAGES = {
    "KnowledgeSearchFailed": (
        "the crew's knowledge could not be searched during the run (CrewAI would have run "
        "without it); the error text is withheld"
    ),
    "MemoryFailed": "the crew's memory failed during the run (CrewAI would have run without it); the error text is withheld",
}
#: At most this many tool errors are kept per job.
MAX_TOOL_ERRORS = 20
_DEGRADED, _TOOL_ERRORS, _TOOL_STARTED = "aip_crewai_degraded", "aip_crewai_tool_errors", "aip_crewai_tool_started"


def note(ctx: JobContext, event: Any) -> None:
    """Record what ``event`` says CrewAI swallowed (see the module docstring). Fast; never raises."""
    kind = DEGRADING_EVENTS.get(type(event))
    if kind is not None:
        ctx.extra.setdefault(_DEGRADED, kind)
    elif isinstance(event, ToolUsageStartedEvent):
        ctx.extra[_TOOL_STARTED] = True
    elif isinstance(event, ToolUsageErrorEvent):
        errors = ctx.extra.setdefault(_TOOL_ERRORS, [])
        if len(errors) < MAX_TOOL_ERRORS:
            error = event.error
            errors.append(
                {
                    "tool": str(event.tool_name)[:256],
                    "error_type": type(error).__name__ if isinstance(error, BaseException) else "error",
                }
            )


def degraded_error(ctx: JobContext) -> SafeJobError | None:
    """The failure of a job during which CrewAI swallowed a knowledge or memory failure, else None."""
    kind = ctx.extra.get(_DEGRADED)
    if kind is None:
        return None
    return SafeJobError(DEGRADED_MESSAGES[kind], error_type=kind, uncertain=_uncertain(ctx))


def tool_errors(ctx: JobContext) -> list[dict[str, str]]:
    """``[{"tool", "error_type"}, ...]`` of the tools that raised during the job, in order."""
    return list(ctx.extra.get(_TOOL_ERRORS, []))


def tool_error_summary(ctx: JobContext) -> str:
    """``"; tool 'x' raised ValueError"`` for each tool error (``""`` without any)."""
    return "".join(f"; tool {e['tool']!r} raised {e['error_type']}" for e in tool_errors(ctx))


def _uncertain(ctx: JobContext) -> bool | None:
    """False when no tool started (a failed run then changed nothing outside); None: the runtime decides."""
    return None if ctx.extra.get(_TOOL_STARTED) else False


#: How deep :func:`provider_error` follows ``__cause__`` / ``__context__``.
MAX_CHAIN = 12


def provider_error(exc: BaseException, ctx: JobContext) -> SafeJobError | None:
    """A typed, publishable failure for a model provider's error in ``exc``'s chain, else None.

    Returns:
        ``ProviderError`` ("the model provider answered HTTP 503") for a status error,
        ``ProviderUnreachable`` ("the model provider could not be reached (APIConnectionError)")
        for a connection or timeout error; the message ends with :func:`tool_error_summary`.
    """
    import httpx
    import openai

    chain = _chain(exc)
    status = next((e for e in chain if isinstance(e, openai.APIStatusError)), None)
    if status is not None:
        return SafeJobError(
            f"the model provider answered HTTP {status.status_code}{tool_error_summary(ctx)}",
            error_type="ProviderError",
            uncertain=_uncertain(ctx),
        )
    timeout = next((e for e in chain if isinstance(e, openai.APITimeoutError | httpx.TimeoutException)), None)
    if timeout is not None:
        return SafeJobError(
            f"the model provider did not answer in time ({type(timeout).__name__}){tool_error_summary(ctx)}",
            error_type="ProviderUnreachable",
            uncertain=_uncertain(ctx),
        )
    # the most specific first: the SDK's or httpx's error, then CrewAI's ConnectionError around it
    connection: BaseException | None = next(
        (e for e in chain if isinstance(e, openai.APIConnectionError | httpx.TransportError)), None
    )
    connection = connection or next((e for e in chain if isinstance(e, ConnectionError)), None)
    if connection is not None:
        return SafeJobError(
            f"the model provider could not be reached (connection failed: "
            f"{type(connection).__name__}){tool_error_summary(ctx)}",
            error_type="ProviderUnreachable",
            uncertain=_uncertain(ctx),
        )
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes and contexts, outermost first (at most :data:`MAX_CHAIN`)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain) and len(chain) < MAX_CHAIN:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def failure(exc: Exception, ctx: JobContext) -> SafeJobError | None:
    """The typed failure to publish instead of ``exc`` (None: keep ``exc``): a swallowed knowledge or memory
    failure first (the likelier root cause), then a provider error, then a tool error naming the tool."""
    if isinstance(exc, SafeJobError | JobCancelled) or ctx.cancel_flag.is_set():
        return None  # already typed, or a cancelled job: its stop is the outcome, not what failed meanwhile
    found = degraded_error(ctx) or provider_error(exc, ctx)
    if found is None and tool_errors(ctx):
        found = SafeJobError(
            f"the crew failed after a tool error{tool_error_summary(ctx)}",
            error_type=type(exc).__name__,
            uncertain=_uncertain(ctx),
        )
    return found
