"""Integration fixtures: real sidecar processes on loopback (see :mod:`kits.sidecar`).

- ``sidecar_factory`` (function scope): ``start(args=..., env=...)`` a sidecar
  on an ephemeral port with a tmp journal and token; ``restart(old)`` a new
  process on the same journal (crash tests); survivors are killed at teardown.
- ``shared_sidecar`` (module scope): one sidecar for tests that only add jobs
  with unique action ids. ``sidecar.base_url`` / ``sidecar.token`` /
  ``sidecar.client()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.sidecar import Sidecar, SidecarFactory


def _private_dir(factory: pytest.TempPathFactory, name: str) -> Path:
    path = factory.mktemp(name)
    path.chmod(0o700)
    return path


@pytest.fixture
def sidecar_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarFactory]:
    factory = SidecarFactory(_private_dir(tmp_path_factory, "sidecar"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def shared_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    factory = SidecarFactory(_private_dir(tmp_path_factory, "shared-sidecar"))
    try:
        yield factory.start()
    finally:
        factory.close()
