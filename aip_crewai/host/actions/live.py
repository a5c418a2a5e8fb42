"""In-process registry of actions being dispatched by this host process.

A :class:`LiveAction` holds the dispatch task and a change signal; followers
(SSE streams, duplicate blocking callers) read chunks and results from the
store and wait on the signal between reads, so the store stays the single
source of truth and a follower never misses or repeats a chunk: it takes
:attr:`LiveAction.version` before reading and waits only for a change after it.
The chunks the dispatch itself just committed are also kept in its
:class:`CommittedTail`, rows exactly as stored, so a live follower on this host
takes them without a store read (ARCHITECTURE.md §10, live followers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...plumbing.wakeup import ChangeSignal
from ..store.records import ChunkRecord
from ..store.store import ActionRecord, Store
from .dispatch import Job
from .lifecycle import ActionState


class CommittedTail:
    """The last chunks one dispatch committed to the store, in sequence order, with no gap: what a live
    follower of the action on this host takes without a store read (``follow`` in ``host/http/routes.py``).

    Only a batch the store inserted in full is kept (:meth:`keep`), so every kept chunk is the stored row,
    text for text; a batch that was not (a sequence already stored, a refused write) empties the tail
    (:meth:`forget`). A batch that does not continue the kept ones (a gap, a repeat) replaces them. The
    oldest chunks go first past :attr:`MAX_CHUNKS` chunks or :attr:`MAX_CHARS` characters of chunk text
    (the stored JSON), so a follower that fell behind reads the store, as every follower did before.

    Source: ARCHITECTURE.md §10 (live followers).
    """

    #: Most chunks kept (a follower reads within one commit window of each batch: a few batches suffice).
    MAX_CHUNKS = 1024
    #: Most characters of chunk text kept (the stored JSON).
    MAX_CHARS = 1 << 20

    def __init__(self, *, max_chunks: int = MAX_CHUNKS, max_chars: int = MAX_CHARS) -> None:
        self.max_chunks = max_chunks
        self.max_chars = max_chars
        self._chunks: list[ChunkRecord] = []
        self._chars = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def keep(self, batch: Sequence[ChunkRecord]) -> None:
        """Keep ``batch``, chunks the store has just committed, every one inserted by this write, in
        stream order. A batch whose sequences are not consecutive keeps nothing."""
        if not batch:
            return
        if any(later.sequence != earlier.sequence + 1 for earlier, later in zip(batch, batch[1:], strict=False)):
            self.forget()
            return
        if self._chunks and batch[0].sequence != self._chunks[-1].sequence + 1:
            self.forget()
        self._chunks.extend(batch)
        self._chars += sum(len(chunk.chunk_json) for chunk in batch)
        drop = 0
        while drop < len(self._chunks) and (len(self._chunks) - drop > self.max_chunks or self._chars > self.max_chars):
            self._chars -= len(self._chunks[drop].chunk_json)
            drop += 1
        del self._chunks[:drop]

    def forget(self) -> None:
        """Keep nothing: the store may hold rows this tail does not (followers read the store)."""
        self._chunks.clear()
        self._chars = 0

    def after(self, sequence: int, limit: int) -> list[ChunkRecord]:
        """The kept chunks after ``sequence``, at most ``limit``, in order; ``[]`` unless the chunk of
        ``sequence + 1`` is kept (the follower then reads the store)."""
        if not self._chunks:
            return []
        start = sequence + 1 - self._chunks[0].sequence
        if start < 0 or start >= len(self._chunks):
            return []
        return self._chunks[start : start + max(0, limit)]


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
    #: The chunks the dispatch's :class:`~.chunk_sink.ChunkSink` last committed (see :class:`CommittedTail`).
    committed: CommittedTail = field(default_factory=CommittedTail)

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


async def follow_page(
    store: Store, watched: LiveAction | None, record: ActionRecord, after_sequence: int, limit: int
) -> tuple[list[ChunkRecord], ActionRecord | None]:
    """One read of a live follower of ``record``'s action: :meth:`Store.follow_page` (the chunks after
    ``after_sequence``, at most ``limit``, then the action row), except that while the action is running and
    ``watched``, its dispatch here, has just committed the chunk after ``after_sequence``, the chunks come from
    its :class:`CommittedTail` and the row is ``record`` itself, unchanged (the same object: nothing was read).
    Source: ARCHITECTURE.md §10 (live followers)."""
    if watched is not None and record.status == ActionState.RUNNING:
        kept = watched.committed.after(after_sequence, limit)
        if kept:
            return kept, record
    return await store.follow_page(record.tenant, record.action_id, after_sequence, limit)
