"""The action service: both fences, dispatch, approvals, cancellation, tenant isolation (ARCHITECTURE.md §7, §8)."""

import asyncio
import dataclasses
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kits.hostapp import count_store_calls, hold_store_call, open_action_service
from kits.poll import until_async
from structlog.testing import capture_logs

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.contracts.errors import (
    ActionNotFound,
    CapabilityNotFound,
    IdempotencyConflict,
    IdempotencyKeyRequired,
    InvalidInput,
    NotCancellable,
)
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.ledger import receipts as rc
from aip_crewai.host.ledger.sealer import Sealer


async def decide(store, *args):
    """Record one decision and start nothing: True when this call decided (the store's decide_and_start)."""
    decided, _ = await store.decide_and_start(*args, start_if=lambda approval, action: False)
    return decided is not None


ALL = frozenset(ops.OPERATION_NAMES)
INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
OTHER = Principal("svc:beta", "beta", frozenset({"invoker", "approver"}))


@pytest.fixture
async def env(tmp_path):
    service, sidecar, http, clock = await open_action_service(
        tmp_path,
        {"acme": {"support": ALL, "legacy": frozenset(ops.LEGACY_DEFAULT_OPERATIONS)}, "beta": {"support": ALL}},
    )
    yield service, sidecar, clock
    await http.aclose()
    await service.store.close()


def action(action_id, cap="cap:crewai:support", inp=None, key="k-" + "1"):
    return Action(
        id=action_id, capability_id=cap, input=inp if inp is not None else {"ticket": "refund"}, idempotency_key=key
    )


async def approve(service, record):
    decided = await service.decide(APPROVER, record.approval_id, "approved", "ok", service.now_ms())
    assert decided is not None and decided.status == "approved"
    return await service.wait(await service.get(INVOKER, record.action_id), 10)


async def test_mutation_waits_for_approval_then_runs_once(env):
    service, sidecar, _ = env
    record = await service.submit(INVOKER, action("a1"), None, stream=False)
    assert record.status == "pending_approval" and sidecar.executions == 0
    result = await service.result(record)
    assert result.status == "pending_approval" and result.output.approval_id == record.approval_id
    done = await approve(service, record)
    assert done.status == "completed" and sidecar.executions == 1
    result = await service.result(done)
    assert result.output["raw"].startswith("done:")
    chunks = await service.store.list_chunks("acme", "a1")
    assert [c.sequence for c in chunks] == [0, 1, 2]
    # same id + key returns the stored result, no second execution
    again = await service.submit(INVOKER, action("a1"), None, stream=False)
    assert again.status == "completed" and sidecar.executions == 1
    # same key, new action id, same input: the original action
    other = await service.submit(INVOKER, action("a2"), None, stream=False)
    assert other.action_id == "a1"


async def test_a_governed_actions_row_and_its_pending_approval_are_one_write(env, monkeypatch):
    """Submitting a governed action writes its row, its key's reservation and its pending approval in ONE
    store write: one hop, and never a pending action without its approval (here: an approval id that
    collides, whose insert fails, leaves no action row either)."""
    from aip_crewai.host.actions import service as service_module

    service, _, _ = env
    monkeypatch.setattr(service_module.secrets, "token_urlsafe", lambda _n: "same")
    hops = []
    run = service.store._run

    async def counting(*args):
        hops.append(args[0])
        return await run(*args)

    monkeypatch.setattr(service.store, "_run", counting)
    first = await service.submit(INVOKER, action("a1"), None, stream=False)
    assert first.status == "pending_approval" and len(hops) == 1
    assert (await service.store.get_approval("acme", first.approval_id)).action_id == "a1"
    with pytest.raises(Exception):  # noqa: B017 - the store's integrity error, whatever its type
        await service.submit(INVOKER, action("a2", key="k-2"), None, stream=False)
    assert await service.store.get_action("acme", "a2") is None


