"""Suite-wide settings.

Hypothesis profiles: ``ci`` (the default, used by ``make test`` and CI) is
derandomized and keeps no example database, so a property test gives the
same draws on every run and cannot turn red on a new random draw without a
change; ``explore`` draws at random (``HYPOTHESIS_PROFILE=explore``). Wide
random exploration runs in ``make chaos`` (tests/reliability/chaos.py sets
its own settings).
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- PostgreSQL: one throwaway server per session, a fresh database per test ----------------------

import itertools  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

import pgserver  # noqa: E402
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
