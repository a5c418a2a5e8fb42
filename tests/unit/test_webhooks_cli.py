"""``aip-crewai webhooks deliveries`` (aip_crewai/webhooks_cli.py) against a canned host on loopback: the
filters go out as the route's query, a page prints one line per delivery and the next page's command,
``--json`` prints the page, a refusal exits as every client command's does (4 for a 403, 1 for a 400) with the
host's error."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from aip_crewai import cli
from aip_crewai.exit_codes import Exit
from aip_crewai.webhooks_cli import delivery_lines

pytestmark = pytest.mark.timeout(60)

DELIVERY = {
    "delivery_id": "msg_1",
    "endpoint_id": "whe_" + "a" * 24,
    "event_type": "action.completed",
    "action_id": "act_1",
    "status": "delivered",
    "attempts": 3,
    "created_at": "2026-12-02T00:00:00.000Z",
    "deadline_at": "2026-12-03T00:00:00.000Z",
    "next_attempt_at": None,
    "finished_at": "2026-12-02T00:00:01.000Z",
    "last_outcome": "delivered",
    "history": [],
}
PAGE = {"deliveries": [DELIVERY], "cursor": "abc", "done": False}
REFUSAL = {
    "aip_version": "1.0",
    "message_type": "aip.core.v1.error",
    "body": {"error": {"error": {"code": "policy.forbidden", "message": "operators only", "category": "policy"}}},
}

INVALID = {
    "aip_version": "1.0",
    "message_type": "aip.core.v1.error",
    "body": {"error": {"error": {"code": "message.invalid_envelope", "message": "status", "category": "permanent"}}},
}


class _Handler(BaseHTTPRequestHandler):
    queries: list[dict[str, list[str]]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        type(self).queries.append(query)
        status, body = {"expired": (403, REFUSAL), "bogus": (400, INVALID)}.get(
            query.get("status", [""])[0], (200, PAGE)
        )
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def host_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def token(tmp_path: Path) -> str:
    path = tmp_path / "operator.token"
    path.write_text("tok\n")
    path.chmod(0o600)
    return str(path)


def _deliveries(host_url: str, token: str, *extra: str) -> int:
    return cli.main(["webhooks", "deliveries", "--url", host_url, "--token-file", token, *extra])


def test_the_filters_are_the_routes_query_and_a_page_prints_lines_and_the_next_command(host_url, token, capsys):
    _Handler.queries.clear()
    code = _deliveries(
        host_url, token, "--status", "delivered", "--event-type", "action.completed", "--action-id", "act_1",
        "--endpoint", DELIVERY["endpoint_id"], "--limit", "5", "--cursor", "c0",
    )  # fmt: skip
    assert code == Exit.OK
    assert _Handler.queries == [
        {
            "status": ["delivered"],
            "event_type": ["action.completed"],
            "action_id": ["act_1"],
            "endpoint": [DELIVERY["endpoint_id"]],
            "limit": ["5"],
            "cursor": ["c0"],
        }
    ]
    lines = capsys.readouterr().out.splitlines()
    assert "delivered" in lines[0] and "act_1" in lines[0] and "attempts=3" in lines[0] and "msg_1" in lines[0]
    assert lines[1] == "more: add --cursor abc"


def test_json_prints_the_page_and_a_refusal_exits_as_for_every_client_command(host_url, token, capsys):
    """A 403 was exit 1 here and 4 for the other commands: the one mapping now (exit_codes.of_error)."""
    assert _deliveries(host_url, token, "--json") == Exit.OK
    assert json.loads(capsys.readouterr().out) == PAGE
    assert _deliveries(host_url, token, "--status", "expired") == Exit.DENIED
    assert "403 policy.forbidden" in capsys.readouterr().err
    assert _deliveries(host_url, token, "--status", "bogus", "--json") == Exit.FAILED
    out, err = capsys.readouterr()
    assert "400 message.invalid_envelope" in err and json.loads(out) == INVALID


def test_an_empty_last_page_says_so():
    assert delivery_lines({"deliveries": [], "cursor": None, "done": True}) == ["no deliveries"]
