"""Every writer of a dispatch carries the lease token it dispatched under, on both store engines
(ARCHITECTURE.md §10, dispatch leases): ``ActionWriter.finish`` (with the usage row and receipt its result
leaves), ``mark_sent``, ``requeue`` and ``correct`` given a stale token are refused (LeaseLost) and store
nothing, even after this host forgot the token (the renewal that found the lease taken forgets it); given the
current token they write. A dispatch (and a restart follower) that met LeaseLost writes nothing more: not its
result, not the failure of an unexpected exception raised at the moment its chunk writer was refused.

Two stores with their own host ids stand for two hosts on one database (on SQLite, one file: the same code
path, though a real SQLite host has one host and no leases).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kits.poll import until_async

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import ActionResult, StreamChunk
from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed
from aip_crewai.host.actions import dispatch_task, recovery
from aip_crewai.host.actions.dispatch import Job
from aip_crewai.host.actions.lifecycle import DispatchState
from aip_crewai.host.actions.live import LiveAction, LiveRegistry
from aip_crewai.host.actions.normalize import failed_result
from aip_crewai.host.actions.writer import ActionWriter
from aip_crewai.host.ledger import receipts as rc
from aip_crewai.host.ledger.sealer import Sealer
from aip_crewai.host.sidecars.client import DispatchProgress
from aip_crewai.host.store.store import ActionRecord, LeaseLost, Store

pytestmark = pytest.mark.timeout(60)

KEY = Ed25519PrivateKey.from_private_bytes(b"\x07" * 32)
STALE, CURRENT = 1, 2


@dataclass
class Hosts:
    """host-a (paused past its lease, then resumed) and host-b (took the lease over) on one store."""

    a: Store
    b: Store
    writer_a: ActionWriter
    writer_b: ActionWriter


@pytest.fixture(params=["sqlite", "postgresql"])
async def hosts(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Hosts]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    location = state / "host.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    a = await Store.open(location, owner="host-a", lease_ms=30_000)
    b = await Store.open(location, owner="host-b", lease_ms=30_000)
    try:
        yield Hosts(
            a,
            b,
            ActionWriter(a, sealer=Sealer(keys=rc.ReceiptKeys(KEY))),
            ActionWriter(b, sealer=Sealer(keys=rc.ReceiptKeys(KEY))),
        )
    finally:
        await a.close()
        await b.close()


async def _running(store: Store, action_id: str, *, dispatch: str = "sent") -> None:
    created, _ = await store.create_action(
        "acme",
        action_id,
        "cap:crewai:alpha",
        "alpha",
        "run",
        "{}",
        "h",
        "svc:acme",
        f"key-{action_id}",
        "running",
        dispatch=dispatch,
        sidecar="main",
    )
    assert created


async def _take_over(h: Hosts, action_id: str) -> ActionRecord:
    """host-a's lease expires by the database's clock (it was paused), host-b takes the action (token 2),
    and host-a, resumed, renews: the renewal forgets host-a's token. Returns the row as host-b left it."""
    assert h.a.lease_token("acme", action_id) == STALE
    await h.b._change("UPDATE actions SET lease_expires_at = 0 WHERE tenant = ? AND action_id = ?", ("acme", action_id))
    assert await h.b.take_lease("acme", action_id) and h.b.lease_token("acme", action_id) == CURRENT
    assert await h.a.renew_leases() == 0
    assert h.a.lease_token("acme", action_id) is None and h.a.lost_leases() == {("acme", action_id)}
    record = await h.b.get_action("acme", action_id)
    assert record is not None and (record.lease_owner, record.lease_epoch) == ("host-b", CURRENT)
    return record


async def _ledger_rows(store: Store) -> tuple[int, int, int]:
    """How many chunk, usage and receipt rows the store holds (every action)."""
    counts = [await store._fetch(f"SELECT COUNT(*) FROM {table}") for table in ("chunks", "action_usage", "receipts")]
    chunks, usage, receipts = (int(rows[0][0]) for rows in counts)
    return chunks, usage, receipts


