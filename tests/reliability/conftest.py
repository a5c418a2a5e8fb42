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
    """``(processes, sidecar, host)``: one running pair for the whole session (each test on it isolates itself
    by its own tenants, action ids and counts); ``make chaos`` builds its own pair and passes it the same way."""
    processes = Processes(tmp_path_factory.mktemp("rel-shared-pair"))
    try:
        sidecar = processes.sidecar()
        host = processes.host(sidecar.base_url)
        yield processes, sidecar, host
    finally:
        processes.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on the session's pair is timed from its call on (``func_only``): the pair's start-up (its sidecar
    imports CrewAI: 45 s and more on a loaded 2-core machine) falls on whichever test asks for it first, and a
    60 s bound of that test's own work ran out in it. The start-up keeps its own deadlines (kits.sidecar
    START_TIMEOUT_S, the host's /ready)."""
    for item in items:
        if "shared_pair" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("timeout")
        timeout = (marker.args[0] if marker.args else marker.kwargs.get("timeout")) if marker else None
        if timeout is None:
            timeout = float(config.getini("timeout") or 0) or None
        if timeout is not None:
            item.add_marker(pytest.mark.timeout(timeout, func_only=True), append=False)
