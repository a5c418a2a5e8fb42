"""Webhooks from a real host process (docs/webhooks.md "Retries and ordering"): the receiver is down while
a denied action's three events wait in the outbox, the host is killed with SIGKILL, the receiver comes up,
the host restarts on the same store, and each event arrives exactly once, in order, signed. Under
``AIP_CREWAI_TEST_STORE=postgresql`` the same on PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from kits.host import bearer_principal, free_port, start_host
from kits.poll import until_async
from kits.webhook_receiver import Receiver
from standardwebhooks.webhooks import Webhook

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), pytest.mark.host_processes]

SECRET = "whsec_" + base64.b64encode(b"w" * 32).decode()
OPERATOR_TOKEN = "tok-acme-operator-1"
OPERATOR = bearer_principal("acme-operator", OPERATOR_TOKEN, "operator")
EVENTS = ["approval.requested", "approval.decided", "action.failed"]


def _webhook_toml(url: str, secret_file: Path) -> str:
    return "\n".join(
        [
            "[[webhooks]]",
            'tenant = "acme"',
            f"url = {json.dumps(url)}",
            f"secret_file = {json.dumps(str(secret_file))}",
            f"events = {json.dumps(EVENTS)}",
            "timeout_seconds = 2",
            "retry_initial_seconds = 0.2",
            "retry_max_seconds = 0.5",
            "",
        ]
    )


def _deliveries(base_url: str) -> list[dict[str, Any]]:
    answer = httpx2.get(
        f"{base_url}/aip/v1/webhooks/deliveries",
        headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
        timeout=30,
    )
    answer.raise_for_status()
    return list(answer.json()["deliveries"])


def _deny(host: Any) -> str:
    """A denied echo call: approval.requested, approval.decided, action.failed. Returns the action id."""
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        action_id, key = new_id("act"), new_id("key")
        pending = app.call("cap:crewai:echo", {"topic": "x"}, action_id=action_id, idempotency_key=key)
        approver.decide(pending["body"]["action_result"]["output"]["approval_id"], "denied", "not today")
        final = app.call("cap:crewai:echo", {"topic": "x"}, action_id=action_id, idempotency_key=key)
        assert final["body"]["action_result"]["status"] == "failed"
    return action_id


async def test_a_receiver_down_across_a_host_kill_and_restart_gets_each_event_once(sidecar_factory, tmp_path):
    sidecar = await asyncio.to_thread(sidecar_factory.start)
    secret_file = tmp_path / "acme.whsec"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    receiver_port = free_port()  # nothing listens there yet: every attempt is refused
    extra = _webhook_toml(f"http://127.0.0.1:{receiver_port}/hook", secret_file)
    workdir = tmp_path / "host"

    def start() -> Any:
        return start_host(workdir, sidecar.base_url, sidecar.token, extra_principals=[OPERATOR], extra_toml=extra)

    host = await asyncio.to_thread(start)
    receiver = None
    try:
        action_id = await asyncio.to_thread(_deny, host)

        async def retried() -> bool:
            found = await asyncio.to_thread(_deliveries, host.base_url)
            first = [d for d in found if d["event_type"] == "approval.requested"]
            return len(found) == 3 and bool(first) and first[0]["attempts"] >= 2

        await until_async(retried, timeout=120, what="the first event retried while the receiver is down")
        listed = await asyncio.to_thread(_deliveries, host.base_url)
        assert {d["last_outcome"] for d in listed if d["attempts"]} == {"connect_error"}
        assert all(d["status"] == "pending" for d in listed)
        assert all(d["attempts"] == 0 for d in listed if d["event_type"] != "approval.requested")  # in order
        assert await asyncio.to_thread(host.kill) != 0
        receiver = await Receiver(port=receiver_port).start()
        host = await asyncio.to_thread(start)

        async def delivered() -> list[dict[str, Any]] | None:
            found = await asyncio.to_thread(_deliveries, host.base_url)
            return found if found and all(d["status"] == "delivered" for d in found) else None

        # a claim the killed host held expires first (timeout_seconds + 30 s), hence the long deadline
        final = await until_async(delivered, timeout=180, what="every event delivered after the restart")
        assert len(final) == 3
        bodies = [Webhook(SECRET).verify(body, headers) for headers, body in receiver.received]
        assert [b["type"] for b in bodies] == EVENTS  # once each, in order
        assert all(
            b["data"].get("action_id", b["data"].get("request", {}).get("action_id")) == action_id for b in bodies
        )
        assert sorted(h["webhook-id"] for h, _ in receiver.received) == sorted(d["delivery_id"] for d in final)
    finally:
        await asyncio.to_thread(host.kill)
        if receiver is not None:
            await receiver.stop()