async def test_a_recall_of_an_action_this_host_dispatches_reads_what_the_create_would_find(env, monkeypatch):
    """A re-call of a running action whose dispatch runs on this single-host store finds, in one read and with
    nothing written, what the create would: the row as stored now (here one the dispatch requeued), replayed or
    refused as before, or the other action a live reservation of its key points at (Store.find_read). A store
    several hosts share takes the create."""
    service, sidecar, _ = env
    release, sending, run = asyncio.Event(), asyncio.Event(), service.dispatcher.run

    async def held(job, on_chunks):
        sending.set()
        await release.wait()
        return await run(job, on_chunks)

    monkeypatch.setattr(service.dispatcher, "run", held)
    record = await service.submit(INVOKER, action("a1"), None, stream=False)
    other = await service.submit(INVOKER, action("a2", key="k-2"), None, stream=False)  # pending: k-2 is a2's
    assert await service.decide(APPROVER, record.approval_id, "approved", "ok", service.now_ms()) is not None
    await sending.wait()  # claimed (`mark_sent`), its start held
    await service.writer.requeue("acme", "a1")  # the stored row moved on: what a re-call must see
    calls = count_store_calls(service.store, monkeypatch)
    again = await service.submit(INVOKER, action("a1"), None, stream=False, blocking=True)
    assert (again.action_id, again.status, again.dispatch) == ("a1", "running", "not_sent")
    with pytest.raises(IdempotencyConflict):
        await service.submit(INVOKER, action("a1", inp={"ticket": "other"}), None, stream=False)
    with pytest.raises(IdempotencyConflict):  # a key no action holds: the id's own row, with another key
        await service.submit(INVOKER, action("a1", key="k-3"), None, stream=False, blocking=True)
    held_key = await service.submit(INVOKER, action("a1", key="k-2"), None, stream=False, blocking=True)
    assert held_key.action_id == other.action_id == "a2"  # the key's live reservation points at a2: a2, as before
    assert calls.count("find_read_now") == 4 and "_write_now" not in calls, calls  # (a2's refresh reads its approval)
    del calls[:]
    monkeypatch.setattr(service.store, "owner", "host-a")  # a shared store: the create decides, as before
    again = await service.submit(INVOKER, action("a1"), None, stream=False, blocking=True)
    monkeypatch.setattr(service.store, "owner", None)
    assert again.action_id == "a1" and "_write_now" in calls
    release.set()
    done = await service.wait(await service.get(INVOKER, "a1"), 10)
    assert done.status == "completed" and sidecar.executions == 1


async def test_changed_input_is_a_conflict(env):
    service, _, _ = env
    await service.submit(INVOKER, action("a1"), None, stream=False)
    with pytest.raises(IdempotencyConflict):
        await service.submit(INVOKER, action("a1", inp={"ticket": "other"}), None, stream=False)
    with pytest.raises(IdempotencyConflict):
        await service.submit(INVOKER, action("a9", inp={"ticket": "other"}), None, stream=False)
    with pytest.raises(IdempotencyConflict):
        await service.submit(INVOKER, action("a1", key="k-2"), None, stream=False)


async def test_key_required_for_mutations_and_knowledge_query(env):
    service, _, _ = env
    with pytest.raises(IdempotencyKeyRequired):
        await service.submit(INVOKER, action("a1", key=None), None, stream=False)
    with pytest.raises(IdempotencyKeyRequired):
        await service.submit(
            INVOKER, action("q1", "cap:crewai:support:knowledge_query", {"query": ["x"]}, None), None, stream=False
        )


@pytest.mark.parametrize("key", ["", "k" * 513, "a\nb"])
async def test_bad_keys(env, key):
    service, _, _ = env
    with pytest.raises(InvalidInput):
        await service.submit(INVOKER, action("a1", key=key), None, stream=False)


async def test_key_at_512_bytes_is_accepted(env):
    service, _, _ = env
    record = await service.submit(INVOKER, action("a1", key="k" * 512), None, stream=False)
    assert record.idempotency_key == "k" * 512


async def test_concurrent_duplicates_execute_once(env):
    service, sidecar, _ = env
    record = await service.submit(INVOKER, action("a1"), None, stream=False)
    await approve(service, record)
    query = action("q1", "cap:crewai:support:knowledge_query", {"query": ["refund"]}, "qk")
    records = await asyncio.gather(*[service.submit(INVOKER, query, None, stream=False) for _ in range(50)])
    assert {r.action_id for r in records} == {"q1"}
    final = await service.wait(await service.get(INVOKER, "q1"), 10)
    assert final.status == "completed"
    assert sidecar.executions == 2


def test_approval_admits_only_its_own_action_before_expiry():
    from aip_crewai.host.actions.lifecycle import approval_admits, policy_hash
    from aip_crewai.host.store.store import ActionRecord, ApprovalRecord

    record = ActionRecord(
        "acme",
        "a1",
        "cap:crewai:support",
        "support",
        "run",
        "{}",
        "h1",
        "p",
        "k",
        "pending_approval",
        "not_sent",
        None,
        None,
        "apr_1",
        None,
        0,
        1000,
        1000,
    )
    bound = policy_hash("acme", "a1", "cap:crewai:support", "h1")
    approval = ApprovalRecord(
        "acme", "apr_1", "a1", "cap:crewai:support", bound, "p", "{}", "approved", "ok", "human", 2000, 1000, 901_000
    )
    assert approval_admits(approval, record)
    assert not approval_admits(dataclasses.replace(approval, status="denied"), record)
    assert not approval_admits(dataclasses.replace(approval, decided_at=901_000), record)  # at expiry
    assert approval_admits(dataclasses.replace(approval, decided_at=900_999), record)
    for changed in (
        {"input_hash": "h2"},
        {"action_id": "a2"},
        {"tenant": "beta"},
        {"capability_id": "cap:crewai:support:train"},
    ):
        assert not approval_admits(approval, dataclasses.replace(record, **changed))


