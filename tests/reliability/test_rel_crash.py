"""Crashes: kill -9 of either process, then restart on the same state (ARCHITECTURE.md §5 crash fence, §8 reconciliation)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import chaoslib
import httpx2
import pytest
import storebackend
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, running
from kits.poll import until_async
from relkit import inproc_app

from aip_crewai.contracts.hashing import canonical_json
from aip_crewai.host.actions.idempotency import fence_hash
from aip_crewai.host.store.store import Store


async def decide(store, *args):
    """Record one decision and start nothing: True when this call decided (the store's decide_and_start)."""
    decided, _ = await store.decide_and_start(*args, start_if=lambda approval, action: False)
    return decided is not None


pytestmark = [pytest.mark.integration, pytest.mark.host_processes]


@pytest.mark.timeout(120)
def test_rel_sidecar_kill9_during_concurrent_runs_fails_each_once_and_reruns_none(procs):
    """6 concurrent slow runs (4 executing, 2 queued), kill -9, restart on the journal: the crash fence."""
    seen = chaoslib.sidecar_kill9(procs, runs=6, running_at_kill=2)
    assert seen["running"] >= 2 and seen["running"] + seen["queued"] == 6


@pytest.mark.timeout(120)
def test_rel_host_kill9_mid_stream_resumes_every_chunk_once_and_never_redispatches(shared_pair):
    """kill -9 of the host after 4 SSE events; restart on the same store and port; resume with Last-Event-ID."""
    procs, sidecar, _ = shared_pair
    seen = chaoslib.host_kill9(procs, sidecar, after_events=4)
    assert seen["history"] == 4 + seen["resumed"]


# ---------------------------------------------------- in-process regression


async def _seed_running(root: Path, action_id: str, chunks: int) -> None:
    """A store left by a killed host: a running, dispatched ``run`` of crew beta with ``chunks`` stored chunks."""
    store = await Store.open(root / "state" / "host.db")
    try:
        inp = {"topic": "restart"}
        await store.create_action(
            "acme",
            action_id,
            "cap:crewai:beta",
            "beta",
            "run",
            canonical_json(inp).decode(),
            fence_hash("cap:crewai:beta", inp),
            "acme-invoker",
            "k-1",
            "running",
        )
        await store.update_action("acme", action_id, from_statuses=["running"], status="running", dispatch="sent")
        kinds = ["progress", "data", "done"]  # what the fake sidecar streams: started, an llm chunk, completed
        rows = [
            (seq, json.dumps({"action_id": action_id, "sequence": seq, "kind": kinds[seq], "data": {}}))
            for seq in range(chunks)
        ]
        await store.append_chunks("acme", action_id, rows, dispatch="acknowledged")
    finally:
        await store.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stored", [0, 1, 2, 3])
async def test_rel_restarted_host_backfills_chunks_from_the_sidecar_journal(tmp_path, stored):
    """Regression: after a host restart the action only waited for the sidecar's terminal event, so the
    chunks the sidecar streamed while the host was down (and the done chunk) never reached the history.
    Now the host follows the job's journaled events from the first missing one (read-only)."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake._admit({"crew_id": "beta", "action_id": "acme:act_r", "operation": "run", "input": {"topic": "restart"}})
    app = inproc_app(tmp_path / "etc", fake.transport())
    await _seed_running(tmp_path / "etc", "act_r", stored)
    executions = fake.executions
    async with running(app) as http:
        status = await _settled(http, "act_r")
        events = await http.get("/aip/v1/actions/act_r/events", headers=bearer("acme-invoker"))
    assert status["state"] == "completed"
    page = events.json()  # the ack, started, chunk, completed (3 chunks), the result
    assert [e["id"] for e in page["events"]] == ["sse_0", "sse_1", "sse_2", "sse_3", "sse_4"]
    assert [c["kind"] for c in page["chunks"]] == ["progress", "data", "done"]
    starts = [r for r in fake.requests if r.method == "POST" and r.url.path in ("/jobs", "/jobs/stream")]
    assert starts == [] and fake.executions == executions  # never re-dispatched


@pytest.mark.timeout(30)
async def test_rel_restarted_host_fails_an_action_the_sidecar_never_admitted(tmp_path):
    """A running action whose job the sidecar does not know (the host died before admission) fails as
    not dispatched (certain), instead of staying running."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = inproc_app(tmp_path / "etc", fake.transport())
    await _seed_running(tmp_path / "etc", "act_lost", 0)
    async with running(app) as http:
        status = await _settled(http, "act_lost")
        result = (await http.get("/aip/v1/actions/act_lost/result", headers=bearer("acme-invoker"))).json()
    error = result["body"]["action_result"]["error"]
    assert status["state"] == "failed" and error["code"] == "connector.crewai.cancelled_unconfirmed"
    assert error["details"]["uncertain_outcome"] is False and error["details"]["dispatch"] == "not_sent"
    assert fake.executions == 0


async def _seed_approved_unsent(root: Path, action_id: str, *, age_s: float) -> None:
    """A store left by a host killed after an approval started its action (one commit: approved, running,
    dispatch `sent`) but before the sidecar admitted the start request; everything happened ``age_s`` ago."""
    from aip_crewai.host.actions.lifecycle import approval_admits, policy_hash
    from aip_crewai.host.actions.service import APPROVAL_TTL_MS

    store = await Store.open(root / "state" / "host.db", clock=lambda: time.time() - age_s)
    try:
        inp = {"topic": "approved"}
        hashed = fence_hash("cap:crewai:beta", inp)
        _, record = await store.create_action(
            "acme",
            action_id,
            "cap:crewai:beta",
            "beta",
            "run",
            canonical_json(inp).decode(),
            hashed,
            "acme-invoker",
            "k-a",
            "pending_approval",
            approval_id=f"apr_{action_id}",
        )
        await store.create_approval(
            "acme",
            f"apr_{action_id}",
            action_id,
            "cap:crewai:beta",
            policy_hash("acme", action_id, "cap:crewai:beta", hashed),
            "acme-invoker",
            record.input_json,
            record.created_at + APPROVAL_TTL_MS,
        )
        _, started = await store.decide_and_start(
            "acme", f"apr_{action_id}", "approved", "ok", "acme-both", store.now_ms(), start_if=approval_admits
        )
        assert started is not None and started.dispatch == "sent"
    finally:
        await store.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("age_s", [1.0, 1000.0])
async def test_rel_an_approved_action_the_sidecar_never_admitted_runs_once_after_restart(tmp_path, age_s):
    """Found by break-it sessions: a host killed after an approval started its action but before the
    sidecar admitted it left an approved action that a restart failed as never dispatched (certain): the
    approval was lost, and a start request of the dead host still on its way could be admitted and run
    after that "certain" answer. A restarted host now dispatches it, joining any such request (the
    sidecar admits a job id once), also after the approval's TTL (which bounds the decision, not the run)."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = inproc_app(tmp_path / "etc", fake.transport(), clock=time.time)
    await _seed_approved_unsent(tmp_path / "etc", "act_unsent", age_s=age_s)
    async with running(app) as http:
        status = await _settled(http, "act_unsent")
    assert status["state"] == "completed" and fake.executions == 1


@pytest.mark.timeout(30)
async def test_rel_a_restarted_host_retries_actions_while_the_sidecar_was_unreachable(tmp_path, monkeypatch):
    """Found by a break-it session: the restart reconciliation ran once; an approved action found while the
    sidecar was unreachable stayed unsent until some client read it. Now it is retried periodically."""
    from aip_crewai.host.actions import recovery

    monkeypatch.setattr(recovery, "RECONCILE_S", 0.05)
    fake = FakeSidecar(SIDECAR_TOKEN)
    reachable = asyncio.Event()
    refused: list[str] = []

    def maybe_down(request: httpx2.Request) -> httpx2.Response:
        if not reachable.is_set() and request.url.path != "/health":
            refused.append(request.url.path)
            raise httpx2.ConnectError("connection refused", request=request)
        return fake.handle(request)

    app = inproc_app(tmp_path / "etc", httpx2.MockTransport(maybe_down), clock=time.time)
    await _seed_approved_unsent(tmp_path / "etc", "act_later", age_s=1.0)
    async with running(app):
        # the restart pass and at least two periodic passes try while the sidecar is down
        await until_async(lambda: len(refused) >= 3, timeout=20, interval=0.01, what="three refused dispatches")
        assert fake.executions == 0
        reachable.set()
        # no client reads the action: the periodic pass must dispatch it
        await until_async(lambda: fake.executions, timeout=20, interval=0.01, what="the periodic dispatch")
    assert fake.executions == 1 and fake.jobs["acme:act_later"].status == "completed"


@pytest.mark.timeout(30)
async def test_rel_restarted_host_keeps_a_running_action_while_the_sidecar_is_unreachable(tmp_path):
    """A sidecar that cannot be reached leaves the action running (a later read retries), never failed."""

    def down(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    app = inproc_app(tmp_path / "etc", httpx2.MockTransport(down))
    await _seed_running(tmp_path / "etc", "act_wait", 2)
    async with running(app) as http:
        for _ in range(3):
            status = (await http.get("/aip/v1/actions/act_wait", headers=bearer("acme-invoker"))).json()
            await asyncio.sleep(0.05)
        chunks = (await http.get("/aip/v1/actions/act_wait/chunks", headers=bearer("acme-invoker"))).json()
    assert status["state"] == "running" and len(chunks["chunks"]) == 2


async def _seed_pending(root: Path, action_id: str, *, decision: str | None, with_approval: bool = True) -> str:
    """A store left by a host killed inside the approval flow: a pending ``run`` of crew beta whose approval
    was decided but not applied (``decision``), or whose approval row was never written."""
    from aip_crewai.host.actions.lifecycle import policy_hash
    from aip_crewai.host.actions.service import APPROVAL_TTL_MS

    store = await Store.open(root / "state" / "host.db")
    try:
        inp = {"topic": "approval"}
        hashed = fence_hash("cap:crewai:beta", inp)
        approval_id = f"apr_{action_id}"
        _, record = await store.create_action(
            "acme",
            action_id,
            "cap:crewai:beta",
            "beta",
            "run",
            canonical_json(inp).decode(),
            hashed,
            "acme-invoker",
            "k-p",
            "pending_approval",
            approval_id=approval_id,
        )
        if with_approval:
            await store.create_approval(
                "acme",
                approval_id,
                action_id,
                "cap:crewai:beta",
                policy_hash("acme", action_id, "cap:crewai:beta", hashed),
                "acme-invoker",
                record.input_json,
                record.created_at + APPROVAL_TTL_MS,
            )
        if decision is not None:
            assert await decide(store, "acme", approval_id, decision, "ok", "acme-both", store.now_ms())
    finally:
        await store.close()
    return approval_id


async def _settled(http, action_id: str) -> dict:
    """The action's status once it left pending_approval, queued and running (within the tests' 30 s)."""

    async def settled() -> dict | None:
        status = (await http.get(f"/aip/v1/actions/{action_id}", headers=bearer("acme-invoker"))).json()
        return status if status["state"] not in ("pending_approval", "queued", "running") else None

    return await until_async(settled, timeout=20, interval=0.01, what=f"action {action_id} settled")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("decision,expected", [("approved", "completed"), ("denied", "failed")])
async def test_rel_a_decision_recorded_before_a_host_crash_is_applied_after_restart(tmp_path, decision, expected):
    """Regression: a host killed between recording an approval decision and applying it left the action
    pending forever (the approval was decided, so nobody could decide again, and nothing expired it).
    A restarted host applies the recorded decision: it dispatches an approval (once), fails a denial."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = inproc_app(tmp_path / "etc", fake.transport(), clock=time.time)
    await _seed_pending(tmp_path / "etc", "act_decided", decision=decision)
    async with running(app) as http:
        status = await _settled(http, "act_decided")
    assert status["state"] == expected
    assert fake.executions == (1 if decision == "approved" else 0)


