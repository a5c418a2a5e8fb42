"""What the approver reads is what runs, in real Chromium (docs/approvals.md "The approval flow"):

- numbers are shown as the host holds them (and the crew runs them): an integer beyond 2^53, ``1.0`` and
  ``-0.0`` keep their digits, in the detail and in the card's preview, and so do a run's result's numbers as
  the host sends them (``1.10`` too); a browser that cannot read them exactly says so;
- Approve stays disabled until the input is on screen (loading, or unreadable), and a decision whose answer
  came back is not shown as failed because the view could not be read again;
- an input with more findings than the host lists says that the rest are not marked;
- a right-to-left string in the card's preview does not reorder the keys and numbers after it;
- before sign-in no workspace control is shown, and after sign-out nothing of the last input stays in the page,
  not even from an answer that arrives after it;
- the detail says when the crew's own code may set the inputs (values no approver sees), naming those a request
  leaves out;
- an approval withdrawn while its reason is typed says so and keeps the focus on it; a focused card decided
  elsewhere moves the focus to its list's heading with a live announcement, never silently to another approval.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from kits.host import TOKENS, submit_for_approval
from playwright.sync_api import Page, Route, expect

from aip_crewai.contracts.display import MAX_FINDINGS

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

#: Numbers JSON.parse reads otherwise than Python runs them: 12345678901234567000, 9007199254740992, 1, 0.
NUMBERS = {"id": 12345678901234567891, "edge": 9007199254740993, "ratio": 1.0, "zero": -0.0}
#: One approval's own GET (not its /display, not the list): the console's read of the input.
APPROVAL = re.compile(r"/aip/v1/approvals/apr_[^/?]+$")
#: The sign-in's first check (one pending approval): the console signs in once it answers.
SIGN_IN_CHECK = re.compile(r"/aip/v1/approvals\?status=pending&limit=1$")
#: An action's event stream: the console follows the run it approved there.
ACTION_EVENTS = re.compile(r"/aip/v1/actions/[^/?]+/events$")
#: A result's output as the host writes it, with numbers JSON.parse reads otherwise (…567000, 1.1, 1, 0).
RESULT_OUTPUT = '{"raw":"done","id":12345678901234567891,"price":1.10,"ratio":1.0,"zero":-0.0}'

#: The left edges of the first "900" and of the first ":10" in the preview of the card naming an action (null
#: until it is laid out: the console replaces its cards as approval events arrive).
PREVIEW_ORDER = """(actionId) => {
  const card = [...document.querySelectorAll("#queue .card")].find((c) => c.textContent.includes(actionId));
  const element = card && card.querySelector(".preview");
  if (!element || !element.textContent.includes("900")) return null;
  const edge = (text) => {
    const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      const at = node.data.indexOf(text);
      if (at < 0) continue;
      const r = document.createRange(); r.setStart(node, at); r.setEnd(node, at + 1);
      return r.getBoundingClientRect().left;
    }
    return null;
  };
  const order = { nine: edge("900"), ten: edge(":10") };
  return order.nine && order.ten ? order : null;
}"""


def _status(host: Any, action_id: str) -> str:
    """The approval status of ``action_id`` as the host holds it."""
    with host.client("acme-approver") as approver:
        for listed in ("pending", "decided"):
            for view in approver.approvals(listed)["approvals"]:
                if view["request"]["action_id"] == action_id:
                    return str(view["status"])
    raise AssertionError(f"no approval for {action_id}")


def _unreadable(route: Route) -> None:
    route.fulfill(status=503, content_type="application/json", body="{}")


def _signed_in(browser: Any, host: Any, init_script: str | None = None, unreadable: bool = False) -> Page:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    if init_script:
        page.add_init_script(init_script)
    if unreadable:  # before sign-in: the console reads the queue's inputs as soon as it is signed in
        page.route(APPROVAL, _unreadable)
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    return page


def _sign_in_routing(page: Page, host: Any, pattern: re.Pattern[str], handler: Callable[[Route], None]) -> None:
    """Sign ``page`` in as the approver with ``handler`` routing the requests ``pattern`` matches; returns once
    the first of them was sent."""
    page.route(pattern, handler)
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    with page.expect_request(lambda request: pattern.search(request.url) is not None):
        page.click("#sign-in-form button[type=submit]")


def _card(page: Page, action_id: str) -> Any:
    card = page.locator("#queue .card", has_text=action_id)
    expect(card).to_have_count(1, timeout=20_000)
    return card


def test_numbers_are_shown_as_they_run_in_the_detail_and_the_preview(host, browser) -> None:
    action_id = submit_for_approval(host, {"topic": "t", **NUMBERS})
    page = _signed_in(browser, host)
    card = _card(page, action_id)
    preview = card.locator(".preview")
    expect(preview).to_contain_text('"id":12345678901234567891', timeout=20_000)
    assert '"edge":9007199254740993' in preview.inner_text() and '"ratio":1.0' in preview.inner_text()
    card.click()
    shown = page.locator("#d-input")
    expect(shown).to_contain_text('"id": 12345678901234567891', timeout=20_000)
    text = shown.inner_text()
    for written in ('"edge": 9007199254740993', '"ratio": 1.0', '"zero": -0.0'):
        assert written in text, text
    assert "12345678901234567000" not in text and "9007199254740992" not in text
    expect(page.locator("#d-numbers")).to_be_hidden()
    page.close()


def test_a_browser_without_exact_numbers_says_so(host, browser) -> None:
    action_id = submit_for_approval(host, {"topic": "t", **NUMBERS})
    page = _signed_in(browser, host, init_script="delete JSON.rawJSON;")  # a browser from before 2025
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text('"topic": "t"', timeout=20_000)
    expect(page.locator("#d-numbers")).to_be_visible()
    page.close()


def _result_stream(action_id: str) -> str:
    """The action's event stream as the host sends it once the run completed: its result event."""
    envelope = (
        '{"aip_version":"1.0","message_type":"aip.core.v1.action_result","message_id":"msg_1",'
        f'"sent_at":"2026-01-01T00:00:00.000Z","body":{{"action_result":{{"action_id":"{action_id}",'
        f'"status":"completed","output":{RESULT_OUTPUT}}}}},"correlation_id":"{action_id}"}}'
    )
    return f"id: sse_1\nevent: result\ndata: {envelope}\n\n"