async def test_denial_and_expiry_never_reach_the_sidecar(env):
    service, sidecar, clock = env
    denied = await service.submit(INVOKER, action("d1", key="kd"), None, stream=False)
    assert (await service.decide(APPROVER, denied.approval_id, "denied", "no", clock.ms)).status == "denied"
    assert await service.decide(APPROVER, denied.approval_id, "approved", "again", clock.ms) is None
    result = await service.result(await service.get(INVOKER, "d1"))
    assert result.status == "failed" and result.error.code == "policy.approval_denied"
    expired = await service.submit(INVOKER, action("e1", key="ke"), None, stream=False)
    clock.ms += 900_001
    assert not await decide(service.store, "acme", expired.approval_id, "approved", "late", APPROVER.id, clock.ms)
    record = await service.get(INVOKER, "e1")
    assert record.status == "failed"
    assert (await service.result(record)).error.code == "policy.approval_expired"
    assert sidecar.executions == 0


async def test_tenants_are_isolated(env):
    service, _, _ = env
    record = await service.submit(INVOKER, action("a1"), None, stream=False)
    await approve(service, record)
    with pytest.raises(ActionNotFound):
        await service.get(OTHER, "a1")
    # beta may see the shared crew, but not acme's run through it
    with pytest.raises(ActionNotFound):
        await service.submit(
            OTHER, action("s1", "cap:crewai:support:status", {"run_action_id": "a1"}, None), None, stream=False
        )
    with pytest.raises(CapabilityNotFound):
        await service.submit(OTHER, action("l1", "cap:crewai:legacy"), None, stream=False)
    # beta's own action with the same id is a different action and a different sidecar job
    other = await service.submit(OTHER, action("a1"), None, stream=False)
    assert other.tenant == "beta" and other.status == "pending_approval"


async def test_status_of_own_run(env):
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    status = await service.submit(
        INVOKER, action("s1", "cap:crewai:support:status", {"run_action_id": "a1"}, None), None, stream=False
    )
    status = await service.wait(status, 10)
    result = await service.result(status)
    assert result.status == "completed"
    assert result.output["action_id"] == "a1" and result.output["status"] == "completed"


async def test_status_of_an_unknown_run_stores_nothing_with_or_without_a_key(env):
    service, _, _ = env
    for action_id, key in (("s1", None), ("s2", "k-status")):
        with pytest.raises(ActionNotFound):
            await service.submit(
                INVOKER,
                action(action_id, "cap:crewai:support:status", {"run_action_id": "nope"}, key),
                None,
                stream=False,
            )
        assert await service.store.get_action("acme", action_id) is None
    # The failed keyed request left no idempotency record: the key is free for a valid request.
    assert not await service.store._fetch("SELECT 1 FROM idempotency WHERE key = ?", ("k-status",))


async def test_a_running_action_is_created_sent(env):
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    status = await service.submit(
        INVOKER, action("s1", "cap:crewai:support:status", {"run_action_id": "a1"}, None), None, stream=False
    )
    assert status.status == "running" and status.dispatch == "sent"
    done = await service.wait(status, 10)
    assert done == await service.store.get_action("acme", "s1")  # the waiter got the stored record
    assert done.status == "completed" and done.dispatch == "acknowledged"


def status_action(action_id, run_action_id="a1", key=None):
    return action(action_id, "cap:crewai:support:status", {"run_action_id": run_action_id}, key)


