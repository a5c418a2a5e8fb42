"""CrewAI execution of the startable operations (the only package importing CrewAI).

:func:`execute` dispatches by importing the submodule named exactly after the
operation (``run``, ``batch_run``, ``replay``, ``train``, ``test``,
``knowledge_query``, ``memory_reset``); each exposes
``async def execute(source, input, ctx) -> dict``. There is no second table of
operations: the module is the registration. Submodules whose name starts with
``_`` are helpers, never operations.

The call runs inside :func:`_common.job_scope`, so every operation gets the
per-job chunk sink and the cooperative cancel check without doing anything,
and inside ``knowledge_query.knowledge_namespace(crew_id, tenant)``, so every
Memory and Knowledge CrewAI builds for the job is private to its
``(tenant, crew)`` (docs/security.md "Tenant-scoped crew state"), and with a
human-input provider that never reads stdin (``train`` sets its own).

What CrewAI swallows during the job (a knowledge search or memory failure it
ran on without, a tool error) and the model provider's errors become typed
failures here, at one boundary (:mod:`._swallowed`): a degraded run is never
``completed``; a completed output lists its ``tool_errors``.

Source: ARCHITECTURE.md §3 (operation catalogue), §4 (outputs), §5 (execution).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.registry import CrewSource

_OPERATION = re.compile(r"^[a-z][a-z0-9_]*$")


async def execute(source: CrewSource, operation: str, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Run one operation of one job and return its output.

    Args:
        source: where the job's fresh crew comes from.
        operation: the operation name (a submodule of this package).
        input: the validated operation input (ARCHITECTURE.md §3).
        ctx: the job context (chunk sink, cancel flag, state dir).

    Returns:
        The operation output (JSON-compatible dict, ARCHITECTURE.md §4 Outputs).

    Raises:
        ValueError: ``operation`` names no operation module.
        asyncio.CancelledError: the job's task was cancelled (propagated).
        SafeJobError: ``KnowledgeSearchFailed`` / ``MemoryFailed`` (CrewAI
            ran on without them), ``ProviderError`` (an HTTP status) or
            ``ProviderUnreachable`` (a connection failure); a failure after a
            tool error names the tool and its exception type.
        Exception: whatever else CrewAI raised; the runtime publishes only its
            class with a fixed message.
    """
    module = _operation_module(operation)
    # The whole operation runs in the job's (tenant, crew) namespace: CrewAI may build
    # Memory/Knowledge again after construction (pydantic re-validates a crew on assignment).
    from aip_crewai.sidecar.operations import _swallowed
    from aip_crewai.sidecar.operations._common import job_scope, no_human_input
    from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace

    with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant), no_human_input():
        try:
            result: dict[str, Any] = await module.execute(source, input, ctx)
        except Exception as exc:  # the one boundary where CrewAI's and providers' errors become ours
            typed = _swallowed.failure(exc, ctx)
            if typed is None:
                raise
            raise typed from exc
    degraded = _swallowed.degraded_error(ctx)  # CrewAI carried on without knowledge or memory: not a success
    if degraded is not None:
        raise degraded
    if _swallowed.tool_errors(ctx):
        result = {**result, "tool_errors": _swallowed.tool_errors(ctx)}
    return result


def _operation_module(operation: str) -> Any:
    if not isinstance(operation, str) or not _OPERATION.match(operation):
        raise ValueError(f"unknown operation {operation!r}")
    name = f"{__name__}.{operation}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            raise ValueError(f"unknown operation {operation!r}") from None
        raise
    if not callable(getattr(module, "execute", None)):
        raise ValueError(f"unknown operation {operation!r}")
    return module
