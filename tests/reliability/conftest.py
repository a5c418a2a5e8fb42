"""Reliability suite fixtures (helpers in ``relkit.py``, scenarios in ``chaoslib.py``).

- ``procs`` (function scope): a :class:`relkit.Processes` in a private
  directory; survivors are killed at teardown.
- ``shared_pair`` (session scope): one real sidecar and one real host on loopback
  shared by the race, security and crash tests (each uses unique action ids).

Every test here has a pytest-timeout; scenarios poll with deadlines.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from relkit import Processes


@pytest.fixture
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    processes = Processes(tmp_path_factory.mktemp("rel"))
    try:
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="session")
def shared_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Processes, object, object]]:
    """``(processes, sidecar, host)``: one running pair for the whole session."""
    processes = Processes(tmp_path_factory.mktemp("rel-shared-pair"))
    try:
        sidecar = processes.sidecar()
        host = processes.host(sidecar.base_url)
        yield processes, sidecar, host
    finally:
        processes.close()
