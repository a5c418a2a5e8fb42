"""A tenant page in real Chromium consumes an action's stream with EventSource and a stream token, from a
different origin through CORS: the token is minted with fetch() and the bearer
(a CORS preflight), the stream needs no header, the AIP frames arrive as named events, and after the
result the host's 204 on reconnect stops EventSource for good."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from typing import Any

import pytest
from host_process import TOKENS, free_port, start_host

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(180)]

PAGE = """<!doctype html>
<meta charset="utf-8"><title>tenant stream</title>
<pre id="chunks"></pre><p id="status">waiting</p><p id="ack"></p><p id="state"></p><p id="errors"></p>
<script>
const params = new URLSearchParams(location.search);
const host = params.get("host"), action = params.get("action");
async function main() {
  const minted = await fetch(`${host}/aip/v1/actions/${action}/stream-token`, {
    method: "POST", headers: {Authorization: `Bearer ${params.get("token")}`}});
  if (!minted.ok) { document.getElementById("errors").textContent = `mint ${minted.status}`; return; }
  const {stream_url} = await minted.json();
  const source = new EventSource(host + stream_url);
  window.aipSource = source;
  const text = (event) => {
    const chunk = JSON.parse(event.data).body.stream_chunk;
    if (chunk && chunk.part && chunk.part.text) document.getElementById("chunks").textContent += chunk.part.text;
  };
  source.addEventListener("ack", (event) => {
    const ack = JSON.parse(event.data).body.ack;
    document.getElementById("ack").textContent = `${event.lastEventId} ${ack.status} ${ack.reason || ""}`.trim();
  });
  source.addEventListener("chunk", text);
  source.addEventListener("done", text);
  source.addEventListener("result", (event) => {
    document.getElementById("status").textContent = JSON.parse(event.data).body.action_result.status;
  });
  source.addEventListener("aip_error", (event) => { document.getElementById("errors").textContent += "aip_error "; });
  source.onerror = () => { document.getElementById("state").textContent = `readyState ${source.readyState}`; };
}
main().catch((err) => { document.getElementById("errors").textContent = String(err); });
</script>
"""


@pytest.fixture
def page_origin(tmp_path: Path) -> Any:
    root = tmp_path / "site"
    root.mkdir()
    (root / "tenant.html").write_text(PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_tenant_page_on_another_origin_follows_a_stream_with_eventsource(
    sidecar_factory, tmp_path, browser, artifacts, page_origin
) -> None:
    from playwright.sync_api import expect

    sidecar = sidecar_factory.start()
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token, host_options={"cors_origins": [page_origin]})
    try:
        topic = f"fjords-{new_id('t')}"
        action_id = new_id("act")
        with host.client("acme-app") as app, host.client("acme-approver") as approver:
            pending = app.call("cap:crewai:echo", {"topic": topic}, action_id=action_id, idempotency_key=new_id("k"))
            approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "browser")
        page = browser.new_page()
        page.goto(f"{page_origin}/tenant.html?host={host.base_url}&action={action_id}&token={TOKENS['acme-app']}")
        expect(page.locator("#status")).to_have_text("completed", timeout=60_000)
        expect(page.locator("#chunks")).to_contain_text(topic)
        expect(page.locator("#errors")).to_have_text("")
        # after the result frame the reconnect gets 204: EventSource is CLOSED (2) and stays so
        page.wait_for_function("window.aipSource && window.aipSource.readyState === 2", timeout=30_000)
        page.screenshot(path=str(artifacts / "tenant-eventsource.png"), full_page=True)
        page.close()
        assert TOKENS["acme-app"] not in host.log.read_text()
        assert "stream_token=" not in host.log.read_text()
    finally:
        host.stop()


#: How long the page watches a pending action's stream, seconds: a window in which nothing may happen (no
#: reconnect), not a wait for a result.
PENDING_WINDOW_S = 15


def test_eventsource_on_a_pending_action_holds_one_connection_and_gets_the_final_result(
    sidecar_factory, tmp_path, browser, page_origin
) -> None:
    """the pending state is the ack (``sse_0``, reason ``pending_approval``); the stream stays
    open through 15 s of pending (fewer than 3 connections), then carries the run to its result."""
    from playwright.sync_api import expect

    sidecar = sidecar_factory.start()
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token, host_options={"cors_origins": [page_origin]})
    try:
        topic = f"tundra-{new_id('t')}"
        action_id = new_id("act")
        with host.client("acme-app") as app:
            pending = app.call("cap:crewai:echo", {"topic": topic}, action_id=action_id, idempotency_key=new_id("k"))
        page = browser.new_page()
        streams: list[str] = []
        page.on(
            "request", lambda request: streams.append(request.url) if "/events?stream_token=" in request.url else None
        )
        page.goto(f"{page_origin}/tenant.html?host={host.base_url}&action={action_id}&token={TOKENS['acme-app']}")
        expect(page.locator("#ack")).to_have_text("sse_0 accepted pending_approval", timeout=30_000)
        page.wait_for_timeout(PENDING_WINDOW_S * 1000)
        assert len(streams) < 3, streams
        expect(page.locator("#status")).to_have_text("waiting")
        with host.client("acme-approver") as approver:
            approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "approved", "browser")
        expect(page.locator("#status")).to_have_text("completed", timeout=60_000)
        expect(page.locator("#chunks")).to_contain_text(topic)
        assert len(streams) < 3, streams
        page.close()
    finally:
        host.stop()
