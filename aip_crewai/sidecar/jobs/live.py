"""In-memory state of an active job: its event sequence, uncommitted chunks
and the wake-up signal SSE followers wait on.

Sequence layout of one job: ``[0, committed)`` are in the journal,
``[committed, next_sequence)`` are ``pending`` (chunks accepted but not yet
checkpointed). Both move only on the event loop and never across an
``await``, so a reader that snapshots them sees every event exactly once:
committed ones from the journal, the rest from memory. Followers therefore
see chunks live, whatever ``stream_checkpoint_events`` is.

Chunk shaping (:func:`chunk_row`): only ``content``, ``channel``,
``task_id``, ``agent_role`` are kept; an event over ``max_event_bytes`` gets
its ``content`` cut to fit and ``truncated: true``.

Source: ARCHITECTURE.md §4 (events and their bounds), §5 (durability).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aip_crewai.contracts.operations import OperationSpec
from aip_crewai.plumbing.wakeup import ChangeSignal
from aip_crewai.sidecar.jobs.context import JobContext
from aip_crewai.sidecar.jobs.model import EventRow, JobStatus
from aip_crewai.sidecar.tenancy import tenant_of

#: Chunk channels passed through; anything else is published as ``llm``.
CHANNELS = frozenset({"llm", "tools", "messages", "internal"})
#: Bound on ``task_id`` / ``agent_role`` in a chunk, characters.
MAX_LABEL_CHARS = 256
_TRUNCATED_MARK = len(b',"truncated":true')


@dataclass(eq=False)
class LiveJob:
    """One admitted job that is not yet terminal in the journal (or whose
    worker still runs).

    ``closed`` is set, synchronously, by whoever decides the terminal outcome
    first (result, cancel, timeout, shutdown); after it no event is accepted.
    ``finished`` is set once the terminal event is committed (or could not be).
    """

    action_id: str
    crew_id: str
    spec: OperationSpec
    timeout_ms: int
    status: JobStatus = JobStatus.QUEUED
    next_sequence: int = 0
    committed: int = 0
    pending: list[EventRow] = field(default_factory=list)
    dropped: int = 0
    closed: bool = False
    lost: bool = False
    ctx: JobContext | None = None
    exec_task: asyncio.Task[Any] | None = None
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    flush_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    flush_scheduled: bool = False
    #: Pending chunks a failed checkpoint left behind: the next try waits for that many more.
    checkpoint_backoff: int = 0
    signal: ChangeSignal = field(default_factory=ChangeSignal)

    @property
    def tenant(self) -> str:
        """The job's tenant (:func:`tenancy.tenant_of` of its job id)."""
        return tenant_of(self.action_id)

    @property
    def operation(self) -> str:
        return self.spec.name

    def changed(self) -> asyncio.Event:
        """The event set at the next change; take it BEFORE reading the state (:mod:`aip_crewai.plumbing.wakeup`)."""
        return self.signal.changed()

    def notify(self) -> None:
        """Wake every follower waiting on :meth:`changed`."""
        self.signal.notify()

    def close(self) -> bool:
        """Claim the terminal outcome; False when someone already did."""
        if self.closed:
            return False
        self.closed = True
        return True

    def snapshot(self) -> tuple[JobStatus, int, list[EventRow], int]:
        """``(status, committed, pending copy, event count)`` at this instant."""
        return self.status, self.committed, list(self.pending), self.next_sequence


def event_row(sequence: int, event: str, data: dict[str, Any]) -> EventRow:
    """Encode an event's data as compact JSON."""
    return EventRow(sequence, event, msgspec.json.encode(data))


def chunk_labels(data: dict[str, Any]) -> dict[str, Any]:
    """What a chunk keeps of an ``emit_chunk`` payload beside its content: ``channel``, ``task_id`` and
    ``agent_role`` as strings of at most :data:`MAX_LABEL_CHARS`, and ``batch_item`` (``batch_run``: the index
    of the item the chunk belongs to, which the CLI's ``[item N]`` lines read) as a non-negative integer. Pure.

    Source: ARCHITECTURE.md §4 (the sidecar contract: chunk events)."""
    labels: dict[str, Any] = {
        key: str(data[key])[:MAX_LABEL_CHARS]
        for key in ("channel", "task_id", "agent_role")
        if data.get(key) is not None
    }
    item = data.get("batch_item")
    if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
        labels["batch_item"] = item
    return labels


def chunk_row(sequence: int, data: Any, max_event_bytes: int) -> EventRow | None:
    """Shape one ``emit_chunk`` payload into a bounded ``chunk`` event.

    Args:
        sequence: the event's sequence.
        data: ``{"content": str, "channel": str, "task_id"?, "agent_role"?, "batch_item"?}`` (:func:`chunk_labels`).
        max_event_bytes: bound on the whole encoded event, bytes.

    Returns:
        The event, or None when ``data`` is not a mapping (dropped).
    """
    if not isinstance(data, dict):
        return None
    content = data.get("content")
    content = "" if content is None else content if isinstance(content, str) else str(content)
    channel = data.get("channel")
    shaped: dict[str, Any] = {"content": content, **chunk_labels(data)}
    shaped["channel"] = channel if channel in CHANNELS else "llm"
    row = event_row(sequence, "chunk", shaped)
    size = len(row.to_json())
    if size <= max_event_bytes:
        return row
    encoded_content = len(msgspec.json.encode(content))
    budget = max_event_bytes - (size - encoded_content) - _TRUNCATED_MARK
    if budget < len(b'""'):  # a small bound (from 1024 bytes) cannot hold long labels: drop them first
        shaped.pop("task_id", None)
        shaped.pop("agent_role", None)
        budget = (
            max_event_bytes
            - len(event_row(sequence, "chunk", {**shaped, "content": ""}).to_json())
            - _TRUNCATED_MARK
            + len(b'""')
        )
    shaped["content"] = _fit(content, budget)
    shaped["truncated"] = True
    return event_row(sequence, "chunk", shaped)


def _fit(text: str, budget: int) -> str:
    """The longest prefix of ``text`` whose JSON string encoding is at most ``budget`` bytes."""
    low, high = 0, len(text)
    while low < high:  # binary search on the character count (encoded size is monotonic)
        mid = (low + high + 1) // 2
        if len(msgspec.json.encode(text[:mid])) <= budget:
            low = mid
        else:
            high = mid - 1
    return text[:low]