@pytest.mark.timeout(30)
async def test_rel_an_approval_lost_in_a_host_crash_is_restored_and_decidable(tmp_path):
    """Regression: a host killed between writing a pending action and its approval left an action that
    pointed at an approval nobody could find or decide (404), pending forever. A restarted host restores
    the approval (same id, hash, requester, snapshot and expiry), so the approver can decide it."""
    fake = FakeSidecar(SIDECAR_TOKEN)
    app = inproc_app(tmp_path / "etc", fake.transport(), clock=time.time)
    approval_id = await _seed_pending(tmp_path / "etc", "act_orphan", decision=None, with_approval=False)
    async with running(app) as http:

        async def restored() -> list:
            return (await http.get("/aip/v1/approvals", headers=bearer("acme-both"))).json()["approvals"]

        listing = await until_async(restored, timeout=20, interval=0.01, what="the approval restored")
        assert [a["request"]["id"] for a in listing] == [approval_id]
        shown = (await http.get(f"/aip/v1/approvals/{approval_id}", headers=bearer("acme-both"))).json()
        assert shown["evidence_payload"]["input"] == {"topic": "approval"}
        assert shown["request"]["requester"]["id"] == "acme-invoker"
        decided = await http.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": "approved", "reason": "ok"},
        )
        assert decided.status_code == 200
        status = await _settled(http, "act_orphan")
    assert status["state"] == "completed" and fake.executions == 1