async def test_a_blocking_keyless_read_is_answered_inline_and_recorded_once_finished(env, monkeypatch):
    """Issue 22 item 3: one store write (admit and result together), no dispatch task, not durable."""
    service, sidecar, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    writes = []
    create, update = service.store.create_action, service.store.update_action

    async def counted_create(*args, **kwargs):
        writes.append(("create", kwargs.get("durable"), kwargs.get("result") is not None))
        return await create(*args, **kwargs)

    async def counted_update(*args, **kwargs):
        writes.append(("update", kwargs.get("durable"), None))
        return await update(*args, **kwargs)

    monkeypatch.setattr(service.store, "create_action", counted_create)
    monkeypatch.setattr(service.store, "update_action", counted_update)
    before = len(sidecar.requests)
    record = await service.submit(INVOKER, status_action("s1"), None, stream=False, blocking=True)
    assert len(sidecar.requests) == before + 1 and await service.record("acme", "s1") == record  # before its write
    await service.writer.drain_answered(5.0)
    assert writes == [("create", False, True)]
    assert record.status == "completed" and record.dispatch == "acknowledged"
    assert service.live.get("acme", "s1") is None
    assert record == await service.store.get_action("acme", "s1")
    result = await service.result(record)
    assert result.output["action_id"] == "a1" and result.output["status"] == "completed"
    # an events page is a read too; a keyed read and a non-blocking one keep the dispatch path
    page = await service.submit(
        INVOKER,
        action("e1", "cap:crewai:support:events", {"run_action_id": "a1"}, None),
        None,
        stream=False,
        blocking=True,
    )
    await service.writer.drain_answered(5.0)
    assert page.status == "completed" and writes[-1] == ("create", False, True)
    for read, blocking in ((status_action("s2", key="k-read"), True), (status_action("s3"), False)):
        running = await service.submit(INVOKER, read, None, stream=False, blocking=blocking)
        assert running.status == "running"
        assert (await service.wait(running, 10)).status == "completed"
    assert [w[0] for w in writes[2:]] == ["create", "update", "create", "update"]


async def test_an_inline_read_repeats_by_action_id_and_refuses_a_foreign_or_missing_target(env):
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    await approve(service, await service.submit(INVOKER, action("a2", key="k-2"), None, stream=False))
    first = await service.submit(INVOKER, status_action("s1"), None, stream=False, blocking=True)
    again = await service.submit(INVOKER, status_action("s1"), None, stream=False, blocking=True)
    assert again == first  # the stored answer, replayed
    with pytest.raises(IdempotencyConflict):
        await service.submit(INVOKER, status_action("s1", run_action_id="a2"), None, stream=False, blocking=True)
    for caller, run_action_id in ((INVOKER, "nope"), (OTHER, "a1")):
        with pytest.raises(ActionNotFound):
            await service.submit(caller, status_action("s9", run_action_id), None, stream=False, blocking=True)
        assert await service.store.get_action(caller.tenant, "s9") is None


async def test_an_inline_read_another_host_recorded_first_keeps_the_first_record(env):
    """Two hosts answering one action id at once (each checked the store before the other wrote): the first
    write stands, the second changes nothing and says so (ARCHITECTURE.md §9, a key-less read answered inline)."""
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    writer = service.writer
    first = await service.submit(INVOKER, status_action("s1"), None, stream=False, blocking=True)
    await writer.drain_answered(5.0)
    later = writer.answered(
        "acme",
        "s1",
        first.capability_id,
        "support",
        "status",
        first.input_json,
        first.input_hash,
        INVOKER.id,
        (await service.result(first)),
        "acknowledged",
        now=first.created_at + 5,
        target=("a1", ("run",)),
    )
    with capture_logs() as logs:
        await writer.record_answered(later)
        assert writer.pending_answer("acme", "s1") == later.record
        await writer.drain_answered(5.0)
    assert [e["event"] for e in logs if e["event"].startswith("answered_read")] == ["answered_read_raced"]
    assert await service.store.get_action("acme", "s1") == first and writer.pending_answer("acme", "s1") is None


async def test_a_read_answered_and_not_yet_written_keeps_its_action_id_from_another_action(env, monkeypatch):
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    release, _ = hold_store_call(service.store, "create_action", monkeypatch)
    read = await asyncio.wait_for(service.submit(INVOKER, status_action("x1"), None, stream=False, blocking=True), 10)
    with pytest.raises(IdempotencyConflict):  # not admitted under the read's id
        await asyncio.wait_for(service.submit(INVOKER, action("x1", key="k-other"), None, stream=False), 10)
    release.set()
    await service.writer.drain_answered(5.0)
    assert await service.store.get_action("acme", "x1") == read


async def test_reads_of_one_action_id_run_one_at_a_time_on_a_host(env, monkeypatch):
    """A repeat arriving while the first read is on its way waits for it, then replays it (or conflicts):
    it neither reads nor answers on its own (ARCHITECTURE.md §9, a key-less read answered inline)."""
    service, _, _ = env
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    await approve(service, await service.submit(INVOKER, action("a2", key="k-2"), None, stream=False))
    release, entered = hold_store_call(service.store, "find_read", monkeypatch)
    first = asyncio.ensure_future(service.submit(INVOKER, status_action("y1"), None, stream=False, blocking=True))
    await until_async(lambda: entered == ["y1"], timeout=10)
    same = asyncio.ensure_future(service.submit(INVOKER, status_action("y1"), None, stream=False, blocking=True))
    other = service.submit(INVOKER, status_action("y1", run_action_id="a2"), None, stream=False, blocking=True)
    other_task = asyncio.ensure_future(other)
    release.set()
    answered = await asyncio.wait_for(first, 10)
    assert await asyncio.wait_for(same, 10) == answered
    with pytest.raises(IdempotencyConflict):
        await asyncio.wait_for(other_task, 10)
    assert entered == ["y1"]


