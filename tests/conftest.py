"""Suite-wide settings.

Hypothesis profiles: ``ci`` (the default, used by ``make test`` and CI) is
derandomized and keeps no example database, so a property test gives the
same draws on every run and cannot turn red on a new random draw without a
change, and it ignores wall time (no per-example deadline, no ``too_slow`` health
check), so a slow or shared machine cannot fail a property; ``explore`` draws at random
(``HYPOTHESIS_PROFILE=explore``). Wide
random exploration runs in ``make chaos`` (tests/reliability/chaos.py sets
its own settings).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- PostgreSQL: one throwaway server per session, a fresh database per test ----------------------

import itertools  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pgserver  # noqa: E402
import pytest  # noqa: E402
import storebackend  # noqa: E402

_database_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def postgres_server() -> pgserver.PostgresServer:
    """The session's throwaway cluster (the one the suites' hosts use under ``AIP_CREWAI_TEST_STORE=postgresql``,
    :mod:`storebackend`); the test skips with one line without PostgreSQL."""
    try:
        return storebackend.cluster()  # stopped by _stop_store_cluster, after every session fixture using it
    except storebackend.Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session", autouse=True)
def _stop_store_cluster() -> Iterator[None]:
    """Stop the session's cluster, if anything started it, once every other session fixture is torn down
    (autouse: set up first, torn down last)."""
    yield
    storebackend.stop_cluster()


@pytest.fixture
def postgres_url(postgres_server: pgserver.PostgresServer) -> str:
    """The URL of a new, empty database on the session's server."""
    return postgres_server.create_database(f"test_{os.getpid()}_{next(_database_numbers)}")


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """Each test starts from structlog's defaults: a test that configures logging (a CLI command, a
    process's main()) leaves nothing behind for the next one."""
    import structlog

    yield
    structlog.reset_defaults()


# --- CrewAI in the test process: prepared before anything can import it ------------------------------------

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from aip_crewai.sidecar.crewai_env import prepare_crewai_environment  # noqa: E402

#: CrewAI fixes its storage paths when it is imported, so whichever test of this process imports it first (a
#: sidecar test, an example crew, a doctor run in-process) finds the environment a sidecar gives it: storage
#: under a private state directory, telemetry off. Without this, a test that imported CrewAI early on one
#: pytest-xdist worker left every in-process sidecar test after it on that worker failing.
CREWAI_STATE_DIR = Path(tempfile.mkdtemp(prefix="aip-crewai-tests-"))
prepare_crewai_environment(CREWAI_STATE_DIR)
atexit.register(shutil.rmtree, CREWAI_STATE_DIR, ignore_errors=True)


# --- Test tiers: `make test-fast` starts no process ---------------------------------------------------------

import _posixsubprocess  # noqa: E402
import subprocess  # noqa: E402

#: ``AIP_CREWAI_TEST_TIER=fast`` (``make test-fast``): only tests without the ``processes`` marker run, and each
#: of them fails if it starts a process (fork, exec or spawn), so the tier stays in-process by construction.
FAST_TIER = os.environ.get("AIP_CREWAI_TEST_TIER") == "fast"
#: Fixtures that start a process: a test using one is marked ``processes``.
PROCESS_FIXTURES = frozenset(
    {"postgres_server", "postgres_url", "sidecar_factory", "shared_sidecar", "procs", "shared_pair"}
)


#: Wider-scoped fixtures every worker may hold a copy of (they do not make a test depend on its module's others).
SHARED_EVERYWHERE = frozenset({"postgres_server", "_stop_store_cluster"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``processes`` every test that starts real processes: the ``integration`` and ``browser`` suites and
    the tests using a fixture of :data:`PROCESS_FIXTURES` or parametrized ``postgresql``; other tests that
    start one carry the mark themselves (the fast tier's guard below finds those that do not).

    For ``pytest -n N --dist loadgroup`` (``make test``): a test using a module- or class-scoped fixture of
    ours (a shared sidecar) joins its module's ``xdist_group``, and one using a session-scoped one (a host
    sidecar and host pair) that fixture's group, so those tests run on one worker and share one copy; every other test is
    scheduled on its own."""
    for item in items:
        fixture_info = getattr(item, "_fixtureinfo", None)
        shared = [
            d
            for name, definitions in (fixture_info.name2fixturedefs.items() if fixture_info else ())
            if name not in SHARED_EVERYWHERE
            for d in definitions
            if d.scope != "function" and str(d.baseid).startswith("tests")
        ]
        sessions = sorted(str(d.baseid) for d in shared if d.scope == "session")
        if sessions:  # every test using the session fixtures of a folder runs where they were made
            item.add_marker(pytest.mark.xdist_group(f"{sessions[0]}::session"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        fixtures = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        on_postgresql = callspec is not None and "postgresql" in callspec.params.values()  # a store parameter
        if (
            item.get_closest_marker("integration")
            or item.get_closest_marker("browser")
            or fixtures & PROCESS_FIXTURES
            or on_postgresql
        ):
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast tier, a test without the ``processes`` marker that forks or starts a program fails, naming
    the marker to add."""
    if not FAST_TIER or request.node.get_closest_marker("processes"):
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.processes "
            "(make test-fast runs only tests that start none)"
        )

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)  # multiprocessing's spawn and fork server
    monkeypatch.setattr(subprocess, "_fork_exec", refuse, raising=False)  # subprocess imported it by name
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(subprocess, "_USE_POSIX_SPAWN", False)
