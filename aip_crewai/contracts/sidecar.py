"""Wire types of the sidecar HTTP contract (peer-compatible).

Source: DESIGN.md §4. The request types ignore unknown fields on purpose: the
sidecar must accept what the public reference host sends, and a newer host
may add fields (evolution by addition). Everything else is validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .inputs import NO_CONTROL, Reason, RunActionId

#: Execution timeout bounds, milliseconds (DESIGN.md §5).
DEFAULT_TIMEOUT_MS = 600_000
MAX_TIMEOUT_MS = 3_600_000
#: Sidecar output bound, bytes (DESIGN.md §4).
MAX_OUTPUT_BYTES = 4 * 1024 * 1024
#: Idempotency-Key header bound, bytes (DESIGN.md §4, §7).
MAX_IDEMPOTENCY_KEY_BYTES = 512

TimeoutMs = Annotated[int, msgspec.Meta(ge=1, le=MAX_TIMEOUT_MS, description="Execution timeout, milliseconds, 1..3600000.")]
CrewId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=NO_CONTROL)]

JobStatus = Literal["queued", "running", "completed", "failed", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
TERMINAL_EVENTS: frozenset[str] = TERMINAL_STATUSES


class JobRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /jobs`` and ``POST /jobs/stream``."""

    crew_id: CrewId
    action_id: RunActionId
    operation: str = "run"
    input: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout_ms: TimeoutMs | None = None


class CancelRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /jobs/{action_id}/cancel``; ``action_id`` must equal the path id."""

    crew_id: CrewId
    action_id: RunActionId
    reason: Reason | None = None


class JobEvent(msgspec.Struct, frozen=True):
    """One journal event: ``sequence`` is its 0-based index, strictly increasing.

    ``event`` is one of started, chunk, completed, failed, cancelled.
    """

    event: str
    sequence: int
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS


class JobView(msgspec.Struct, frozen=True):
    """``GET /jobs/{action_id}``. ``error`` (the failed event's data),
    ``provider_stop_observed`` (None until a stopped worker returned),
    ``uncertain_outcome`` (cancelled jobs: False only once the stop is
    confirmed: the worker returned on it, so no model call or tool follows) and
    ``dropped_events`` (chunks past the per-run bound) are our additions."""

    action_id: str
    crew_id: str
    operation: str
    status: str
    event_count: int
    output: Any = None
    error: dict[str, Any] | None = None
    provider_stop_observed: bool | None = None
    uncertain_outcome: bool | None = None
    dropped_events: int = 0


class EventsPage(msgspec.Struct, frozen=True):
    """``GET /jobs/{action_id}/events?cursor=N`` as JSON."""

    action_id: str
    cursor: int
    next_cursor: int
    status: str
    events: list[JobEvent]


class HealthView(msgspec.Struct, frozen=True):
    """``GET /health``. ``status`` is ``ready``; ``stopping`` while a SIGTERM
    drains in-flight jobs (new admissions then get 503); ``degraded`` after a
    journal write failure, until an unrecorded result is written (new
    admissions then get 507, and the host reports unready)."""

    status: str
    crews: list[str]
    active_runs: int
    retained_runs: int
    max_retained_runs: int
    durable_journal: bool
    stream_checkpoint_events: int
    operations: list[str]
    training_directory: bool


class ErrorBody(msgspec.Struct, frozen=True):
    """Every sidecar error body: ``{"detail": "<message>"}``."""

    detail: str
