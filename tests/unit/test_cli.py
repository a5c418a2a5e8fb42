"""``aip-crewai`` client commands: exit codes per outcome, with and without --stream/--json,
usage errors, --version, help text, ``| head`` (docs/reference/cli.md "Exit codes").

The host is a canned AIP server on loopback (one answer per capability id), so
every outcome is produced on demand; the real host and sidecar answer the same
shapes in ``tests/integration/test_host_sidecar.py::test_cli_call_and_approvals``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from aip_crewai import cli
from aip_crewai.exit_codes import Exit

pytestmark = pytest.mark.timeout(60)


def _result(status: str, error_code: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"action_id": "act_1", "status": status}
    if error_code:
        result["error"] = {"code": error_code, "message": "m", "category": "x", "retryable": False}
    return {"aip_version": "1.0", "message_type": "aip.core.v1.action_result", "body": {"action_result": result}}


def _error(code: str) -> dict[str, Any]:
    return {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.error",
        "body": {"error": {"error": {"code": code, "message": "refused", "category": "x", "retryable": False}}},
    }


#: (batch item, text) of the chunks ``cap:batch`` streams.
BATCH_CHUNKS = [(0, "first "), (0, "item"), (1, "second item")]


def _chunk(sequence: int, item: int, text: str) -> dict[str, Any]:
    chunk = {
        "action_id": "act_1",
        "sequence": sequence,
        "kind": "data",
        "data": {"content": text, "batch_item": item},
        "part": {"type": "text", "text": text},
    }
    return {"aip_version": "1.0", "message_type": "aip.core.v1.stream_chunk", "body": {"stream_chunk": chunk}}


ACK = {
    "aip_version": "1.0",
    "message_type": "aip.core.v1.ack",
    "body": {"ack": {"action_id": "act_1", "status": "accepted"}},
}
PENDING_ACK = {
    "aip_version": "1.0",
    "message_type": "aip.core.v1.ack",
    "body": {"ack": {"action_id": "act_1", "status": "accepted", "reason": "pending_approval"}},
}

#: capability id -> (HTTP status of a sync answer, sync answer, stream frames [(event, envelope)])
OUTCOMES: dict[str, tuple[int, dict[str, Any], list[tuple[str, dict[str, Any]]]]] = {
    "cap:done": (200, _result("completed"), [("ack", ACK), ("result", _result("completed"))]),
    "cap:failed": (
        200,
        _result("failed", "connector.crewai.execution_failed"),
        [
            ("ack", ACK),
            ("aip_error", _error("connector.crewai.execution_failed")),
            ("result", _result("failed", "connector.crewai.execution_failed")),
        ],
    ),
    "cap:cancelled": (200, _result("cancelled"), [("ack", ACK), ("result", _result("cancelled"))]),
    "cap:denied": (
        200,
        _result("failed", "policy.approval_denied"),
        [
            ("ack", ACK),
            ("aip_error", _error("policy.approval_denied")),
            ("result", _result("failed", "policy.approval_denied")),
        ],
    ),
    "cap:pending": (202, _result("pending_approval"), [("ack", PENDING_ACK), ("result", _result("pending_approval"))]),
    "cap:running": (202, ACK, [("ack", ACK)]),
    "cap:unknown": (404, _error("capability.not_found"), []),
    "cap:batch": (
        200,
        _result("completed"),
        [("ack", ACK), *[("chunk", _chunk(n, item, text)) for n, (item, text) in enumerate(BATCH_CHUNKS)]]
        + [("result", _result("completed"))],
    ),
    "cap:forbidden": (403, _error("policy.forbidden"), []),
}
EXPECTED = {
    "cap:done": Exit.OK,
    "cap:batch": Exit.OK,
    "cap:failed": Exit.FAILED,
    "cap:cancelled": Exit.CANCELLED,
    "cap:denied": Exit.DENIED,
    "cap:pending": Exit.PENDING_APPROVAL,
    "cap:running": Exit.RUNNING,
    "cap:unknown": Exit.FAILED,
    "cap:forbidden": Exit.DENIED,
}
BIG_MANIFEST = {
    "capabilities": [
        {
            "id": f"cap:crewai:crew{i}",
            "kind": "agent",
            "description": "x" * 80,
            "input_schema": {"type": "object", "properties": {"topic": {}}},
        }
        for i in range(3000)
    ]
}


def _approval_event(kind: str, status: str, decision: dict[str, Any] | None = None) -> str:
    view: dict[str, Any] = {
        "request": {
            "id": "apr_1",
            "capability_id": "cap:crewai:echo",
            "action_id": "act_1",
            "requester": {"id": "svc:app", "kind": "service"},
            "expires_at": "2026-09-21T14:28:20.000Z",
            "policy_hash": "ab12",
        },
        "status": status,
    }
    if decision:
        view["decision"] = decision
    return json.dumps({"id": "x", "kind": f"approval.{kind}", "occurred_at": "2026-09-21T14:13:20.000Z", "data": view})


#: What the fake host streams on /aip/v1/approvals/events: the queue, ready, a decision, then it ends.
APPROVAL_FRAMES = (
    f"event: pending\ndata: {_approval_event('pending', 'pending')}\n\n"
    'id: apv_1\nevent: ready\ndata: {"position": "apv_1"}\n\n'
    f"id: apv_2\nevent: decided\ndata: {_approval_event('decided', 'approved', {'decision': 'approved', 'approver': {'id': 'human:bob', 'kind': 'human'}})}\n\n"
).encode()


SPOOF_INPUT = {"note": "refund 10 EUR to account \u202e9876-5432\u202c then close", "user": "ad\u200bmin"}
SPOOF_VIEW = {
    "request": {
        "id": "apr_spoof",
        "action_id": "act_spoof",
        "capability_id": "cap:crewai:echo",
        "requester": {"id": "svc:app", "kind": "service"},
        "expires_at": "2026-09-21T14:28:20.000Z",
        "policy_hash": "ab12",
        "risk": "medium",
        "reason": "cap:crewai:echo changes crew state; ... values no approver sees: \u202etopic",
        "evidence": [],
    },
    "status": "pending",
    "created_at": "2026-09-21T14:13:20.000Z",
    "updated_at": "2026-09-21T14:13:20.000Z",
    "evidence_payload": {
        "action_id": "act_spoof",
        "capability_id": "cap:crewai:echo",
        "input_hash": "cd34",
        "input": SPOOF_INPUT,
    },
}

USAGE = {"tenant": "acme", "crews": [], "totals": {"actions": 0}}
#: HTTP status → the host's error code of a refused ``GET /aip/v1/usage``.
USAGE_REFUSALS = {400: "request.invalid_range", 401: "auth.unauthenticated", 403: "policy.forbidden"}


#: A ``Last-Event-ID`` past the end of the fake host's stream: it answers ``204 No Content``.
END_OF_STREAM = "sse_999999"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/aip/v1/manifest":
            self._send(200, json.dumps(BIG_MANIFEST).encode())
        elif self.path.startswith("/aip/v1/approvals?"):
            self._send(200, json.dumps({"approvals": [SPOOF_VIEW], "cursor": "c2"}).encode())
        elif self.path == "/aip/v1/approvals/apr_spoof":
            self._send(200, json.dumps(SPOOF_VIEW).encode())
        elif self.path.startswith("/aip/v1/usage"):
            status = int(self.path.rpartition("from=")[2] or 200)  # the test names the status it wants
            answer = USAGE if status == 200 else _error(USAGE_REFUSALS[status])
            self._send(status, json.dumps(answer).encode())
        elif self.path == "/aip/v1/approvals/events":
            self._send(200, APPROVAL_FRAMES, "text/event-stream")
        elif self.path.endswith("/result"):
            self._send(200, json.dumps(OUTCOMES["cap:cancelled"][1]).encode())
        elif self.path.endswith("/events") and self.headers.get("Last-Event-ID") == END_OF_STREAM:
            self._send(204, b"")  # the host's answer at or past the result frame of an ended action
        elif self.path.endswith("/events"):
            self._stream(OUTCOMES["cap:denied"][2])
        else:
            self._send(200, json.dumps({"action_id": "act_1", "state": "running"}).encode())

    def do_POST(self) -> None:  # noqa: N802
        if self.path.endswith("/cancel"):  # the runtime cancel route
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(200, json.dumps(_result("cancelled")).encode())
            return
        envelope = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status, answer, frames = OUTCOMES[envelope["body"]["action"]["capability_id"]]
        if "text/event-stream" in self.headers.get("Accept", "") and frames:
            self._stream(frames)
        else:
            self._send(status, json.dumps(answer).encode())

    def _stream(self, frames: list[tuple[str, dict[str, Any]]]) -> None:
        body = b"".join(
            f"id: sse_{n}\nevent: {event}\ndata: {json.dumps(env)}\n\n".encode()
            for n, (event, env) in enumerate(frames)
        )
        self._send(200, body, "text/event-stream")


@pytest.fixture(scope="module")
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
    path = tmp_path / "tenant.token"
    path.write_text("tok\n")
    path.chmod(0o600)
    return str(path)


def _call(host_url: str, token: str, capability: str, *extra: str) -> int:
    return cli.main(
        [
            "call",
            capability,
            "--input",
            "{}",
            "--idempotency-key",
            "k",
            "--url",
            host_url,
            "--token-file",
            token,
            *extra,
        ]
    )


@pytest.mark.parametrize("mode", [(), ("--json",), ("--stream",), ("--stream", "--json")], ids=" ".join)
@pytest.mark.parametrize("capability", sorted(EXPECTED))
def test_call_exit_code_names_the_outcome_in_every_mode(host_url, token, capsys, capability, mode):
    if "--stream" in mode and not OUTCOMES[capability][2]:
        mode = tuple(m for m in mode if m != "--stream")  # a refusal is answered before any stream
    assert _call(host_url, token, capability, *mode) == EXPECTED[capability]


def test_exit_codes_are_distinct_and_config_errors_are_2():
    values = [code.value for code in Exit]
    assert len(values) == len(set(values))
    assert Exit.USAGE == 2 and Exit.OK == 0 and Exit.FAILED == 1


def test_actions_result_and_follow_use_the_call_exit_codes(host_url, token, capsys):
    assert cli.main(["actions", "result", "act_1", "--url", host_url, "--token-file", token]) == Exit.CANCELLED
    capsys.readouterr()
    assert cli.main(["actions", "follow", "act_1", "--url", host_url, "--token-file", token, "--json"]) == Exit.DENIED
    frames = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [f["event"] for f in frames][-3:] == ["ack", "aip_error", "result"]
    assert cli.main(["actions", "show", "act_1", "--url", host_url, "--token-file", token]) == Exit.OK


@pytest.mark.parametrize("as_json", [False, True])
def test_follow_past_the_end_says_so_and_exits_as_actions_result(host_url, token, capsys, as_json):
    """Regression: ``actions follow ID --last-event-id sse_N`` at or past the result frame of an ended action
    (the host's 204) printed nothing and exited 1 ("failed"). It says the stream has nothing after that
    position, prints the stored result as ``actions result`` does and exits with its outcome (3 here)."""
    flags = ["--url", host_url, "--token-file", token, *(["--json"] if as_json else [])]
    assert cli.main(["actions", "result", "act_1", *flags]) == Exit.CANCELLED
    result = capsys.readouterr().out
    assert cli.main(["actions", "follow", "act_1", "--last-event-id", END_OF_STREAM, *flags]) == Exit.CANCELLED
    out, err = capsys.readouterr()
    assert out == result
    assert err == (
        "aip-crewai: the stream of act_1 has nothing after sse_999999: the action has ended; "
        "its result, as aip-crewai actions result act_1 prints it:\n"
    )


def test_manifest_lists_capabilities_and_their_input_fields(host_url, token, capsys):
    assert cli.main(["manifest", "--url", host_url, "--token-file", token]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cap:crewai:crew0  [agent]") and out[1] == "    input: topic?: any"


def test_unreachable_host_is_its_own_code(token, capsys):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert _call(f"http://127.0.0.1:{port}", token, "cap:done") == Exit.UNREACHABLE
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["call", "cap:x", "--input", "[1]"], "must be a JSON object"),
        (["call", "cap:x", "--input", "{"], "--input is not JSON"),
        (["call", "cap:x", "--input", "{}", "--url", "127.0.0.1:8081"], "http://127.0.0.1:8081"),
        (["call", "cap:x", "--input", "{}"], "--token-file or --signing-key"),
        (["call", "cap:x", "--input", "{}", "--token-file", "/nonexistent/token"], "/nonexistent/token"),
        (["call"], "required"),
        (["approvals", "list", "--signing-key", "/nonexistent/key.pem"], "--signing-key needs --key-id"),
        (["approvals", "decide", "apr_1", "approved", "--reason", "r", "--signing-key", "k.pem"], "--key-id"),
        (["actions", "show", "act_1", "--signing-key", "k.pem"], "--key-id"),
        (["actions", "show", "../../etc"], "'../../etc' is not an action id: 1 to 256 visible ASCII characters"),
        (["actions", "follow", "a" * 257], "is not an action id"),
        (["call", "cap:x", "--input", "{}", "--action-id", "a b"], "'a b' is not an action id"),
        (["approvals", "watch", "--count", "1_0"], "'1_0' must be an integer 1..1000000 (ASCII digits only)"),
        (["approvals", "watch", "--count", "0"], "'0' must be an integer 1..1000000"),
        (["journal", "list", "j.db", "--limit", " 5 "], "' 5 ' must be an integer 1..1000000 (ASCII digits only)"),
        (["webhooks", "deliveries", "--limit", "+5"], "'+5' must be an integer 1..200 (ASCII digits only)"),
        (["journal", "import", "r.json", "--max-events-per-run", "1e3"], "'1e3' must be an integer 2..100000"),
        (["journal", "import", "r.json", "--max-event-bytes", "\u0665\u0665\u0665\u0665"], "must be an integer 1024.."),
    ],
)
def test_usage_and_configuration_errors_exit_2_with_a_hint(argv, says, capsys, monkeypatch):
    monkeypatch.delenv("AIP_CREWAI_TOKEN_FILE", raising=False)
    monkeypatch.delenv("AIP_CREWAI_SIGNING_KEY", raising=False)
    monkeypatch.delenv("AIP_CREWAI_KEY_ID", raising=False)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def _silent_port() -> int:
    """A loopback port nothing listens on: a request sent there is exit 7, not 2."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["approvals", "show", ""], "'' is not an approval id: the apr_"),
        (["approvals", "show", "  "], "'  ' is not an approval id"),
        (["approvals", "decide", "", "approved", "--reason", "r"], "'' is not an approval id"),
        (["approvals", "decide", "apr/1", "denied", "--reason", "r"], "'apr/1' is not an approval id"),
        (["actions", "result", ""], "'' is not an action id"),
        (["actions", "cancel", " "], "' ' is not an action id"),
        (["call", "cap:x", "--input", "{}", "--action-id", ""], "'' is not an action id"),
        (["actions", "follow", "act_1", "--last-event-id", ""], "'' is empty"),
        (["approvals", "watch", "--last-event-id", " "], "' ' is empty"),
        (["approvals", "list", "--cursor", ""], "'' is empty"),
        (["webhooks", "deliveries", "--cursor", ""], "argument --cursor: '' is empty"),
        (["webhooks", "deliveries", "--cursor", "  "], "argument --cursor: '  ' is empty"),
        (["webhooks", "deliveries", "--action-id", ""], "argument --action-id: '' is not an action id"),
        (["webhooks", "deliveries", "--action-id", "a/b"], "argument --action-id: 'a/b' is not an action id"),
        (["usage", "--from", ""], "argument --from: '' is empty"),
        (["usage", "--to", " "], "argument --to: ' ' is empty"),
    ],
)
def test_an_empty_or_blank_id_is_a_usage_error_before_any_request(argv, says, token, capsys):
    """``approvals show ""`` asked for ``/aip/v1/approvals/`` and reported the host's 307 redirect; an empty
    ``--last-event-id`` or ``--cursor`` silently meant "from the start". Each is refused before anything is
    sent (the URL below answers nothing: a request would be exit 7). ``webhooks deliveries`` sent its
    ``--cursor`` and ``--action-id`` to the host (a 400, exit 1); ``usage --from ""`` was dropped (the whole
    range), where the host answers ``from=`` with 400."""
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--url", f"http://127.0.0.1:{_silent_port()}", "--token-file", token])
    err = capsys.readouterr().err
    assert exc.value.code == Exit.USAGE, err
    assert says in err and "cannot reach" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "status, expected", [(200, Exit.OK), (400, Exit.FAILED), (401, Exit.DENIED), (403, Exit.DENIED)]
)
def test_usage_exits_as_every_client_command_on_a_refusal(status, expected, host_url, token, capsys):
    """``usage`` exited 1 on a 403 where the other commands exit 4: the one mapping now (exit_codes.of_error)."""
    code = cli.main(["usage", "--from", str(status), "--url", host_url, "--token-file", token, "--json"])
    out, err = capsys.readouterr()
    assert code == expected, err
    if status == 200:
        assert json.loads(out) == USAGE and err == ""
    else:  # as for the other commands: the refusal on stderr, its envelope on stdout with --json
        assert f"{status} {USAGE_REFUSALS[status]}" in err and json.loads(out) == _error(USAGE_REFUSALS[status])


