"""The example webhook receiver in-process (aip_crewai/examples/webhook_receiver.py, docs/webhooks.md "The
demo"): a delivery signed as the host signs it is verified and printed once per ``webhook-id``; a bad
signature, a stale timestamp, a missing length and a body past the bound are refused with their status, the
bound accepted at its edge; the secret file is read as the host reads it. And the demo's ``--webhooks``
configuration: a 0600 ``whsec_`` secret and a ``[[webhooks]]`` entry the host loads, with all five events
and the short retry schedule."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from standardwebhooks.webhooks import Webhook

from aip_crewai.examples import demo, webhook_receiver
from aip_crewai.host.config import load_settings
from aip_crewai.host.webhooks.config import EVENT_TYPES
from aip_crewai.host.webhooks.signing import signed_headers
from aip_crewai.plumbing.keys import SecretFileError

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
APPROVAL = {
    "type": "approval.requested",
    "timestamp": "2026-12-02T02:42:23.957Z",
    "data": {"request": {"id": "apr_1", "action_id": "act_1"}, "status": "pending"},
}


@pytest.fixture
def served() -> Iterator[tuple[str, io.StringIO]]:
    out = io.StringIO()
    server = webhook_receiver.serve(SECRET, out=out)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield webhook_receiver.url_of(server), out
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def _signed(body: bytes, msg_id: str = "msg_" + "a" * 32, at_s: float | None = None) -> dict[str, str]:
    """The headers the host's sender signs ``body`` with (host/webhooks/signing.py)."""
    return signed_headers(Webhook(SECRET), msg_id, time.time() if at_s is None else at_s, body.decode())


def test_a_signed_delivery_is_verified_and_printed_once_per_webhook_id(served) -> None:
    url, out = served
    body = json.dumps(APPROVAL).encode()
    headers = _signed(body)
    for _ in range(2):  # a retry of the same delivery: answered, not printed again
        assert httpx2.post(url, content=body, headers=headers, timeout=10).status_code == 204
    assert out.getvalue().splitlines() == [
        f"approval.requested approval=apr_1 action=act_1 verified webhook-id={headers['webhook-id']}"
    ]


def test_an_action_event_is_printed_with_its_status(served) -> None:
    url, out = served
    body = json.dumps({"type": "action.completed", "timestamp": "t", "data": {"action_id": "a", "status": "completed"}})
    headers = _signed(body.encode(), "msg_" + "b" * 32)
    assert httpx2.post(url, content=body.encode(), headers=headers, timeout=10).status_code == 204
    assert out.getvalue().startswith("action.completed action=a status=completed verified webhook-id=msg_")


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda h: {**h, "webhook-signature": "v1," + base64.b64encode(b"x" * 32).decode()}, "not verified"),
        (lambda h: {k: v for k, v in h.items() if k != "webhook-signature"}, "not verified"),
        (lambda h: {**h, "webhook-signature": "garbage"}, "malformed"),
        (lambda h: {**h, "webhook-id": "msg_other"}, "not verified"),
    ],
)
def test_a_delivery_that_does_not_verify_is_refused_400(served, mangle, reason) -> None:
    url, out = served
    body = json.dumps(APPROVAL).encode()
    answer = httpx2.post(url, content=body, headers=mangle(_signed(body)), timeout=10)
    assert answer.status_code == 400
    (line,) = out.getvalue().splitlines()
    assert line.startswith("rejected: ") and reason in line and SECRET not in line


@pytest.mark.parametrize(
    ("value", "malformed"),
    [
        (None, False),  # missing: verification refuses it
        ("v1," + base64.b64encode(b"x" * 32).decode(), False),
        ("v1a,abc= v1,abcd", False),
        ("garbage v1," + base64.b64encode(b"s").decode(), False),  # one well-formed entry is enough
        ("garbage", True),
        ("", True),
        ("v1,", True),
        ("v1,not-base64!", True),
        ("x1,abcd", True),
    ],
)
def test_a_signature_header_without_a_well_formed_entry_is_malformed(value, malformed) -> None:
    assert webhook_receiver.malformed_signature(value) is malformed


def test_a_stale_timestamp_is_refused(served) -> None:
    url, out = served
    body = json.dumps(APPROVAL).encode()
    stale = time.time() - 600  # receivers refuse a timestamp more than 5 minutes away
    assert httpx2.post(url, content=body, headers=_signed(body, at_s=stale), timeout=10).status_code == 400
    assert out.getvalue().startswith("rejected: not verified")


