"""Browser tests in real Chromium: Debian's ``chromium`` driven by Playwright's Python
package pointed at it (``executable_path``; Playwright downloads no browser). ``.ci/run`` installs both.

Without the browser, or without Playwright, every test here skips with one line naming what is missing.
``AIP_CREWAI_CHROMIUM`` overrides the browser path. Screenshots go to ``.artifacts/browser/`` (or
``$AIP_CREWAI_TEST_ARTIFACTS/browser``).

Fixtures: ``host`` (one sidecar and host per module), ``host_with_key_approver`` (test_console_browser.py: a real sidecar and host on loopback: the integration helpers' tenants and principals,
plus ``acme-key-approver``, an approver with only an Ed25519 key), ``browser`` (one headless Chromium per
module) and ``artifacts`` (the screenshot directory).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.host import Host, start_host
from kits.sidecar import SidecarFactory

REPO = Path(__file__).resolve().parents[2]

CHROMIUM = os.environ.get("AIP_CREWAI_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = None
    if not Path(CHROMIUM).exists():
        missing = f"browser tests skipped: no Chromium at {CHROMIUM} (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "browser tests skipped: Playwright's Python package is not installed (pip install playwright)"
    if missing:
        here = str(Path(__file__).parent)
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.skip(reason=missing))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def artifacts() -> Path:
    base = Path(os.environ.get("AIP_CREWAI_TEST_ARTIFACTS") or REPO / ".artifacts")
    path = base / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """One sidecar and one host for the module (the integration helpers' tenants and principals)."""
    base = tmp_path_factory.mktemp("console")
    base.chmod(0o700)
    (base / "sidecar").mkdir(mode=0o700)
    factory = SidecarFactory(base / "sidecar")
    try:
        sidecar = factory.start()
        started = start_host(base / "host", sidecar.base_url, sidecar.token)
        try:
            yield started
        finally:
            started.stop()
    finally:
        factory.close()


@pytest.fixture
def sidecar_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarFactory]:
    path = tmp_path_factory.mktemp("sidecar")
    path.chmod(0o700)
    factory = SidecarFactory(path)
    try:
        yield factory
    finally:
        factory.close()
