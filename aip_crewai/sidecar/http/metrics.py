"""Sidecar counters and gauges, rendered as Prometheus text (``GET /metrics``).

An additive route (ARCHITECTURE.md §1: "metrics ... additive and optional for the
peer"), behind the same bearer token as every route. Counters live in memory
(they restart at zero with the process); gauges are read at render time.

| metric | type | labels |
|---|---|---|
| ``aip_crewai_sidecar_jobs_admitted_total`` | counter | operation |
| ``aip_crewai_sidecar_jobs_finished_total`` | counter | operation, status |
| ``aip_crewai_sidecar_chunks_total`` | counter | (chunk events accepted) |
| ``aip_crewai_sidecar_chunks_dropped_total`` | counter | (past the per-run event bound) |
| ``aip_crewai_sidecar_journal_write_failures_total`` | counter | |
| ``aip_crewai_sidecar_active_runs`` | gauge | |
| ``aip_crewai_sidecar_retained_runs`` / ``..._max_retained_runs`` | gauge | |
| ``aip_crewai_sidecar_workers_idle`` / ``..._workers_warm`` | gauge | (``--isolation process``) |
| ``aip_crewai_sidecar_workers_started_total``, ``..._worker_jobs_reused_total``, ``..._warm_workers_retired_total``, ``..._workers_shrunk_total`` | counter | (``--isolation process``) |

Source: ARCHITECTURE.md §1, §6 (``/metrics`` as Prometheus text on the host).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from aip_crewai.plumbing.prometheus import CONTENT_TYPE, escape_label_value

__all__ = ["CONTENT_TYPE", "PREFIX", "Metrics"]

PREFIX = "aip_crewai_sidecar_"

_HELP = {
    "jobs_admitted_total": ("counter", "Jobs admitted (new action ids only)."),
    "jobs_finished_total": ("counter", "Jobs that reached a terminal event."),
    "chunks_total": ("counter", "Chunk events accepted."),
    "chunks_dropped_total": ("counter", "Chunk events dropped past the per-run event bound."),
    "journal_write_failures_total": ("counter", "Journal write transactions that failed and were rolled back."),
    "active_runs": ("gauge", "Jobs admitted and not yet terminal."),
    "retained_runs": ("gauge", "Non-archived jobs in the journal."),
    "max_retained_runs": ("gauge", "Retained-run limit."),
    "unauthenticated_body_bytes": ("gauge", "Bytes of request bodies being read without a token (budget use)."),
    "workers_idle": ("gauge", "Job workers booted and waiting for any job."),
    "workers_warm": ("gauge", "Warm job workers waiting for their owner's next job (--worker-jobs)."),
    "workers_started_total": ("counter", "Job workers booted."),
    "worker_jobs_reused_total": ("counter", "Jobs that ran in a warm worker (no boot)."),
    "warm_workers_retired_total": ("counter", "Warm workers killed to make room for another owner's job."),
    "workers_shrunk_total": ("counter", "Idle and warm workers ended once no job started or ended for a while."),
}


class Metrics:
    """In-memory counters keyed by ``(name, sorted label pairs)``; loop-thread only."""

    def __init__(self) -> None:
        self._counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        """Add ``amount`` to counter ``name`` (without the prefix) with ``labels``."""
        self._counters[(name, tuple(sorted(labels.items())))] += amount

    def value(self, name: str, **labels: str) -> int:
        return self._counters[(name, tuple(sorted(labels.items())))]

    def render(self, gauges: Mapping[str, int]) -> str:
        """Prometheus text exposition of every counter and the given gauges."""
        lines: list[str] = []
        names = sorted(
            {name for name, _ in self._counters}
            | set(gauges)
            | {n for n, (kind, _) in _HELP.items() if kind == "counter"}
        )
        for name in names:
            kind, text = _HELP.get(name, ("untyped", name))
            lines += [f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}"]
            if name in gauges:
                lines.append(f"{PREFIX}{name} {gauges[name]}")
                continue
            series = sorted((labels, v) for (n, labels), v in self._counters.items() if n == name)
            for labels, value in series or [((), 0)]:
                rendered = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels)
                lines.append(f"{PREFIX}{name}{{{rendered}}} {value}" if rendered else f"{PREFIX}{name} {value}")
        return "\n".join(lines) + "\n"
