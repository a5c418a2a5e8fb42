"""The journal's memory of ended jobs: the rows last read of jobs that ended, so that reading one again
(``GET /jobs/{id}`` of a finished job, the common status read) skips the journal's worker thread.

Coherence: one process owns the journal file (its lock), and every write goes through
:class:`~.store.Journal` on its one worker thread. Each write that names a job drops that job's entry on
the worker before its transaction, and :meth:`EndedJobs.remember` is called on the worker right after the
row was read; a reader on the event loop therefore sees either the row as it was before a write that has
not returned yet, or nothing (and asks the worker, queued behind the write). An ended job's row still
changes twice at most: its stop recorded once (``provider_stop_observed``) and its archiving.

Bounds: at most ``max_entries`` rows and ``max_bytes`` of output and error bytes; a row whose blobs take
more than a sixteenth of ``max_bytes`` is never kept; the oldest entry is dropped first.

Threads: :meth:`remember` and :meth:`forget` on the journal's worker only; :meth:`get` from any thread
(one dict lookup, atomic under the GIL).

Source: ARCHITECTURE.md §5 (journal: reads of ended jobs).
"""

from __future__ import annotations

from aip_crewai.sidecar.jobs.model import JobRecord

__all__ = ["EndedJobs", "MAX_ENTRIES", "MAX_BYTES"]

#: Rows kept at most.
MAX_ENTRIES = 1024
#: Output and error bytes kept at most, all rows together.
MAX_BYTES = 4 * 1024 * 1024


def _blob_bytes(record: JobRecord) -> int:
    return len(record.output or b"") + len(record.error or b"")


class EndedJobs:
    """Bounded map ``action_id -> JobRecord`` of jobs whose status is terminal and that are not archived.

    Args:
        max_entries: rows kept at most (>= 0; 0 keeps none).
        max_bytes: output and error bytes kept at most (>= 0).
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._rows: dict[str, JobRecord] = {}
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0

    def get(self, action_id: str) -> JobRecord | None:
        """The row kept for ``action_id``, or None."""
        return self._rows.get(action_id)

    def remember(self, record: JobRecord) -> JobRecord:
        """Keep ``record`` if it is an ended, non-archived job within the bounds (journal worker only).

        Returns:
            ``record``, kept or not.
        """
        self.forget(record.action_id)  # an older row of the job is never left behind, kept or not
        size = _blob_bytes(record)
        if not record.status.terminal or record.archived or size * 16 > self._max_bytes or self._max_entries < 1:
            return record
        while self._rows and (len(self._rows) >= self._max_entries or self._bytes + size > self._max_bytes):
            self.forget(next(iter(self._rows)))
        self._rows[record.action_id] = record
        self._bytes += size
        return record

    def forget(self, action_id: str) -> None:
        """Drop ``action_id``'s row, if kept (journal worker only: before any write naming the job)."""
        record = self._rows.pop(action_id, None)
        if record is not None:
            self._bytes -= _blob_bytes(record)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def blob_bytes(self) -> int:
        """Output and error bytes of the kept rows."""
        return self._bytes