async def test_a_read_whose_result_carries_a_receipt_is_written_before_its_answer(env, monkeypatch):
    """A receipt's reference is never answered before the receipt is stored."""
    service, _, _ = env
    service.writer.sealer = Sealer(keys=rc.ReceiptKeys(Ed25519PrivateKey.from_private_bytes(b"\x09" * 32)))
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    release, entered = hold_store_call(service.store, "create_action", monkeypatch)
    read = asyncio.ensure_future(service.submit(INVOKER, status_action("r1"), None, stream=False, blocking=True))
    await until_async(lambda: "r1" in entered, timeout=10)
    assert not service.writer._answering and not read.done()  # written in the request, not after it
    release.set()
    record = await asyncio.wait_for(read, 10)
    (receipt,) = await service.store.receipts_of_action("acme", "r1")
    assert json.loads(record.result_json)["receipt"]["id"] == json.loads(receipt)["receipt"]["id"]


async def test_an_inline_status_of_an_unadmitted_run_is_the_hosts_view(env):
    service, _, _ = env
    await service.submit(INVOKER, action("p1", key="kp"), None, stream=False)
    record = await service.submit(INVOKER, status_action("s1", "p1"), None, stream=False, blocking=True)
    assert (await service.result(record)).output["status"] == "pending_approval"


async def test_status_of_a_run_that_never_reached_the_sidecar_is_the_hosts_view(env):
    """Found by a break-it session: a status of a pending run failed with a connector error (sidecar 404)."""
    service, sidecar, clock = env

    async def status_of(run_action_id, status_id):
        record = await service.submit(
            INVOKER,
            action(status_id, "cap:crewai:support:status", {"run_action_id": run_action_id}, None),
            None,
            stream=False,
        )
        return await service.result(await service.wait(record, 10))

    await service.submit(INVOKER, action("p1", key="kp"), None, stream=False)
    pending = await status_of("p1", "s1")
    assert pending.status == "completed" and pending.output == {
        "action_id": "p1",
        "crew_id": "support",
        "operation": "run",
        "status": "pending_approval",
        "event_count": 0,
        "output": None,
    }
    denied = await service.submit(INVOKER, action("d1", key="kd"), None, stream=False)
    await service.decide(APPROVER, denied.approval_id, "denied", "no", clock.ms)
    assert (await status_of("d1", "s2")).output["status"] == "failed"
    # approved, its start not admitted yet (still on its way): the host's view says running
    from aip_crewai.host.actions.lifecycle import approval_admits

    started = await service.submit(INVOKER, action("r1", key="kr"), None, stream=False)
    _, run = await service.store.decide_and_start(
        "acme", started.approval_id, "approved", "ok", APPROVER.id, clock.ms, start_if=approval_admits
    )  # not dispatched here
    assert run.dispatch == "sent" and (await status_of("r1", "s4")).output["status"] == "running"
    # a run whose start the sidecar answered but that it does not know now (lost): the sidecar's 404 stands
    await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    del sidecar.jobs["acme:a1"]
    lost = await status_of("a1", "s3")
    assert lost.status == "failed" and lost.error.details["remote_status"] == 404


async def test_reading_one_expired_approval_fails_every_expired_action(env):
    """Found by a break-it session: a read of action A expired every due approval but failed only A; the
    periodic sweep then skipped B (its approval was already expired), leaving B pending forever."""
    service, sidecar, clock = env
    for action_id in ("e1", "e2"):
        await service.submit(INVOKER, action(action_id, key=f"k-{action_id}"), None, stream=False)
    clock.ms += 900_001
    assert (await service.get(INVOKER, "e1")).status == "failed"
    other = await service.store.get_action("acme", "e2")  # not read through the service
    assert other.status == "failed" and (await service.result(other)).error.code == "policy.approval_expired"
    assert sidecar.executions == 0


async def test_legacy_crew_has_no_train(env):
    service, _, _ = env
    with pytest.raises(CapabilityNotFound):
        await service.submit(
            INVOKER,
            action("t1", "cap:crewai:legacy:train", {"n_iterations": 1, "artifact_name": "x"}),
            None,
            stream=False,
        )


