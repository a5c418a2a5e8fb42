"""The host's own work on a key-less blocking ``:status`` read of a run (ARCHITECTURE.md §9, a key-less read
answered inline), over HTTP in-process with the final-view cache off: one read (the target check) beside one
sidecar request, the answer, then one write recording the read; the bearer checked once; what is answered and
recorded, and every refusal.
"""

import asyncio
import dataclasses

import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import (
    SIDECAR_TOKEN,
    action_env,
    bearer,
    calls_of,
    completed_run,
    count_store_calls,
    envelope,
    hold_store_call,
    running,
    sign,
)
from kits.hostapp import post_message as post
from kits.poll import until_async
from structlog.testing import capture_logs

from aip_crewai.host.http.state import host_setup, host_state
from aip_crewai.host.store.records import StoreUnavailable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake():
    return FakeSidecar(SIDECAR_TOKEN)


@pytest.fixture
async def app_http(make_app, settings, fake):
    app = make_app(dataclasses.replace(settings, status_cache_entries=0), sidecar_transport=fake.transport())
    async with running(app) as http:
        yield app, http


def status_env(n, run_action_id="act_run"):
    return action_env(f"msg_s{n}", f"act_s{n}", "cap:crewai:beta:status", {"run_action_id": run_action_id})


def view_reads(fake, run_action_id="act_run"):
    return sum(1 for r in fake.requests if r.method == "GET" and r.url.path == f"/jobs/acme:{run_action_id}")


async def test_a_status_read_is_one_write_and_one_sidecar_request(app_http, fake, monkeypatch):
    app, http = app_http
    await completed_run(http)
    before = view_reads(fake)
    calls = count_store_calls(host_state(app).store, monkeypatch)
    response = await post(http, "acme-invoker", status_env(1))
    assert response.status_code == 200, response.text
    result = response.json()["body"]["action_result"]
    assert result["action_id"] == "act_s1" and result["status"] == "completed"
    assert result["output"]["action_id"] == "act_run" and result["output"]["status"] == "completed"
    # answered after one read beside the hop (a one-sidecar host reads no placement before it); written after
    assert calls[0] == "find_read_now" and calls.count("find_read_now") == 1 and "_write_now" not in calls[:1]
    assert view_reads(fake) == before + 1
    shown = await http.get("/aip/v1/actions/act_s1", headers=bearer("acme-invoker"))  # this host's, written or not
    assert shown.status_code == 200 and shown.json()["result"] == result
    await host_state(app).actions.writer.drain_answered(5.0)
    assert calls == ["find_read_now", "_write_now"], calls
    monkeypatch.undo()
    shown = await http.get("/aip/v1/actions/act_s1", headers=bearer("acme-invoker"))  # the read is recorded
    assert shown.status_code == 200 and shown.json()["state"] == "completed"
    assert shown.json()["result"] == result


async def test_a_status_read_is_answered_before_its_record_is_written(app_http, fake, monkeypatch):
    """The write comes after the answer: a write held up does not hold up the answer, and until it lands this
    host serves the record as answered (its view, a repeat of its action id) without asking the sidecar again."""
    app, http = app_http
    await completed_run(http)
    store, writer = host_state(app).store, host_state(app).actions.writer
    release, _ = hold_store_call(store, "create_action", monkeypatch)
    response = await asyncio.wait_for(post(http, "acme-invoker", status_env(11)), 10)
    assert response.status_code == 200, response.text
    result = response.json()["body"]["action_result"]
    assert await store.get_action("acme", "act_s11") is None  # not written yet
    shown = await http.get("/aip/v1/actions/act_s11", headers=bearer("acme-invoker"))
    assert shown.status_code == 200 and shown.json()["state"] == "completed" and shown.json()["result"] == result
    reads = view_reads(fake)
    again = await post(http, "acme-invoker", status_env(11))  # a repeat replays the answer
    assert again.status_code == 200 and again.json()["body"]["action_result"] == result
    assert view_reads(fake) == reads
    answered = writer.pending_answer("acme", "act_s11")
    release.set()
    await writer.drain_answered(5.0)
    assert await store.get_action("acme", "act_s11") == answered is not None
    assert writer.pending_answer("acme", "act_s11") is None
    shown_after = await http.get("/aip/v1/actions/act_s11", headers=bearer("acme-invoker"))
    assert shown_after.json() == shown.json()  # the record as answered is the record as stored