def test_the_body_bound_is_enforced_at_its_edge(served) -> None:
    url, out = served
    envelope = json.dumps({**APPROVAL, "pad": ""}).encode()
    padded = envelope.replace(
        b'"pad": ""', b'"pad": "' + b"p" * (webhook_receiver.MAX_BODY_BYTES - len(envelope)) + b'"'
    )
    assert len(padded) == webhook_receiver.MAX_BODY_BYTES
    assert httpx2.post(url, content=padded, headers=_signed(padded), timeout=30).status_code == 204
    over = padded + b" "
    assert httpx2.post(url, content=over, headers=_signed(over, "msg_" + "c" * 32), timeout=30).status_code == 413
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("approval.requested approval=apr_1") and lines[1].startswith("rejected: a body of")


def test_a_post_without_a_length_or_elsewhere_is_refused(served) -> None:
    url, out = served

    def chunks() -> Iterator[bytes]:
        yield b"{}"

    assert httpx2.post(url, content=chunks(), timeout=10).status_code == 411  # chunked: no Content-Length
    assert httpx2.post(url.replace("/hook", "/other"), content=b"{}", timeout=10).status_code == 404
    assert out.getvalue() == ""


def test_the_secret_file_is_read_as_the_host_reads_it(tmp_path: Path) -> None:
    good = tmp_path / "good.whsec"
    good.write_text(SECRET + "\n")
    good.chmod(0o600)
    assert webhook_receiver.read_secret(good) == SECRET
    good.chmod(0o644)
    with pytest.raises(SecretFileError):
        webhook_receiver.read_secret(good)
    plain = tmp_path / "plain.secret"
    plain.write_text("not-a-whsec\n")
    plain.chmod(0o600)
    with pytest.raises(SecretFileError, match="whsec_"):
        webhook_receiver.read_secret(plain)
    assert webhook_receiver.main(["--secret-file", str(plain)]) == 2


def test_the_demos_webhook_configuration_loads_with_every_event_and_short_retries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    secret = demo.write_webhook_secret(run)
    assert secret.stat().st_mode & 0o777 == 0o600
    text = secret.read_text().strip()
    assert text.startswith("whsec_") and len(base64.b64decode(text.removeprefix("whsec_"))) == 32
    assert webhook_receiver.read_secret(secret) == text
    demo.write_config(run, "http://127.0.0.1:8787/hook")
    settings = load_settings(run / "host" / "host.toml", environ={})
    (endpoint,) = settings.webhooks.endpoints
    assert endpoint.tenant == "acme" and endpoint.url == "http://127.0.0.1:8787/hook"
    assert endpoint.events == frozenset(EVENT_TYPES)
    assert endpoint.retry_initial_s == 0.5 and endpoint.retry_max_s == 5 and endpoint.deadline_s == 300
    # the endpoint signs with the secret the receiver reads
    body = json.dumps(APPROVAL)
    assert Webhook(text).verify(body, signed_headers(endpoint.signer, "msg_" + "d" * 32, time.time(), body))


def test_without_webhooks_the_demo_configuration_has_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    demo.write_config(run)
    assert "[[webhooks]]" not in (run / "host" / "host.toml").read_text()
    assert load_settings(run / "host" / "host.toml", environ={}).webhooks.endpoints == ()
    assert not (run / "secrets" / "webhook.whsec").exists()


def test_a_start_retried_with_new_ports_writes_new_credentials(tmp_path: Path) -> None:
    """start_both retries with new ports by writing the configuration again: its credentials are replaced,
    not refused as existing files."""
    demo.write_config(tmp_path)
    token = (tmp_path / "secrets" / "sidecar.token").read_bytes()
    second = demo.write_config(tmp_path)
    assert (tmp_path / "secrets" / "sidecar.token").read_bytes() != token
    assert (tmp_path / "secrets" / "approver.pem").stat().st_mode & 0o077 == 0
    assert load_settings(tmp_path / "host" / "host.toml").bind.endswith(str(second["host_port"]))


@pytest.mark.parametrize("port", ["1_0", " 5", "-1", "65536", "8e3"])
def test_a_port_that_is_no_plain_number_in_range_is_a_usage_error(port: str, capsys) -> None:
    # argparse's int took 1_0 (10) and " 5" (5), as the sidecar's options once did.
    with pytest.raises(SystemExit) as refused:
        webhook_receiver.main(["--secret-file", "unused.whsec", "--port", port])
    assert refused.value.code == 2 and "--port" in capsys.readouterr().err