def _approve_and_watch(page: Page, action_id: str, stream: str, reason: str) -> None:
    """Open ``action_id`` (submitted with ``{"topic": "t"}``), approve it with ``reason`` once its input is on
    screen, answer the run's event stream with ``stream`` and wait until the console shows the run completed."""
    page.route(ACTION_EVENTS, lambda route: route.fulfill(status=200, content_type="text/event-stream", body=stream))
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text('"topic": "t"', timeout=20_000)
    page.fill("#reason", reason)
    page.click("#approve")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=20_000)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "without-source-text"])
def test_a_results_numbers_are_shown_as_sent(host, browser, exact) -> None:
    action_id = submit_for_approval(host, {"topic": "t"})
    page = _signed_in(browser, host, init_script=None if exact else "delete JSON.rawJSON;")
    _approve_and_watch(page, action_id, _result_stream(action_id), "numbers as sent")
    result = page.locator("#run-result")
    expect(result).to_contain_text('"raw": "done"')
    text = result.inner_text()
    if exact:
        for written in ('"id": 12345678901234567891', '"price": 1.10', '"ratio": 1.0', '"zero": -0.0'):
            assert written in text, text
        assert "12345678901234567000" not in text
        expect(page.locator("#run-numbers")).to_be_hidden()
    else:
        expect(page.locator("#run-numbers")).to_be_visible()
    page.close()


def test_approve_waits_for_the_input_and_a_failed_reread_does_not_undo_the_decision(host, browser) -> None:
    action_id = submit_for_approval(host, {"topic": "t"})
    page = _signed_in(browser, host, unreadable=True)
    card = _card(page, action_id)
    expect(card.locator(".preview")).to_contain_text("input unreadable", timeout=20_000)
    card.click()
    expect(page.locator("#d-input")).to_contain_text("input unreadable")
    page.fill("#reason", "looks fine")
    expect(page.locator("#approve")).to_be_disabled()
    expect(page.locator("#approve-hint")).to_be_visible()
    expect(page.locator("#deny")).to_be_enabled()
    page.evaluate("document.getElementById('decide-form').requestSubmit()")  # a submit without a button: approve
    expect(page.locator("#decide-error")).to_contain_text("not shown yet")
    assert _status(host, action_id) == "pending"

    page.unroute(APPROVAL)
    page.keyboard.press("Escape")
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text('"topic": "t"', timeout=20_000)
    expect(page.locator("#approve")).to_be_enabled()
    expect(page.locator("#approve-hint")).to_be_hidden()
    page.route(APPROVAL, _unreadable)  # the decision goes through; the view's re-read after it fails
    page.fill("#reason", "looks fine")
    page.click("#approve")
    expect(page.locator("#decided-note")).to_contain_text("Approved", timeout=20_000)
    expect(page.locator("#decided-note")).to_contain_text("could not be read again")
    expect(page.locator("#decide-error")).to_have_text("")
    assert _status(host, action_id) == "approved"
    page.close()


