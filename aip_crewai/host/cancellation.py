"""Runtime cancellation of an action by its own tenant: the outcomes of the
DESIGN.md §8 table, by operation and by how far the dispatch got.

Functions take the :class:`~aip_crewai.host.actions.ActionService` first;
:meth:`ActionService.cancel` calls them.

Source: DESIGN.md §8 (cancellation outcomes).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..contracts import operations as ops
from ..contracts.aip import ActionResult
from ..contracts.errors import AipError, ConnectorCancelledUnconfirmed, NotCancellable
from .auth import Principal
from .dispatch import Job
from .live import LiveAction
from .normalize import failed_result
from .store import ActionState

if TYPE_CHECKING:
    from .actions import ActionService

#: Action statuses after which nothing changes.
TERMINAL = ("completed", "failed", "cancelled")


async def cancel(service: ActionService, caller: Principal, action_id: str) -> ActionResult:
    """Runtime cancellation by the action's own tenant (DESIGN.md §8 table)."""
    record = await service.get(caller, action_id)
    spec = ops.get(record.operation)
    if record.status in TERMINAL:
        result = await service.result(record)
        if result is not None:
            return result
    if spec.name in ("memory_reset", "cancel"):
        raise NotCancellable(details={"operation": spec.name})
    if record.status == "pending_approval":
        result = ActionResult(action_id=action_id, status="cancelled",
                              output={"remote_stop_confirmed": False, "provider_effect": "none"})
        # Only while still pending: an approval that started the action meanwhile wins the row, and the
        # action is then cancelled as the running action it now is (never "nothing happened" for a job that runs).
        if await service._finish(record.tenant, action_id, result, None, only_from=ActionState.PENDING_APPROVAL):
            return (await service.result(await service._get(record.tenant, action_id))) or result
        record = await service._get(record.tenant, action_id)
        if record.status != "running":
            return (await service.result(record)) or result
    live = service.live.get(record.tenant, action_id)
    if spec.read_only:
        if live is not None and live.task is not None:
            live.task.cancel()
        output = {"remote_stop_confirmed": False, "provider_effect": "read_only", "completion_unobserved": True}
        if spec.name == "events":
            output = {"stream_detached": True, **output}
        result = ActionResult(action_id=action_id, status="cancelled", output=output)  # type: ignore[arg-type]
        await service._finish(record.tenant, action_id, result, None)
        return (await service.result(await service._get(record.tenant, action_id))) or result
    job = live.job if live is not None else service._job(record, stream=True)
    if live is not None and live.task is not None:
        await _until_answered(live)  # a start still in flight may be admitted after a cancel would arrive
    confirmed, view = await service.dispatcher.cancel_remote(job)
    if confirmed and live is not None and live.task is not None:
        # The sidecar records `cancelled`; the stream ends with it. Give it a moment, then detach.
        done, _ = await asyncio.wait({live.task}, timeout=10)
        if not done:
            live.task.cancel()
    record = await service._get(record.tenant, action_id)
    if record.status in TERMINAL:
        return (await service.result(record)) or ActionResult(action_id=action_id, status="cancelled")  # type: ignore[arg-type]
    ended = await ended_before_cancel(service, job, view) if confirmed else None
    if ended is not None:  # the job finished before the cancel reached it: its real outcome, not `cancelled`
        result = ended
    elif confirmed:
        output = {"remote_stop_confirmed": True,
                  "provider_stop_observed": bool((view or {}).get("provider_stop_observed", False))}
        result = ActionResult(action_id=action_id, status="cancelled", output=output)
    else:
        if live is not None and live.task is not None:
            live.task.cancel()
        result = failed_result(action_id, ConnectorCancelledUnconfirmed(
            operation=spec.name, uncertain_outcome=True, dispatch=record.dispatch))
    await service._finish(record.tenant, action_id, result, None)
    return (await service.result(await service._get(record.tenant, action_id))) or result


async def ended_before_cancel(service: ActionService, job: Job, view: dict[str, Any] | None) -> ActionResult | None:
    """The sidecar's own terminal result when the cancel found the job already
    completed or failed (None otherwise, or when it cannot be read)."""
    if (view or {}).get("status") not in ("completed", "failed"):
        return None
    from .normalize import result_from_terminal

    try:
        terminal = await service.dispatcher.terminal_event(job)
    except AipError:
        return None
    return None if terminal is None else result_from_terminal(job.action_id, job.spec, terminal)


async def _until_answered(live: LiveAction, bound_s: float = 10.0) -> None:
    """Wait (bounded) until the live dispatch's start request was answered
    (``acknowledged``) or the dispatch ended: the sidecar admits a job before
    it answers, so until then (the request in flight, or not even sent yet
    because the dispatch task has not run) a cancel may get 404 for a job that
    is admitted a moment later and then runs unseen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while live.job.dispatch.state != "acknowledged" and live.task is not None and not live.task.done() \
            and loop.time() < deadline:
        await asyncio.sleep(0.005)