async def test_cancel_pending_and_not_cancellable(env):
    service, sidecar, _ = env
    await service.submit(INVOKER, action("a1"), None, stream=False)
    result = await service.cancel(INVOKER, "a1")
    assert result.status == "cancelled" and sidecar.executions == 0
    await service.submit(
        INVOKER, action("m1", "cap:crewai:support:memory_reset", {"command_type": "memory"}, "km"), None, stream=False
    )
    with pytest.raises(NotCancellable):
        await service.cancel(INVOKER, "m1")


async def test_a_cancel_that_saw_pending_never_overwrites_an_approval_that_started_the_run(env, monkeypatch):
    """Regression (found by a break-it session): a cancel read the action as pending, an approval then
    started it, and the cancel's `cancelled, provider_effect: none` overwrote the running action while
    the sidecar ran the job to completion."""
    service, sidecar, clock = env
    pending = await service.submit(INVOKER, action("a1"), None, stream=False)
    read = service.get

    async def read_then_decide(caller, action_id):
        record = await read(caller, action_id)
        await service.decide(APPROVER, record.approval_id, "approved", "ok", clock.ms)  # lands after the read
        return record  # still says pending_approval

    monkeypatch.setattr(service, "get", read_then_decide)
    result = await service.cancel(INVOKER, pending.action_id)
    stored = await service.result(await service.store.get_action("acme", "a1"))
    assert sidecar.executions == 1 and sidecar.jobs["acme:a1"].status == "completed"
    assert result.status == stored.status == "completed"  # the job's real outcome, not "nothing happened"


async def test_a_cancel_waits_until_the_start_was_answered_even_before_it_is_sent():
    """Regression: `_until_answered` waited only while the start request was `sent`; a cancel arriving
    before the dispatch task had even sent it went straight to the sidecar, got 404, and the job was
    admitted and ran unseen right after."""
    from aip_crewai.contracts import operations as ops
    from aip_crewai.host.actions.cancellation import _until_answered
    from aip_crewai.host.actions.dispatch import Job
    from aip_crewai.host.actions.live import LiveAction

    gate = asyncio.Event()
    live = LiveAction(
        job=Job(tenant="acme", action_id="a1", crew_id="support", spec=ops.get("run"), input={}, idempotency_key="k")
    )
    live.task = asyncio.get_running_loop().create_task(gate.wait())
    waiting = asyncio.get_running_loop().create_task(_until_answered(live))
    for state in ("not_sent", "sent"):
        live.job.dispatch.state = state
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done(), state
    live.job.dispatch.state = "acknowledged"
    await asyncio.wait_for(waiting, 5)
    # a dispatch that ends without an answer (connect failure: back to not_sent) releases the wait too
    live.job.dispatch.state = "not_sent"
    waiting = asyncio.get_running_loop().create_task(_until_answered(live))
    gate.set()
    await asyncio.wait_for(waiting, 5)


async def test_invalid_stream_fails_with_cancel_attempt(env):
    service, sidecar, _ = env
    sidecar.stream_override = b'event: started\ndata: {"event":"started","sequence":0,"data":{}}\n\n'
    done = await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    result = await service.result(done)
    assert result.status == "failed" and result.error.code == "connector.crewai.invalid_stream"
    assert result.error.details["cancel_confirmed"] is True
    assert any(r.url.path.endswith("/cancel") for r in sidecar.requests)


async def test_a_sidecar_frame_nested_1500_deep_fails_the_action_with_the_stream_error_code(env):
    """Regression (second review): the action failed with ``internal.error``; a frame nested past the
    decoder's bound is an invalid stream like any other undecodable frame."""
    service, sidecar, _ = env
    deep = "[" * 1500 + "]" * 1500
    sidecar.stream_override = (
        b'event: started\ndata: {"event":"started","sequence":0,"data":{}}\n\n'
        + f'event: chunk\ndata: {{"event":"chunk","sequence":1,"data":{{"x":{deep}}}}}\n\n'.encode()
    )
    done = await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    result = await service.result(done)
    assert result.status == "failed" and result.error.code == "connector.crewai.invalid_stream"


async def test_invalid_stream_with_failed_cancel_is_cancelled_unconfirmed(env):
    service, sidecar, _ = env
    sidecar.stream_override = b'event: started\ndata: {"event":"started","sequence":1,"data":{}}\n\n'
    sidecar.cancel_status = 503
    done = await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    assert (await service.result(done)).error.code == "connector.crewai.cancelled_unconfirmed"


async def test_omitted_output_is_read_from_the_job_view(env):
    service, sidecar, _ = env
    sidecar.omit_output = True
    done = await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    result = await service.result(done)
    assert result.status == "completed" and result.output["raw"].startswith("done:")
    assert "output_omitted" not in result.output


