"""The read side of the job runtime: job views, event pages and live followers.

Committed events come from the journal, newer ones from the job's
:class:`LiveJob` in memory (see :mod:`live` for why a snapshot of both never
misses or repeats an event). A follower wakes on every change of its job and
yields a keep-alive tick after ``keepalive_seconds`` without news.

Source: ARCHITECTURE.md §4 (``GET /jobs/{id}``, ``/events`` as JSON and SSE, 416).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Container
from typing import Any

import anyio
import msgspec

from aip_crewai.sidecar.errors import CursorOutOfRange, JobNotFound, JobWaitTimeout, OutcomeNotRecorded
from aip_crewai.sidecar.jobs.live import LiveJob
from aip_crewai.sidecar.jobs.model import EventRow, JobRecord, JobStatus
from aip_crewai.sidecar.journal.store import Journal

#: Bound on one JSON events page, bytes of event data (at least one event is returned).
PAGE_MAX_BYTES = 8 * 1024 * 1024


#: Events per page a follower reads and sends at once (one journal read, one socket write).
FOLLOW_PAGE_EVENTS = 4096
#: Shortest time between two page reads of a live follower, seconds: events arriving sooner after a read
#: wait for the rest of it and go out in one page (one socket write, one read by the host), instead of
#: one page per event; the job's end cuts the wait short (ARCHITECTURE.md §10 "Live followers").
FOLLOW_PAGE_WINDOW_S = 0.005


class JobReader:
    """Reads jobs for the HTTP routes.

    Args:
        journal: the open journal.
        live: the runtime's live jobs by action id (shared, read-only here).
        keepalive_seconds: idle interval before a follower yields a keep-alive tick.
        unrecorded: the action ids of jobs that ended but whose terminal event the journal has not taken yet
            (:class:`~aip_crewai.sidecar.journal.backlog.TerminalBacklog`): their reads answer
            :class:`OutcomeNotRecorded` (503) instead of the journal's stale ``running`` row.
    """

    def __init__(
        self, journal: Journal, live: dict[str, LiveJob], keepalive_seconds: float, unrecorded: Container[str] = ()
    ) -> None:
        self.journal = journal
        self._live = live
        self._unrecorded = unrecorded
        self._keepalive = keepalive_seconds
        self._window = FOLLOW_PAGE_WINDOW_S

    def _check_recorded(self, action_id: str) -> None:
        """Raise :class:`OutcomeNotRecorded` for a job whose end waits for the journal (a full disk): its row
        says ``running`` with only the events committed before, so a reader would see a job stuck with a
        shorter stream than it was sent (a follower's cursor past the end: 416)."""
        if action_id in self._unrecorded and action_id not in self._live:
            raise OutcomeNotRecorded(details={"action_id": action_id})

    async def record(self, action_id: str, *, recorded: bool = True) -> tuple[JobRecord, LiveJob | None]:
        """The job's record and its live state (None once terminal). Raises JobNotFound, and with ``recorded``
        OutcomeNotRecorded (503: its end is not in the journal yet; without, the row as it is)."""
        if recorded:
            self._check_recorded(action_id)
        record = await self.journal.get(action_id)
        if record is None:
            raise JobNotFound(f"job {action_id!r} not found")
        if record.archived:
            raise JobNotFound(f"job {action_id!r} was archived")
        return record, self._live.get(action_id)

    async def view(self, action_id: str) -> dict[str, Any]:
        """``GET /jobs/{id}``: ``{action_id, crew_id, operation, status, event_count,
        output}`` plus ``error`` (failed), ``provider_stop_observed`` (cancelled,
        or known), ``uncertain_outcome`` (cancelled: true until the stop is
        confirmed), ``dropped_events`` (when > 0), ``imported: true`` (a job ``journal import`` brought
        from a reference journal).

        A job queued or running here is answered from memory alone: until its terminal event its row holds
        no output, error or stop (the journal's guards), and it was not imported; an ended job's row comes
        from the journal (kept in memory once read, :mod:`..journal.ended`). Raises JobNotFound."""
        live = self._live.get(action_id)
        if live is not None and not live.status.terminal:
            view = _view(action_id, live.crew_id, live.operation, live.status, live.next_sequence)
            return _with_dropped(view, live.dropped)
        record, live = await self.record(action_id)
        status, count = (live.status, live.next_sequence) if live is not None else (record.status, record.event_count)
        output = record.output if status is JobStatus.COMPLETED else None
        view = _view(record.action_id, record.crew_id, record.operation, status, count, output)
        if status is JobStatus.FAILED and record.error:
            view["error"] = msgspec.Raw(record.error)
        if status is JobStatus.CANCELLED or record.provider_stop_observed is not None:
            view["provider_stop_observed"] = record.provider_stop_observed
        if status is JobStatus.CANCELLED:
            # Confirmed only once the worker returned on the stop (no model call or tool can follow).
            view["uncertain_outcome"] = record.provider_stop_observed is not True
        _with_dropped(view, live.dropped if live is not None else record.dropped_events)
        if record.imported:
            view["imported"] = True
        return view

    async def page(
        self, action_id: str, cursor: int, *, limit: int = 1000, max_bytes: int = PAGE_MAX_BYTES
    ) -> tuple[JobStatus, list[EventRow], int]:
        """Events from ``cursor``: ``(status, events, event_count)``.

        Committed events come from the journal, newer ones from memory.
        Raises JobNotFound, CursorOutOfRange (416: cursor < 0 or > event_count), OutcomeNotRecorded (503: the
        job ended and its end is not in the journal yet).
        """
        live = self._live.get(action_id)
        if live is None:  # not running here: the journal's summary and the page in one hop
            self._check_recorded(action_id)
            summary, events = await self.journal.summary_and_events(action_id, cursor, limit=limit, max_bytes=max_bytes)
            if summary is None or summary[2]:
                raise JobNotFound(
                    f"job {action_id!r} not found" if summary is None else f"job {action_id!r} was archived"
                )
            if not 0 <= cursor <= summary[1]:
                raise CursorOutOfRange(f"cursor {cursor} is outside the journal (0..{summary[1]})")
            return summary[0], events, summary[1]
        status, committed, pending, count = live.snapshot()
        if not 0 <= cursor <= count:
            raise CursorOutOfRange(f"cursor {cursor} is outside the journal (0..{count})")
        events = []
        if cursor < committed and limit > 0:
            events = await self.journal.read_events(
                action_id, cursor, limit=min(limit, committed - cursor), max_bytes=max_bytes
            )
        if cursor + len(events) >= committed and len(events) < limit:
            start = cursor + len(events) - committed
            events.extend(pending[start : start + limit - len(events)])
        return status, events, count

    async def follow(self, action_id: str, cursor: int) -> AsyncIterator[EventRow | None]:
        """Yield events from ``cursor`` live until the terminal one; None every
        ``sse_keepalive_seconds`` without news (a keep-alive tick).

        One event at a time over :meth:`follow_pages`.

        Raises JobNotFound / CursorOutOfRange before the first yield.
        """
        async for page in self.follow_pages(action_id, cursor):
            if page is None:
                yield None
                continue
            for row in page:
                yield row

    async def follow_pages(self, action_id: str, cursor: int) -> AsyncIterator[list[EventRow] | None]:
        """Yield the events from ``cursor`` live, a page (up to :data:`FOLLOW_PAGE_EVENTS`
        events, never empty) at a time, until the page that ends with the terminal event;
        None every ``sse_keepalive_seconds`` without news (a keep-alive tick).

        Pages are consecutive: no event is skipped or repeated, whether it was
        committed or still pending when read.

        Raises JobNotFound / CursorOutOfRange before the first yield.
        """
        async for page in await self.open_pages(action_id, cursor):
            yield page

    async def open_pages(self, action_id: str, cursor: int) -> AsyncIterator[list[EventRow] | None]:
        """:meth:`follow_pages` with its first read done before this returns: JobNotFound and
        CursorOutOfRange are raised here, so an SSE route answers 404/416 before its stream starts
        and the first page costs no second read."""
        live = self._live.get(action_id)
        changed = live.changed() if live is not None else None
        read_at = anyio.current_time()
        first = await self.page(action_id, cursor, limit=FOLLOW_PAGE_EVENTS)
        return self._pages(action_id, cursor, live, changed, first, read_at)

    async def _pages(
        self,
        action_id: str,
        cursor: int,
        live: LiveJob | None,
        changed: asyncio.Event | None,
        read: tuple[JobStatus, list[EventRow], int],
        read_at: float,
    ) -> AsyncIterator[list[EventRow] | None]:
        """The loop of :meth:`follow_pages`; ``live``/``changed`` were taken before ``read``, the first page
        (a wake-up between the two is never missed), read at ``read_at`` (``anyio.current_time()``). Two
        page reads are at least :data:`FOLLOW_PAGE_WINDOW_S` apart while the job runs."""
        while True:
            status, events, count = read
            for index, row in enumerate(events):
                if row.terminal:
                    yield events[: index + 1]
                    return
            if events:
                yield events
                cursor += len(events)
                if cursor >= count and live is not None and not live.finished.is_set():
                    # caught up with a running job: what it emits next joins the next page
                    await self._rest_of_window(live, read_at)
            elif status.terminal or live is None or live.lost:
                return  # terminal (all read), or lost: the stream ends without a terminal event
            elif not live.finished.is_set():
                with anyio.move_on_after(self._keepalive) as idle:
                    await changed.wait()  # type: ignore[union-attr]
                if idle.cancelled_caught:
                    yield None
                else:  # news: let what follows join it
                    await self._rest_of_window(live, read_at)
            live = self._live.get(action_id)
            changed = live.changed() if live is not None else None
            read_at = anyio.current_time()
            try:
                read = await self.page(action_id, cursor, limit=FOLLOW_PAGE_EVENTS)
            except (JobNotFound, OutcomeNotRecorded):
                # Archived while followed, or ended with an outcome the journal could not take yet (the
                # reader resumes later, once it is recorded): the stream ends without a terminal event.
                return

    async def _rest_of_window(self, live: LiveJob, read_at: float) -> None:
        """Wait until :data:`FOLLOW_PAGE_WINDOW_S` after the page read at ``read_at`` (``anyio.current_time()``),
        or the job's end, whichever comes first."""
        if (rest := read_at + self._window - anyio.current_time()) > 0:
            with anyio.move_on_after(rest):
                await live.finished.wait()

    async def wait(self, action_id: str, timeout_ms: int) -> JobRecord:
        """Wait until the job is terminal; raise JobWaitTimeout (504) after ``timeout_ms``. The record is the
        journal's row as it is: still ``running`` when the end could not be recorded (the blocking answer is
        then 507 ``journal_write_failed``, ARCHITECTURE.md §4)."""
        live = self._live.get(action_id)
        if live is not None:
            try:
                with anyio.fail_after(timeout_ms / 1000):
                    await live.finished.wait()
            except TimeoutError:
                raise JobWaitTimeout(details={"action_id": action_id, "status": live.status.value}) from None
        record, _ = await self.record(action_id, recorded=False)
        return record


def _view(
    action_id: str, crew_id: str, operation: str, status: JobStatus, event_count: int, output: bytes | None = None
) -> dict[str, Any]:
    """The fields every job view has, in the contract's order (``output``: completed output JSON bytes)."""
    return {
        "action_id": action_id,
        "crew_id": crew_id,
        "operation": operation,
        "status": status.value,
        "event_count": event_count,
        "output": msgspec.Raw(output) if output else None,
    }


def _with_dropped(view: dict[str, Any], dropped: int) -> dict[str, Any]:
    """``view`` with ``dropped_events`` when > 0 (events a full bound dropped)."""
    if dropped:
        view["dropped_events"] = dropped
    return view
