"""Dispatch leases on a shared PostgreSQL store are fenced and judged by the database's clock: a host
whose clock is off cannot take a live lease, and a lease holder that was paused past its lease (another
host took it) writes nothing after losing it: a trigger records the lease current at each chunk insert and
each action update, so a write under a stale token would show.

ARCHITECTURE.md §10 (dispatch leases). Against the real throwaway server; skipped with one line without it.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from kits.poll import until_async

from aip_crewai.host.store.store import LeaseLost, Store

pytestmark = pytest.mark.timeout(60)

#: Every chunk insert and action update, with the lease current when it was written (proof of the writer).
AUDIT = """
CREATE TABLE lease_audit (what TEXT, action_id TEXT, sequence BIGINT, lease_owner TEXT, lease_epoch BIGINT,
    status TEXT);
CREATE FUNCTION audit_chunk() RETURNS trigger AS $$
BEGIN
    INSERT INTO lease_audit SELECT 'chunk', NEW.action_id, NEW.sequence, a.lease_owner, a.lease_epoch, a.status
    FROM actions a WHERE a.tenant = NEW.tenant AND a.action_id = NEW.action_id;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE FUNCTION audit_action() RETURNS trigger AS $$
BEGIN
    INSERT INTO lease_audit VALUES ('action', NEW.action_id, NEW.chunk_count, NEW.lease_owner, NEW.lease_epoch,
        NEW.status);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER chunks_audit AFTER INSERT ON chunks FOR EACH ROW EXECUTE FUNCTION audit_chunk();
CREATE TRIGGER actions_audit AFTER UPDATE ON actions FOR EACH ROW EXECUTE FUNCTION audit_action();
"""


async def _running(store: Store, action_id: str) -> None:
    await store.create_action(
        "acme", action_id, "cap:crewai:alpha", "alpha", "run", "{}", "h", "svc:acme", f"key-{action_id}", "running"
    )


def _expire(url: str, action_id: str) -> None:
    """The database's clock passes the lease (its holder stopped renewing: paused, frozen)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE actions SET lease_expires_at = 0 WHERE action_id = %s", (action_id,))


@pytest.mark.parametrize("skew_s", [40, -40])
async def test_a_host_whose_clock_is_off_does_not_take_a_live_lease(postgres_url: str, skew_s: int) -> None:
    healthy = await Store.open(postgres_url, owner="host-a", lease_ms=30_000)
    skewed = await Store.open(postgres_url, clock=lambda: time.time() + skew_s, owner="host-b", lease_ms=30_000)
    try:
        await _running(healthy, "act_1")
        record = await skewed.get_action("acme", "act_1")
        assert record is not None
        if skew_s > 0:  # by its own clock the lease has expired: it tries, and the database refuses
            assert not skewed.lease_is_foreign(record)
        assert not await skewed.take_lease("acme", "act_1")
        assert await healthy.renew_leases() == 1 and await skewed.renew_leases() == 0
        _expire(postgres_url, "act_1")  # once the lease has expired by the database's clock it is taken over
        assert await skewed.take_lease("acme", "act_1")
        after = await skewed.get_action("acme", "act_1")
        assert after is not None and (after.lease_owner, after.lease_epoch) == ("host-b", 2)
        assert abs((after.lease_expires_at or 0) - (time.time() * 1000 + 30_000)) < 10_000  # not skewed by 40 s
    finally:
        await healthy.close()
        await skewed.close()


