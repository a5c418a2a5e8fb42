"""Security hardening: each finding of the independent review, replayed against the real
host and sidecar on loopback. The docs/security.md's "Security" section lists each bound tested here.

Error bodies are read through :func:`error_code` only, so a change of the error envelope's layout
adapts in one place; the tests assert statuses, error codes and stored state.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx2
import pytest
from chaoslib import uid
from kits.aip import action, envelope
from relkit import post_action

pytestmark = [pytest.mark.integration, pytest.mark.host_processes]


def error_code(response: httpx2.Response) -> str | None:
    """The ``ProtocolError.code`` of an AIP error answer, whatever envelope carries it
    (``{"body": {"error": …}}`` or ``{"error": {"error": …}}``); None when there is none."""
    try:
        data: Any = response.json()
    except ValueError:
        return None
    for path in (("body", "error", "error"), ("body", "error"), ("error", "error"), ("error",)):
        node = data
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get("code"), str):
            return node["code"]
    return None


def action_result(response: httpx2.Response) -> dict[str, Any]:
    return response.json()["body"]["action_result"]


# --- 1. idempotency reservations only for admitted requests -------------------------------------


@pytest.mark.timeout(60)
def test_rel_a_refused_request_leaves_its_idempotency_key_free(shared_pair):
    """Regression (item 1): a request refused with 409 (its action id taken) reserved its key, and a later
    request with that key and input got the OTHER action's result, with no approval and no execution."""
    _, _, host = shared_pair
    taken, fresh, key = uid("h1-taken"), uid("h1-fresh"), uid("h1-key")
    with host.http("acme-app") as app:
        first = post_action(app, "cap:crewai:echo", {"topic": "first"}, taken, uid("h1-other"))
        assert first.status_code == 202 and action_result(first)["status"] == "pending_approval"
        refused = post_action(app, "cap:crewai:echo", {"topic": "second"}, taken, key)
        assert refused.status_code == 409 and error_code(refused) == "action.idempotency_conflict"
        again = post_action(app, "cap:crewai:echo", {"topic": "second"}, fresh, key)
        assert again.status_code == 202
        result = action_result(again)
        assert result["action_id"] == fresh and result["status"] == "pending_approval"
        assert result["output"]["approval_id"] != action_result(first)["output"]["approval_id"]
        assert app.get(f"/aip/v1/actions/{fresh}").json()["state"] == "pending_approval"
        replay = post_action(app, "cap:crewai:echo", {"topic": "second"}, uid("h1-third"), key)
        assert replay.status_code == 202 and action_result(replay)["action_id"] == fresh


# --- 2. the sidecar client ignores the environment's proxies --------------------------------------


class _Recorder:
    """A loopback TCP listener standing in for a proxy: records every byte any client sends it."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(2)
                try:
                    self.received += conn.recv(65536)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(120)
def test_rel_the_host_never_sends_the_sidecar_token_to_an_environment_proxy(shared_pair):
    """Regression (item 2): with HTTP_PROXY set, the proxy received `Authorization: Bearer <sidecar token>`.
    The host's sidecar client ignores HTTP(S)_PROXY/ALL_PROXY (only an explicit sidecar.proxy is used)."""
    from relkit import TOKEN

    procs, sidecar, _ = shared_pair
    proxy = _Recorder()
    try:
        url = f"http://127.0.0.1:{proxy.port}"
        env = {
            name: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
        }
        env.update(NO_PROXY="", no_proxy="")
        host = procs.host(sidecar.base_url, name=uid("h2-host"), env=env)  # waits for /ready: reached directly
        with host.http("acme-app") as app:
            action_id = uid("h2")
            answer = post_action(app, "cap:crewai:echo:status", {"run_action_id": action_id}, uid("h2s"))
            assert answer.status_code in (200, 202, 404)
        host.kill(signal.SIGTERM)
        assert proxy.connections == 0 and TOKEN.encode() not in proxy.received
    finally:
        proxy.close()


# --- 4. metrics labels from closed sets only ----------------------------------------------------


