"""Wire types of the sidecar HTTP contract (peer-compatible).

Source: ARCHITECTURE.md §4. The request types ignore unknown fields on purpose: the
sidecar must accept what the public reference host sends, and a newer host
may add fields (evolution by addition). Everything else is validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .inputs import NO_CONTROL, Reason, RunActionId

#: Execution timeout bounds, milliseconds (ARCHITECTURE.md §5).
DEFAULT_TIMEOUT_MS = 600_000
MAX_TIMEOUT_MS = 3_600_000
#: Sidecar output bound, bytes (ARCHITECTURE.md §4).
MAX_OUTPUT_BYTES = 4 * 1024 * 1024
#: Idempotency-Key header bound, bytes (ARCHITECTURE.md §4, §7).
MAX_IDEMPOTENCY_KEY_BYTES = 512

TimeoutMs = Annotated[
    int, msgspec.Meta(ge=1, le=MAX_TIMEOUT_MS, description="Execution timeout, milliseconds, 1..3600000.")
]
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