async def _sink(service, **kwargs):
    from aip_crewai.host.actions.chunk_sink import ChunkSink
    from aip_crewai.host.actions.dispatch import Job
    from aip_crewai.host.actions.live import LiveAction

    await service.store.create_action(
        "acme", "s1", "cap:crewai:support", "support", "run", "{}", "h", "p", "k", "running"
    )
    job = Job(tenant="acme", action_id="s1", crew_id="support", spec=ops.get("run"), input={}, idempotency_key="k")
    return ChunkSink(service.store, LiveAction(job=job), **kwargs)


def _chunk(sequence):
    from aip_crewai.contracts.aip import StreamChunk

    return StreamChunk(action_id="s1", sequence=sequence, kind="data", data={"content": str(sequence)})


async def test_chunks_arriving_one_per_read_are_stored_in_order_with_group_commit(env):
    """The sidecar sends one SSE frame per event: the host must not pay one store transaction per frame."""
    service, _, _ = env
    sink = await _sink(service)
    calls = []
    append = service.store.append_chunks

    async def counting(*args, **kwargs):
        calls.append(len(args[2]))
        return await append(*args, **kwargs)

    service.store.append_chunks = counting
    for sequence in range(300):
        await sink.add([_chunk(sequence)])
    await sink.drain()
    stored = await service.store.list_chunks("acme", "s1", -1, 1000)
    assert [c.sequence for c in stored] == list(range(300))
    assert sum(calls) == 300 and len(calls) < 300
    assert (await service.store.get_action("acme", "s1")).chunk_count == 300


def _count_batches(service):
    """Record the size of each chunk batch the store is asked to append; the event is set after each."""
    batches, stored = [], asyncio.Event()
    append = service.store.append_chunks

    async def counting(*args, **kwargs):
        batches.append(len(args[2]))
        try:
            return await append(*args, **kwargs)
        finally:
            stored.set()

    service.store.append_chunks = counting
    return batches, stored


async def _yield_to_the_writer():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_chunks_arriving_within_the_commit_window_wait_for_one_batch(env):
    """A chunk after a quiet spell is written at once; those arriving sooner after that commit than the
    window wait and go in one batch, however often the writer could have run (one store hop per window)."""
    service, _, _ = env
    sink = await _sink(service, commit_window_s=60.0)
    batches, stored = _count_batches(service)
    await sink.add([_chunk(0)])
    await asyncio.wait_for(stored.wait(), 10)
    for sequence in range(1, 10):
        await sink.add([_chunk(sequence)])
        await _yield_to_the_writer()
    assert batches == [1]
    await asyncio.wait_for(sink.drain(), 10)  # the stream ended: no wait for the window
    assert batches == [1, 9]
    assert [c.sequence for c in await service.store.list_chunks("acme", "s1", -1, 100)] == list(range(10))


async def test_the_default_window_holds_a_chunk_10_ms_after_a_commit(env, monkeypatch):
    """The default window is 20 ms: a burst's chunk 10 ms after a batch's commit waits for the next batch
    (the event loop's clock is the test's own: nothing sleeps)."""
    service, _, _ = env
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    sink = await _sink(service)
    batches, stored = _count_batches(service)
    await sink.add([_chunk(0)])
    await asyncio.wait_for(stored.wait(), 10)
    now[0] += 0.010
    await sink.add([_chunk(1)])
    await _yield_to_the_writer()
    assert batches == [1]  # held: 10 ms left of the window
    now[0] += 0.011
    await sink.add([_chunk(2)])
    await asyncio.wait_for(sink.drain(), 10)
    assert batches == [1, 2]


async def test_a_full_queue_is_written_without_waiting_for_the_window(env):
    from aip_crewai.host.actions.chunk_sink import ChunkSink

    service, _, _ = env
    sink = await _sink(service, commit_window_s=60.0)
    batches, stored = _count_batches(service)
    await sink.add([_chunk(0)])
    await asyncio.wait_for(stored.wait(), 10)
    full = [_chunk(s) for s in range(1, ChunkSink.MAX_QUEUED + 1)]
    await asyncio.wait_for(sink.add(full), 10)  # held back until written, not for the window
    assert batches == [1, ChunkSink.MAX_QUEUED]
    await sink.add([_chunk(ChunkSink.MAX_QUEUED + 1)])  # the window applies again after that batch
    await _yield_to_the_writer()
    assert len(batches) == 2
    await asyncio.wait_for(sink.drain(), 10)
    assert batches == [1, ChunkSink.MAX_QUEUED, 1]


async def test_a_discarded_sink_stores_nothing_more(env):
    service, _, _ = env
    sink = await _sink(service)
    await sink.add([_chunk(0)])
    sink.discard()
    await asyncio.sleep(0)
    assert await service.store.list_chunks("acme", "s1") == []


