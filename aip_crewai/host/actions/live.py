"""In-process registry of actions being dispatched by this host process.

A :class:`LiveAction` holds the dispatch task and a change signal; followers
(SSE streams, duplicate blocking callers) read chunks and results from the
store and wait on the signal between reads, so the store stays the single
source of truth and a follower never misses or repeats a chunk: it takes
:attr:`LiveAction.version` before reading and waits only for a change after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...plumbing.wakeup import ChangeSignal
from ..store.store import ActionRecord
from .dispatch import Job


@dataclass
class LiveAction:
    """One action whose dispatch task runs in this process."""

    job: Job
    task: asyncio.Task[None] | None = None
    #: The record as the dispatch's own result write left it (None until then,
    #: and when another writer, e.g. a cancel, ended the action first).
    final: ActionRecord | None = None
    #: The change signal (:class:`~aip_crewai.plumbing.wakeup.ChangeSignal`): a follower
    #: reads :attr:`version` BEFORE reading the store and passes it to
    #: :meth:`wait`, so a change between its read and its wait is never missed.
    signal: ChangeSignal = field(default_factory=ChangeSignal)
    #: True only while the dispatch sleeps before retrying a start the sidecar did not admit:
    #: cancelling the task then stops it before anything is sent (ARCHITECTURE.md §8 ``dequeue``).
    retry_waiting: bool = False
    #: The fencing token the dispatch (or restart follower) took with the action's lease (None: no lease,
    #: a store without host id); every write it makes carries it (ARCHITECTURE.md §10, dispatch leases).
    lease_token: int | None = None

    @property
    def version(self) -> int:
        return self.signal.version

    def notify(self) -> None:
        """Wake every waiter (new chunks or a result are in the store)."""
        self.signal.notify()

    async def wait(self, timeout_s: float, *, seen: int | None = None) -> bool:
        """Wait for a change after ``seen`` (see :meth:`ChangeSignal.wait`); False on timeout."""
        return await self.signal.wait(timeout_s, seen=seen)


#: The first pause before a restart follower that ended without a result may follow the same action again,
#: seconds; it doubles per attempt up to :data:`FOLLOW_BACKOFF_MAX_S`.
FOLLOW_BACKOFF_S = 0.5
#: The longest such pause, seconds (the reconciler's period, ARCHITECTURE.md §9).
FOLLOW_BACKOFF_MAX_S = 5.0
#: Pauses kept before those long past are forgotten (an action ended by another writer keeps its entry).
MAX_PAUSED = 1024


class LiveRegistry:
    """(tenant, action_id) → LiveAction for dispatches running here, and when an action whose restart
    follower ended without a result (its sidecar unreachable) may be followed again."""

    def __init__(self) -> None:
        self._items: dict[tuple[str, str], LiveAction] = {}
        self._paused: dict[tuple[str, str], tuple[float, float]] = {}  # → (not before, loop time; last pause, s)

    def may_follow(self, tenant: str, action_id: str, now: float) -> bool:
        """Whether a restart follower may start now (``now``: the event loop's clock, seconds)."""
        paused = self._paused.get((tenant, action_id))
        return paused is None or now >= paused[0]

    def follow_failed(self, tenant: str, action_id: str, now: float) -> float:
        """A restart follower ended without a result: the next may start only after a pause (0.5 s, doubling
        to 5 s), so a tenant waiting on the action and the reconciler never re-follow it in a tight loop
        while its sidecar cannot be reached. Returns the pause, seconds."""
        if len(self._paused) >= MAX_PAUSED:  # actions ended by another writer: forget pauses long past
            self._paused = {k: v for k, v in self._paused.items() if v[0] > now - FOLLOW_BACKOFF_MAX_S}
        last = self._paused.get((tenant, action_id), (0.0, 0.0))[1]
        pause = min(FOLLOW_BACKOFF_MAX_S, last * 2 if last else FOLLOW_BACKOFF_S)
        self._paused[(tenant, action_id)] = (now + pause, pause)
        return pause

    def follow_ended(self, tenant: str, action_id: str) -> None:
        """A restart follower stored the action's result: no pause is kept for it."""
        self._paused.pop((tenant, action_id), None)

    def get(self, tenant: str, action_id: str) -> LiveAction | None:
        return self._items.get((tenant, action_id))

    def add(self, live: LiveAction) -> None:
        self._items[(live.job.tenant, live.job.action_id)] = live

    def remove(self, tenant: str, action_id: str) -> None:
        self._items.pop((tenant, action_id), None)

    def placed_on(self, sidecar: str) -> int:
        """How many jobs dispatched or followed here are placed on ``sidecar`` (its in-flight load
        as :class:`~aip_crewai.host.sidecars.placement.Placement` weighs it)."""
        return sum(1 for live in self._items.values() if live.job.sidecar == sidecar and live.job.spec.startable)

    def tasks(self) -> list[asyncio.Task[None]]:
        return [live.task for live in self._items.values() if live.task is not None]