@pytest.mark.timeout(60)
def test_rel_a_frozen_sidecar_cannot_hang_status_reads_or_cancels(tmp_path, monkeypatch):
    """Regression: the sidecar client had no read timeout, so a sidecar that stops answering (SIGSTOP, a
    wedged loop: the connection stays open) held a status read and a runtime cancel forever (a real
    host, a SIGSTOPped sidecar: both still unanswered after 40 s). Non-stream reads now give up after
    JSON_READ_TIMEOUT_S (30 s; 0.5 s here): the status read fails as a transport error, the cancel as
    cancelled_unconfirmed, both in time."""
    import streamkit
    from relkit import AppThread

    from aip_crewai.contracts.operations import OPERATION_NAMES
    from aip_crewai.host.sidecars import client as sidecar_client

    monkeypatch.setattr(sidecar_client, "JSON_READ_TIMEOUT_S", 0.5)
    fake = streamkit.FakeSidecarServer(SIDECAR_TOKEN, ["alpha", "beta", "gamma"], sorted(OPERATION_NAMES))
    app = AppThread(inproc_app(tmp_path / "etc", None, sidecar_url=fake.base_url, clock=time.time))
    try:

        def post(action_id, capability, inp, key=None):
            env = {
                "aip_version": "1.0",
                "message_type": "aip.core.v1.action",
                "message_id": f"msg_{action_id}",
                "sent_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "body": {
                    "action": {
                        "id": action_id,
                        "capability_id": capability,
                        "input": inp,
                        **({"idempotency_key": key} if key else {}),
                    }
                },
            }
            status, _, content = app.request(
                "POST", "/aip/v1/messages", json=env, headers=bearer("acme-invoker"), timeout=20
            )
            return status, json.loads(content)

        status, pending = post("act_long", "cap:crewai:beta", {"topic": "alive_for_30s"}, "k-long")
        approval_id = pending["body"]["action_result"]["output"]["approval_id"]
        status, _, _ = app.request(
            "POST",
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),
            json={"decision": "approved", "reason": "ok"},
        )
        assert status == 200
        fake.frozen |= {"GET /jobs/", "POST /jobs/acme"}  # reads and cancels are never answered from now on
        started = time.monotonic()
        status, answer = post("act_read", "cap:crewai:beta:status", {"run_action_id": "act_long"})
        error = answer["body"]["action_result"]["error"]
        assert error["code"] == "connector.crewai.transport" and time.monotonic() - started < 10
        started = time.monotonic()
        status, _, content = app.request(
            "POST", "/aip/v1/actions/act_long/cancel", headers=bearer("acme-invoker"), timeout=20
        )
        result = json.loads(content)["body"]["action_result"]
        assert result["error"]["code"] == "connector.crewai.cancelled_unconfirmed"
        assert time.monotonic() - started < 10
    finally:
        app.close()
        fake.close()


@pytest.mark.timeout(120)
def test_rel_a_second_host_on_the_same_store_is_refused(procs):
    """Regression (resilience review, item 6): a second host on the same store started and reported
    ready, with nothing to keep the two apart. It now exits 2 before serving, as a second sidecar on a
    journal does; once the first host is gone, a new one starts on the store. The store is the host's
    alone: no sidecar runs (each host serves, unready, on a port where none listens)."""
    import signal

    from relkit import free_port, served, write_host_config

    nowhere = f"http://127.0.0.1:{free_port()}"
    first = served(procs.host(nowhere, name="h-one", ready=False))
    config = write_host_config(first.workdir, nowhere, free_port())  # same store, another port
    process, stderr_path, _ = procs.launch_host(first.workdir, config)
    assert process.wait(timeout=60) == 2
    # SQLite: the store's lock file; PostgreSQL: the session advisory lock on the host's id in its database.
    held = "another running host uses host_id" if storebackend.postgresql() else "already owned by another running host"
    assert held in stderr_path.read_text()
    first.kill(signal.SIGTERM)
    again = served(procs.host(nowhere, name="h-one", ready=False))
    assert again.process.poll() is None
