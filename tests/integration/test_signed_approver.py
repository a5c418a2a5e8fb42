"""docs/approvals.md's approver, configured with only an Ed25519 public key, approves with the
CLI against the real host process.

One host and sidecar pair serves the module (``keyed``); the watch test's approver has a tenant of its own
(``watch``), so the pending approvals it counts are only its own.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from kits.host import ACME_CREWS, Host, start_host
from kits.poll import until

from aip_crewai.client import AipClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.host_processes]

APPROVER = "human:acme-approver"  # docs/approvals.md and host/host.example.toml
#: The approver and invoker of tenant ``watch`` (the watch test's own queue).
WATCHER = "human:watch-approver"
WATCH_APP_TOKEN = "tok-watch-app-1"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", *args], capture_output=True, text=True, timeout=timeout
    )


class Keyed(NamedTuple):
    host: Host
    key: Path  # APPROVER's private key
    watch_key: Path  # WATCHER's


def generate_key(path: Path) -> str:
    """docs/approvals.md's command: an Ed25519 key at ``path``; its public key."""
    generated = run_cli("keys", "generate", "ed25519", "--out", str(path))
    assert generated.returncode == 0, generated.stderr
    return str(json.loads(generated.stdout)["ed25519_public_key"])


@pytest.fixture(scope="module")
def keyed(shared_sidecar, tmp_path_factory: pytest.TempPathFactory):
    """A host whose approvers hold only the public keys docs/approvals.md's command printed."""
    workdir = tmp_path_factory.mktemp("keyed")
    key, watch_key = workdir / "approver.pem", workdir / "watcher.pem"
    public, watch_public = generate_key(key), generate_key(watch_key)
    host = start_host(
        workdir / "host",
        shared_sidecar.base_url,
        shared_sidecar.token,
        tenants={"acme": ACME_CREWS, "beta": ["knowledge_b"], "watch": ["echo"]},
        extra_principals=[
            {"id": APPROVER, "tenant": "acme", "role": "approver", "ed25519_public_key": public},
            {"id": WATCHER, "tenant": "watch", "role": "approver", "ed25519_public_key": watch_public},
            {
                "id": "watch-app",
                "tenant": "watch",
                "role": "invoker",
                "token_sha256": hashlib.sha256(WATCH_APP_TOKEN.encode()).hexdigest(),
            },
        ],
    )
    try:
        yield Keyed(host, key, watch_key)
    finally:
        host.stop()


def test_the_readme_approver_approves_with_only_its_key(keyed):
    host, key, _ = keyed
    signed = ["--url", host.base_url, "--signing-key", str(key), "--key-id", APPROVER, "--json"]
    with host.client("acme-app") as app:
        pending = app.call("cap:crewai:echo", {"topic": "signed"}, idempotency_key="sig-1")
    approval_id = pending["body"]["action_result"]["output"]["approval_id"]
    listed = run_cli("approvals", "list", *signed)
    assert listed.returncode == 0, listed.stderr
    assert [a["request"]["id"] for a in json.loads(listed.stdout)["approvals"]] == [approval_id]
    shown = run_cli("approvals", "show", approval_id, *signed)
    assert json.loads(shown.stdout)["evidence_payload"]["input"] == {"topic": "signed"}
    decided = run_cli("approvals", "decide", approval_id, "approved", "--reason", "checked", *signed)
    assert decided.returncode == 0, decided.stderr
    decision = json.loads(decided.stdout)
    assert decision["approver"]["id"] == APPROVER and decision["evidence"][0]["kind"] == "http_message_signature"
    action_id = pending["body"]["action_result"]["action_id"]
    with host.client("acme-app") as app:
        until(
            lambda: app.action(action_id)["state"] == "completed", interval=0.05, what="the approved action completed"
        )
    result = run_cli("actions", "result", action_id, *signed)  # the approver decided it: it may read it
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["body"]["action_result"]["status"] == "completed"


def test_a_signing_key_without_a_key_id_is_a_usage_error(keyed):
    host, key, _ = keyed
    answer = run_cli("approvals", "list", "--url", host.base_url, "--signing-key", str(key))
    assert answer.returncode == 2 and "--key-id" in answer.stderr
    unsigned = run_cli(
        "approvals", "list", "--url", host.base_url, "--signing-key", str(key), "--key-id", "human:someone-else"
    )
    assert unsigned.returncode == 4  # the host refused the credential (401): docs/reference/cli.md "Exit codes"


def test_approvals_watch_prints_a_new_pending_approval_live(keyed):
    host, _, key = keyed  # tenant watch: no other test's approval is pending there
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aip_crewai.cli",
            "approvals",
            "watch",
            "--count",
            "2",
            "--json",
            "--url",
            host.base_url,
            "--signing-key",
            str(key),
            "--key-id",
            WATCHER,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with AipClient(host.base_url, token=WATCH_APP_TOKEN) as app:
            first = app.call("cap:crewai:echo", {"topic": "w1"}, idempotency_key="watch-1")
            second = app.call("cap:crewai:echo", {"topic": "w2"}, idempotency_key="watch-2")
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    pending = [line["data"]["data"]["request"]["id"] for line in lines if line["event"] == "pending"]
    expected = [r["body"]["action_result"]["output"]["approval_id"] for r in (first, second)]
    assert pending == expected


def refused_streams(host: Host) -> int:
    """How many requests for an ``/events`` stream the host's log shows refused (401)."""
    count = 0
    for line in host.log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and record.get("event") == "request_finished"
            and record.get("status") == 401
            and str(record.get("route", "")).endswith("/events")
        ):
            count += 1
    return count


def test_a_stream_token_follows_an_action_without_a_header_and_is_never_logged(keyed):
    import httpx2

    host, _, _ = keyed
    with host.client("acme-app") as app:
        done = app.call("cap:crewai:knowledge_a:knowledge_query", {"query": ["lamp"]}, idempotency_key="tok-1")
        action_id = done["body"]["action_result"]["action_id"]
        minted = app.stream_token(action_id)
    token = minted["stream_token"]
    before = refused_streams(host)
    with httpx2.stream(
        "GET", host.base_url + minted["stream_url"], headers={"Accept": "text/event-stream"}, timeout=30
    ) as response:
        text = response.read().decode()
    assert response.status_code == 200 and "event: result" in text
    refused = httpx2.get(f"{host.base_url}/aip/v1/actions/{action_id}/events?stream_token={token[:-2]}xx", timeout=30)
    assert refused.status_code == 401
    # the module's host runs on: it writes a line per finished request, so once the refused one's is there, the log
    # holds every line of this test's requests
    until(
        lambda: refused_streams(host) == before + 1, interval=0.05, what="the refused stream's line in the host's log"
    )
    log = host.log.read_text()
    assert "/events" in log and token not in log and token[:24] not in log