@pytest.mark.timeout(60)
def test_rel_made_up_methods_and_paths_never_become_metric_labels(shared_pair):
    """Regression (item 4): each anonymous request with a made-up method added a label value that was never
    freed (300 requests: +13.6 MB, /metrics 45 MB). Methods outside the known set count as `other`, paths as
    their route template or `unmatched`, statuses as their class."""
    from relkit import OPERATOR_TOKEN

    _, _, host = shared_pair
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:
        before = http.get("/metrics", headers=operator)
        assert before.status_code == 200
        made_up = [f"M{uid('x').replace('-', '').upper()}{'Q' * 200}" for _ in range(40)]
        for method in made_up:
            http.request(method, f"/health/{uid('p')}")
            http.request(method, "/health")
        text = http.get("/metrics", headers=operator).text
    assert not any(method in text for method in made_up) and "/health/" not in text
    assert 'method="other"' in text and 'route="unmatched"' in text
    statuses = {
        line.rsplit('status="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("aip_host_requests_total{")
    }
    assert statuses and statuses <= {"1xx", "2xx", "3xx", "4xx", "5xx"}, statuses
    assert len(text) < len(before.text) + 4096  # a handful of new series at most, not one per request


# --- 5. every body bounded by route before it is read ---------------------------------------------


@pytest.mark.timeout(60)
def test_rel_bodies_over_their_route_bound_are_refused_before_being_read(shared_pair):
    """Regression (item 5): the decision route read an unbounded body (96 MiB: +181 MB). Each route now has a
    bound (messages 2 MiB, decisions 32 KiB, others 16 KiB); a declared or chunked body past it is 413."""
    from aip_crewai.host.http.limits import MAX_DECISION_BYTES, MAX_MESSAGE_BYTES

    _, _, host = shared_pair
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "bounded"}, uid("h5"), uid("h5k"))
        approval_id = action_result(pending)["output"]["approval_id"]

    def chunks(total: int):
        for _ in range(total // 65536 + 1):
            yield b" " * 65536

    decision = f"/aip/v1/approvals/{approval_id}/decision"
    with host.http("acme-approver") as approver:
        big = b'{"decision": "approved", "reason": "' + b"x" * (MAX_DECISION_BYTES + 10) + b'"}'
        refused = approver.post(decision, content=big, headers={"Content-Type": "application/json"})
        assert refused.status_code == 413 and error_code(refused) == "message.too_large"
        streamed = approver.post(
            decision, content=chunks(4 * MAX_DECISION_BYTES), headers={"Content-Type": "application/json"}
        )
        assert streamed.status_code == 413 and error_code(streamed) == "message.too_large"
        assert approver.get(f"/aip/v1/approvals/{approval_id}").json()["status"] == "pending"
    with host.http("acme-app") as app:
        for body in (b"{" + b" " * MAX_MESSAGE_BYTES + b"}", chunks(MAX_MESSAGE_BYTES + 1)):
            answer = app.post("/aip/v1/messages", content=body, headers={"Content-Type": "application/aip+json"})
            assert answer.status_code == 413 and error_code(answer) == "message.too_large"
        cancel = app.post(f"/aip/v1/actions/{uid('h5c')}/cancel", content=chunks(100_000))
        assert cancel.status_code in (404, 413)  # the cancel route reads no body: never more than 16 KiB
        assert httpx2.get(f"{host.base_url}/ready", timeout=10).status_code == 200


# --- 14. one nesting bound, checked at the host ----------------------------------------------------


@pytest.mark.timeout(60)
def test_rel_inputs_nested_past_the_shared_bound_are_a_400_at_submission(shared_pair):
    """Regression (item 14): the host accepted inputs nested ~960 levels that the sidecar could not hash; the
    action then failed as "uncertain" although nothing was admitted. The host now refuses them at submission
    (400 action.invalid_input, nothing stored); the bound itself is accepted and runs."""
    from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH

    def nested(levels: int) -> dict[str, Any]:
        value: dict[str, Any] = {"topic": "deep"}
        for _ in range(levels - 1):
            value = {"topic": "deep", "n": value}
        return value

    _, _, host = shared_pair
    with host.http("acme-app") as app:
        for levels in (MAX_INPUT_DEPTH + 1, 300, 960):
            action_id = uid("h14")
            env = envelope(action(action_id, "cap:crewai:echo", {"topic": "deep"}, action_id))
            raw = json.dumps(env).replace(
                '{"topic": "deep"}', '{"n": ' * (levels - 1) + '{"topic": "deep"}' + "}" * (levels - 1)
            )  # the stdlib encoder recurses
            answer = app.post("/aip/v1/messages", content=raw, headers={"Content-Type": "application/aip+json"})
            assert answer.status_code == 400 and error_code(answer) == "action.invalid_input", levels
            assert app.get(f"/aip/v1/actions/{action_id}").status_code == 404
        action_id = uid("h14ok")
        accepted = post_action(app, "cap:crewai:echo", nested(MAX_INPUT_DEPTH), action_id, action_id)
        assert accepted.status_code == 202 and action_result(accepted)["status"] == "pending_approval"


# --- 12. FIFO token, key and config files ------------------------------------------------------------


@pytest.mark.timeout(180)
def test_rel_fifo_token_key_and_config_files_refuse_start_up_instead_of_hanging(tmp_path):
    """Regression (item 12): a token, key or config file that is a FIFO hung start-up in open(). Files are
    opened without blocking and anything but a regular file is refused: exit 2, one line, no traceback."""
    import os
    import subprocess
    import sys

    from kits.host import free_port
    from kits.sidecar import ALLOWED, REGISTRY, child_env, sidecar_command
    from relkit import write_host_config

    def refused(argv: list[str], needle: str, env: dict[str, str] | None = None) -> None:
        try:
            done = subprocess.run(argv, capture_output=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:  # the hang this test is about
            raise AssertionError(f"{argv[-4:]} hung") from None
        err = done.stderr.decode(errors="replace")
        assert done.returncode == 2 and needle in err and "Traceback" not in err, (argv, done.returncode, err[-400:])
        assert "not a regular file" in err, err[-400:]

    def fifo(path: Path) -> Path:
        path.unlink(missing_ok=True)
        os.mkfifo(path, 0o600)
        return path

    py = sys.executable
    for name in ("host.toml", "crews.json", "sidecar.token"):
        d = tmp_path / f"host-{name}"
        config = write_host_config(d, "http://127.0.0.1:9", free_port())
        fifo(d / name)
        refused(
            [py, "-m", "aip_crewai.cli", "host", "--config", str(config)],
            "--config" if name == "host.toml" else ("crews.file" if name == "crews.json" else "sidecar.token_file"),
        )
    d = tmp_path / "sidecar"
    d.mkdir(mode=0o700)
    refused(
        [
            *sidecar_command("--registry", REGISTRY),
            "--journal",
            str(d / "journal.db"),
            "--token-file",
            str(fifo(d / "token")),
            "--port",
            "0",
            "--allowed-operations",
            ALLOWED,
        ],
        "--token-file",
        child_env(d / "calls.log"),
    )
    from aip_crewai.plumbing.keys import SecretFileError, load_ed25519

    with pytest.raises(SecretFileError, match="not a regular file"):  # the CLI's signing key
        load_ed25519(fifo(d / "signing.key"))


# --- 11. an aborted upload is not a server error -------------------------------------------------


def _abort_upload(base_url: str, path: str, headers: dict[str, str]) -> None:
    """Send the head of a POST announcing 100 000 bytes, 1 000 of them, then close the connection."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    assert parts.port is not None  # the suite's base URLs name their port
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {parts.hostname}",
        "Content-Type: application/json",
        "Content-Length: 100000",
        *(f"{k}: {v}" for k, v in headers.items()),
        "",
        "",
    ]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + b"{" + b" " * 999)


@pytest.mark.timeout(120)
def test_rel_aborted_uploads_are_no_500_and_log_no_traceback(shared_pair):
    """Regression (item 11): each aborted anonymous upload became a 500 and an error-level traceback of
    ~2.5 KB. A client going away is logged at debug level: no traceback, no error line, no 500."""
    from kits.poll import until
    from relkit import LogsSince

    _, sidecar, host = shared_pair
    host_logs, sidecar_log = LogsSince(host.log, host.stdout_path), LogsSince(sidecar.stderr_path)  # from now on
    for _ in range(5):
        _abort_upload(host.base_url, "/aip/v1/messages", {})
        _abort_upload(host.base_url, "/aip/v1/messages", {"Authorization": "Bearer tok-acme-app-1"})
        _abort_upload(sidecar.base_url, "/jobs", {**sidecar.headers, "Idempotency-Key": "k"})

    def logged() -> bool:
        host_lines = [x for x in host_logs.read().splitlines() if b"request_finished" in x and b"/aip/v1/messages" in x]
        side_lines = [
            line for line in sidecar_log.read().splitlines() if b"request_finished" in line and b'"/jobs"' in line
        ]
        return len(host_lines) >= 10 and len(side_lines) >= 5

    until(logged, timeout=30, what="the aborted requests' summary lines")
    output = host_logs.read() + sidecar_log.read()
    for needle in (b"Traceback", b"request_failed", b"unhandled_error", b'"level": "error"', b'"status": 500'):
        assert needle not in output, needle
    assert httpx2.get(f"{host.base_url}/ready", timeout=10).status_code == 200


# --- 10. anonymous health answers carry no tenant data -------------------------------------------


@pytest.mark.timeout(120)
def test_rel_anonymous_ready_names_no_crew_while_unready(shared_pair):
    """Regression (item 10): an anonymous /ready listed every configured crew id, of every tenant, while
    unready. It now gives the kind of disagreement only; the ids go to the operator's log."""
    from kits.host import write_config
    from kits.poll import until
    from relkit import TOKEN, free_port

    hidden = "zz-hidden-crew-of-beta"
    procs, sidecar, _ = shared_pair  # a host of its own, with a crew the sidecar lacks
    port = free_port()
    workdir = procs.workdir / uid("host-unready")
    crews = [{"id": "echo", "name": "Echo"}, {"id": hidden, "name": "Hidden"}]
    config = write_config(
        workdir, sidecar.base_url, TOKEN, port, crews=crews, tenants={"acme": ["echo"], "beta": [hidden]}
    )
    process, stderr_path, _ = procs.launch_host(workdir, config)
    from kits.host import Host

    procs.hosts.append(host := Host(process, f"http://127.0.0.1:{port}", stderr_path, workdir))

    def unready() -> httpx2.Response | None:
        try:
            answer = httpx2.get(f"http://127.0.0.1:{port}/ready", timeout=10)
        except httpx2.TransportError:
            return None
        return answer if answer.status_code == 503 and "crews" in answer.text else None

    answer = until(unready, timeout=60, what="an unready host naming the crew disagreement")
    assert answer.json() == {"status": "unready", "reason": "sidecar lacks configured crews"}
    assert hidden not in answer.text
    health = httpx2.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert health.status_code == 200 and hidden not in health.text
    assert hidden.encode() in stderr_path.read_bytes()  # the operator still learns which crew
    host.kill(signal.SIGTERM)


# --- 7. Content-Length with Transfer-Encoding -------------------------------------------------------


def _raw_exchange(base_url: str, data: bytes) -> tuple[bytes, bool]:
    """Send ``data`` on one connection; return everything received and whether the server closed it."""
    import socket
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    assert parts.port is not None  # the suite's base URLs name their port
    received = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(data)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                piece = sock.recv(65536)
            except TimeoutError:
                return received, False
            if not piece:
                return received, True
            received += piece
    return received, False


@pytest.mark.timeout(120)
def test_rel_content_length_with_transfer_encoding_is_400_and_closes_on_both_processes(shared_pair):
    """Regression (item 7): a request with both Content-Length and Transfer-Encoding was processed and the
    connection kept open (request smuggling behind a proxy that frames by Content-Length). Both processes
    answer 400 with `Connection: close` and close; the request pipelined after it is never answered."""
    _, sidecar, host = shared_pair
    cases = [
        (host.base_url, "/aip/v1/messages", "Authorization: Bearer tok-acme-app-1\r\n"),
        (host.base_url, "/health", ""),
        (sidecar.base_url, "/jobs", f"Authorization: Bearer {sidecar.token}\r\nIdempotency-Key: k\r\n"),
        (sidecar.base_url, "/health", ""),
    ]
    for base_url, path, extra in cases:
        smuggled = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\n"
            "Content-Length: 48\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        ).encode()
        received, closed = _raw_exchange(base_url, smuggled)
        head = received.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 400"), (base_url, path, received[:300])
        assert b"connection: close" in head and closed, (base_url, path, received[:300])
        assert received.count(b"HTTP/1.1 ") == 1, (base_url, path, received[:600])
    with host.http("acme-app") as app:
        assert app.get("/aip/v1/manifest").status_code == 200


# --- 3. authenticate first; timeouts; bounded requests; no h2c --------------------------------------


def _timed_exchange(base_url: str, data: bytes, wait_s: float = 30.0) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes; return what came back and how long it took, seconds."""
    import socket
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    assert parts.port is not None  # the suite's base URLs name their port
    started = time.monotonic()
    received = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=wait_s) as sock:
        sock.sendall(data)
        while True:
            try:
                piece = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not piece:
                break
            received += piece
    return received, time.monotonic() - started


@pytest.mark.timeout(120)
def test_rel_a_bad_bearer_is_refused_before_its_body_is_read(shared_pair):
    """Regression (item 3): POST /aip/v1/messages read up to 2 MiB before authenticating. A request whose
    Authorization header is wrong is 401 at once, with the announced body never sent, and closed."""
    _, _, host = shared_pair
    for authorization in ("Bearer nope", "Basic abc"):
        head = (
            f"POST /aip/v1/messages HTTP/1.1\r\nHost: x\r\nAuthorization: {authorization}\r\n"
            "Content-Type: application/aip+json\r\nContent-Length: 2000000\r\n\r\n"
        ).encode()
        received, took = _timed_exchange(host.base_url, head)
        assert received.startswith(b"HTTP/1.1 401") and b"connection: close" in received.lower(), received[:300]
        assert took < 5.0, took


@pytest.mark.timeout(120)
def test_rel_stalled_heads_and_bodies_are_timed_out_on_both_processes(shared_pair):
    """Regression (item 3): 20 stalled anonymous connections held 42 MB indefinitely. A request head must
    arrive within 5 s (the connection is closed), and a body may not pause for more than 10 s (408, closed),
    on the host and the sidecar alike."""
    from aip_crewai.plumbing.serving import BODY_IDLE_TIMEOUT_S, HEADER_TIMEOUT_S

    _, sidecar, host = shared_pair
    partial_head = b"POST /aip/v1/messages HTTP/1.1\r\nHost: x\r\nContent-Le"
    stalled_body = (
        b"POST /aip/v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/aip+json\r\n"
        b'Content-Length: 100000\r\n\r\n{"aip_version"'
    )
    stalled_job = (
        f"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {sidecar.token}\r\nIdempotency-Key: k\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    ).encode()
    for base_url in (host.base_url, sidecar.base_url):
        received, took = _timed_exchange(base_url, partial_head)
        assert received == b"" and HEADER_TIMEOUT_S - 1 <= took < HEADER_TIMEOUT_S + 10, (base_url, took)
    for base_url, data in ((host.base_url, stalled_body), (sidecar.base_url, stalled_job)):
        received, took = _timed_exchange(base_url, data)
        assert received.startswith(b"HTTP/1.1 408") and b"connection: close" in received.lower(), received[:300]
        assert BODY_IDLE_TIMEOUT_S - 1 <= took < BODY_IDLE_TIMEOUT_S + 10, took


@pytest.mark.timeout(60)
def test_rel_cleartext_http2_is_not_served(shared_pair):
    """Item 3: one cleartext HTTP/2 connection with 50 streams added 50 MB. h2c is off on both processes:
    an `Upgrade: h2c` request is answered as HTTP/1.1 and the prior-knowledge preface is no HTTP/2."""
    _, sidecar, host = shared_pair
    upgrade = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQAAP__\r\nConnection: close\r\n\r\n"
    )
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
    for base_url in (host.base_url, sidecar.base_url):
        received, _ = _timed_exchange(base_url, upgrade, wait_s=20)
        assert received.startswith(b"HTTP/1.1 ") and b" 101 " not in received.split(b"\r\n", 1)[0], received[:200]
        received, _ = _timed_exchange(base_url, preface, wait_s=20)
        # an HTTP/2 server answers the preface with a SETTINGS frame (type 0x04 in the 4th byte)
        assert not (len(received) >= 9 and received[3] == 4), received[:50]
        assert received == b"" or received.startswith(b"HTTP/1.1 4"), received[:200]


# --- 6 and 8. signed envelopes: canonical numbers; message ids claimed per key after authorization ---


def _signed(
    action_id: str,
    input: dict[str, Any],
    *,
    message_id: str | None = None,
    seed: bytes | None = None,
    key_id: str | None = None,
) -> dict[str, Any]:
    from relkit import SIGNER, signer_key

    from aip_crewai.client import sign_envelope

    env = envelope(action(action_id, "cap:crewai:echo", input, action_id))
    if message_id is not None:
        env["message_id"] = message_id
    return sign_envelope(env, signer_key(seed) if seed else signer_key(), key_id or SIGNER)


@pytest.mark.timeout(60)
def test_rel_signed_numbers_run_exactly_as_signed_or_are_a_typed_400(shared_pair):
    """Regression (item 6): an envelope signed over 1 was accepted as 1.0, 1e0 or -0.0 and the crew ran with
    "1.0"; integers of 2^53 or more were a 401. Non-canonical numbers and unsignable integers are now a 400
    (message.non_canonical_number) naming the field; nothing is stored, and the canonical message still runs."""
    _, _, host = shared_pair
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:
        for variant in ("1.0", "1e0", "1E+0", "10e-1"):
            action_id = uid("h6")
            raw = json.dumps(_signed(action_id, {"topic": "numbers", "n": 1})).replace('"n": 1}', f'"n": {variant}}}')
            assert f'"n": {variant}' in raw
            answer = http.post("/aip/v1/messages", content=raw, headers={"Content-Type": "application/aip+json"})
            assert answer.status_code == 400 and error_code(answer) == "message.non_canonical_number", answer.text
            assert "$.body.action.input.n" in answer.text
        action_id = uid("h6-zero")
        raw = json.dumps(_signed(action_id, {"topic": "numbers", "n": 0})).replace('"n": 0}', '"n": -0.0}')
        answer = http.post("/aip/v1/messages", content=raw, headers={"Content-Type": "application/aip+json"})
        assert answer.status_code == 400 and error_code(answer) == "message.non_canonical_number"
        big = _signed(uid("h6-big"), {"topic": "numbers", "n": 1})
        raw = json.dumps(big).replace('"n": 1}', f'"n": {2**53}}}')
        answer = http.post("/aip/v1/messages", content=raw, headers={"Content-Type": "application/aip+json"})
        assert answer.status_code == 400 and error_code(answer) == "message.non_canonical_number"
        assert "$.body.action.input.n" in answer.text
        action_id = uid("h6-ok")
        answer = http.post("/aip/v1/messages", json=_signed(action_id, {"topic": "numbers", "n": 1}))
        assert answer.status_code == 202 and action_result(answer)["status"] == "pending_approval"
    with host.http("acme-approver") as approver:
        shown = approver.get(f"/aip/v1/approvals/{action_result(answer)['output']['approval_id']}").json()
        snapshot = shown["evidence_payload"]["input"]
        assert snapshot["n"] == 1 and isinstance(snapshot["n"], int)


@pytest.mark.timeout(60)
def test_rel_a_signer_without_the_role_cannot_burn_another_signers_message_ids(shared_pair):
    """Regression (item 8): signed message ids were claimed per tenant and before the role check, so an
    approver-only signer could burn an invoker signer's ids. They are claimed per key, after authorization."""
    from relkit import APPROVER_SIGNER, APPROVER_SIGNER_SEED

    _, _, host = shared_pair
    message_id = f"msg_{uid('h8')}"
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:
        burned = http.post(
            "/aip/v1/messages",
            json=_signed(
                uid("h8a"), {"topic": "burn"}, message_id=message_id, seed=APPROVER_SIGNER_SEED, key_id=APPROVER_SIGNER
            ),
        )
        assert burned.status_code == 403 and error_code(burned) == "policy.forbidden"
        action_id = uid("h8b")
        mine = _signed(action_id, {"topic": "mine"}, message_id=message_id)
        first = http.post("/aip/v1/messages", json=mine)
        assert first.status_code == 202 and action_result(first)["action_id"] == action_id
        replay = http.post("/aip/v1/messages", json=mine)
        assert replay.status_code == 401 and error_code(replay) == "auth.unauthenticated"


# --- 13. an approval re-checks routing and the requester at decision and at dispatch ----------------


@pytest.mark.timeout(120)
def test_rel_an_approval_after_the_crew_left_the_tenant_fails_the_action_and_runs_nothing(shared_pair):
    """Regression (item 13): an approval decided after the crew was removed from the tenant still ran
    the action once. Now the decision is refused (403 ``policy.capability_revoked``), the action fails
    with that policy error, and the sidecar never sees it. (A host of its own, restarted with other tenants.)"""
    from relkit import ACME_CREWS, TENANTS, approve, calls_by_action

    procs, sidecar, _ = shared_pair
    name = uid("h13-host")
    host = procs.host(sidecar.base_url, name=name)
    action_id = uid("h13")
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "revoked"}, action_id, action_id)
        assert pending.status_code == 202, pending.text
    host.kill(signal.SIGTERM)
    tenants = {**TENANTS, "acme": [crew for crew in ACME_CREWS if crew != "echo"]}
    host = procs.host(sidecar.base_url, name=name, port=host.port, tenants=tenants)
    answer = approve(host, pending)
    assert answer.status_code == 403 and error_code(answer) == "policy.capability_revoked", answer.text
    with host.http("acme-app") as app:
        result = app.get(f"/aip/v1/actions/{action_id}/result").json()["body"]["action_result"]
    assert result["status"] == "failed" and result["error"]["code"] == "policy.capability_revoked"
    assert calls_by_action(procs.call_log)[f"acme:{action_id}"] == 0
    host.kill(signal.SIGTERM)