async def test_rest_hands_back_the_chunks_waiting_for_the_window_and_stores_none_of_them(env):
    """The stream ended: the chunks still waiting for the commit window go in the result's own write."""
    service, _, _ = env
    sink = await _sink(service, commit_window_s=60.0)
    batches, stored = _count_batches(service)
    await sink.add([_chunk(0)])
    await asyncio.wait_for(stored.wait(), 10)
    for sequence in range(1, 4):
        await sink.add([_chunk(sequence)])
    assert [c.sequence for c in await asyncio.wait_for(sink.rest(), 10)] == [1, 2, 3]
    await _yield_to_the_writer()
    assert batches == [1]
    assert [c.sequence for c in await service.store.list_chunks("acme", "s1", -1, 100)] == [0]


async def test_rest_waits_for_the_batch_the_store_is_writing(env):
    service, _, _ = env
    sink = await _sink(service, commit_window_s=0.0)
    entered, gate = asyncio.Event(), asyncio.Event()
    append = service.store.append_chunks

    async def held(*args, **kwargs):
        entered.set()
        await gate.wait()
        return await append(*args, **kwargs)

    service.store.append_chunks = held
    await sink.add([_chunk(0)])
    await asyncio.wait_for(entered.wait(), 10)
    await sink.add([_chunk(1)])
    rest = asyncio.ensure_future(sink.rest())
    await _yield_to_the_writer()
    assert not rest.done()  # batch 0 is on its way to the store
    gate.set()
    assert [c.sequence for c in await asyncio.wait_for(rest, 10)] == [1]
    assert [c.sequence for c in await service.store.list_chunks("acme", "s1", -1, 100)] == [0]


async def test_a_runs_last_chunks_are_stored_in_its_results_write(env, monkeypatch):
    """One store write fewer per run: the chunks that arrive within the commit window of the stream's end
    are not a batch of their own; the stored stream is whole and in order all the same."""
    from aip_crewai.host.actions.chunk_sink import ChunkSink

    service, _, _ = env
    monkeypatch.setitem(ChunkSink.__init__.__kwdefaults__, "commit_window_s", 60.0)
    batches, _ = _count_batches(service)
    done = await approve(service, await service.submit(INVOKER, action("a1"), None, stream=False))
    assert done.status == "completed" and done.chunk_count == 3
    assert sum(batches) < 3  # what had not been stored when the result came went in its write
    assert [c.sequence for c in await service.store.list_chunks("acme", "a1")] == [0, 1, 2]


def test_only_key_less_read_only_actions_skip_fsync():
    from aip_crewai.host.actions.service import durable_action

    assert not durable_action(ops.get("status"), None)
    assert durable_action(ops.get("status"), "k")
    assert durable_action(ops.get("knowledge_query"), "k")
    assert all(durable_action(ops.get(name), None) for name in ops.OPERATION_NAMES if not ops.get(name).read_only)


async def test_concurrent_duplicates_of_a_mutation_all_see_the_pending_approval(env):
    service, sidecar, _ = env
    same_id = [service.submit(INVOKER, action("p1", key="pk"), None, stream=False) for _ in range(20)]
    other_ids = [service.submit(INVOKER, action(f"p{i}", key="pk"), None, stream=False) for i in range(2, 12)]
    records = await asyncio.gather(*same_id, *other_ids)
    results = [await service.result(r) for r in records]
    assert {r.status for r in results} == {"pending_approval"}
    assert len({r.output.approval_id for r in results}) == 1
    assert {r.action_id for r in records} == {"p1"} and sidecar.executions == 0


async def test_a_store_outage_during_a_dispatch_leaves_the_action_running_until_it_is_settled(env, monkeypatch):
    """The result write fails with StoreUnavailable (the database is down): no failure is recorded for a
    run the sidecar completes; the action stays running, and the next read re-attaches and records the
    real outcome, with the crew run once."""
    from aip_crewai.host.store.store import StoreUnavailable

    service, sidecar, _ = env
    record = await service.submit(INVOKER, action("o1"), None, stream=False)
    finish, failed = service.writer.finish, []

    async def outage(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise StoreUnavailable()
        return await finish(*args, **kwargs)

    monkeypatch.setattr(service.writer, "finish", outage)
    assert await service.decide(APPROVER, record.approval_id, "approved", "ok", service.now_ms()) is not None
    await until_async(  # the dispatch met the outage and ended
        lambda: failed and service.live.get("acme", "o1") is None, interval=0.01, what="the dispatch ended"
    )
    assert (await service.store.get_action("acme", "o1")).status == "running"
    done = await service.wait(await service.get(INVOKER, "o1"), 10)
    assert done.status == "completed" and sidecar.executions == 1
    assert (await service.result(done)).output["raw"].startswith("done:")