def _completed(action_id: str) -> ActionResult:
    return ActionResult(action_id=action_id, status="completed", output={"raw": "done"})


def _chunk(action_id: str, sequence: int) -> StreamChunk:
    return StreamChunk(action_id=action_id, sequence=sequence, kind="progress")


#: Each writer of a dispatch, given the token it works under.
WRITERS: dict[str, Callable[[ActionWriter, int], Awaitable[ActionRecord | None]]] = {
    "finish": lambda w, token: w.finish(
        "acme",
        "act_1",
        _completed("act_1"),
        DispatchState.ACKNOWLEDGED.value,
        settle_dispatch=True,
        chunks=[_chunk("act_1", 0), _chunk("act_1", 1)],
        lease_token=token,
    ),
    "mark_sent": lambda w, token: w.mark_sent("acme", "act_1", sidecar="other", lease_token=token),
    "requeue": lambda w, token: w.requeue("acme", "act_1", lease_token=token),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
async def test_a_dispatch_writer_with_a_stale_token_is_refused_and_stores_nothing(hosts: Hosts, name: str) -> None:
    write = WRITERS[name]
    await _running(hosts.a, "act_1", dispatch="not_sent" if name == "mark_sent" else "sent")
    before = await _take_over(hosts, "act_1")

    with pytest.raises(LeaseLost):  # host-a forgot its token; the dispatch's own token still fences the write
        await write(hosts.writer_a, STALE)
    assert await hosts.b.get_action("acme", "act_1") == before
    assert await _ledger_rows(hosts.b) == (0, 0, 0)  # no chunk, no usage row, no receipt

    written = await write(hosts.writer_b, CURRENT)  # the holder's current token: written
    assert written is not None and (written.lease_owner, written.lease_epoch) == ("host-b", CURRENT)
    if name == "finish":
        assert (written.status, written.dispatch, written.chunk_count) == ("completed", "acknowledged", 2)
        assert await _ledger_rows(hosts.b) == (2, 1, 1)  # its stream, its usage row and its receipt
    elif name == "mark_sent":
        assert (written.status, written.dispatch, written.sidecar) == ("running", "sent", "other")
    else:
        assert (written.status, written.dispatch) == ("running", "not_sent")


async def test_a_correction_with_a_stale_token_is_refused_and_stores_nothing(hosts: Hosts) -> None:
    await _running(hosts.a, "act_1")
    await _take_over(hosts, "act_1")
    provisional = failed_result(
        "act_1", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True, dispatch="acknowledged")
    )
    stored = await hosts.writer_b.finish(
        "acme", "act_1", provisional, DispatchState.ACKNOWLEDGED.value, lease_token=CURRENT
    )
    assert stored is not None and stored.status == "failed"
    rows = await _ledger_rows(hosts.b)

    with pytest.raises(LeaseLost):
        await hosts.writer_a.correct(stored, _completed("act_1"), chunks=[_chunk("act_1", 0)], lease_token=STALE)
    assert await hosts.b.get_action("acme", "act_1") == stored
    assert await _ledger_rows(hosts.b) == rows

    corrected = await hosts.writer_b.correct(
        stored, _completed("act_1"), chunks=[_chunk("act_1", 0)], lease_token=CURRENT
    )
    assert corrected is not None and (corrected.status, corrected.chunk_count) == ("completed", 1)
    chunks, usage, receipts = await _ledger_rows(hosts.b)
    assert (chunks, usage, receipts) == (1, 1, 1)  # the final result's receipt (the provisional one had none)


# --- the dispatch task and the restart follower ------------------------------------------------------------


class FakeDispatcher:
    """Stands for the sidecar: ``script`` runs as the job's stream (``run``, and ``resume`` for a follower)."""

    placement = None  # every job here is placed already (``Job.sidecar``)

    def __init__(self, script: Callable[[Job, Any], Awaitable[ActionResult]]) -> None:
        self.script = script

    async def run(self, job: Job, on_chunks: Any) -> ActionResult:
        return await self.script(job, on_chunks)

    async def resume(self, job: Job, on_chunks: Any) -> ActionResult:
        return await self.script(job, on_chunks)


