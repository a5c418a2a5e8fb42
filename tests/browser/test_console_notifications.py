"""The approval console shows whether an approval's webhook notification went out (docs/webhooks.md
"Notification state"), in real Chromium over a real host: a receiver that answers 500 shows as retrying on
the pending card and in the detail, and once the receiver answers 2xx the same card turns delivered without
a reload; the decided view shows it too. The receiver (tests/kits/webhook_receiver.py) verifies nothing
itself: the test checks every body it got with the ``standardwebhooks`` package."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.host import start_host
from kits.webhook_receiver import Receiver
from playwright.sync_api import expect
from standardwebhooks.webhooks import Webhook
from test_console_keyboard import sign_in_by_keyboard, submit, tab_to

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(240)]

SECRET = "whsec_" + base64.b64encode(b"c" * 32).decode()
#: Generous for a slow machine: a retry comes within about a second, the console reads every 3 s.
SHOWN_MS = 45_000


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, asyncio.AbstractEventLoop]]:
    """The receiver kit on its own event loop in a thread, answering 500 until its ``statuses`` is cleared."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = asyncio.run_coroutine_threadsafe(Receiver(statuses=[500] * 100_000).start(), loop).result(30)
    try:
        yield started, loop
    finally:
        asyncio.run_coroutine_threadsafe(started.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture
def hooked_host(sidecar_factory, tmp_path, receiver) -> Iterator[Any]:
    """A host whose tenant acme sends ``approval.requested`` to the receiver, retrying every 0.3 .. 1 s."""
    sidecar = sidecar_factory.start()
    secret = tmp_path / "acme.whsec"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    entry = "\n".join(
        [
            "[[webhooks]]",
            'tenant = "acme"',
            f"url = {json.dumps(receiver[0].url)}",
            f"secret_file = {json.dumps(str(secret))}",
            'events = ["approval.requested"]',
            "timeout_seconds = 5",
            "retry_initial_seconds = 0.3",
            "retry_max_seconds = 1",
            "",
        ]
    )
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token, extra_toml=entry)
    try:
        yield host
    finally:
        host.stop()


def test_a_failing_receiver_shows_retrying_then_delivered_without_a_reload(
    hooked_host, receiver, browser, artifacts: Path
) -> None:
    answering, loop = receiver
    page = browser.new_page(viewport={"width": 1280, "height": 860})
    sign_in_by_keyboard(page, hooked_host)
    action_id = submit(hooked_host, note="notify me")
    card = page.locator("#queue .card", has_text=action_id)
    expect(card).to_have_count(1, timeout=20_000)
    expect(card.locator(".notify")).to_contain_text("retrying", timeout=SHOWN_MS)
    expect(card.locator(".notify")).to_contain_text("http_error")
    assert answering.received  # the receiver was asked, and answered 500

    tab_to(page, f'#queue .card[data-approval-id="{card.get_attribute("data-approval-id")}"]')
    page.keyboard.press("Enter")  # the detail shows it too
    expect(page.locator("#d-action")).to_have_text(action_id, timeout=20_000)
    expect(page.locator("#d-notify")).to_contain_text("retrying", timeout=SHOWN_MS)
    page.screenshot(path=str(artifacts / "console-notification-retrying.png"), full_page=True)

    loop.call_soon_threadsafe(answering.statuses.clear)  # from now on the receiver answers 200
    expect(card.locator(".notify")).to_contain_text("delivered", timeout=SHOWN_MS)
    expect(page.locator("#d-notify")).to_contain_text("delivered", timeout=SHOWN_MS)
    page.screenshot(path=str(artifacts / "console-notification-delivered.png"), full_page=True)
    bodies = [Webhook(SECRET).verify(body, headers) for headers, body in list(answering.received)]
    assert {b["type"] for b in bodies} == {"approval.requested"}
    assert {b["data"]["request"]["action_id"] for b in bodies} == {action_id}
    assert len({h["webhook-id"] for h, _ in answering.received}) == 1  # one delivery, retried

    tab_to(page, "#reason")
    page.keyboard.type("notified and checked")
    tab_to(page, "#deny")
    page.keyboard.press("Enter")
    expect(page.locator("#d-status")).to_contain_text("denied", timeout=20_000)
    page.keyboard.press("Escape")
    page.click("#view-decided")
    decided = page.locator("#history .card", has_text=action_id)
    expect(decided.locator(".notify")).to_contain_text("delivered", timeout=SHOWN_MS)
    page.close()
