"""Faithful display in real Chromium: an input holding a right-to-left override and a zero-width space is
rendered by the approval console with each of those code points as a highlighted ``\\u…`` marker under a
warning, so the rendered text never reads as the spoofed string (docs/approvals.md "The approval flow"); an input
of about 1 MiB of zero-width spaces renders in one pass with every one of them written as its marker, consecutive
ones in one highlighted run and the runs past the console's bound said and written without highlight
(docs/approvals.md "Approval console")."""

from __future__ import annotations

import pytest
from kits.host import TOKENS, submit_for_approval
from playwright.sync_api import expect

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

NOTE = "refund 10 EUR to account \u202e9876-5432\u202c then close"
USER = "ad\u200bmin"

#: Visual order of the first "9" and the first "2" of "9876-5432" inside an element: their rendered left edges
#: (a bidi override shows the digits reversed, so the "2" is drawn left of the "9").
VISUAL_ORDER = """(element) => {
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  const rect = (node, offset) => { const r = document.createRange(); r.setStart(node, offset);
    r.setEnd(node, offset + 1); return r.getBoundingClientRect().left; };
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const at = node.data.indexOf("9876-5432");
    if (at >= 0) return { nine: rect(node, at), two: rect(node, at + 8) };
  }
  return null;
}"""


def test_the_console_never_renders_a_spoofed_input_as_the_spoof(host, browser, artifacts) -> None:
    with host.client("acme-app") as app:
        pending = app.call(
            "cap:crewai:echo",
            {"topic": "t", "note": NOTE, "user": USER},
            action_id=new_id("act"),
            idempotency_key=new_id("k"),
        )
    assert pending["body"]["action_result"]["status"] == "pending_approval"
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    item = page.locator("#queue .card", has_text="cap:crewai:echo")
    expect(item).to_have_count(1, timeout=20_000)
    preview = item.locator(".preview")  # the card's input preview is faithful too
    expect(preview.locator("mark.cp")).to_have_count(3, timeout=20_000)
    assert "\\u202e9876-5432\\u202c" in preview.inner_text() and "\u202e" not in preview.inner_text()
    item.click()
    expect(page.locator("#d-warning")).to_be_visible(timeout=20_000)
    expect(page.locator("#d-warning-count")).to_have_text("3")
    shown = page.locator("#d-input")
    expect(shown.locator("mark.cp")).to_have_count(3)
    text = shown.inner_text()
    assert "account \\u202e9876-5432\\u202c then close" in text and "ad\\u200bmin" in text
    assert "\u202e" not in text and "\u202c" not in text and "\u200b" not in text
    assert "admin" not in text and "2345-6789" not in text
    order = shown.evaluate(VISUAL_ORDER)
    assert order is not None and order["nine"] < order["two"], order  # drawn in the order it runs

    # The measurement does tell a spoofed rendering: the same text put in the page as is reads reversed.
    raw = page.evaluate(
        """(note) => { const p = document.createElement("p"); p.id = "raw"; p.textContent = note;
                       document.body.append(p); return p.id; }""",
        NOTE,
    )
    spoofed = page.locator(f"#{raw}").evaluate(VISUAL_ORDER)
    assert spoofed is not None and spoofed["two"] < spoofed["nine"], spoofed
    page.screenshot(path=str(artifacts / "console-faithful-display.png"), full_page=True)
    page.close()


def test_an_input_of_a_million_invisible_bytes_renders_in_one_pass_with_every_character_marked(host, browser) -> None:
    blank = 340_000  # zero-width spaces: 3 bytes each in UTF-8, about 1 MiB (the host's bound on an input)
    past = 100  # "a\u00ad" pairs beyond the highlighted runs the console draws: one run each
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    page.goto(f"{host.base_url}/console/")
    runs = page.evaluate("MAX_MARKS")  # the console's bound on highlighted runs in one input
    pairs = runs + past
    action_id = submit_for_approval(host, {"blank": "\u200b" * blank, "soft": "a\u00ad" * pairs, "topic": "t"})
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    item = page.locator("#queue .card", has_text=action_id)
    expect(item).to_have_count(1, timeout=20_000)
    item.click()
    expect(page.locator("#d-warning-count")).to_have_text(f"at least {blank + pairs}", timeout=20_000)
    shown = page.locator("#d-input")
    marks = shown.locator("mark.cp")
    # One element per run, not per character: the 340,000 zero-width spaces are one highlighted run.
    assert page.evaluate("document.querySelectorAll('#d-input *').length") <= runs + 6  # + the 6 strings' spans
    expect(marks).to_have_count(runs)
    assert marks.first.text_content() == "\\u200b" * blank
    assert marks.first.get_attribute("title") == f"U+200B \u00d7{blank}"
    # The runs past the bound are said, and their characters are still written as markers, never as themselves.
    expect(page.locator("#d-plain")).to_be_visible()
    expect(page.locator("#d-plain-count")).to_have_text(str(pairs - (runs - 1)))
    text = shown.text_content()
    assert text.count("\\u200b") == blank and text.count("a\\u00ad") == pairs, (len(text), text[-200:])
    assert "\u200b" not in text and "\u00ad" not in text
    expect(page.locator("#approve")).to_be_enabled()  # the whole input is on screen
    page.close()


#: Where each needle's first code point is drawn: (line top, left edge), so that reading order compares as tuples.
LEFT_EDGES = """(element, needles) => {
  const range = document.createRange();
  const out = {};
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const needle of needles) {
      const at = node.data.indexOf(needle);
      if (at < 0 || needle in out) continue;
      range.setStart(node, at); range.setEnd(node, at + 1);
      const rect = range.getBoundingClientRect();
      out[needle] = [Math.round(rect.top), rect.left];
    }
  }
  return out;
}"""


def test_a_right_to_left_word_never_moves_the_digits_after_it(host, browser) -> None:
    """Within one string, a right-to-left letter used to carry the digit groups after it into its run: "שלום 3456
    7890" was drawn "7890 3456 םולש", the groups swapped. Now everything but the right-to-left words shows left
    to right in stored order; the words themselves still read right to left (their first letter drawn rightmost)."""
    account = "pay \u05e9\u05dc\u05d5\u05dd 3456 7890 \u0663\u0664 \u0665\u0666 done"
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    action_id = submit_for_approval(host, {"account": account, "topic": "t"})
    page.goto(f"{host.base_url}/console/")
    page.fill("#token", TOKENS["acme-approver"])
    page.click("#sign-in-form button[type=submit]")
    item = page.locator("#queue .card", has_text=action_id)
    expect(item).to_have_count(1, timeout=20_000)
    item.click()
    shown = page.locator("#d-input")
    expect(shown).to_contain_text("3456 7890", timeout=20_000)
    for where in (shown, item.locator(".preview")):
        at = where.evaluate(
            LEFT_EDGES, ["pay", "\u05e9", "\u05dd", "3456", "7890", "\u0663\u0664", "\u0665\u0666", "done"]
        )
        assert at["pay"] < at["\u05dd"] < at["\u05e9"] < at["3456"] < at["7890"], at  # the word reads RTL
        assert at["7890"] < at["\u0663\u0664"] < at["\u0665\u0666"] < at["done"], at  # Arabic-Indic digits too
    page.close()
