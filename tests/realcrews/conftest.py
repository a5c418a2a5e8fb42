"""Fixtures of the real-crew suite (helpers in ``realkit.py``, the provider in ``fake_provider.py``).

- ``provider`` (session): one fake OpenAI-compatible provider; tests script it by markers unique to them.
- ``otlp`` (session): a real OTLP/HTTP trace receiver on loopback (``kits.otlp_receiver``).
- ``deployment`` (session): the example deployment (sidecar with the default process isolation + host), both
  exporting their traces to ``otlp``, the host signing receipts.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_provider import FakeProvider
from kits.otlp_receiver import OtlpReceiver
from realkit import Deployment, start_deployment


@pytest.fixture(scope="session")
def provider() -> Iterator[FakeProvider]:
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="session")
def deployment(
    provider: FakeProvider, otlp: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("realcrews")
    workdir.chmod(0o700)
    started = start_deployment(workdir, provider, otlp=otlp)  # AIP_CREWAI_ISOLATION decides (default: process)
    try:
        yield started
    finally:
        started.close()