class Runtime:
    """What the dispatch task and the restart follower use of the action service."""

    def __init__(self, store: Store, dispatcher: FakeDispatcher) -> None:
        self.store = store
        self.writer = ActionWriter(store, sealer=Sealer(keys=rc.ReceiptKeys(KEY)))
        self.dispatcher = dispatcher
        self.live = LiveRegistry()
        self.dispatch_deadline_ms = 60_000

    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def job(self, record: ActionRecord, *, stream: bool) -> Job:
        return Job(
            tenant=record.tenant,
            action_id=record.action_id,
            crew_id=record.crew_id,
            spec=ops.get(record.operation),
            input={},
            idempotency_key=record.idempotency_key or record.action_id,
            stream=True,
            first_chunk_sequence=record.chunk_count,
            dispatch=DispatchProgress(DispatchState.ACKNOWLEDGED),
            sidecar=record.sidecar,
        )

    def revocation(self, record: ActionRecord) -> None:
        return None


async def _start(runtime: Runtime, role: str) -> asyncio.Task[None]:
    """host-a's dispatch task (``dispatch``) or restart follower (``follower``) of act_1."""
    record = await runtime.store.get_action("acme", "act_1")
    assert record is not None
    if role == "follower":
        recovery._resume(runtime, record)  # type: ignore[arg-type]
        live = runtime.live.get("acme", "act_1")
        assert live is not None and live.task is not None
        return live.task
    live = LiveAction(job=runtime.job(record, stream=True))
    runtime.live.add(live)
    live.task = asyncio.create_task(dispatch_task.run(runtime, live, mark_sent=False, recheck=False))  # type: ignore[arg-type]
    return live.task


@pytest.mark.parametrize("role", ["dispatch", "follower"])
async def test_a_dispatch_whose_lease_was_taken_does_not_store_its_result(hosts: Hosts, role: str) -> None:
    """The job ends after host-b took the lease and host-a's renewal forgot host-a's token: the result is
    written under the dispatch's own token, so it is refused (before, it went out unfenced)."""
    await _running(hosts.a, "act_1", dispatch="acknowledged")

    async def script(job: Job, on_chunks: Any) -> ActionResult:
        await on_chunks([_chunk("act_1", 0)])
        await until_async(lambda: hosts.b.list_chunks("acme", "act_1"), interval=0.01, what="chunk 0 stored")
        await _take_over(hosts, "act_1")
        return _completed("act_1")

    with structlog.testing.capture_logs() as logs:
        task = await _start(Runtime(hosts.a, FakeDispatcher(script)), role)
        await asyncio.wait_for(task, 30)
    stored = await hosts.b.get_action("acme", "act_1")
    assert stored is not None and (stored.status, stored.result_json, stored.chunk_count) == ("running", None, 1)
    assert (stored.lease_owner, stored.lease_epoch) == ("host-b", CURRENT)
    assert await _ledger_rows(hosts.b) == (1, 0, 0)
    assert any(e["event"] == "lease_lost" for e in logs), logs