def test_journal_inspect_refuses_an_empty_job_id_as_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["journal", "inspect", str(tmp_path / "journal.db"), ""])
    assert exc.value.code == Exit.USAGE and "'' is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, says",
    [
        (b"garbage\n", "not a PEM private key"),
        (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "not a PEM private key"),
        (None, "encrypted; give an unencrypted PEM key"),  # an Ed25519 key encrypted with a password
    ],
)
def test_a_signing_key_that_is_no_usable_key_is_one_line_and_exit_2(content, says, tmp_path, capsys, monkeypatch):
    """A garbled or encrypted ``--signing-key`` file: one line naming the file and what is wrong, exit 2,
    never a traceback (the file's content is never shown)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if content is None:
        content = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    key = tmp_path / "signing.pem"
    key.write_bytes(content)
    key.chmod(0o600)
    monkeypatch.delenv("AIP_CREWAI_TOKEN_FILE", raising=False)
    code = cli.main(["approvals", "list", "--signing-key", str(key), "--key-id", "human:approver"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert says in err and str(key) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip().startswith("aip-crewai ")


def _actions(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from ((f"{name} {where}", a) for where, a in _actions(child))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, action


def test_every_argument_has_help_text():
    missing = [f"{where}: {action.dest}" for where, action in _actions(cli.build_parser()) if not action.help]
    assert missing == []


@pytest.mark.processes
def test_a_closed_pipe_ends_quietly(host_url, token):
    """``aip-crewai manifest | head -1``: no "Broken pipe" message, exit 141 (docs/reference/cli.md "Exit codes")."""
    process = subprocess.Popen(
        [sys.executable, "-m", "aip_crewai.cli", "manifest", "--url", host_url, "--token-file", token],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith(b"cap:crewai:crew0")
    process.stdout.close()  # the reader goes away, as head does; the rest (> a pipe buffer) cannot be written
    err = process.stderr.read()
    assert process.wait(timeout=30) == Exit.BROKEN_PIPE
    assert err == b""


def test_a_stream_that_ends_without_its_result_says_how_to_resume(capsys):
    """Issue 17 item 4: a host that shuts down ends the stream; the CLI tells the user and the resume command."""
    events = [
        ("ack", {"correlation_id": "act_cut", "_sse_id": "sse_0", "body": {"ack": {"status": "streaming"}}}),
        (
            "chunk",
            {
                "correlation_id": "act_cut",
                "_sse_id": "sse_1",
                "body": {"stream_chunk": {"kind": "data", "content": "x"}},
            },
        ),
    ]
    cli._show_stream(events, False)
    err = capsys.readouterr().err
    assert "ended before the result" in err and "aip-crewai actions follow act_cut --last-event-id sse_1" in err
    finished = [*events, ("result", {"correlation_id": "act_cut", "_sse_id": "sse_2", "body": {}})]
    cli._show_stream(finished, False)
    assert "ended before the result" not in capsys.readouterr().err


def test_ctrl_c_during_a_stream_says_how_to_resume_and_exits_130(capsys):
    """A person stops `actions follow` (or `call --stream`) with Ctrl-C mid-stream: no traceback; stderr names
    the command that picks the stream up after the last frame printed, and the exit is 130 (128 + SIGINT)."""

    def stopped():
        yield "ack", {"correlation_id": "act_int", "_sse_id": "sse_0", "body": {"ack": {"status": "streaming"}}}
        yield "chunk", {"correlation_id": "act_int", "_sse_id": "sse_4", "body": {"stream_chunk": {"kind": "data"}}}
        raise KeyboardInterrupt

    assert cli._show_stream(stopped(), False) == Exit.INTERRUPTED == 130
    err = capsys.readouterr().err
    assert "aip-crewai: interrupted; resume with: aip-crewai actions follow act_int --last-event-id sse_4" in err
    assert "Traceback" not in err


def test_ctrl_c_in_any_client_command_exits_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C while a client command waits (a blocking `call`, a request in flight): exit 130, no traceback."""

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv: argparse.Namespace(func=interrupted))
    assert cli.main(["manifest"]) == Exit.INTERRUPTED
    assert "Traceback" not in capsys.readouterr().err


