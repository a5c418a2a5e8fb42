"""The seam between the sidecar runtime (journal, HTTP) and the CrewAI adapter.

The runtime builds one :class:`JobContext` per admitted job and hands it to
``aip_crewai.sidecar.operations.execute``. The adapter never sees the journal or
HTTP; the runtime never imports CrewAI.

Source: ARCHITECTURE.md §5 (per-job event capture, cooperative cancellation).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JobCancelled(Exception):
    """Raised inside a worker (from the offline LLM or a before-call hook) once
    the job's cancel flag is set, so synchronous CrewAI work stops at its next
    model call. Source: ARCHITECTURE.md §5 (cancellation)."""


@dataclass
class JobContext:
    """Everything one job's CrewAI work may touch.

    Attributes:
        action_id: the job identity (AIP action id).
        crew_id: the admitted crew id.
        operation: one of the seven startable operations.
        emit_chunk: ``emit_chunk(data)`` appends a ``chunk`` event whose data is
            ``{"content": str, "channel": "llm"|"tools", "task_id"?: str,
            "agent_role"?: str}``. Safe to call from any thread; fast; never
            raises. Events past the per-run bound are dropped by the runtime.
        cancel_flag: set by the runtime when the job is cancelled; worker-thread
            operations check it before every model call and raise
            :class:`JobCancelled`.
        state_dir: the sidecar state directory (CrewAI storage lives under it).
        training_dir: directory for train artifacts, or None when train is off.
        find_task_run: ``await find_task_run(task_id)`` returns the stored
            output (serialized CrewOutput dict) of a retained run of THIS crew
            whose ``tasks_output`` holds that task id, or None.
        tenant: the job's tenant (``tenancy.tenant_of`` of its job id; ``""``
            for job ids without one); every piece of crew state the job
            touches is kept per ``(tenant, crew_id)``.
        run_state: set by run, batch_run and replay for the runtime to keep
            with a completed job (what a later replay of it needs): result
            index (None: the job's own output; a batch item's index) ->
            ``{"inputs": dict, "fingerprint": list}``. Crew inputs: the
            runtime keeps them in the journal only, never in logs.
        stop_observed: set True by the adapter when a cancelled worker really
            stopped at a model call (recorded on the ``cancelled`` event).
        note_dropped: ``note_dropped(n)`` counts ``n`` chunks a worker process
            dropped itself at the per-job event bound (process isolation,
            ARCHITECTURE.md §5 "Isolation"); None in-process.
        traceparent: the W3C ``traceparent`` of the job's span (a worker's spans continue it), or None.
        spans: the job's :class:`~aip_crewai.sidecar.tracing.CrewSpans` (CrewAI's events as spans), or
            None when tracing is off (docs/observing.md "Observing actions").
    """

    action_id: str
    crew_id: str
    operation: str
    emit_chunk: Callable[[dict[str, Any]], None]
    cancel_flag: threading.Event
    state_dir: Path
    training_dir: Path | None = None
    find_task_run: Callable[[str], Awaitable[dict[str, Any] | None]] | None = None
    stop_observed: bool = False
    tenant: str = ""
    run_state: dict[int | None, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    note_dropped: Callable[[int], None] | None = None
    traceparent: str | None = None
    spans: Any = None


#: Published instead of any exception text that is not a SafeJobError.
GENERIC_FAILURE = "the operation raised an error; its text is withheld (it can hold provider secrets)"
#: Operations whose asyncio task is cancelled in-process (natively async CrewAI calls); the
#: others stop at their next model call. Source: ARCHITECTURE.md §5 (cancellation).
TASK_CANCELLED_OPERATIONS = frozenset({"run", "batch_run"})


class SafeJobError(Exception):
    """A job failure whose message is safe to publish on the ``failed`` event
    (it names our own rule or target, never provider text), e.g.
    "memory_reset target 'memory' is not initialized". Any other exception is
    published with a fixed generic message.

    ``before_any_effect=True`` says the job failed before any model call, tool
    or state change (a refusal at its start), so its ``failed`` event carries
    ``uncertain_outcome: false`` even for a mutation; ``uncertain`` (when not
    None) sets ``uncertain_outcome`` outright (a worker process that died:
    True). Source: ARCHITECTURE.md §4 (events), §5 (isolation)."""

    def __init__(
        self,
        message: str,
        error_type: str = "SafeJobError",
        *,
        before_any_effect: bool = False,
        uncertain: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type
        self.before_any_effect = before_any_effect
        #: Overrides the ``uncertain_outcome`` the runtime derives (a dead worker: always True).
        self.uncertain = uncertain


class InputRejected(SafeJobError):
    """The input cannot apply to this crew (e.g. a replay task id that belongs
    to no retained run of the crew). The runtime answers it at admission time
    where it can (a typed 4xx) and otherwise fails the job with this message."""

    def __init__(self, message: str, error_type: str = "SafeJobError") -> None:
        super().__init__(message, error_type, before_any_effect=True)
