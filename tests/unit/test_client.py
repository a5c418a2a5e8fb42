"""The tenant client reads every frame a host can send: a ``result`` envelope carrying an output of up to
4 MiB (``contracts.sidecar.MAX_OUTPUT_BYTES``) arrives whole; only a frame past ``client.MAX_FRAME_BYTES`` is
refused, typed (``SSEFrameTooLarge``), which the CLI prints as one line. An answer that is not the
host's (the sidecar's 401, anything not AIP) is one line that names the flag giving the host's URL."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2
import pytest

from aip_crewai import cli
from aip_crewai.client import HOST_URL_FIX, MAX_FRAME_BYTES, AipClient, AipClientError, foreign_answer
from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.exit_codes import Exit
from aip_crewai.sse import SSEFrameTooLarge, encode_event


def _client_streaming(frame_data: str) -> AipClient:
    body = encode_event(frame_data, event="result", id="sse_1")

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"Content-Type": "text/event-stream"})

    client = AipClient("http://host.test", token="t")
    client.http = httpx2.Client(base_url="http://host.test", transport=httpx2.MockTransport(answer))
    return client


def test_a_result_with_the_largest_output_is_read_whole() -> None:
    output = {"raw": "x" * (MAX_OUTPUT_BYTES - 64)}
    envelope = {"message_type": "aip.core.v1.action_result", "body": {"action_result": {"output": output}}}
    events = list(_client_streaming(json.dumps(envelope)).follow("act_1"))
    assert [event for event, _ in events] == ["result"]
    assert events[0][1]["body"]["action_result"]["output"] == output


def test_a_frame_past_the_bound_is_refused_typed() -> None:
    with pytest.raises(SSEFrameTooLarge):
        list(_client_streaming("x" * (MAX_FRAME_BYTES + 1)).follow("act_1"))


# --- an answer that is not the host's names the fix -------------------------------------------


def _client_answering(status: int, content: bytes, content_type: str = "application/json") -> AipClient:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, content=content, headers={"Content-Type": content_type})

    client = AipClient("http://127.0.0.1:8090", token="t")
    client.http = httpx2.Client(base_url="http://127.0.0.1:8090", transport=httpx2.MockTransport(answer))
    return client


def test_the_sidecars_401_says_it_is_the_sidecar_and_names_the_host_url_flag() -> None:
    from aip_crewai.sidecar.http.auth import _UNAUTHORIZED_BODY  # the sidecar's own 401 body

    with pytest.raises(AipClientError) as info:
        _client_answering(401, _UNAUTHORIZED_BODY).manifest()
    assert str(info.value) == (
        '401 from http://127.0.0.1:8090: this looks like the aip-crewai sidecar (it answered {"detail": '
        '"missing or invalid bearer token"}), not the host; ' + HOST_URL_FIX
    )
    assert (info.value.status, info.value.code) == (401, "unknown")
    assert "--url" in HOST_URL_FIX and "AIP_CREWAI_HOST_URL" in HOST_URL_FIX and "bind" in HOST_URL_FIX


@pytest.mark.parametrize(
    ("status", "content", "shown"),
    [
        (404, b"<html>Not Found</html>", '"<html>Not Found</html>"'),
        (200, b"[1, 2]", "[1, 2]"),
        (502, b'{"error": "bad gateway\\n\\u202e"}', '{"error": "bad gateway\\n\\u202e"}'),
    ],
)
def test_any_other_foreign_answer_is_one_line_naming_the_flag(status: int, content: bytes, shown: str) -> None:
    with pytest.raises(AipClientError) as info:
        _client_answering(status, content).manifest()
    message = str(info.value)
    assert message == (
        f"{status} from http://127.0.0.1:8090: not an AIP answer ({shown}), so this is probably not the "
        f"aip-crewai host; {HOST_URL_FIX}"
    )
    assert "\n" not in message and "\u202e" not in message


@pytest.mark.parametrize("length", [120, 121])
def test_a_foreign_body_is_shown_up_to_120_characters(length: int) -> None:
    body = "x" * (length - 2)  # its JSON form is `length` characters
    message = foreign_answer(500, body, None)
    shown = message.split("(", 1)[1].split(")", 1)[0]
    assert shown == (json.dumps(body) if length <= 120 else json.dumps(body)[:119] + "…")
    assert message.startswith("500: not an AIP answer")


def test_an_aip_error_keeps_its_code_and_message() -> None:
    envelope = {"body": {"error": {"error": {"code": "capability.not_found", "message": "capability x not found"}}}}
    with pytest.raises(AipClientError) as info:
        _client_answering(404, json.dumps(envelope).encode()).manifest()
    assert (str(info.value), info.value.code) == (
        "404 capability.not_found: capability x not found",
        "capability.not_found",
    )


class _SidecarLike(BaseHTTPRequestHandler):
    """Answers every request as the sidecar does without its token: 401 and its own error body."""

    def log_message(self, *args: object) -> None:
        return None

    def _unauthorized(self) -> None:
        from aip_crewai.sidecar.http.auth import _UNAUTHORIZED_BODY

        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Length", str(len(_UNAUTHORIZED_BODY)))
        self.end_headers()
        self.wfile.write(_UNAUTHORIZED_BODY)

    do_GET = do_POST = _unauthorized  # noqa: N815


def test_a_cli_pointed_at_the_sidecar_says_so_in_one_line_and_names_the_flag(tmp_path: Path, capsys) -> None:
    token = tmp_path / "tenant.token"
    token.write_text("tok\n")
    token.chmod(0o600)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SidecarLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert cli.main(["manifest", "--url", url, "--token-file", str(token)]) == Exit.DENIED
        call = ["call", "cap:crewai:x", "--input", "{}", "--idempotency-key", "k", "--url", url]
        assert cli.main([*call, "--token-file", str(token)]) == Exit.DENIED
    finally:
        server.shutdown()
        server.server_close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1]
    assert lines[0].startswith(f"aip-crewai: 401 from {url}: this looks like the aip-crewai sidecar")
    assert "--url or AIP_CREWAI_HOST_URL" in lines[0] and "{'detail'" not in lines[0]