def test_a_streams_error_frame_reads_as_the_failure_it_is_not_a_refusal(capsys):
    # `actions follow` of a failed run printed "refused: ..." for the error frame; a failure says "error: ...".
    from aip_crewai import render

    error = {"code": "connector.crewai.execution_failed", "message": "the crew failed", "retryable": False}
    events = [
        ("aip_error", {"correlation_id": "act_f", "_sse_id": "sse_2", "body": {"error": {"error": error}}}),
        ("result", {"correlation_id": "act_f", "_sse_id": "sse_3", "body": {"action_result": {"status": "failed"}}}),
    ]
    cli._show_stream(events, False)
    out = capsys.readouterr().out
    assert "error: connector.crewai.execution_failed" in out and "refused:" not in out
    assert render.envelope_lines({"body": {"error": {"error": error}}})[0].startswith("refused: ")  # a request's
    pending = render.envelope_lines({"body": {"ack": {"action_id": "act_p", "reason": "pending_approval"}}})
    assert "aip-crewai approvals list" in pending[1]  # the ack names no approval: where to find it


def test_a_stream_cut_by_a_lost_connection_says_how_to_resume_and_exits_7(capsys):
    """A host killed mid-stream: the connection drops (a transport error, not a clean end). The CLI says so,
    prints the resume command with the last SSE id it printed, and exits 7 (unreachable)."""
    import httpx2

    def cut():
        yield "ack", {"correlation_id": "act_cut", "_sse_id": "sse_0", "body": {"ack": {"status": "streaming"}}}
        yield "chunk", {"correlation_id": "act_cut", "_sse_id": "sse_3", "body": {"stream_chunk": {"kind": "data"}}}
        raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")

    assert cli._show_stream(cut(), True) == Exit.UNREACHABLE
    out, err = capsys.readouterr()
    assert '"_sse_id":"sse_3"' in out.splitlines()[-1]  # --json lines carry the id to resume after
    assert "connection to the host was lost (RemoteProtocolError)" in err
    assert "aip-crewai actions follow act_cut --last-event-id sse_3" in err

    def refused():
        raise httpx2.ConnectError("refused")
        yield  # a generator that fails before its first event

    with pytest.raises(httpx2.ConnectError):
        cli._show_stream(refused(), False)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_doctor_runs_the_start_up_preflight_by_hand():
    """Issue 20 item 6: the same checks as the sidecar's start-up, exit 1 on a problem, 2 on a bad registry."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "aip_crewai.cli",
            "doctor",
            "--registry",
            "aip_crewai.examples.maintenance_crews:CREWS",
            "--json",
        ],
        capture_output=True,
        timeout=100,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    report = json.loads(run.stdout)
    assert report["crew_problems"] == {"asks_human": ["human_input"], "broken_knowledge": ["knowledge_unavailable"]}
    assert report["crew_inputs"]["trainable"] == {
        "placeholders": ["topic"],
        "defaults": True,
        "memory_domains": ["kickoff_outputs"],
    }
    assert b"sk-test-SECRET" not in run.stdout + run.stderr  # CrewAI's printed embedder error is swallowed
    sandbox = report["worker_sandbox"]  # what a sidecar started here would have (docs/security.md "Security")
    assert sandbox["mode"] in {"user+landlock", "user", "landlock", "none"} and isinstance(sandbox["missing"], list)
    assert ("worker_user" in sandbox["missing"]) == (os.geteuid() == 0)  # no AIP_CREWAI_WORKER_USER here
    inprocess = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "doctor", "--registry", "aip_crewai.examples.testing:CREWS"],
        capture_output=True,
        timeout=100,
        check=False,
        env={**os.environ, "AIP_CREWAI_ISOLATION": "inprocess"},
    )
    assert b"worker sandbox: inprocess; missing: --isolation inprocess runs crews in the sidecar process" in (
        inprocess.stdout
    ), inprocess.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "doctor", "--registry", "nope:X"],
        capture_output=True,
        timeout=100,
        check=False,
    )
    assert bad.returncode == 2 and b"cannot import module 'nope'" in bad.stderr


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_doctor_says_a_registry_that_ends_or_hangs_its_check_in_one_line_exit_1(tmp_path):
    """Regression: a registry calling ``os._exit(3)`` at import made ``doctor`` exit 3 (the CLI's "cancelled")
    with no output, and one that hangs made it wait without end. The check runs in a child process within
    a bound (``--timeout``, default the sidecar's 300 s), and says what the sidecar says, exit 1."""
    (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(3)\n")
    (tmp_path / "hangs_at_import.py").write_text("import threading\nthreading.Event().wait()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}

    def doctor(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "aip_crewai.cli", "doctor", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    ended = doctor("--registry", "exits_at_import:CREWS")
    assert (ended.returncode, ended.stdout) == (1, ""), ended.stderr
    assert ended.stderr == (
        "aip-crewai: cannot check the crew registry: "
        "the registry check process ended without an answer (exit status 3)\n"
    )
    hung = doctor("--registry", "hangs_at_import:CREWS", "--timeout", "1")
    assert (hung.returncode, hung.stdout) == (1, ""), hung.stderr
    assert hung.stderr.startswith(
        "aip-crewai: cannot check the crew registry: the registry check process did not answer within 1 s (killed"
    )
    assert len(hung.stderr.splitlines()) == 1


def test_approvals_watch_prints_the_queue_and_changes_and_says_how_to_resume(host_url, token, capsys):
    assert cli.main(["approvals", "watch", "--url", host_url, "--token-file", token]) == Exit.FAILED
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "pending    apr_1  cap:crewai:echo  action act_1  by svc:app  expires 2026-09-21T14:28:20.000Z  policy ab12",
        "decided    apr_1  approved by human:bob",
    ]
    assert "aip-crewai approvals watch --last-event-id apv_2" in err


def test_approvals_watch_stops_after_count_pending_and_prints_json(host_url, token, capsys):
    assert (
        cli.main(["approvals", "watch", "--count", "1", "--json", "--url", host_url, "--token-file", token]) == Exit.OK
    )
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["event"] == "pending" and json.loads(line)["id"] is None


def test_client_commands_send_log_lines_to_stderr_never_stdout(capsys) -> None:
    """A library module's log line during a client command must not corrupt its stdout (JSON, streams)."""
    import structlog

    from aip_crewai import cli

    with pytest.raises(SystemExit) as exited:  # argparse's --version exits 0 after configuring
        cli.main(["--version"])
    assert exited.value.code == 0
    capsys.readouterr()
    structlog.get_logger("aip_crewai.test").warning("a_warning_during_a_command")
    structlog.get_logger("aip_crewai.test").info("an_info_line")
    out, err = capsys.readouterr()
    assert out == "" and "a_warning_during_a_command" in err and "an_info_line" not in err


def test_approvals_show_writes_misread_code_points_as_escapes_under_a_warning(host_url, token, capsys):
    """the approver reads ``\\u202e`` and ``\\u200b``, never the raw controls."""
    argv = ["approvals", "show", "apr_spoof", "--url", host_url, "--token-file", token]
    assert cli.main(argv) == Exit.OK
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\u200b" not in out and "\u202c" not in out
    assert "account \\u202e9876-5432\\u202c then close" in out and "ad\\u200bmin" in out
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "3 character(s)" in warning and "$.note[25] U+202E bidi_control" in warning
    assert cli.main([*argv, "--json"]) == Exit.OK
    raw = capsys.readouterr().out
    assert json.loads(raw)["evidence_payload"]["input"] == SPOOF_INPUT and "warning" not in raw


def _run(host_url: str, token: str, *argv: str) -> int:
    return cli.main([*argv, "--url", host_url, "--token-file", token])


def test_a_pending_call_prints_lines_and_the_next_command_and_json_keeps_the_envelope(host_url, token, capsys):
    assert _call(host_url, token, "cap:pending") == Exit.PENDING_APPROVAL
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("pending_approval  action act_1") and "{" not in out
    assert _call(host_url, token, "cap:pending", "--json") == Exit.PENDING_APPROVAL
    assert json.loads(capsys.readouterr().out) == OUTCOMES["cap:pending"][1]


def test_a_pending_call_with_approval_details_names_the_approval_and_the_commands(host_url, token, capsys):
    from aip_crewai import render

    lines = render.envelope_lines(
        {
            "body": {
                "action_result": {
                    "action_id": "act_9",
                    "status": "pending_approval",
                    "output": {"approval_id": "apr_9", "expires_at": "2026-09-21T14:28:20.000Z"},
                }
            }
        }
    )
    assert lines[0] == "pending approval  action act_9  approval apr_9  expires 2026-09-21T14:28:20.000Z"
    assert "aip-crewai approvals show apr_9" in lines[1] and "aip-crewai actions result act_9" in lines[1]


def test_a_failed_call_prints_its_error_code_and_message(host_url, token, capsys):
    assert _call(host_url, token, "cap:failed") == Exit.FAILED
    out = capsys.readouterr().out
    assert out.splitlines() == ["failed  action act_1", "error: connector.crewai.execution_failed: m"]


def test_batch_items_are_labelled_in_a_stream(host_url, token, capsys):
    assert _call(host_url, token, "cap:batch", "--stream") == Exit.OK
    out = capsys.readouterr().out
    assert "[item 0]\nfirst item\n[item 1]\nsecond item" in out
    assert out.rstrip().endswith("completed  action act_1")


def test_approvals_list_is_a_table_and_show_names_the_decide_command(host_url, token, capsys):
    assert _run(host_url, token, "approvals", "list") == Exit.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["APPROVAL", "STATUS", "ACTION", "CAPABILITY", "REQUESTER", "RISK", "EXPIRES/DECIDED"]
    assert out[1].split()[:6] == ["apr_spoof", "pending", "act_spoof", "cap:crewai:echo", "svc:app", "medium"]
    assert out[-1] == "more: aip-crewai approvals list --cursor c2"
    assert _run(host_url, token, "approvals", "show", "apr_spoof") == Exit.OK
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "approval    apr_spoof  (pending)"
    assert "why         cap:crewai:echo changes crew state; ... values no approver sees: \\u202etopic" in shown
    assert shown[-1] == "next: aip-crewai approvals decide apr_spoof approved|denied --reason TEXT"


def test_actions_show_prints_fields_and_the_next_command(host_url, token, capsys):
    assert _run(host_url, token, "actions", "show", "act_1") == Exit.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "action      act_1" and "state       running" in out
    assert out[-1] == "next: aip-crewai actions follow act_1"
    assert _run(host_url, token, "actions", "show", "act_1", "--json") == Exit.OK
    assert json.loads(capsys.readouterr().out) == {"action_id": "act_1", "state": "running"}


def test_actions_cancel_uses_the_runtime_cancel_route_and_exits_as_cancelled(host_url, token, capsys):
    assert _run(host_url, token, "actions", "cancel", "act_1") == Exit.CANCELLED
    assert capsys.readouterr().out.splitlines()[0] == "cancelled  action act_1"
    assert _run(host_url, token, "actions", "cancel", "act_1", "--json") == Exit.CANCELLED
    assert json.loads(capsys.readouterr().out) == _result("cancelled")


def test_a_stream_stops_at_a_pending_ack_with_exit_5_and_the_follow_command(host_url, token, capsys):
    assert _call(host_url, token, "cap:pending", "--stream") == Exit.PENDING_APPROVAL
    captured = capsys.readouterr()
    assert "pending approval  action act_1" in captured.out
    assert "aip-crewai actions follow act_1 --last-event-id sse_0" in captured.err


def test_the_ack_of_an_ended_action_says_so_without_a_next_command():
    """A follow of a finished action starts with a ``cached`` ack: not "still running" and no follow hint."""
    from aip_crewai import render

    lines = render.envelope_lines({"body": {"ack": {"action_id": "act_9", "status": "cached", "reason": "completed"}}})
    assert lines == ["cached  action act_9  (already ended: completed)"]
    running = render.envelope_lines({"body": {"ack": {"action_id": "act_9", "status": "accepted"}}})
    assert "(still running)" in running[0] and "actions follow act_9" in running[1]


@pytest.mark.parametrize(
    ("schema", "shown"),
    [
        ({"type": "string"}, "string"),
        ({"type": "array", "items": {"type": "string"}}, "string[]"),  # knowledge_query's query: not one string
        ({"anyOf": [{"type": "object"}, {"type": "null"}]}, "object|null"),
        ({"enum": ["memory", "all"]}, '"memory"|"all"'),
        ({"type": ["integer", "null"]}, "integer|null"),
        ({}, "any"),
        ("not a schema", "any"),
    ],
)
def test_manifest_lines_show_each_fields_type(schema, shown):
    from aip_crewai import render

    assert render.field_type(schema) == shown
    manifest = {"capabilities": [{"id": "cap:x", "kind": "agent", "input_schema": {"properties": {"f": schema}}}]}
    assert list(render.manifest_lines(manifest))[1] == f"    input: f?: {shown}"


@pytest.mark.parametrize("action_id", ["act_1", "a;touch pwned", "$(id)", "it's", "a`b`|c&d"])
def test_a_suggested_command_pastes_as_one_command_whatever_the_action_id(action_id: str):
    """Every visible ASCII character but '/' is allowed in an action id: the suggested next command quotes it,
    so pasted into a shell it is the one intended command with the id as one word."""
    import shlex

    from aip_crewai import render

    ack = {"body": {"ack": {"action_id": action_id, "status": "accepted"}}}
    status = {"action_id": action_id, "state": "running"}
    for line in (render.envelope_lines(ack)[-1], render.status_lines(status)[-1]):
        suggested = line.removeprefix("next: ").split("  (or: ")[0]
        assert shlex.split(suggested) == ["aip-crewai", "actions", "follow", action_id]
    assert render.command("actions", "follow", "act_1") == "aip-crewai actions follow act_1"  # plain ids stay plain
