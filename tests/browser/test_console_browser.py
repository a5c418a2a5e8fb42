"""The approval console in real Chromium: an approver signs in with a token or an
Ed25519 key, sees a pending action appear live, approves it, and watches its chunks and result arrive."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kits.host import start_host

from aip_crewai.client import new_id
from aip_crewai.plumbing.keys import generate_ed25519

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

KEY_APPROVER = "acme-key-approver"


@pytest.fixture
def host_with_key_approver(sidecar_factory, tmp_path) -> Any:
    sidecar = sidecar_factory.start()
    key_file = tmp_path / "approver.pem"
    public = generate_ed25519(key_file)
    host = start_host(
        tmp_path / "host",
        sidecar.base_url,
        sidecar.token,
        extra_principals=[{"id": KEY_APPROVER, "tenant": "acme", "role": "approver", "ed25519_public_key": public}],
    )
    try:
        yield host, key_file
    finally:
        host.stop()


def sign_in_with_token(page: Any, host: Any) -> None:
    from kits.host import TOKENS

    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")


def sign_in_with_key(page: Any, host: Any, key_file: Path) -> None:
    page.goto(f"{host.base_url}/console/")
    page.check("input[name=method][value=key]")
    page.fill("#key-id", KEY_APPROVER)
    page.set_input_files("#key-file", str(key_file))
    page.click("#sign-in-form button[type=submit]")


def approve_live(page: Any, host: Any, artifacts: Path, name: str) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#workspace")).to_be_visible()
    expect(page.locator("#live")).to_have_text("live", timeout=20_000)
    topic = f"lighthouse-{new_id('t')}"
    with host.client("acme-app") as app:  # submitted after sign-in: it must arrive through the live stream
        pending = app.call("cap:crewai:echo", {"topic": topic}, action_id=new_id("act"), idempotency_key=new_id("k"))
    assert pending["body"]["action_result"]["status"] == "pending_approval"
    item = page.locator("#queue .card", has_text="cap:crewai:echo")
    expect(item).to_have_count(1, timeout=20_000)
    item.click()
    expect(page.locator("#d-input")).to_contain_text(topic)
    expect(page.locator("#d-policy")).to_have_text(re.compile(r"^[0-9a-f]{64}$"))
    page.screenshot(path=str(artifacts / f"{name}-pending.png"), full_page=True)
    page.fill("#reason", "checked in the browser")
    page.click("#approve")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#run-chunks")).to_contain_text(topic)
    expect(page.locator("#run-result")).to_contain_text(topic)
    expect(page.locator("#queue .card")).to_have_count(0)
    expect(page.locator("#queue-state")).to_have_text("Nothing waits for a decision.")
    page.screenshot(path=str(artifacts / f"{name}-completed.png"), full_page=True)


def test_an_approver_with_a_token_approves_a_live_pending_action(host_with_key_approver, browser, artifacts) -> None:
    host, _ = host_with_key_approver
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    sign_in_with_token(page, host)
    approve_live(page, host, artifacts, "console-token")
    page.close()


def test_an_approver_with_only_an_ed25519_key_approves_in_the_browser(
    host_with_key_approver, browser, artifacts
) -> None:
    host, key_file = host_with_key_approver
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    sign_in_with_key(page, host, key_file)
    approve_live(page, host, artifacts, "console-key")
    page.close()