async def test_a_paused_lease_holder_writes_nothing_after_losing_its_lease(postgres_url: str) -> None:
    paused = await Store.open(postgres_url, owner="host-a", lease_ms=30_000)
    taker = await Store.open(postgres_url, owner="host-b", lease_ms=30_000)
    try:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(AUDIT)
        await _running(paused, "act_1")
        assert await paused.take_lease("acme", "act_1") and paused.lease_token("acme", "act_1") == 1
        assert await paused.append_chunks("acme", "act_1", [(0, '{"n":0}'), (1, '{"n":1}')]) == 2

        _expire(postgres_url, "act_1")  # host-a is paused past its lease; host-b takes the action over
        assert await taker.take_lease("acme", "act_1") and taker.lease_token("acme", "act_1") == 2
        assert await taker.append_chunks("acme", "act_1", [(2, '{"n":2}')]) == 1

        # host-a resumes with its stale token: every write on behalf of the action is refused, whole.
        with pytest.raises(LeaseLost) as lost:
            await paused.append_chunks(
                "acme", "act_1", [(3, '{"stale":3}'), (4, '{"stale":4}')], dispatch="acknowledged"
            )
        assert lost.value.status == 503 and lost.value.code == "store.lease_lost"
        assert paused.lease_token("acme", "act_1") is None  # forgotten: it no longer acts as the holder
        # A result (or a dispatch state, a correction) under the stale token is refused too: the token is
        # put back as a process paused before any refusal still holds it.
        paused._tokens[("acme", "act_1")] = (1, 0)
        with pytest.raises(LeaseLost):
            await paused.update_action("acme", "act_1", from_statuses=["running"], status="completed", result_json="{}")
        paused._tokens[("acme", "act_1")] = (1, 0)
        with pytest.raises(LeaseLost):
            await paused.update_action(
                "acme", "act_1", from_statuses=["running"], status="running", dispatch="acknowledged"
            )
        paused._tokens[("acme", "act_1")] = (1, 0)
        assert await paused.renew_leases() == 0
        assert ("acme", "act_1") in paused.lost_leases()

        stored = await taker.get_action("acme", "act_1")
        assert stored is not None and (stored.status, stored.chunk_count, stored.lease_owner) == (
            "running",
            3,
            "host-b",
        )
        assert [c.chunk_json for c in await taker.list_chunks("acme", "act_1")] == ['{"n":0}', '{"n":1}', '{"n":2}']
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            audit = conn.execute(
                "SELECT what, sequence, lease_owner, lease_epoch FROM lease_audit ORDER BY ctid"
            ).fetchall()
        chunks = [(seq, owner, epoch) for what, seq, owner, epoch in audit if what == "chunk"]
        assert chunks == [(0, "host-a", 1), (1, "host-a", 1), (2, "host-b", 2)]
        # every action write after the takeover carries host-b's token: none by host-a
        after_takeover = audit[[row[2:] for row in audit].index(("host-b", 2)) :]
        assert all((owner, epoch) == ("host-b", 2) for _, _, owner, epoch in after_takeover)
        # the new holder's own writes go on
        done = await taker.update_action(
            "acme", "act_1", from_statuses=["running"], status="completed", result_json="{}"
        )
        assert done is not None and taker.lease_token("acme", "act_1") is None
    finally:
        await paused.close()
        await taker.close()


async def test_a_stale_holders_result_leaves_no_usage_or_receipt(postgres_url: str) -> None:
    """The writer's seal (usage row, receipt) is written in the result's transaction, under the same fence:
    a result refused for a stale token leaves neither (the seal is not even called); the holder's does."""
    from aip_crewai.host.store.store import ActionRecord, SealedRows

    calls: list[str] = []

    def seal(record: ActionRecord, proof: str | None) -> SealedRows:
        calls.append(record.lease_owner or "")
        usage = ("acme", record.action_id, "alpha", "run", 1, 1, 2, 3, 0, 1, 5, None, None)
        receipt = ("acme", f"rcpt_{record.lease_owner}", record.action_id, None, "h", "{}", 1)
        return SealedRows('{"sealed":true}', usage, receipt)

    paused = await Store.open(postgres_url, owner="host-a", lease_ms=30_000)
    taker = await Store.open(postgres_url, owner="host-b", lease_ms=30_000)
    try:
        await _running(paused, "act_1")
        _expire(postgres_url, "act_1")
        assert await taker.take_lease("acme", "act_1")
        with pytest.raises(LeaseLost):
            await paused.update_action(
                "acme", "act_1", from_statuses=["running"], status="completed", result_json="{}", seal=seal
            )
        assert calls == []
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM action_usage").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM receipts").fetchone() == (0,)
        done = await taker.update_action(
            "acme", "act_1", from_statuses=["running"], status="completed", result_json="{}", seal=seal
        )
        assert done is not None and done.result_json == '{"sealed":true}' and calls == ["host-b"]
        assert await taker.receipts_of_action("acme", "act_1") == ["{}"]
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            assert conn.execute("SELECT receipt_id FROM receipts").fetchall() == [("rcpt_host-b",)]
    finally:
        await paused.close()
        await taker.close()


async def test_a_host_that_never_held_the_lease_writes_as_before(postgres_url: str) -> None:
    """A cancel or a correction on a host without the lease is guarded by the action's state, not a token."""
    holder = await Store.open(postgres_url, owner="host-a", lease_ms=30_000)
    other = await Store.open(postgres_url, owner="host-b", lease_ms=30_000)
    try:
        await _running(holder, "act_1")
        assert other.lease_token("acme", "act_1") is None
        cancelled = await other.update_action(
            "acme", "act_1", from_statuses=["running"], status="cancelled", result_json='{"c":1}'
        )
        assert cancelled is not None and cancelled.status == "cancelled"
        # the holder's late result does not overwrite it (the state condition), and is no lease loss
        assert (
            await holder.update_action("acme", "act_1", from_statuses=["running"], status="completed", result_json="{}")
            is None
        )
        assert await holder.append_chunks("acme", "act_1", [(0, "{}")]) == 0
    finally:
        await holder.close()
        await other.close()