async def test_reads_answered_before_their_write_are_bounded(app_http, monkeypatch):
    """At the bound, reads are still answered before their write; one more waits for its own write."""
    app, http = app_http
    await completed_run(http)
    store, writer = host_state(app).store, host_state(app).actions.writer
    assert writer.max_unwritten == 256  # writer.MAX_UNWRITTEN_ANSWERS, docs/ARCHITECTURE.md §9
    writer.max_unwritten = 2
    release, entered = hold_store_call(store, "create_action", monkeypatch)
    for n in (21, 22):  # up to the bound: answered while their writes are held
        assert (await asyncio.wait_for(post(http, "acme-invoker", status_env(n)), 10)).status_code == 200
    third = asyncio.ensure_future(post(http, "acme-invoker", status_env(23)))
    await until_async(lambda: "act_s23" in entered, timeout=10)
    # the bound + 1: its write runs in the request itself (not a third background write), its answer after it
    assert len(writer._answering) == 2 and not third.done()
    release.set()
    assert (await asyncio.wait_for(third, 10)).status_code == 200
    await writer.drain_answered(5.0)
    assert all([await store.get_action("acme", f"act_s{n}") for n in (21, 22, 23)])


async def test_a_failed_record_write_drops_those_waiting_and_reads_write_first_until_the_store_answers(
    app_http, monkeypatch
):
    """A store that stops answering (an outside write lock) must not hold every other store call behind a
    queue of these writes: the first failure drops the others, and reads then wait for their own write."""
    app, http = app_http
    await completed_run(http)
    store, writer = host_state(app).store, host_state(app).actions.writer
    create, gates, entered = store.create_action, {"fail": asyncio.Event(), "go": asyncio.Event()}, []

    async def gated_create(*args, **kwargs):
        entered.append(args[1])
        if len(entered) == 1:
            await gates["fail"].wait()
            raise StoreUnavailable()
        await gates["go"].wait()
        return await create(*args, **kwargs)

    monkeypatch.setattr(store, "create_action", gated_create)
    for n in (31, 32, 33):  # answered; their writes wait
        assert (await asyncio.wait_for(post(http, "acme-invoker", status_env(n)), 10)).status_code == 200
    await until_async(lambda: len(entered) == 3, timeout=10)
    with capture_logs() as logs:
        gates["fail"].set()
        await until_async(lambda: not writer._answering, timeout=10)
    assert [(e["event"], e.get("count")) for e in logs if e["event"] == "answered_reads_shed"] == [
        ("answered_reads_shed", 2)
    ]
    assert all(writer.pending_answer("acme", f"act_s{n}") is None for n in (31, 32, 33))
    fourth = asyncio.ensure_future(post(http, "acme-invoker", status_env(34)))
    await until_async(lambda: "act_s34" in entered, timeout=10)
    assert not writer._answering and not fourth.done()  # written before its answer now
    gates["go"].set()
    assert (await asyncio.wait_for(fourth, 10)).status_code == 200
    assert await store.get_action("acme", "act_s34") is not None
    gates["go"].clear()
    assert (await asyncio.wait_for(post(http, "acme-invoker", status_env(35)), 10)).status_code == 200
    assert writer.pending_answer("acme", "act_s35") is not None  # the store answered again: after the answer
    gates["go"].set()
    await writer.drain_answered(5.0)


