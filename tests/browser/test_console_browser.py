"""The approval console in real Chromium: an approver signs in with a token or an
Ed25519 key, sees a pending action appear live, approves it, and watches its chunks and result arrive; a
principal that may not decide approvals (an operator, an invoker) is told so at sign-in and can sign in again."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kits.host import TOKENS, bearer_principal, start_host, submit_for_approval

from aip_crewai.client import new_id
from aip_crewai.plumbing.keys import generate_ed25519

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

KEY_APPROVER = "acme-key-approver"
#: An operator of acme: it reads the approvals (not their inputs) and decides none.
OPERATOR_TOKEN = "tok-acme-operator-1"
OPERATOR = bearer_principal("acme-operator", OPERATOR_TOKEN, "operator")
#: The console's sign-in check of the approver role (console.js APPROVER_CHECK).
APPROVER_CHECK = "**/aip/v1/approvals/apr_console-approver-check/display"
#: What the console shows for an approval whose input the host did not send (to a principal that is no approver).
NO_INPUT = "no input: the host sends the input to approvers only"


@pytest.fixture
def host_with_key_approver(sidecar_factory, tmp_path) -> Any:
    sidecar = sidecar_factory.start()
    key_file = tmp_path / "approver.pem"
    public = generate_ed25519(key_file)
    host = start_host(
        tmp_path / "host",
        sidecar.base_url,
        sidecar.token,
        extra_principals=[
            {"id": KEY_APPROVER, "tenant": "acme", "role": "approver", "ed25519_public_key": public},
            OPERATOR,
        ],
    )
    try:
        yield host, key_file
    finally:
        host.stop()


def sign_in_with_token(page: Any, host: Any) -> None:
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


def test_a_principal_that_may_not_decide_is_told_so_and_signs_in_again(host_with_key_approver, browser) -> None:
    from playwright.sync_api import expect

    host, _ = host_with_key_approver
    action_id = submit_for_approval(host, {"topic": "t"})  # a queue an operator could only watch load
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.goto(f"{host.base_url}/console/")
    error = page.locator("#sign-in-error")
    for token, says in (
        (OPERATOR_TOKEN, "the display findings describe the input, which only approvers read"),
        (TOKENS["acme-app"], "reading approvals needs the approver or operator role"),
    ):
        page.fill("#token", token)
        page.click("#sign-in-form button[type=submit]")
        expect(error).to_contain_text("This principal may not decide approvals: the host answered 403 policy.forbidden")
        expect(error).to_contain_text(says)
        expect(page.locator("#token")).to_be_focused()  # described by the error, its text selected: type another
        expect(page.locator("#workspace")).to_be_hidden()
        assert "loading" not in page.locator("body").inner_text()
    page.keyboard.type(TOKENS["acme-approver"])
    page.keyboard.press("Enter")
    expect(page.locator("#queue .card", has_text=action_id)).to_have_count(1, timeout=20_000)
    expect(error).to_have_text("")
    page.close()

    # Were the host to let an operator past that check, its queue would say why it shows no input, not load forever.
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.route(APPROVER_CHECK, lambda route: route.fulfill(status=404, json={}))
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", OPERATOR_TOKEN)
    page.click("#sign-in-form button[type=submit]")
    card = page.locator("#queue .card", has_text=action_id)
    expect(card.locator(".preview")).to_have_text(NO_INPUT, timeout=20_000)
    card.click()
    expect(page.locator("#d-input")).to_have_text(NO_INPUT)
    expect(page.locator("#approve")).to_be_disabled()
    page.close()
