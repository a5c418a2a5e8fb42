"""The sidecar HTTP contract (ARCHITECTURE.md §4) over ASGI, with a fake executor."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import msgspec
import pytest
from kits.aip import sse_events
from kits.poll import until_async
from kits.sidecar_fakes import FAKE_CREWS, SECRET, TOKEN, job, running_app

pytestmark = pytest.mark.timeout(30)

KEY = {"Idempotency-Key": "key-1"}
#: A raw body's declared media type (``json=`` sets it; the sidecar refuses any other with 415).
JSON = {"Content-Type": "application/json"}


def job_events(body: bytes) -> list[dict]:
    """The job events of a sidecar SSE body (each frame's name and id are its event's name and sequence)."""
    out = []
    for event, sse_id, data in sse_events(body):
        assert event == data["event"] and sse_id == str(data["sequence"])
        out.append(data)
    return out


async def test_health_reports_crews_limits_and_operations(tmp_path):
    async with running_app(tmp_path, allowed_operations=("run", "replay")) as (client, _app, _fake):
        resp = await client.get("/health")
    assert resp.status_code == 200
    body = resp.json()
    sandbox = body.pop("worker_sandbox")  # no SandboxPlan given to this app: nothing confines its workers
    assert (sandbox["mode"], sandbox["worker_user"], sandbox["landlock_abi"]) == ("none", None, 0)
    assert "landlock" in sandbox["missing"]
    assert body == {
        "status": "ready",
        "crews": sorted(FAKE_CREWS),
        "active_runs": 0,
        "retained_runs": 0,
        "max_retained_runs": 2000,
        "durable_journal": True,
        "stream_checkpoint_events": 128,
        "operations": ["cancel", "events", "replay", "run", "status"],
        "training_directory": True,
        "crew_problems": {},
        "crew_inputs": {},
        "sse_keepalive_seconds": 0.05,
        "cancellable_operations": ["replay", "run"],
    }


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/health"),
        ("POST", "/jobs"),
        ("POST", "/jobs/stream"),
        ("GET", "/jobs/a"),
        ("GET", "/jobs/a/events"),
        ("POST", "/jobs/a/cancel"),
        ("DELETE", "/jobs/a"),
        ("GET", "/nowhere"),
        ("POST", "/runs"),
        ("POST", "/runs/stream"),
        ("GET", "/runs/a"),
        ("POST", "/runs/a/cancel"),
    ],
)
async def test_every_route_requires_the_bearer_token(tmp_path, method, path):
    async with running_app(tmp_path) as (client, _app, fake):
        missing = await client.request(method, path, headers={"Authorization": ""}, json=job("a"))
        wrong = await client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}x"}, json=job("a"))
        basic = await client.request(method, path, headers={"Authorization": f"Basic {TOKEN}"}, json=job("a"))
        good = ("Authorization", f"Bearer {TOKEN}")
        twice = await client.request(method, path, headers=[good, good], json=job("a"))
        either = await client.request(method, path, headers=[good, ("Authorization", "Bearer x")], json=job("a"))
    for resp in (missing, wrong, basic, twice, either):  # one Authorization header: two were never meant
        assert resp.status_code == 401
        assert resp.headers["www-authenticate"] == "Bearer"
        assert resp.json() == {"detail": "missing or invalid bearer token"}
    assert fake.calls == []


async def test_blocking_job_returns_the_output_and_records_events(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        resp = await client.post("/jobs", json=job("a1", input={"chunks": 3}), headers=KEY)
        view = (await client.get("/jobs/a1")).json()
        page = (await client.get("/jobs/a1/events")).json()
    assert resp.status_code == 200
    assert resp.json()["tasks_output"][0]["task_id"] == "task-a1-0"
    assert view == {
        "action_id": "a1",
        "crew_id": "echo",
        "operation": "run",
        "status": "completed",
        "event_count": 5,
        "output": resp.json(),
    }
    assert [e["event"] for e in page["events"]] == ["started", "chunk", "chunk", "chunk", "completed"]
    assert [e["sequence"] for e in page["events"]] == [0, 1, 2, 3, 4]
    assert page["events"][0]["data"] == {"status": "running", "operation": "run"}
    assert page["events"][1]["data"] == {"content": "part 0", "channel": "llm", "task_id": "t", "agent_role": "writer"}
    assert page["events"][-1]["data"] == resp.json()
    assert (page["cursor"], page["next_cursor"], page["status"]) == (0, 5, "completed")
    assert len(fake.calls) == 1


async def test_failed_job_is_502_with_a_generic_message_never_provider_text(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        resp = await client.post("/jobs", json=job("f1", "failing"), headers=KEY)
        events = (await client.get("/jobs/f1/events")).json()["events"]
        view = (await client.get("/jobs/f1")).json()
    assert resp.status_code == 502
    body = resp.json()
    assert body["error_type"] == "RuntimeError" and body["uncertain_outcome"] is True
    assert body["detail"] == body["message"]
    assert events[-1] == {
        "event": "failed",
        "sequence": 1,
        "data": {
            "status": "failed",
            "error_type": "RuntimeError",
            "message": body["message"],
            "uncertain_outcome": True,
        },
    }
    assert view["status"] == "failed" and view["error"]["error_type"] == "RuntimeError"
    assert SECRET not in resp.text + json.dumps(events) + json.dumps(view)
    journal_bytes = b"".join(p.read_bytes() for p in tmp_path.glob("journal.db*"))
    assert SECRET.encode() not in journal_bytes


async def test_read_only_failure_is_not_uncertain_and_safe_errors_keep_their_message(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        kq = await client.post("/jobs", json=job("k1", "failing", "knowledge_query", {"query": ["q"]}), headers=KEY)
        safe = await client.post(
            "/jobs", json=job("s1", "safe", "memory_reset", {"command_type": "memory"}), headers=KEY
        )
    assert kq.status_code == 502 and kq.json()["uncertain_outcome"] is False
    assert safe.json()["error_type"] == "TargetNotInitialized"
    assert safe.json()["detail"] == "memory_reset target 'memory' is not initialized"


async def test_blocking_wait_past_timeout_is_504_and_the_job_keeps_running(tmp_path):
    async with running_app(tmp_path, max_concurrency=1) as (client, _app, fake):
        # occupy the only slot, so the next job stays queued past its wait bound
        blocker = asyncio.create_task(client.post("/jobs", json=job("busy", "slow"), headers=KEY))
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        resp = await client.post("/jobs", json=job("t1", timeout_ms=50), headers={"Idempotency-Key": "k2"})
        assert resp.status_code == 504
        assert resp.json()["status"] == "queued"
        fake.release.set()
        assert (await blocker).status_code == 200
        await until_async(lambda: _status(client, "t1", "completed"), interval=0.005)


async def _status(client, action_id, expected):
    return (await client.get(f"/jobs/{action_id}")).json()["status"] == expected


async def test_exact_repeat_returns_the_record_without_a_second_execution(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        first = await client.post("/jobs", json=job("r1"), headers=KEY)
        again = await client.post("/jobs", json=job("r1"), headers=KEY)
        stream = await client.post("/jobs/stream", json=job("r1"), headers=KEY)
        changed = await client.post("/jobs", json=job("r1", input={"x": 1}), headers=KEY)
        other_key = await client.post("/jobs", json=job("r1"), headers={"Idempotency-Key": "key-2"})
        other_timeout = await client.post("/jobs", json=job("r1", timeout_ms=1000), headers=KEY)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert [e["event"] for e in job_events(stream.content)][-1] == "completed"
    assert changed.status_code == other_key.status_code == other_timeout.status_code == 409
    assert len(fake.calls) == 1


ADMISSION_CASES = [
    # (description, body, headers, expected status): each later case also breaks every later rule
    ("unknown operation (the reference's 422)", job("x", "nope", "deploy", "x" * 10), {}, 422),
    ("operation not enabled", job("x", "nope", "train", "x" * 10), {}, 403),
    ("inspection operation", job("x", "nope", "status", {}), {}, 403),
    ("missing key", job("x", "nope", "run", {"a": "b" * 2_000_000}), {}, 428),
    ("blank key", job("x", "nope"), {"Idempotency-Key": "  "}, 428),
    ("key too long", job("x", "nope"), {"Idempotency-Key": "k" * 513}, 400),
    ("key with control char", job("x", "nope"), {"Idempotency-Key": "a\tb"}, 400),
    ("invalid input", job("x", "nope", "replay", {"task_id": "", "pad": "p" * 2_000_000}), KEY, 422),
    ("invalid request field", job("x", "nope", timeout_ms=0), KEY, 422),
    ("boolean timeout", job("x", "nope", timeout_ms=True), KEY, 422),
    ("unknown crew and too large", job("x", "nope", "run", {"a": "b" * 1_100_000}), KEY, 404),
    ("too large", job("x", "echo", "run", {"a": "b" * 1_100_000}), KEY, 413),
]


@pytest.mark.parametrize("name,body,headers,status", ADMISSION_CASES, ids=[c[0] for c in ADMISSION_CASES])
async def test_admission_statuses_follow_the_design_order(tmp_path, name, body, headers, status):
    async with running_app(tmp_path, allowed_operations=("run", "replay", "memory_reset")) as (client, _app, fake):
        resp = await client.post("/jobs", json=body, headers=headers)
    assert resp.status_code == status, resp.text
    assert isinstance(resp.json()["detail"], str)
    assert fake.calls == []


async def test_key_length_is_512_bytes_inclusive_and_body_bound_is_413(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        ok = await client.post("/jobs", json=job("k"), headers={"Idempotency-Key": "k" * 512})
        huge = await client.post("/jobs", content=b"{" + b" " * (9 * 1024 * 1024) + b"}", headers={**KEY, **JSON})
        not_json = await client.post("/jobs", content=b"{oops", headers={**KEY, **JSON})
        not_object = await client.post("/jobs", json=[1], headers=KEY)
        mismatch = await client.post("/jobs", json=job("m"), headers={**KEY, "X-AIP-Action-ID": "other"})
    assert ok.status_code == 200
    assert huge.status_code == 413 and not_json.status_code == 422 and not_object.status_code == 422
    assert mismatch.status_code == 400


async def test_replay_needs_a_retained_completed_run_of_the_same_crew(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        unknown = await client.post(
            "/jobs", json=job("p0", operation="replay", input={"task_id": "task-r-0"}), headers=KEY
        )
        await client.post("/jobs", json=job("r"), headers=KEY)
        other_crew = await client.post("/jobs", json=job("p1", "slow", "replay", {"task_id": "task-r-0"}), headers=KEY)
        ok = await client.post("/jobs", json=job("p2", operation="replay", input={"task_id": "task-r-0"}), headers=KEY)
        await client.post("/jobs", json=job("b", operation="batch_run", input={"inputs": [{}, {}]}), headers=KEY)
        batch_item = await client.post(
            "/jobs", json=job("p3", operation="replay", input={"task_id": "task-b-1-0"}), headers=KEY
        )
        archived = await client.delete("/jobs/r", headers={"X-AIP-Archive-Confirmation": "r"})
        after_archive = await client.post(
            "/jobs", json=job("p4", operation="replay", input={"task_id": "task-r-0"}), headers=KEY
        )
    assert unknown.status_code == other_crew.status_code == after_archive.status_code == 422
    assert "task_id" in unknown.json()["detail"]
    assert archived.status_code == 200
    assert ok.status_code == 200 and ok.json()["replayed_from"] is True
    assert batch_item.status_code == 200 and batch_item.json()["replayed_from"] is True
    assert [c[1] for c in fake.calls] == ["run", "replay", "batch_run", "replay"]


async def test_retained_run_limit_is_507_and_archiving_frees_a_slot(tmp_path):
    async with running_app(tmp_path, max_retained_runs=2) as (client, _app, fake):
        for aid in ("a", "b"):
            assert (await client.post("/jobs", json=job(aid), headers=KEY)).status_code == 200
        full = await client.post("/jobs", json=job("c"), headers=KEY)
        repeat = await client.post("/jobs", json=job("a"), headers=KEY)
        await client.delete("/jobs/a", headers={"X-AIP-Archive-Confirmation": "a"})
        after = await client.post("/jobs", json=job("c"), headers=KEY)
    assert full.status_code == 507 and "retained" in full.json()["detail"]
    assert repeat.status_code == 200
    assert after.status_code == 200
    assert len(fake.calls) == 3


async def fail_job_inserts(journal) -> None:
    """Make every insert into the journal's jobs table fail like a disk error (``DROP TRIGGER fail_insert``)."""
    await journal._run(
        journal._conn.execute,
        "CREATE TEMP TRIGGER fail_insert BEFORE INSERT ON jobs BEGIN SELECT RAISE(FAIL, 'disk I/O error'); END",
    )


