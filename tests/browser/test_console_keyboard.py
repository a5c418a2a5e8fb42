"""The approval console for people, in real Chromium: driven by the keyboard alone (Tab, Enter, Escape) at
desktop width and at 375 px (no horizontal scroll), checked by axe-core (0 serious or critical violations),
with distinguishable queue cards, a decided history that survives a reload and filters, a key file picker
whose garbled PEMs get precise errors, honest empty states, jittered reconnects after the server's
``retry:``, and approvals that arrive while signed in said once in the live region (docs/approvals.md
"Approval console")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kits.host import TOKENS, submit_for_approval
from playwright.sync_api import expect

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(300)]

AXE = Path(__file__).parent / "vendor" / "axe.min.js"
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 375, "height": 740}
#: The most Tab presses a control may be away (a generous bound: the page has about 20 stops).
MAX_TABS = 60


def submit(host: Any, **input: Any) -> str:
    return submit_for_approval(host, {"topic": "t", **input})


def focused(page: Any) -> dict[str, Any]:
    return page.evaluate(
        """() => { const e = document.activeElement; const style = getComputedStyle(e);
                   return { id: e.id, approval: e.dataset ? e.dataset.approvalId || null : null, tag: e.tagName,
                            text: e.textContent, outline: style.outlineStyle, width: style.outlineWidth }; }"""
    )


def tab_to(page: Any, selector: str, *, backwards: bool = False) -> dict[str, Any]:
    """Press Tab (Shift+Tab) until the focused element matches ``selector``; asserts its focus is visible."""
    for _ in range(MAX_TABS):
        page.keyboard.press("Shift+Tab" if backwards else "Tab")
        if page.evaluate("(s) => document.activeElement.matches(s)", selector):
            now = focused(page)
            assert now["outline"] != "none" and now["width"] != "0px", now  # focus is visible
            return now
    raise AssertionError(f"{selector} is not reachable by Tab")


def no_horizontal_scroll(page: Any) -> None:
    sizes = page.evaluate("() => [document.scrollingElement.scrollWidth, innerWidth]")
    assert sizes[0] <= sizes[1], sizes


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations of the page as it is now (WCAG 2 A/AA and best practices)."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.add_script_tag(content=AXE.read_text())  # as content: the console's CSP allows no other script origin
    found = page.evaluate("async () => (await axe.run(document, { resultTypes: ['violations'] })).violations")
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]]}
        for v in found
        if v["impact"] in ("serious", "critical")
    ]


def sign_in_by_keyboard(page: Any, host: Any) -> None:
    page.goto(f"{host.base_url}/console/")
    expect(page.locator("#queue-state")).to_be_hidden()  # nothing claims an empty queue before sign-in
    assert "Nothing waits" not in page.locator("body").inner_text()
    tab_to(page, "#token")
    page.keyboard.type(TOKENS["acme-approver"])
    page.keyboard.press("Enter")
    expect(page.locator("#workspace")).to_be_visible(timeout=20_000)
    expect(page.locator("#live")).to_have_text("live", timeout=20_000)


def test_the_console_passes_axe_and_keeps_its_history_across_a_reload(host, browser, artifacts) -> None:
    page = browser.new_page(viewport=DESKTOP, bypass_csp=True)  # axe is injected as an inline script
    page.goto(f"{host.base_url}/console/")
    assert axe_violations(page) == []  # the sign-in form
    page.check("input[name=method][value=key]")
    assert axe_violations(page) == []
    page.check("input[name=method][value=token]")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#live")).to_have_text("live", timeout=20_000)
    # the server's retry: reached the reader; reconnects wait it, doubled per failure, times [1, 2)
    assert page.evaluate("state.retryMs") == 3000
    assert page.evaluate("[reconnectDelay(0, 3000, () => 0), reconnectDelay(0, 3000, () => 0.999)]") == [3000, 5997]
    assert page.evaluate("reconnectDelay(1, 3000, () => 0.5)") == 9000
    assert page.evaluate("reconnectDelay(9, 3000, () => 0)") == 30000  # the cap

    approved = submit(host, note="history")
    card = page.locator("#queue .card", has_text=approved)
    expect(card).to_have_count(1, timeout=20_000)
    card.click()
    expect(page.locator("#d-input")).to_contain_text("history", timeout=20_000)
    assert axe_violations(page) == []  # the queue and an open approval
    page.fill("#reason", "fine")
    page.click("#approve")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    expect(page.locator("#queue-state")).to_have_text("Nothing waits for a decision.")

    page.reload()  # the token is kept for the tab: the console signs in again and reads the history
    expect(page.locator("#live")).to_have_text("live", timeout=20_000)
    page.click("#view-decided")
    expect(page.locator("#history .card", has_text=approved)).to_have_count(1, timeout=20_000)
    page.select_option("#f-state", "denied")
    expect(page.locator("#history .card", has_text=approved)).to_have_count(0)
    page.select_option("#f-state", "approved")
    page.select_option("#f-requester", "acme-app")
    page.select_option("#f-capability", "cap:crewai:echo")
    expect(page.locator("#history .card", has_text=approved)).to_have_count(1)
    page.fill("#f-action", "no-such-action")
    expect(page.locator("#history-state")).to_have_text("No decided approval matches the filters.")
    page.fill("#f-action", "")
    assert axe_violations(page) == []  # the decided view with its filters
    page.close()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "375px"])
def test_an_approver_opens_and_decides_by_keyboard_alone(host, browser, artifacts, viewport) -> None:
    page = browser.new_page(viewport=viewport)
    sign_in_by_keyboard(page, host)
    # two approvals of the same capability and requester: the cards tell them apart
    first = submit(host, note="refund 10 EUR to account \u202e9876-5432\u202c then close")
    second = submit(host, note="a plain second request")
    for action_id in (first, second):
        expect(page.locator("#queue .card", has_text=action_id)).to_have_count(1, timeout=20_000)
    card = page.locator("#queue .card", has_text=first)
    expect(card.locator(".preview")).to_contain_text("\\u202e9876-5432\\u202c", timeout=20_000)
    expect(card).to_contain_text("risk: ")
    expect(card).to_contain_text("acme-app")
    expect(card).to_contain_text("left")
    assert "\u202e" not in card.inner_text()
    no_horizontal_scroll(page)

    now = tab_to(page, f'#queue .card[data-approval-id="{card.get_attribute("data-approval-id")}"]')
    assert now["tag"] == "BUTTON"
    page.keyboard.press("Enter")  # open
    expect(page.locator("#d-action")).to_have_text(first, timeout=20_000)
    assert focused(page)["id"] == "d-capability"
    expect(page.locator("#d-warning")).to_be_visible(timeout=20_000)
    no_horizontal_scroll(page)
    page.screenshot(path=str(artifacts / f"console-keyboard-{viewport['width']}-detail.png"), full_page=True)
    page.keyboard.press("Escape")  # back to the card it came from
    expect(page.locator("#detail")).to_be_hidden()
    assert focused(page)["approval"] == card.get_attribute("data-approval-id")
    page.keyboard.press("Enter")  # open again, then decide: reason, Tab to Deny, Enter
    expect(page.locator("#d-action")).to_have_text(first, timeout=20_000)
    tab_to(page, "#reason")
    page.keyboard.type("refund to an account the customer does not hold")
    tab_to(page, "#deny")
    page.keyboard.press("Enter")
    expect(page.locator("#d-status")).to_contain_text("denied by acme-approver", timeout=20_000)
    expect(page.locator("#decide-form")).to_be_hidden()
    expect(page.locator("#queue .card", has_text=first)).to_have_count(0)

    # the decided view, by keyboard: the history (from the host) filtered by an action id search
    page.keyboard.press("Escape")
    tab_to(page, "#view-decided", backwards=True)
    page.keyboard.press("Enter")
    tab_to(page, "#f-action")
    page.keyboard.type(first[-8:])
    history = page.locator("#history .card")
    expect(history).to_have_count(1, timeout=20_000)
    expect(history).to_contain_text("denied by acme-approver")
    no_horizontal_scroll(page)
    page.screenshot(path=str(artifacts / f"console-keyboard-{viewport['width']}-history.png"), full_page=True)
    page.close()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("just some text", 'no "-----BEGIN PRIVATE KEY-----" line'),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n", "an OpenSSH key"),
        ("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEI\n", 'no "-----END PRIVATE KEY-----" line'),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAw*QYDK2Vw\n-----END PRIVATE KEY-----\n",
            'not base64: "*" at character 9',
        ),
        (
            "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIE\n-----END PRIVATE KEY-----\n",
            "garbled: its DER is 15 bytes",
        ),
    ],
    ids=["not-pem", "openssh", "cut", "not-base64", "truncated"],
)
def test_a_garbled_key_file_gets_a_precise_error(host, browser, content, says) -> None:
    page = browser.new_page(viewport=DESKTOP)
    page.goto(f"{host.base_url}/console/")
    page.check("input[name=method][value=key]")
    assert page.locator("#key-fields textarea").count() == 0  # no field ever shows the key
    page.fill("#key-id", "acme-approver")
    page.set_input_files("#key-file", files=[{"name": "key.pem", "mimeType": "text/plain", "buffer": content.encode()}])
    page.click("#sign-in-form button[type=submit]")
    error = page.locator("#sign-in-error")
    expect(error).to_contain_text("The key file cannot be used: ")
    expect(error).to_contain_text(says)
    assert "browser" not in error.inner_text()
    page.close()


def test_approvals_that_arrive_while_signed_in_are_said_once(host, browser) -> None:
    page = browser.new_page(viewport=DESKTOP)
    sign_in_by_keyboard(page, host)
    expect(page.locator("#count")).to_have_text(re.compile(r"^\(\d+\)$"), timeout=20_000)
    announce = page.locator("#announce")
    expect(announce).to_have_text("")  # what waited at sign-in is the list itself, not news
    first = submit(host, note="arrives while the approver is on the page")
    expect(announce).to_have_text(re.compile(r"^1 new approval waiting \(\d+ pending\)\.$"), timeout=20_000)
    expect(page.locator("#queue .card", has_text=first)).to_have_count(1)

    # Without the live stream, approvals arrive with the next reload of the queue (what a reconnect does): together.
    page.evaluate("state.liveAbort.abort()")
    page.evaluate("document.getElementById('announce').textContent = ''")
    others = [submit(host, note="second"), submit(host, note="third")]
    page.evaluate("loadPending()")
    expect(announce).to_have_text(re.compile(r"^2 new approvals waiting \(\d+ pending\)\.$"))
    for action_id in others:
        expect(page.locator("#queue .card", has_text=action_id)).to_have_count(1)
    # A reload that brings nothing new says nothing: approvals already listed are not announced again.
    page.evaluate("document.getElementById('announce').textContent = ''")
    page.evaluate("loadPending()")
    assert announce.text_content() == ""
    page.close()


def test_a_failed_queue_load_says_why_and_never_claims_an_empty_queue(host, browser) -> None:
    page = browser.new_page(viewport=DESKTOP)
    error = {"body": {"error": {"error": {"code": "host.unavailable", "message": "the store is unreachable"}}}}
    failing = "**/aip/v1/approvals?status=pending&limit=200*"
    page.route(failing, lambda route: route.fulfill(status=503, json=error))
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    expect(page.locator("#queue-error")).to_be_visible(timeout=20_000)
    expect(page.locator("#queue-error")).to_contain_text(
        "The queue could not be loaded: the store is unreachable (host.unavailable)."
    )
    assert "Nothing waits" not in page.locator("#pending-view").inner_text()
    with page.expect_response(lambda r: "status=pending" in r.url and r.status == 503):
        page.click("#queue-retry")  # still failing: the button asks again, and the error stays
    expect(page.locator("#queue-error")).to_be_visible()
    page.unroute(failing)
    # Now the retry (or the live stream's own reload, which may come first on a loaded machine) clears it.
    page.eval_on_selector("#queue-retry", "button => button.click()")
    expect(page.locator("#queue-error")).to_be_hidden(timeout=20_000)
    expect(page.locator("#count")).to_have_text(re.compile(r"^\(\d+\)$"))
    page.close()
