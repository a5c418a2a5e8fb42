"""The sidecar HTTP contract against a real process and the offline test crews (ARCHITECTURE.md §4)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx2
import pytest
from kits.poll import until_async

from aip_crewai.sse import SSEDecoder

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.sidecar_jobs]

#: aip_crewai.examples.offline_llm.FAKE_SECRET (not imported: that would import CrewAI into the test process).
FAKE_SECRET = "sk-test-SECRET-7f3a9c"


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def body(action_id: str, crew: str = "echo", operation: str = "run", input: dict | None = None, **extra) -> dict:
    return {"crew_id": crew, "action_id": action_id, "operation": operation, "input": input or {}, **extra}


async def read_sse(response: httpx2.Response, until_terminal: bool = True, on_event=None):
    """Decode a live SSE response; return (events, raw bytes). Events are the parsed ``data`` objects."""
    decoder, events, raw = SSEDecoder(), [], b""
    async for chunk in response.aiter_raw():
        raw += chunk
        for frame in decoder.feed(chunk):
            data = json.loads(frame.data)
            assert frame.event == data["event"] and frame.id == str(data["sequence"])
            events.append(data)
            if on_event is not None:
                await on_event(data)
            if until_terminal and data["event"] in ("completed", "failed", "cancelled"):
                return events, raw
    return events, raw


async def wait_calls(sidecar, at_least: int, timeout: float = 30.0) -> int:
    return await until_async(
        lambda: len(sidecar.calls()) if len(sidecar.calls()) >= at_least else None,
        timeout=timeout,
        what=f"{at_least} model calls",
    )


async def test_admit_stream_until_the_terminal_event(shared_sidecar):
    aid = uid("stream")
    async with shared_sidecar.client() as client:
        async with client.stream(
            "POST", "/jobs/stream", json=body(aid, input={"topic": "tides"}), headers={"Idempotency-Key": aid}
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["cache-control"] == "no-cache" and resp.headers["x-accel-buffering"] == "no"
            events, _raw = await read_sse(resp)
        view = (await client.get(f"/jobs/{aid}")).json()
    assert [e["sequence"] for e in events] == list(range(len(events)))
    assert events[0]["event"] == "started" and events[-1]["event"] == "completed"
    assert {e["event"] for e in events[1:-1]} == {"chunk"}
    assert "tides" in "".join(e["data"]["content"] for e in events[1:-1])
    assert view["status"] == "completed" and view["event_count"] == len(events)
    assert view["output"] == events[-1]["data"] and "tides" in view["output"]["raw"]


async def test_batch_run_chunks_name_their_item(shared_sidecar):
    # The worker's channel and the journal kept only channel, task_id and agent_role: the CLI's `[item N]`
    # lines (docs/reference/cli.md) never had a `batch_item` to read.
    aid = uid("batch")
    inputs = {"inputs": [{"topic": "tides"}, {"topic": "owls"}]}
    async with shared_sidecar.client() as client:
        async with client.stream(
            "POST",
            "/jobs/stream",
            json=body(aid, operation="batch_run", input=inputs),
            headers={"Idempotency-Key": aid},
        ) as resp:
            events, _raw = await read_sse(resp)
        page = (await client.get(f"/jobs/{aid}/events", params={"cursor": 0})).json()
    assert events[-1]["event"] == "completed", events[-1]
    for chunks in ([e for e in events if e["event"] == "chunk"], [e for e in page["events"] if e["event"] == "chunk"]):
        items = [e["data"].get("batch_item") for e in chunks]
        assert None not in items and sorted(set(items)) == [0, 1] and items == sorted(items), items
        text = {n: "".join(e["data"]["content"] for e in chunks if e["data"]["batch_item"] == n) for n in (0, 1)}
        assert "tides" in text[0] and "owls" in text[1], text


async def test_exact_repeat_returns_the_record_without_a_second_execution(shared_sidecar):
    aid = uid("repeat")
    headers = {"Idempotency-Key": aid}
    async with shared_sidecar.client() as client:
        before = len(shared_sidecar.calls())
        first = await client.post("/jobs", json=body(aid, input={"topic": "owls"}), headers=headers)
        after_first = len(shared_sidecar.calls())
        again = await client.post("/jobs", json=body(aid, input={"topic": "owls"}), headers=headers)
        stream = await client.post("/jobs/stream", json=body(aid, input={"topic": "owls"}), headers=headers)
        changed = await client.post("/jobs", json=body(aid, input={"topic": "bats"}), headers=headers)
        other_key = await client.post(
            "/jobs", json=body(aid, input={"topic": "owls"}), headers={"Idempotency-Key": aid + "x"}
        )
    assert first.status_code == again.status_code == stream.status_code == 200
    assert first.json() == again.json()
    assert after_first - before == 2  # two tasks, one model call each
    assert len(shared_sidecar.calls()) == after_first  # the repeats executed nothing
    assert changed.status_code == other_key.status_code == 409


async def test_admission_statuses_in_design_order(shared_sidecar):
    big = {"blob": "b" * 1_100_000}
    cases = [
        (body(uid("a"), "nope", "deploy", big), {}, 422),  # an unknown operation, as the reference answers
        (body(uid("a"), "nope", "train", big), {}, 403),
        (body(uid("a"), "nope", "run", big), {}, 428),
        (body(uid("a"), "nope", "run", big), {"Idempotency-Key": "k" * 513}, 400),
        (body(uid("a"), "nope", "batch_run", {"inputs": []}), {"Idempotency-Key": "k"}, 422),
        (body(uid("a"), "nope", "run", big), {"Idempotency-Key": "k"}, 404),
        (body(uid("a"), "echo", "run", big), {"Idempotency-Key": "k"}, 413),
        (body(uid("a"), "echo", "replay", {"task_id": "no-such-task"}), {"Idempotency-Key": "k"}, 422),
    ]
    async with shared_sidecar.client() as client:
        before = len(shared_sidecar.calls())
        for request, headers, expected in cases:
            resp = await client.post("/jobs", json=request, headers=headers)
            assert resp.status_code == expected, (expected, resp.text)
            assert isinstance(resp.json()["detail"], str)
    assert len(shared_sidecar.calls()) == before


async def test_failed_job_is_502_without_provider_text(shared_sidecar):
    aid = uid("fail")
    async with shared_sidecar.client() as client:
        resp = await client.post("/jobs", json=body(aid, "failing"), headers={"Idempotency-Key": aid})
        events = (await client.get(f"/jobs/{aid}/events")).json()["events"]
    assert resp.status_code == 502
    assert resp.json()["error_type"] and resp.json()["uncertain_outcome"] is True
    assert events[-1]["event"] == "failed"
    assert FAKE_SECRET not in resp.text + json.dumps(events)
    assert FAKE_SECRET not in shared_sidecar.stderr()


async def test_every_route_needs_the_token(shared_sidecar):
    routes = [
        ("GET", "/health"),
        ("POST", "/jobs"),
        ("POST", "/jobs/stream"),
        ("GET", "/jobs/x"),
        ("GET", "/jobs/x/events"),
        ("POST", "/jobs/x/cancel"),
        ("DELETE", "/jobs/x"),
        ("GET", "/other"),
    ]
    async with httpx2.AsyncClient(base_url=shared_sidecar.base_url) as client:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                resp = await client.request(method, path, headers=headers, json=body("x"))
                assert resp.status_code == 401, (method, path)
                assert resp.headers["www-authenticate"] == "Bearer"
                assert resp.json() == {"detail": "missing or invalid bearer token"}


async def test_concurrent_jobs_never_see_each_others_events(shared_sidecar):
    topics = {uid("conc"): "alpha", uid("conc"): "omega"}

    async def one(client, aid, topic):
        async with client.stream(
            "POST", "/jobs/stream", json=body(aid, "slow", input={"topic": topic}), headers={"Idempotency-Key": aid}
        ) as resp:
            events, _ = await read_sse(resp)
        return aid, topic, events

    async with shared_sidecar.client() as client:
        results = await asyncio.gather(*(one(client, aid, t) for aid, t in topics.items()))
    for _aid, topic, events in results:
        assert events[-1]["event"] == "completed"
        own_tasks = {t["task_id"] for t in events[-1]["data"]["tasks_output"]}
        chunks = [e["data"] for e in events if e["event"] == "chunk"]
        assert chunks and {c["task_id"] for c in chunks} <= own_tasks
        text = "".join(c["content"] for c in chunks)
        other = "omega" if topic == "alpha" else "alpha"
        assert topic in text and other not in text
        assert [e["sequence"] for e in events] == list(range(len(events)))


async def test_cancelling_a_running_run_ends_it_cancelled_within_a_second(shared_sidecar):
    aid = uid("cancel")
    async with shared_sidecar.client() as client:
        async with client.stream(
            "POST", "/jobs/stream", json=body(aid, "slow"), headers={"Idempotency-Key": aid}
        ) as resp:
            cancelled_at = []

            async def on_event(event):
                if event["event"] == "chunk" and not cancelled_at:
                    cancelled_at.append(time.monotonic())
                    answer = await client.post(f"/jobs/{aid}/cancel", json={"crew_id": "slow", "action_id": aid})
                    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"

            events, _ = await read_sse(resp, on_event=on_event)
            ended_at = time.monotonic()

        def job_calls(since: float | None = None) -> list[str]:  # the shared sidecar's log holds other jobs too
            return [line for line in shared_sidecar.calls(since=since) if line.split()[3].endswith(aid)]

        calls_after_cancel = len(job_calls())

        async def stop_recorded() -> dict | None:  # once the worker (thread or process) has returned
            view = (await client.get(f"/jobs/{aid}")).json()
            return view if view.get("provider_stop_observed") is not None else None

        view = await until_async(stop_recorded, timeout=30, interval=0.01, what="the stop recorded")
        confirmed_at = time.time()  # the worker has returned: nothing of this job can call the model after it
        repeat = await client.post(f"/jobs/{aid}/cancel", json={"crew_id": "slow", "action_id": aid})
        blocking = await client.post("/jobs", json=body(aid, "slow"), headers={"Idempotency-Key": aid})
    assert events[-1] == {"event": "cancelled", "sequence": events[-1]["sequence"], "data": {"status": "cancelled"}}
    assert ended_at - cancelled_at[0] < 1.0
    assert view["status"] == "cancelled" and view["provider_stop_observed"] is True
    assert repeat.status_code == 200 and repeat.json()["status"] == "cancelled"
    assert blocking.status_code == 409
    # A stopped crew makes no further call (the confirmed stop means its worker returned or died).
    assert job_calls(since=confirmed_at) == [] and len(job_calls()) == calls_after_cancel


async def test_sse_resumes_with_last_event_id_and_cursor_and_416_outside(shared_sidecar):
    aid = uid("resume")
    sse = {"Accept": "text/event-stream"}
    async with shared_sidecar.client() as client:
        # follow a live job, drop the connection after 3 events, resume with Last-Event-ID
        first: list[dict] = []
        async with client.stream(
            "POST", "/jobs/stream", json=body(aid, "slow"), headers={"Idempotency-Key": aid}
        ) as resp:
            decoder = SSEDecoder()
            async for chunk in resp.aiter_raw():
                first += [json.loads(f.data) for f in decoder.feed(chunk)]
                if len(first) >= 3:
                    break
        last_id = first[-1]["sequence"]
        async with client.stream("GET", f"/jobs/{aid}/events", headers={**sse, "Last-Event-ID": str(last_id)}) as resp:
            rest, raw = await read_sse(resp)
        by_cursor = await client.get(f"/jobs/{aid}/events", params={"cursor": 2}, headers=sse)
        page = (await client.get(f"/jobs/{aid}/events", params={"cursor": 1})).json()
        count = (await client.get(f"/jobs/{aid}")).json()["event_count"]
        past = await client.get(f"/jobs/{aid}/events", params={"cursor": count + 1})
        past_sse = await client.get(f"/jobs/{aid}/events", headers={**sse, "Last-Event-ID": str(count)})
    sequences = [e["sequence"] for e in first + rest]  # the read stops after 3 events, or more in one piece
    assert sequences == list(range(count)) and rest[-1]["event"] == "completed"
    assert b": keep-alive" in raw  # 0.2 s keep-alives between the 300 ms chunks
    cursor_events = [json.loads(f.data) for f in SSEDecoder().feed(by_cursor.content)]
    assert [e["sequence"] for e in cursor_events] == list(range(2, count))
    assert page["cursor"] == 1 and page["next_cursor"] == count and page["status"] == "completed"
    assert past.status_code == past_sse.status_code == 416


async def test_archive_needs_confirmation_and_a_terminal_job(shared_sidecar):
    aid = uid("archive")
    async with shared_sidecar.client() as client:
        task = asyncio.create_task(client.post("/jobs", json=body(aid, "slow"), headers={"Idempotency-Key": aid}))
        await wait_calls(shared_sidecar, len(shared_sidecar.calls()) + 1)
        missing = await client.delete(f"/jobs/{aid}")
        running = await client.delete(f"/jobs/{aid}", headers={"X-AIP-Archive-Confirmation": aid})
        assert (await task).status_code == 200
        ok = await client.delete(f"/jobs/{aid}", headers={"X-AIP-Archive-Confirmation": aid})
        gone = await client.get(f"/jobs/{aid}")
    assert missing.status_code == 428 and running.status_code == 409
    assert ok.status_code == 200 and gone.status_code == 404


async def test_health_and_routing_errors(shared_sidecar):
    async with shared_sidecar.client() as client:
        health = (await client.get("/health")).json()
        not_found = await client.get("/nope")
        not_allowed = await client.put("/health")
    assert health["status"] == "ready" and health["durable_journal"] is True
    assert "echo" in health["crews"] and health["operations"] == sorted(
        {"run", "batch_run", "replay", "test", "knowledge_query", "memory_reset", "status", "events", "cancel"}
    )
    assert not_found.status_code == 404 and not_found.json() == {"detail": "Not Found"}
    assert not_allowed.status_code == 405 and "detail" in not_allowed.json()