async def test_journal_write_failure_at_admission_is_507_with_nothing_half_admitted(tmp_path):
    async with running_app(tmp_path) as (client, app, fake):
        await fail_job_inserts(app.state.runtime.journal)  # inside the admission transaction
        resp = await client.post("/jobs", json=job("w"), headers=KEY)
        status = await client.get("/jobs/w")
    assert resp.status_code == 507
    assert status.status_code == 404
    assert fake.calls == []
    with sqlite3.connect(tmp_path / "journal.db") as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 0


async def test_a_failed_admission_write_turns_health_degraded_until_an_admission_succeeds(tmp_path):
    async with running_app(tmp_path) as (client, app, _fake):
        journal = app.state.runtime.journal
        await fail_job_inserts(journal)
        assert (await client.get("/health")).json()["status"] == "ready"
        assert (await client.post("/jobs", json=job("w1"), headers=KEY)).status_code == 507
        assert (await client.get("/health")).json()["status"] == "degraded"
        await journal._run(journal._conn.execute, "DROP TRIGGER fail_insert")
        assert (await client.post("/jobs", json=job("w2"), headers=KEY)).status_code == 200
        assert (await client.get("/health")).json()["status"] == "ready"


async def test_a_failed_admission_write_stops_degrading_health_after_its_window(tmp_path, monkeypatch):
    from aip_crewai.sidecar.jobs import runtime as runtime_module

    async with running_app(tmp_path) as (client, app, _fake):
        journal = app.state.runtime.journal
        await fail_job_inserts(journal)
        assert (await client.post("/jobs", json=job("w1"), headers=KEY)).status_code == 507
        assert (await client.get("/health")).json()["status"] == "degraded"
        monkeypatch.setattr(runtime_module, "RECENT_WRITE_FAILURE_SECONDS", 0.0)
        assert (await client.get("/health")).json()["status"] == "ready"