# --- 9. least privilege inside a tenant -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_rel_operators_read_metadata_and_approvers_read_what_they_decided(shared_pair):
    """Regression (item 9): any principal of a tenant read every action's input and output. Now an
    operator reads metadata only, an approver the actions it decided, an invoker its own actions
    (every cell: tests/host/test_read_permissions.py)."""
    from relkit import OPERATOR, OPERATOR_TOKEN, approve, wait_action

    _, _, host = shared_pair
    action_id = uid("h9")
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "h9-private"}, action_id, action_id)
        assert approve(host, pending).status_code == 200
        wait_action(app, action_id)
        assert "output" in app.get(f"/aip/v1/actions/{action_id}").json()["result"]
    with httpx2.Client(
        base_url=host.base_url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=30
    ) as operator:
        view = operator.get(f"/aip/v1/actions/{action_id}")
        assert view.status_code == 200 and view.json()["result"]["status"] == "completed", (OPERATOR, view.text)
        assert "output" not in view.json()["result"] and b"h9-private" not in view.content
        for suffix in ("/result", "/events", "/chunks"):
            answer = operator.get(f"/aip/v1/actions/{action_id}{suffix}")
            assert answer.status_code == 403 and error_code(answer) == "policy.forbidden", suffix
    with host.http("acme-approver") as approver:  # it decided this one
        assert approver.get(f"/aip/v1/actions/{action_id}/result").status_code == 200