def test_more_findings_than_listed_say_the_rest_are_not_marked(host, browser) -> None:
    padding = "\uff41" * MAX_FINDINGS  # fullwidth "a": one compatibility finding each
    action_id = submit_for_approval(host, {"topic": "t", "a_padding": padding, "payee": "p\u0430ypal"})
    page = _signed_in(browser, host)
    _card(page, action_id).click()
    expect(page.locator("#d-truncated")).to_be_visible(timeout=20_000)
    expect(page.locator("#d-warning-count")).to_have_text(f"at least {MAX_FINDINGS}")
    page.close()


def test_a_right_to_left_string_does_not_reorder_the_preview(host, browser) -> None:
    # Keys sort as {"1":"\u05d0","2":900,"3":10,"topic":"t"}: nothing strong left-to-right between the letter and 10.
    action_id = submit_for_approval(host, {"1": "\u05d0", "2": 900, "3": 10, "topic": "t"})
    page = _signed_in(browser, host)
    _card(page, action_id)
    order = page.wait_for_function(PREVIEW_ORDER, arg=action_id, timeout=20_000).json_value()
    assert order["nine"] < order["ten"], order  # before: drawn as {"1":"10:"3",900:"2","\u05d0",...
    page.close()


def test_no_workspace_before_sign_in_and_no_input_after_sign_out(host, browser) -> None:
    action_id = submit_for_approval(host, {"topic": "t", "note": "kept only while signed in"})
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{host.base_url}/console/")
    expect(page.locator("#sign-in-form")).to_be_visible()
    expect(page.locator("#workspace")).to_be_hidden()
    expect(page.locator("#view-decided")).to_be_hidden()
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text("kept only while signed in", timeout=20_000)
    page.click("#sign-out")
    expect(page.locator("#workspace")).to_be_hidden()
    assert "kept only while signed in" not in page.content()
    assert page.locator("#count").text_content() == ""
    page.close()


def test_an_input_whose_answer_arrives_after_sign_out_is_dropped(host, browser) -> None:
    """The approval's read (its input) answers only after the approver signed out: the answer is dropped, and
    neither the queue nor the detail shows the input again (before, the late answer put its card back)."""
    action_id = submit_for_approval(host, {"topic": "t", "note": "answered after sign-out"})
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    held: list[Route] = []
    released = False

    def hold(route: Route) -> None:  # each read of an input waits for the sign-out (one routed later goes on)
        if released:
            route.continue_()
        else:
            held.append(route)

    _sign_in_routing(page, host, APPROVAL, hold)
    _card(page, action_id)  # listed; its input's read is held
    page.click("#sign-out")
    expect(page.locator("#workspace")).to_be_hidden()
    with page.expect_console_message(lambda message: "was dropped" in message.text, timeout=20_000):
        released = True
        for route in held:
            route.continue_()
    assert "answered after sign-out" not in page.content()
    assert page.locator("#queue .card").count() == 0
    page.close()


def test_an_approval_withdrawn_while_typing_says_so_and_keeps_the_focus_on_it(host, browser) -> None:
    action_id = submit_for_approval(host, {"topic": "t"})
    page = _signed_in(browser, host)
    _card(page, action_id).click()
    expect(page.get_by_role("article", name=re.compile(action_id))).to_be_visible(timeout=20_000)
    page.focus("#reason")
    page.keyboard.type("reading it")
    with host.client("acme-app") as app:
        app.cancel(action_id)
    expect(page.locator("#decided-note")).to_contain_text("withdrawn", timeout=20_000)
    expect(page.locator("#decide-form")).to_be_hidden()
    expect(page.locator("#d-capability")).to_be_focused()
    page.close()


def test_a_focused_card_decided_elsewhere_moves_the_focus_to_its_list_and_says_why(host, browser) -> None:
    first = submit_for_approval(host, {"topic": "first"})
    second = submit_for_approval(host, {"topic": "second"})
    page = _signed_in(browser, host)
    card = _card(page, first)
    _card(page, second)
    card.focus()
    expect(card).not_to_have_accessible_name(re.compile(r"\d+ s left"))  # no countdown read out every second
    with host.client("acme-approver") as approver:
        listed = approver.approvals("pending")["approvals"]
        approval = next(v for v in listed if v["request"]["action_id"] == first)
        approver.decide(approval["request"]["id"], "denied", "not now")
    expect(page.locator("#queue .card", has_text=first)).to_have_count(0, timeout=20_000)
    expect(page.locator("#pending-title")).to_be_focused()
    expect(page.locator("#announce")).to_contain_text("left this list")
    page.close()


