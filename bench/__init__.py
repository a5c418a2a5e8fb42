"""Benchmarks of aip-crewai: each measures our path and its baseline side by
side in one run and prints the ratio (p50 and p99), never a bare time.

``python -m bench`` (or ``make bench``) runs them all and writes
``bench/results/latest.md``; ``python -m bench control_path journal`` runs a
subset. One module per benchmark:

| module | ours | baseline |
|---|---|---|
| :mod:`bench.control_path` | ``:status`` through host and sidecar | the sidecar alone; a bare Starlette-on-Hypercorn handler |
| :mod:`bench.run_overhead` | a governed ``run`` through the host (approval decision to result) | ``akickoff`` of the same crew in-process |
| :mod:`bench.streaming` | 1,000 chunks through the host's normalizer; the SSE decoder | the sidecar's SSE read directly; a bare frame split |
| :mod:`bench.journal` | durable admissions; chunk appends with 10,000 retained jobs | a bare SQLite insert (FULL, WAL); appends with 10 retained jobs |
| :mod:`bench.load` | 200 concurrent governed runs through the host | the same 200 runs straight to the sidecar |
| :mod:`bench.footprint` | CPU per ``fast`` job of the sidecar's whole process tree; the idle tree's PSS | the same crew's ``akickoff`` in one process; one process with CrewAI and the registry imported |

Source: ARCHITECTURE.md §10 (performance and limits to design for).
"""
