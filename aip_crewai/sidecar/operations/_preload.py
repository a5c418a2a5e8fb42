"""Imported once by the worker fork server (``workers.start_forkserver``), before it forks any worker.

Loads CrewAI and every operation module, so a job worker forked from the
fork server starts with them in memory (pages shared with the fork server)
and never pays the CrewAI import. The fork server inherits the sidecar's
CrewAI environment (``crewai_env.prepare_crewai_environment`` ran first).
A failure here is not raised (it would stop the fork server): each worker
imports again at boot and reports its own failure.

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

try:
    import crewai  # noqa: F401  (the import is the point)

    from aip_crewai.sidecar import worker, workers  # noqa: F401
    from aip_crewai.sidecar.operations import (  # noqa: F401
        _common,
        _preflight,
        _task_outputs,
        batch_run,
        knowledge_query,
        memory_reset,
        replay,
        run,
        test,
        train,
    )
except Exception:  # noqa: BLE001, S110 - reported by the worker that imports it again
    pass