async def test_stream_route_sends_all_events_as_sse_frames(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        resp = await client.post("/jobs/stream", json=job("s", input={"chunks": 2}), headers=KEY)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
    events = job_events(resp.content)
    assert [e["event"] for e in events] == ["started", "chunk", "chunk", "completed"]
    assert b"id: 0\nevent: started\ndata: {" in resp.content


async def test_a_stream_start_refused_for_its_last_event_id_admits_nothing(tmp_path):
    """Found by a break-it session: a bad ``Last-Event-ID`` (400), or one past the events of a job that does
    not exist yet (416), was checked after the admission: the caller got the refusal and the job ran."""
    async with running_app(tmp_path) as (client, _app, fake):
        bad = await client.post("/jobs/stream", json=job("b"), headers={**KEY, "Last-Event-ID": "zz"})
        past = await client.post("/jobs/stream", json=job("p"), headers={**KEY, "Last-Event-ID": "5"})
        views = [(await client.get(f"/jobs/{action_id}")).status_code for action_id in ("b", "p")]
        resumed = await client.post("/jobs/stream", json=job("r"), headers=KEY)  # an existing job resumes
        again = await client.post("/jobs/stream", json=job("r"), headers={**KEY, "Last-Event-ID": "1"})
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["detail"]
    assert past.status_code == 416 and "outside the journal" in past.json()["detail"]
    assert views == [404, 404] and [call[2] for call in fake.calls] == [{}]  # only "r" ran
    assert resumed.status_code == 200 and [e["sequence"] for e in job_events(again.content)] == [2, 3]


async def test_events_resume_with_cursor_and_last_event_id_and_416_outside(tmp_path):
    sse = {"Accept": "text/event-stream"}
    async with running_app(tmp_path) as (client, _app, _fake):
        await client.post("/jobs", json=job("e", input={"chunks": 3}), headers=KEY)
        by_cursor = await client.get("/jobs/e/events?cursor=2", headers=sse)
        by_id = await client.get("/jobs/e/events?cursor=0", headers={**sse, "Last-Event-ID": "3"})
        json_page = (await client.get("/jobs/e/events", params={"cursor": 4})).json()
        at_end = (await client.get("/jobs/e/events", params={"cursor": 5})).json()
        past = await client.get("/jobs/e/events", params={"cursor": 6})
        past_sse = await client.get("/jobs/e/events", headers={**sse, "Last-Event-ID": "5"})
        negative = await client.get("/jobs/e/events", params={"cursor": -1})
        garbage = await client.get("/jobs/e/events", params={"cursor": "x"})
        unknown = await client.get("/jobs/zzz/events")
    assert [e["sequence"] for e in job_events(by_cursor.content)] == [2, 3, 4]
    assert [e["sequence"] for e in job_events(by_id.content)] == [4]
    assert [e["event"] for e in json_page["events"]] == ["completed"] and json_page["next_cursor"] == 5
    assert at_end["events"] == [] and at_end["next_cursor"] == 5
    assert past.status_code == past_sse.status_code == negative.status_code == 416
    assert garbage.status_code == 400 and unknown.status_code == 404


async def test_cancel_route_checks_ids_and_is_idempotent_on_terminal_jobs(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        await client.post("/jobs", json=job("c"), headers=KEY)
        mismatch = await client.post("/jobs/c/cancel", json={"crew_id": "echo", "action_id": "other"})
        invalid = await client.post("/jobs/c/cancel", json={"action_id": "c"})
        wrong_crew = await client.post("/jobs/c/cancel", json={"crew_id": "slow", "action_id": "c"})
        unknown = await client.post("/jobs/u/cancel", json={"crew_id": "echo", "action_id": "u"})
        done = await client.post("/jobs/c/cancel", json={"crew_id": "echo", "action_id": "c", "reason": "r"})
    assert mismatch.status_code == 400 and invalid.status_code == 422
    assert wrong_crew.status_code == unknown.status_code == 404
    assert done.status_code == 200 and done.json()["status"] == "completed"


async def test_cancelling_a_running_job_ends_it_cancelled_and_blocking_waiters_get_409(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        waiter = asyncio.create_task(client.post("/jobs", json=job("c", "slow"), headers=KEY))
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        resp = await client.post("/jobs/c/cancel", json={"crew_id": "slow", "action_id": "c"})
        blocked = await waiter
        events = (await client.get("/jobs/c/events")).json()["events"]
        view = await until_async(lambda: _view_with_stop(client, "c"), interval=0.005)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    assert blocked.status_code == 409 and blocked.json()["status"] == "cancelled"
    assert events[-1]["event"] == "cancelled" and events[-1]["data"] == {"status": "cancelled"}
    assert view["provider_stop_observed"] is True


async def _view_with_stop(client, action_id):
    view = (await client.get(f"/jobs/{action_id}")).json()
    return view if view.get("provider_stop_observed") is not None else None


async def test_non_cancellable_operation_is_409_while_running(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        task = asyncio.create_task(
            client.post("/jobs", json=job("m", "slow", "memory_reset", {"command_type": "all"}), headers=KEY)
        )
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        resp = await client.post("/jobs/m/cancel", json={"crew_id": "slow", "action_id": "m"})
        fake.release.set()
        assert (await task).status_code == 200
    assert resp.status_code == 409


async def test_archive_needs_confirmation_refuses_running_jobs_and_hides_the_record(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        task = asyncio.create_task(client.post("/jobs", json=job("d", "slow"), headers=KEY))
        await until_async(lambda: fake.started.is_set(), interval=0.005)
        no_header = await client.delete("/jobs/d")
        wrong = await client.delete("/jobs/d", headers={"X-AIP-Archive-Confirmation": "x"})
        running = await client.delete("/jobs/d", headers={"X-AIP-Archive-Confirmation": "d"})
        fake.release.set()
        await task
        ok = await client.delete("/jobs/d", headers={"X-AIP-Archive-Confirmation": "d"})
        again = await client.delete("/jobs/d", headers={"X-AIP-Archive-Confirmation": "d"})
        gone = await client.get("/jobs/d")
        rerun = await client.post("/jobs", json=job("d", "slow"), headers=KEY)
        unknown = await client.delete("/jobs/u", headers={"X-AIP-Archive-Confirmation": "u"})
    assert no_header.status_code == wrong.status_code == 428
    assert running.status_code == 409
    assert ok.status_code == again.status_code == 200 and ok.json() == {"action_id": "d", "archived": True}
    assert gone.status_code == 404 and rerun.status_code == 409 and unknown.status_code == 404
    assert len(fake.calls) == 1


async def test_routing_errors_and_crashes_use_detail_bodies(tmp_path):
    async with running_app(tmp_path) as (client, app, _fake):
        not_found = await client.get("/nowhere")
        bad_method = await client.put("/jobs")

        async def boom(action_id):
            raise RuntimeError(SECRET)

        app.state.runtime.reads.view = boom
        crash = await client.get("/jobs/x")
    assert not_found.status_code == 404 and not_found.json() == {"detail": "Not Found"}
    assert bad_method.status_code == 405 and bad_method.json() == {"detail": "Method Not Allowed"}
    assert crash.status_code == 500 and crash.json() == {"detail": "internal error"}


async def test_unauthenticated_mode_serves_without_a_token(tmp_path):
    async with running_app(tmp_path, token=None, allow_unauthenticated=True) as (client, _app, _fake):
        resp = await client.get("/health", headers={"Authorization": ""})
    assert resp.status_code == 200


async def test_output_with_raw_json_round_trips_exactly(tmp_path):
    async with running_app(tmp_path) as (client, _app, _fake):
        resp = await client.post("/jobs", json=job("o", "bulky", input={"size": 3}), headers=KEY)
        view = (await client.get("/jobs/o")).json()
    assert msgspec.json.decode(resp.content) == {"raw": "xxx"} == view["output"]


async def test_metrics_count_jobs_by_operation_and_outcome(tmp_path):
    async with running_app(tmp_path, max_events_per_run=3) as (client, _app, _fake):
        await client.post("/jobs", json=job("m1", input={"chunks": 1}), headers=KEY)
        await client.post("/jobs", json=job("m2", "failing"), headers=KEY)
        await client.post("/jobs", json=job("m3", "chatty", input={"chunks": 5}), headers=KEY)
        resp = await client.get("/metrics")
        unauthenticated = await client.get("/metrics", headers={"Authorization": ""})
    text = resp.text
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'aip_crewai_sidecar_jobs_admitted_total{operation="run"} 3' in text
    assert 'aip_crewai_sidecar_jobs_finished_total{operation="run",status="completed"} 2' in text
    assert 'aip_crewai_sidecar_jobs_finished_total{operation="run",status="failed"} 1' in text
    assert "aip_crewai_sidecar_chunks_dropped_total 4" in text
    assert "aip_crewai_sidecar_retained_runs 3" in text and "aip_crewai_sidecar_active_runs 0" in text
    assert "aip_crewai_sidecar_journal_write_failures_total 0" in text
    assert unauthenticated.status_code == 401


async def test_an_input_nested_past_the_shared_bound_is_422_before_hashing(tmp_path):
    """Issue 16 item 14: the sidecar applies the host's nesting bound at admission (the host refuses first)."""
    from aip_crewai.contracts.inputs import MAX_INPUT_DEPTH

    def nested(levels: int) -> dict:
        value: dict = {"topic": "x"}
        for _ in range(levels - 1):
            value = {"n": value}
        return value

    async with running_app(tmp_path) as (client, _app, fake):
        deep = await client.post("/jobs", json=job("deep", "echo", "run", nested(MAX_INPUT_DEPTH + 1)), headers=KEY)
        ok = await client.post("/jobs", json=job("ok", "echo", "run", nested(MAX_INPUT_DEPTH)), headers=KEY)
    assert deep.status_code == 422 and "nested deeper" in deep.json()["detail"]
    assert ok.status_code == 200 and len(fake.calls) == 1


async def test_the_reference_legacy_run_routes_answer_as_the_job_routes(tmp_path):
    async with running_app(tmp_path) as (client, _app, fake):
        blocking = await client.post("/runs", json=job("l1", input={"chunks": 2}), headers=KEY)
        legacy_view, view = (await client.get("/runs/l1")).json(), (await client.get("/jobs/l1")).json()
        streamed = await client.post("/runs/stream", json={**job("l2"), "operation": "run"}, headers=KEY)
        defaulted = await client.post("/runs", json={"crew_id": "echo", "action_id": "l3", "input": {}}, headers=KEY)
        cancel = await client.post("/runs/l1/cancel", json={"crew_id": "echo", "action_id": "l1"})
        mismatch = await client.post("/runs/l1/cancel", json={"crew_id": "echo", "action_id": "other"})
        calls = len(fake.calls)
        other = await client.post("/runs", json=job("l4", operation="replay", input={"task_id": "t"}), headers=KEY)
        other_stream = await client.post("/runs/stream", json=job("l5", operation="batch_run"), headers=KEY)
    assert blocking.status_code == 200 and blocking.json()["tasks_output"][0]["task_id"] == "task-l1-0"
    assert legacy_view == view and view["status"] == "completed"
    assert [e["event"] for e in job_events(streamed.content)][-1] == "completed"
    assert defaulted.status_code == 200
    assert cancel.status_code == 200 and cancel.json()["status"] == "completed" and mismatch.status_code == 400
    for refused in (other, other_stream):
        assert refused.status_code == 400 and refused.json() == {"detail": "legacy run route only accepts run"}
    assert len(fake.calls) == calls == 3


async def test_without_a_token_bodies_being_read_share_one_budget_and_one_more_is_503(tmp_path):
    """docs/security.md "Security" (bodies before authentication): a sidecar serving without a token reads every body
    unauthenticated; their total is bounded (``--unauthenticated-body-budget-bytes``), past it 503 with
    ``Retry-After``; each body gives its share back once read."""
    budget_bytes = 8 * 1024 * 1024
    gate = asyncio.Event()

    async def slow(first: int):
        yield b" " * first
        await gate.wait()
        yield msgspec.json.encode(job("slow"))

    async with running_app(tmp_path, token=None, allow_unauthenticated=True, body_budget_bytes=budget_bytes) as (
        client,
        app,
        _fake,
    ):
        budget = app.state.body_budget
        held = [
            asyncio.create_task(client.post("/jobs", content=slow(1024 * 1024), headers={**KEY, **JSON}))
            for _ in range(7)
        ]
        await until_async(lambda: budget.used_bytes == budget_bytes - 1024 * 1024, interval=0.005)
        refused = await client.post("/jobs", content=slow(1024 * 1024 + 1), headers={**KEY, **JSON})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["budget_bytes"] == budget_bytes and "retry later" in refused.json()["detail"]
        metrics = await client.get("/metrics")
        assert f"aip_crewai_sidecar_unauthenticated_body_bytes {budget_bytes - 1024 * 1024}" in metrics.text
        gate.set()
        answers = await asyncio.gather(*held)
        assert all(a.status_code == 200 for a in answers) and budget.used_bytes == 0


async def test_with_a_token_bodies_are_read_after_authentication_and_never_counted(tmp_path):
    async with running_app(tmp_path) as (client, app, _fake):
        assert app.state.body_budget is None
        assert (await client.post("/jobs", json=job("counted"), headers=KEY)).status_code == 200
        assert "unauthenticated_body_bytes" not in (await client.get("/metrics")).text


@pytest.mark.parametrize(
    "path", ["/jobs", "/jobs/stream", "/runs", "/runs/stream", "/jobs/mt/cancel", "/runs/mt/cancel"]
)
async def test_a_body_not_declared_json_is_415_before_it_is_read(tmp_path, path):
    """Any Content-Type was accepted; every route reading a body now takes ``application/json`` (parameters and
    case aside) and answers 415 otherwise, nothing admitted; a bad token is still 401 first."""
    body = msgspec.json.encode(job("mt") if "cancel" not in path else {"crew_id": "echo", "action_id": "mt"})
    async with running_app(tmp_path) as (client, _app, fake):
        refused = {
            kind: await client.post(path, content=body, headers={**KEY, **({"Content-Type": kind} if kind else {})})
            for kind in ("text/plain", "", "application/aip+json", "application/x-www-form-urlencoded")
        }
        unauthenticated = await client.post(
            path, content=body, headers={**KEY, "Content-Type": "text/plain", "Authorization": "Bearer wrong"}
        )
        assert fake.calls == []
        accepted = await client.post(
            path, content=body, headers={**KEY, "Content-Type": "Application/JSON; charset=utf-8"}
        )
    for kind, answer in refused.items():
        assert answer.status_code == 415, (kind, answer.text)
        assert answer.json()["content_type"] == kind and answer.json()["accepted"] == ["application/json"]
        assert "must be JSON, declared as Content-Type application/json" in answer.json()["detail"]
    assert unauthenticated.status_code == 401
    assert accepted.status_code in (200, 404), accepted.text  # 404: a cancel of a job that does not exist


@pytest.mark.parametrize("cursor", ["%C2%B2", "%D9%A3"])  # "²" (a 500 before), "٣" (read as 3 before)
async def test_a_cursor_in_another_scripts_digits_is_400(tmp_path, cursor):
    async with running_app(tmp_path) as (client, _app, _fake):
        await client.post("/jobs", json=job("q1"), headers=KEY)
        answer = await client.get(f"/jobs/q1/events?cursor={cursor}")
    assert answer.status_code == 400 and answer.json()["detail"] == "cursor must be an integer"
