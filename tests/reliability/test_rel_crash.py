"""Crashes: kill -9 of either process, then restart on the same state (DESIGN.md §5 crash fence, §8 reconciliation)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

import chaoslib
from aip_crewai.contracts.hashing import canonical_json
from aip_crewai.host.actions import fence_hash
from aip_crewai.host.store import Store
from fake_sidecar import FakeSidecar
from hostkit import SIDECAR_TOKEN, bearer, running
from relkit import inproc_app

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(120)
def test_rel_sidecar_kill9_during_concurrent_runs_fails_each_once_and_reruns_none(procs):
    """6 concurrent slow runs (4 executing, 2 queued), kill -9, restart on the journal: the crash fence."""
    seen = chaoslib.sidecar_kill9(procs, runs=6, running_at_kill=2)
    assert seen["running"] >= 2 and seen["running"] + seen["queued"] >= 5


@pytest.mark.timeout(120)
def test_rel_host_kill9_mid_stream_resumes_every_chunk_once_and_never_redispatches(stack):
    """kill -9 of the host after 4 SSE events; restart on the same store and port; resume with Last-Event-ID."""
    procs, sidecar, _ = stack
    seen = chaoslib.host_kill9(procs, sidecar, after_events=4)
    assert seen["history"] == 4 + seen["resumed"]


# ---------------------------------------------------- in-process regression


async def _seed_running(root: Path, action_id: str, chunks: int) -> None:
    """A store left by a killed host: a running, dispatched ``run`` of crew beta with ``chunks`` stored chunks."""
    store = await Store.open(root / "state" / "host.db")
    try:
        inp = {"topic": "restart"}
        await store.create_action("acme", action_id, "cap:crewai:beta", "beta", "run", canonical_json(inp).decode(),
                                  fence_hash("cap:crewai:beta", inp), "acme-invoker", "k-1", "running")
        await store.update_action("acme", action_id, from_statuses=["running"], status="running", dispatch="sent")
        kinds = ["progress", "data", "done"]  # what the fake sidecar streams: started, an llm chunk, completed
        rows = [(seq, json.dumps({"action_id": action_id, "sequence": seq, "kind": kinds[seq], "data": {}}))
                for seq in range(chunks)]
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
        for _ in range(200):
            status = (await http.get("/aip/v1/actions/act_r", headers=bearer("acme-invoker"))).json()
            if status["status"] != "running":
                break
            await asyncio.sleep(0.01)
        events = await http.get("/aip/v1/actions/act_r/events", headers=bearer("acme-invoker"))
    assert status["status"] == "completed" and status["chunk_count"] == 3  # started, chunk, completed
    assert [e["id"] for e in events.json()["events"]] == ["sse_1", "sse_2", "sse_3"]
    assert events.json()["events"][-1]["chunk"]["kind"] == "done"
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
        for _ in range(200):
            status = (await http.get("/aip/v1/actions/act_lost", headers=bearer("acme-invoker"))).json()
            if status["status"] != "running":
                break
            await asyncio.sleep(0.01)
        result = (await http.get("/aip/v1/actions/act_lost/result", headers=bearer("acme-invoker"))).json()
    error = result["body"]["action_result"]["error"]
    assert status["status"] == "failed" and error["code"] == "connector.crewai.cancelled_unconfirmed"
    assert error["details"]["uncertain_outcome"] is False and error["details"]["dispatch"] == "not_sent"
    assert fake.executions == 0


@pytest.mark.timeout(30)
async def test_rel_restarted_host_keeps_a_running_action_while_the_sidecar_is_unreachable(tmp_path):
    """A sidecar that cannot be reached leaves the action running (a later read retries), never failed."""

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    app = inproc_app(tmp_path / "etc", httpx.MockTransport(down))
    await _seed_running(tmp_path / "etc", "act_wait", 2)
    async with running(app) as http:
        for _ in range(3):
            status = (await http.get("/aip/v1/actions/act_wait", headers=bearer("acme-invoker"))).json()
            await asyncio.sleep(0.05)
    assert status["status"] == "running" and status["chunk_count"] == 2