@pytest.mark.parametrize("role", ["dispatch", "follower"])
async def test_an_unexpected_exception_when_the_chunk_writer_is_refused_writes_nothing(
    hosts: Hosts, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1 of the fencing work: the dispatch crashes (an unexpected exception) at the very moment its
    chunk writer is refused for a stale token; its crash handler drains the sink (LeaseLost) and must then
    write nothing: no failed result, no usage, no receipt, while host-b runs the action."""
    await _running(hosts.a, "act_1", dispatch="acknowledged")
    refused = asyncio.Event()
    append = hosts.a.append_chunks

    async def watched(*args: Any, **kwargs: Any) -> int:
        try:
            return await append(*args, **kwargs)
        except LeaseLost:
            refused.set()
            raise

    monkeypatch.setattr(hosts.a, "append_chunks", watched)

    async def script(job: Job, on_chunks: Any) -> ActionResult:
        await on_chunks([_chunk("act_1", 0)])
        await until_async(lambda: hosts.b.list_chunks("acme", "act_1"), interval=0.01, what="chunk 0 stored")
        await _take_over(hosts, "act_1")
        await on_chunks([_chunk("act_1", 1)])  # its batch is refused by the token the sink holds ...
        await asyncio.wait_for(refused.wait(), 30)
        raise RuntimeError("injected: the host fails at the moment its chunk writer is refused")  # ... and then this

    with structlog.testing.capture_logs() as logs:
        task = await _start(Runtime(hosts.a, FakeDispatcher(script)), role)
        await asyncio.wait_for(task, 30)  # the task ends without raising
    stored = await hosts.b.get_action("acme", "act_1")
    assert stored is not None and (stored.status, stored.result_json, stored.chunk_count) == ("running", None, 1)
    assert (stored.lease_owner, stored.lease_epoch) == ("host-b", CURRENT)
    assert await _ledger_rows(hosts.b) == (1, 0, 0)
    assert any(e["event"] == "lease_lost" for e in logs), logs


def test_saw_lease_lost_follows_the_cause_and_the_context() -> None:
    def raised_while_handling() -> BaseException:
        try:
            try:
                raise LeaseLost()
            except LeaseLost:
                raise ValueError("while handling") from None
        except ValueError as exc:
            return exc

    assert dispatch_task.saw_lease_lost(LeaseLost())
    caused = RuntimeError("caused")
    caused.__cause__ = LeaseLost()
    assert dispatch_task.saw_lease_lost(caused)
    assert dispatch_task.saw_lease_lost(raised_while_handling())  # `from None` keeps the context
    assert not dispatch_task.saw_lease_lost(RuntimeError("unrelated"))
    assert not dispatch_task.saw_lease_lost(None)
    looped = RuntimeError("a")
    looped.__context__ = RuntimeError("b")
    looped.__context__.__context__ = looped  # a cycle ends the walk
    assert not dispatch_task.saw_lease_lost(looped)


# --- a restart follower that cannot read its sidecar is not re-followed in a tight loop -----------------------


def test_a_follower_pause_doubles_to_its_cap_and_ends_with_a_result() -> None:
    registry = LiveRegistry()
    pauses = [registry.follow_failed("acme", "act_1", 100.0) for _ in range(6)]
    assert pauses == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert not registry.may_follow("acme", "act_1", 104.9) and registry.may_follow("acme", "act_1", 105.0)
    assert registry.may_follow("acme", "act_2", 100.0)  # another action is not paused
    registry.follow_ended("acme", "act_1")
    assert registry.may_follow("acme", "act_1", 100.0)


async def test_a_follower_whose_sidecar_cannot_be_read_is_not_followed_again_before_its_pause(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar is down: each follower ends at once (``action_resume_deferred``). A tenant waiting on the
    action re-reads it in a loop (ActionService.wait → refresh → reconcile → _resume); before, each read
    started a new follower at once (hundreds a second, the host at full CPU)."""
    monkeypatch.setattr("aip_crewai.host.actions.live.FOLLOW_BACKOFF_S", 0.05)
    await _running(hosts.a, "act_1", dispatch="acknowledged")
    followed = 0

    async def script(job: Job, on_chunks: Any) -> ActionResult:
        nonlocal followed
        followed += 1
        raise ConnectorCancelledUnconfirmed("the sidecar cannot be reached", operation="run")

    runtime = Runtime(hosts.a, FakeDispatcher(script))
    record = await hosts.a.get_action("acme", "act_1")
    assert record is not None
    task = await _start(runtime, "follower")
    await asyncio.wait_for(task, 30)
    for _ in range(200):  # a tenant's wait loop re-reading at once
        recovery._resume(runtime, record)  # type: ignore[arg-type]
    assert followed == 1 and runtime.live.get("acme", "act_1") is None
    await until_async(
        lambda: runtime.live.may_follow("acme", "act_1", asyncio.get_running_loop().time()), what="pause passed"
    )
    recovery._resume(runtime, record)  # type: ignore[arg-type]
    live = runtime.live.get("acme", "act_1")
    assert live is not None and live.task is not None
    await asyncio.wait_for(live.task, 30)
    assert followed == 2
