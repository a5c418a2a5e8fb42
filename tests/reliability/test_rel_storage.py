"""Storage faults: journal write failures (in-process and real), the journal size bound, and unusable
journals at start-up (ARCHITECTURE.md §4 "507 (nothing half-admitted)", §5 journal)."""

from __future__ import annotations

import pytest
import storagekit

pytestmark = [pytest.mark.integration]


def _failures(results):
    return [f"{name}: {detail}" for name, ok, detail in results if not ok]


@pytest.mark.timeout(30)
async def test_rel_a_failed_admission_write_is_507_and_admits_and_runs_nothing(tmp_path):
    results = await storagekit.admission_write_failure(tmp_path / "j")
    assert len(results) == 8 and _failures(results) == []


@pytest.mark.timeout(30)
async def test_rel_a_failed_terminal_write_stops_new_work_until_the_outcome_is_recorded(tmp_path):
    """Regression: after a terminal commit failed (a full disk), the sidecar kept admitting and running new
    jobs whose outcomes it could not record either. It now refuses new jobs (507, `degraded` health) and
    retries the kept outcome; once the disk takes writes the job has its one terminal event and work resumes."""
    results = await storagekit.terminal_write_failure(tmp_path / "j")
    assert len(results) == 9 and _failures(results) == []


@pytest.mark.timeout(30)
async def test_rel_a_streamed_job_whose_end_is_not_recorded_ends_its_stream_and_resumes_later(tmp_path):
    """Regression (an operator's full disk): the live follower raised 416 inside the response once the job's
    end failed to commit, and the resume's 416 made the host cancel a job that had completed."""
    results = await storagekit.streamed_terminal_write_failure(tmp_path / "j")
    assert len(results) == 6 and _failures(results) == []


@pytest.mark.timeout(120)
def test_rel_real_write_failures_under_a_file_size_limit(procs):
    """A real sidecar under RLIMIT_FSIZE (writes fail with EFBIG like a full disk), kill -9, restart."""
    results = storagekit.file_size_limit(procs)
    assert len(results) > 8 and _failures(results) == []


@pytest.mark.timeout(120)
def test_rel_the_journal_size_bound_is_507_and_admits_nothing(procs):
    results = storagekit.journal_size_bound(procs)
    assert len(results) == 4 and _failures(results) == []


@pytest.mark.timeout(120)
def test_rel_corrupt_foreign_or_newer_journals_refuse_start_up_untouched(tmp_path):
    """Regression: another application's SQLite file was migrated (our tables added to its data), a
    corrupt journal could pass the open and fail later, and refusals came after the CrewAI import."""
    results = storagekit.journal_refusals(tmp_path / "journals")
    assert len(results) == 12 and _failures(results) == []
