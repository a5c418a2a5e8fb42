"""The journal's memory of ended jobs (journal/ended.py): bounded, and never older than the last write."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits.poll import at_once

from aip_crewai.sidecar.jobs.model import EventRow, JobRecord, JobStatus, NewJob
from aip_crewai.sidecar.journal.ended import EndedJobs
from aip_crewai.sidecar.journal.store import Journal

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 40


def row(action_id: str, status: JobStatus = JobStatus.COMPLETED, blob: int = 0, **changes: Any) -> JobRecord:
    record = JobRecord(action_id, "echo", "run", "h", "k", None, status, 2, b"x" * blob, None, 0, None, False, 1, 1)
    return replace(record, **changes)


# ------------------------------------------------------------------ the map alone


def test_only_ended_rows_that_are_not_archived_are_kept():
    kept = EndedJobs()
    for status in JobStatus:
        assert kept.remember(row(status.value, status)).action_id == status.value
    assert {a for a in (s.value for s in JobStatus) if kept.get(a)} == {s.value for s in JobStatus if s.terminal}
    kept.remember(row("gone", archived=True))
    assert kept.get("gone") is None


def test_the_entry_bound_drops_the_oldest_first_at_its_edge():
    kept = EndedJobs(max_entries=3, max_bytes=BIG)
    for name in "abc":
        kept.remember(row(name))
    assert len(kept) == 3 and all(kept.get(n) for n in "abc")  # at the limit: all kept
    kept.remember(row("d"))  # limit + 1
    assert len(kept) == 3 and kept.get("a") is None and all(kept.get(n) for n in "bcd")
    kept.remember(row("b", event_count=9))  # remembered again: the newest, the row replaced
    kept.remember(row("e"))
    assert kept.get("c") is None and kept.get("b").event_count == 9


def test_the_byte_bound_counts_output_and_error_and_refuses_a_row_over_a_sixteenth():
    kept = EndedJobs(max_entries=100, max_bytes=1600)
    kept.remember(row("edge", blob=100))  # exactly a sixteenth: kept
    kept.remember(row("over", blob=101))  # one byte more: never kept
    assert kept.get("edge") and kept.get("over") is None and kept.blob_bytes == 100
    kept.remember(row("failed", JobStatus.FAILED, error=b"e" * 50))
    assert kept.blob_bytes == 150
    for n in range(15):
        kept.remember(row(f"r{n}", blob=100))
    assert kept.blob_bytes <= 1600 and kept.get("edge") is None and kept.get("r14")
    kept.forget("r14")
    kept.forget("r14")  # twice: nothing more to drop
    kept_r = sum(1 for n in range(15) if kept.get(f"r{n}"))
    assert kept.get("r14") is None and kept.blob_bytes == 100 * kept_r + (50 if kept.get("failed") else 0)


def test_a_map_of_no_entries_keeps_nothing():
    kept = EndedJobs(max_entries=0)
    kept.remember(row("a"))
    assert kept.get("a") is None and len(kept) == 0


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["remember", "forget"]), st.sampled_from("abcdefg"), st.integers(0, 40)),
        max_size=60,
    ),
    max_entries=st.integers(0, 5),
    max_bytes=st.integers(0, 400),
)
def test_the_bounds_hold_and_a_kept_row_is_the_last_remembered(steps, max_entries, max_bytes):
    kept, last = EndedJobs(max_entries, max_bytes), {}
    for op, name, blob in steps:
        if op == "remember":
            kept.remember(row(name, blob=blob, event_count=blob))
            last[name] = blob
        else:
            kept.forget(name)
            last.pop(name, None)
        assert len(kept) <= max_entries and 0 <= kept.blob_bytes <= max_bytes
        for other in "abcdefg":
            got = kept.get(other)
            assert got is None or (other in last and got.event_count == last[other])
    assert kept.blob_bytes == sum(len(kept.get(n).output or b"") for n in "abcdefg" if kept.get(n))


# ------------------------------------------------------------------ inside the journal


def new(action_id: str) -> NewJob:
    return NewJob(action_id, "echo", "run", f"hash-{action_id}", "key", None)


def ev(sequence: int, event: str) -> EventRow:
    return EventRow(sequence, event, b"{}")


async def ended(j: Journal, action_id: str, status: JobStatus) -> None:
    await j.admit(new(action_id), max_retained_runs=BIG, max_bytes=BIG, started=ev(0, "started"))
    await j.transition(
        action_id, status, first_sequence=1, events=[ev(1, status.value)], output=b"{}" if status.terminal else None
    )


async def test_an_ended_jobs_row_read_again_answers_while_the_worker_is_stuck(tmp_path):
    """A status read of a finished job needs no journal hop: it answers while a commit hangs (a stalled disk)."""
    j = await Journal.open(tmp_path / "j.db")
    gate = threading.Event()
    try:
        await ended(j, "done", JobStatus.COMPLETED)
        await j.admit(new("running"), max_retained_runs=BIG, max_bytes=BIG, started=ev(0, "started"))
        assert (await j.get("done")).status is JobStatus.COMPLETED
        await j.get("running")
        j._worker.submit(gate.wait, 30)  # the worker is stuck from here
        assert at_once(j.get("done")).status is JobStatus.COMPLETED
        with pytest.raises(AssertionError, match="suspended"):
            at_once(j.get("running"))  # not ended: asks the worker, every time
    finally:
        gate.set()
        await j.close()


async def test_a_kept_row_follows_the_stop_record_and_the_archive(tmp_path):
    j = await Journal.open(tmp_path / "j.db")
    try:
        await ended(j, "stopped", JobStatus.CANCELLED)
        assert (await j.get("stopped")).provider_stop_observed is None
        assert await j.set_provider_stop_observed("stopped", True)
        assert (await j.get("stopped")).provider_stop_observed is True
        await j.archive("stopped")
        record = await j.get("stopped")
        assert record is not None and record.archived and record.output is None
    finally:
        await j.close()


async def test_a_read_only_journal_keeps_nothing_and_sees_the_owners_later_writes(tmp_path):
    owner = await Journal.open(tmp_path / "j.db")
    reader = await Journal.open_readonly(tmp_path / "j.db")
    try:
        await ended(owner, "stopped", JobStatus.CANCELLED)
        assert (await reader.get("stopped")).provider_stop_observed is None
        await owner.set_provider_stop_observed("stopped", False)
        assert (await reader.get("stopped")).provider_stop_observed is False
    finally:
        await reader.close()
        await owner.close()
