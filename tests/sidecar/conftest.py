"""Fixtures for sidecar tests that run CrewAI in-process (offline).

``crewai_state_dir`` prepares CrewAI's environment once per session (before
crewai is imported: telemetry off, storage under a temporary state dir) and
imports it. ``make_ctx`` builds a :class:`JobContext` that records chunks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aip_crewai.sidecar.crewai_env import import_crewai, prepare_crewai_environment
from aip_crewai.sidecar.jobs.context import JobContext


@pytest.fixture(scope="session")
def crewai_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sidecar state dir CrewAI was prepared with (shared by the session)."""
    storage = os.environ.get("CREWAI_STORAGE_DIR")
    if "crewai" in sys.modules and storage:
        state = Path(storage).parent
    else:
        state = tmp_path_factory.mktemp("sidecar-state")
    prepare_crewai_environment(state)
    import_crewai()
    return state


class ChunkRecorder:
    """Thread-safe ``emit_chunk`` that keeps every chunk with its arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.chunks: list[dict[str, Any]] = []

    def __call__(self, data: dict[str, Any]) -> None:
        with self._lock:
            self.chunks.append(dict(data))

    def text(self) -> str:
        with self._lock:
            return "".join(c["content"] for c in self.chunks)

    def __len__(self) -> int:
        with self._lock:
            return len(self.chunks)


@pytest.fixture
def make_ctx(crewai_state_dir: Path) -> Callable[..., tuple[JobContext, ChunkRecorder]]:
    """Return ``make_ctx(operation="run", action_id=...) -> (ctx, recorder)``."""
    counter = iter(range(1_000_000))

    def make(operation: str = "run", action_id: str | None = None) -> tuple[JobContext, ChunkRecorder]:
        recorder = ChunkRecorder()
        ctx = JobContext(
            action_id=action_id or f"act-{next(counter)}",
            crew_id="test",
            operation=operation,
            emit_chunk=recorder,
            cancel_flag=threading.Event(),
            state_dir=crewai_state_dir,
        )
        return ctx, recorder

    return make
