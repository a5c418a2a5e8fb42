"""Journal, as an operator switching from the reference sidecar sees it: ours versus a whole-file JSON journal.

The reference sidecar keeps its journal as one JSON file that it rewrites
whole, with an fsync, on every persist. Its code is not part of this
repository, so this benchmark models that method (the *reference-style
journal*): every job with its events in one dict, serialized with ``json``,
written to a temporary file beside the journal, ``fsync``-ed and renamed over
it, then the directory ``fsync``-ed. One persist per admission, as one
``Journal.admit`` commit is one durable write for ours.

Both journals hold the same retained jobs: completed ``chatty`` runs of
``journal.EVENTS_PER_RETAINED_JOB`` chunk events each (the bench's chunk), at
10, 1,000 and 2,000 retained jobs (2,000 is the default
``--max-retained-runs``). Admissions alternate between the two in the same
run; the ratio is ours / reference in admissions per second (higher is
better), reported without a target.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from aip_crewai.sidecar.journal.store import Journal
from bench.common import Section, Stats, interleave, rate_row
from bench.journal import CHUNK, EVENTS_PER_RETAINED_JOB, LIMITS, _journal, _new_job

RETAINED = (10, 1_000, 2_000)
ROUNDS = 60
BUDGET_S = 12.0


class ReferenceStyleJournal:
    """Every job and its events in one JSON file, rewritten whole (fsync, rename, directory fsync) per persist."""

    def __init__(self, path: Path, retained: int) -> None:
        self.path = path
        chunk = json.loads(CHUNK)
        self.runs: dict[str, dict[str, Any]] = {
            f"retained:{i:06d}": {
                "action_id": f"retained:{i:06d}",
                "crew_id": "chatty",
                "operation": "run",
                "status": "completed",
                "request_hash": f"{i:064x}",
                "idempotency_key": f"key-{i}",
                "output": {"raw": "done"},
                "events": [{"event": "chunk", "sequence": s, "data": chunk} for s in range(EVENTS_PER_RETAINED_JOB)],
            }
            for i in range(retained)
        }
        self.persist()

    def persist(self) -> None:
        """Write the whole journal durably (the reference method)."""
        data = json.dumps({"runs": self.runs}).encode("utf-8")
        temporary = self.path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def admit(self) -> None:
        job = _new_job()
        self.runs[job.action_id] = {
            "action_id": job.action_id,
            "crew_id": job.crew_id,
            "operation": job.operation,
            "status": "queued",
            "request_hash": job.request_hash,
            "idempotency_key": job.idempotency_key,
            "events": [],
        }
        self.persist()


async def run() -> Section:
    section = Section("journal_switch", "4b. Journal: ours vs a reference-style whole-file JSON journal")
    workdir = Path(tempfile.mkdtemp(prefix="aip-bench-switch-"))
    ours: dict[int, Journal] = {}
    samples: dict[int, dict[str, list[float]]] = {}
    sizes: dict[int, int] = {}
    try:
        for retained in RETAINED:
            journal = ours[retained] = await _journal(workdir / f"ours-{retained}", retained)
            (workdir / f"ref-{retained}").mkdir(mode=0o700)
            reference = ReferenceStyleJournal(workdir / f"ref-{retained}" / "runs.json", retained)
            sizes[retained] = reference.path.stat().st_size

            async def admit_ours(journal: Journal = journal) -> float:
                started = time.perf_counter()
                _, created = await journal.admit(_new_job(), **LIMITS)
                if not created:
                    raise RuntimeError("admission found an existing job")
                return time.perf_counter() - started

            async def admit_reference(reference: ReferenceStyleJournal = reference) -> float:
                started = time.perf_counter()
                reference.admit()
                return time.perf_counter() - started

            samples[retained] = await interleave(
                {"ours": admit_ours, "reference": admit_reference}, rounds=ROUNDS, warmup=3, budget_s=BUDGET_S
            )
    finally:
        for journal in ours.values():
            await journal.close()
        shutil.rmtree(workdir, ignore_errors=True)
    for retained in RETAINED:
        stats = {k: Stats.of(v) for k, v in samples[retained].items()}
        section.rows.append(
            rate_row(
                f"admission at {retained:,} retained jobs: ours vs reference-style JSON journal",
                "admissions",
                stats["ours"],
                stats["reference"],
                units=1,
                min_ratio=None,
            )
        )
    section.notes += [
        "Method: the reference-style journal rewrites one JSON file of every retained job and its events per "
        "persist (write, fsync, rename, directory fsync); ours commits one SQLite transaction (WAL, "
        "synchronous=FULL). Same retained jobs in both; admissions interleaved in one run.",
        "Reference-style file sizes: " + ", ".join(f"{sizes[r] / 1e6:.1f} MB at {r:,}" for r in RETAINED) + ".",
        f"Up to {ROUNDS} admissions per journal and size (fewer when a size takes longer than {BUDGET_S:g} s).",
    ]
    return section