async def test_shutdown_drops_the_record_writes_left_after_its_bound(app_http, monkeypatch):
    app, http = app_http
    await completed_run(http)
    store, writer = host_state(app).store, host_state(app).actions.writer
    never = asyncio.Event()

    async def stuck_create(*args, **kwargs):
        await never.wait()

    monkeypatch.setattr(store, "create_action", stuck_create)
    assert (await post(http, "acme-invoker", status_env(41))).status_code == 200
    with capture_logs() as logs:
        await writer.drain_answered(0.05)  # a write that never ends: the bound passes
    assert [e.get("count") for e in logs if e["event"] == "answered_reads_unwritten"] == [1]
    assert not writer._answering and writer.pending_answer("acme", "act_s41") is None


async def test_a_record_write_that_fails_after_the_answer_is_logged_and_not_pending(app_http, monkeypatch):
    app, http = app_http
    await completed_run(http)
    store, writer = host_state(app).store, host_state(app).actions.writer

    async def failing_create(*args, **kwargs):
        raise StoreUnavailable()

    monkeypatch.setattr(store, "create_action", failing_create)
    with capture_logs() as logs:
        response = await post(http, "acme-invoker", status_env(12))
        await writer.drain_answered(5.0)
    assert response.status_code == 200, response.text
    unrecorded = [e for e in logs if e["event"] == "answered_read_unrecorded"]
    assert [e["reason"] for e in unrecorded] == ["store_unavailable"] and unrecorded[0]["log_level"] == "warning"
    assert writer.pending_answer("acme", "act_s12") is None
    monkeypatch.undo()
    assert await store.get_action("acme", "act_s12") is None


@pytest.mark.parametrize(
    ("principal", "env"),
    [
        ("acme-invoker", status_env(2, run_action_id="act_nope")),  # no such run
        ("acme-both", status_env(3)),  # a run of the tenant, submitted by another principal
    ],
)
async def test_a_missing_or_foreign_target_answers_not_found_and_records_nothing(app_http, monkeypatch, principal, env):
    app, http = app_http
    await completed_run(http)
    calls = count_store_calls(host_state(app).store, monkeypatch)
    response = await post(http, principal, env)
    assert response.status_code == 404, response.text
    assert response.json()["body"]["error"]["error"]["code"] == "action.not_found"
    # the refused read's check (a sidecar's 404 may first read what the host knows of the run); no write
    await host_state(app).actions.writer.drain_answered(5.0)
    assert "find_read_now" in calls and "_write_now" not in calls, calls
    monkeypatch.undo()
    action_id = env["body"]["action"]["id"]
    assert await host_state(app).store.get_action("acme", action_id) is None


async def test_a_bearer_is_checked_once_per_message(app_http, monkeypatch):
    app, http = app_http
    await completed_run(http)
    seen = calls_of(host_setup(app).authenticator, "authenticate", monkeypatch)
    assert (await post(http, "acme-invoker", status_env(5))).status_code == 200
    assert len(seen) == 1


async def test_an_envelope_signature_beside_a_bearer_is_still_verified(app_http):
    _, http = app_http
    other = sign(envelope("msg_other", body=status_env(6)["body"]), "acme-approver")
    refused = await post(http, "acme-both", other)  # the bearer's principal, the envelope signed by another
    assert refused.status_code == 401, refused.text
    broken = sign(envelope("msg_broken", body=status_env(7)["body"]), "acme-both")
    broken["body"]["action"]["input"]["run_action_id"] = "act_changed"  # after signing
    assert (await post(http, "acme-both", broken)).status_code == 401
    agreeing = sign(envelope("msg_agreeing", body=status_env(8)["body"]), "acme-both")
    answered = await post(http, "acme-both", agreeing)
    assert answered.status_code == 404, answered.text  # authenticated; acme-both submitted no act_run
    assert answered.json()["body"]["error"]["error"]["code"] == "action.not_found"


async def test_a_status_read_while_the_host_stops_still_answers_its_result(app_http):
    app, http = app_http
    await completed_run(http)
    host_setup(app).stopping.set()
    response = await post(http, "acme-invoker", status_env(9))
    assert response.status_code == 200, response.text
    assert response.json()["body"]["action_result"]["output"]["status"] == "completed"