def test_streamed_output_highlights_a_bounded_number_of_runs(host, browser) -> None:
    """A run's streamed chunks get the input's bound on highlighted runs: a chatty crew's output of thousands of
    soft hyphens used to become one element each (no bound); past the bound each is still written as its code."""
    action_id = submit_for_approval(host, {"topic": "t"})
    page = _signed_in(browser, host, init_script=None)
    runs = page.evaluate("MAX_MARKS")
    text = "a\u00ad" * (runs + 50)
    chunk = (
        '{"aip_version":"1.0","message_type":"aip.core.v1.stream_chunk","message_id":"msg_c",'
        '"sent_at":"2026-01-01T00:00:00.000Z","body":{"stream_chunk":{"action_id":"' + action_id + '","sequence":0,'
        '"kind":"data","part":{"kind":"text","text":' + json.dumps(text) + '}}},"correlation_id":"' + action_id + '"}'
    )
    stream = f"id: sse_1\nevent: chunk\ndata: {chunk}\n\n" + _result_stream(action_id).replace("sse_1", "sse_2")
    _approve_and_watch(page, action_id, stream, "bounded output")
    chunks = page.locator("#run-chunks")
    assert (chunks.text_content() or "").count("a\\u00ad") == runs + 50  # every one written as its code
    assert page.evaluate("document.querySelectorAll('#run-chunks *').length") <= runs
    page.close()


def test_sign_out_after_a_run_leaves_nothing_of_the_approval_or_its_run_in_the_page(host, browser) -> None:
    """The run an approval started echoes its input; after sign-out neither the run's output nor the approval's
    fields (its action id) stay in the page."""
    action_id = submit_for_approval(host, {"topic": "echoed by the run"})
    page = _signed_in(browser, host)
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text("echoed by the run", timeout=20_000)
    page.fill("#reason", "checked")
    page.click("#approve")
    expect(page.locator("#run-status")).to_have_text("completed", timeout=60_000)
    page.click("#sign-out")
    expect(page.locator("#workspace")).to_be_hidden()
    html = page.content()
    assert "echoed by the run" not in html and action_id not in html
    page.close()


def test_a_second_sign_in_while_the_first_is_checked_leaves_a_session_that_decides(host, browser) -> None:
    """A slow host: Sign in is clicked twice and the first click's check answers after the second signed in. That
    late answer is dropped; the session stays signed in, without an error, and decides."""
    action_id = submit_for_approval(host, {"topic": "t", "note": "signed in twice"})
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    held: list[Route] = []

    def hold_the_first(route: Route) -> None:
        if held:
            route.continue_()
        else:
            held.append(route)

    _sign_in_routing(page, host, SIGN_IN_CHECK, hold_the_first)
    page.click("#sign-in-form button[type=submit]")  # again: the token is still in its field
    expect(_card(page, action_id).locator(".preview")).to_contain_text("signed in twice", timeout=20_000)
    with page.expect_console_message(lambda message: "was dropped" in message.text, timeout=20_000):
        held[0].continue_()
    expect(page.locator("#workspace")).to_be_visible()
    assert page.locator("#sign-in-error").text_content() == ""
    _card(page, action_id).click()
    expect(page.locator("#d-input")).to_contain_text("signed in twice", timeout=20_000)
    page.fill("#reason", "after a double sign-in")
    page.click("#approve")
    expect(page.locator("#decided-note")).to_contain_text("Approved", timeout=20_000)
    assert page.locator("#decide-error").text_content() == ""
    page.close()


def test_the_detail_names_the_inputs_the_crew_fills_itself(host, browser) -> None:
    """``echo`` fills ``topic`` itself (a ``before_kickoff`` callback) when a request leaves it out: the detail
    says that the crew's code may set the inputs and names the one left out, counting none of it in the
    input's warning. A queue loaded again after the card's input was read (as the approval stream's ``ready``
    does; its pages carry the plain reason) keeps it, even when the detail's own read then fails (before,
    the detail showed the plain reason beside the input, with Approve enabled)."""
    left_out = submit_for_approval(host, {"customer": "Dana"})
    carried = submit_for_approval(host, {"topic": "given"})
    page = _signed_in(browser, host)
    expect(_card(page, left_out).locator(".preview")).to_contain_text("Dana", timeout=20_000)
    page.evaluate("loadPending()")
    page.route(APPROVAL, _unreadable)
    _card(page, left_out).click()
    expect(page.locator("#d-input")).to_contain_text("Dana")
    why = page.locator("#d-why")
    expect(why).to_contain_text("may set or change them, with values no approver sees")
    expect(why).to_contain_text('this request leaves out ["topic"]')
    expect(page.locator("#d-warning")).to_be_hidden()
    page.unroute(APPROVAL)
    page.keyboard.press("Escape")
    _card(page, carried).click()
    expect(page.locator("#d-input")).to_contain_text("given", timeout=20_000)
    expect(why).to_contain_text("with values no approver sees")
    expect(why).not_to_contain_text("leaves out")
    page.close()