async def test_a_renewal_that_finds_a_lease_lost_stops_that_actions_dispatch_at_once(monkeypatch) -> None:
    """recovery.renew_leases cancels this host's dispatch (or follower) of an action whose lease the
    renewal found taken by another host, and logs lease_lost; other actions go on."""
    import asyncio
    import types

    import structlog

    from aip_crewai.host.actions import recovery

    class FakeStore:
        lease_ms = 150  # renewed every 50 ms

        def __init__(self) -> None:
            self.lost = {("acme", "act_lost")}

        async def renew_leases(self) -> int:
            return 1

        def lost_leases(self) -> set[tuple[str, str]]:
            lost, self.lost = self.lost, set()
            return lost

    never = asyncio.Event()
    tasks = {name: asyncio.create_task(never.wait()) for name in ("act_lost", "act_kept")}
    live = {key: types.SimpleNamespace(task=task) for key, task in tasks.items()}
    runtime = types.SimpleNamespace(
        store=FakeStore(), live=types.SimpleNamespace(get=lambda tenant, action_id: live.get(action_id))
    )
    with structlog.testing.capture_logs() as logs:
        renewing = asyncio.create_task(recovery.renew_leases(runtime))
        try:
            await until_async(
                lambda: tasks["act_lost"].done(), interval=0.01, what="the lost action's dispatch stopped"
            )
        finally:
            renewing.cancel()
    assert tasks["act_lost"].cancelled() and not tasks["act_kept"].done()
    assert any(e["event"] == "lease_lost" and e["action_id"] == "act_lost" for e in logs)
    tasks["act_kept"].cancel()


async def test_a_dispatchs_chunk_batch_after_its_token_was_forgotten_is_still_refused(postgres_url: str) -> None:
    """Regression (found by tests/integration/test_lease_pause.py's reasoning, pinned here): a renewal that
    finds the lease taken forgets the token before it cancels the dispatch, and the dispatch's chunk
    writer is a task of its own; a batch it wrote next went out without a fence (this host no longer held a
    token, so it wrote as a host that never held the lease). The sink keeps the token it dispatched under:
    that batch is refused (LeaseLost) and writes nothing."""
    import types

    from aip_crewai.contracts.aip import StreamChunk
    from aip_crewai.host.actions.chunk_sink import ChunkSink
    from aip_crewai.host.actions.live import CommittedTail

    paused = await Store.open(postgres_url, owner="host-a", lease_ms=30_000)
    taker = await Store.open(postgres_url, owner="host-b", lease_ms=30_000)
    try:
        await _running(paused, "act_1")
        assert await paused.take_lease("acme", "act_1")
        live = types.SimpleNamespace(
            job=types.SimpleNamespace(
                tenant="acme", action_id="act_1", dispatch=types.SimpleNamespace(state="acknowledged")
            ),
            notify=lambda: None,
            committed=CommittedTail(),
        )
        sink = ChunkSink(paused, live)  # type: ignore[arg-type]
        sink.hold(paused.lease_token("acme", "act_1"))
        await sink.add([StreamChunk(action_id="act_1", sequence=0, kind="progress")])
        await sink.drain()

        _expire(postgres_url, "act_1")  # host-a paused past its lease; host-b takes the action over
        assert await taker.take_lease("acme", "act_1")
        assert await paused.renew_leases() == 0  # host-a resumes: its renewal forgets the token ...
        assert paused.lease_token("acme", "act_1") is None and paused.lost_leases() == {("acme", "act_1")}
        # ... and the dispatch's writer stores its next batch before the cancel reaches it: refused.
        await sink.add([StreamChunk(action_id="act_1", sequence=1, kind="progress")])
        with pytest.raises(LeaseLost):
            await sink.drain()
        with pytest.raises(LeaseLost):  # the store refuses an explicit stale token as well
            await paused.append_chunks("acme", "act_1", [(1, "{}")], lease_token=1)
        stored = await taker.get_action("acme", "act_1")
        assert stored is not None and stored.chunk_count == 1
        assert [c.sequence for c in await taker.list_chunks("acme", "act_1")] == [0]
    finally:
        await paused.close()
        await taker.close()
