"""Fault scenarios shared by ``tests/reliability`` and ``make chaos``.

Each function runs ONE trial against real processes and raises
``AssertionError`` with a precise message when an invariant breaks; it
returns a small dict of what it observed. The tests call them with small
counts, ``chaos.py`` with counts scaled by ``AIP_CREWAI_CHAOS_SCALE``.

Categories (ARCHITECTURE.md §5, §7, §8):

- crash: ``sidecar_kill9`` (kill -9 during N concurrent runs, restart on the
  same journal), ``host_kill9`` (kill -9 mid-stream, restart on the same
  store and port, resume with ``Last-Event-ID``);
- race: ``duplicate_requests``, ``decision_race``, ``cancel_race``.
"""

from __future__ import annotations

import concurrent.futures
import random
import signal
import threading
import time
import uuid
from typing import Any

import httpx2
from kits.aip import sse_events
from relkit import (
    TERMINAL,
    Host,
    Processes,
    Sidecar,
    approve,
    calls_by_action,
    chunk_count,
    host_history,
    post_action,
    sidecar_events,
    sidecar_view,
    until,
    wait_action,
)

#: Model calls of one run of the offline crews ``slow`` and ``echo`` (1 agent, 2 tasks).
CALLS_PER_RUN = 2


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def admitted(sidecar: Sidecar, job_id: str) -> int:
    """How many times the sidecar logged ``job_admitted`` for ``job_id``."""
    return sum(1 for record in sidecar.log_events("job_admitted") if record.get("action_id") == job_id)


# ------------------------------------------------------------------- crash


def sidecar_kill9(procs: Processes, runs: int = 6, running_at_kill: int = 2) -> dict[str, Any]:
    """kill -9 the sidecar while ``runs`` slow jobs stream (4 execute, the rest
    queue), restart it on the same journal, and check the crash fence.

    Invariants: every admitted job has exactly one terminal event, last, with
    dense sequences; each is ``failed`` (``SidecarRestarted``) with
    ``uncertain_outcome`` true exactly when CrewAI had started it; no model
    call happens for any of them after the kill (per-action call counts are
    unchanged, the new process makes none), also when the same request is
    sent again.
    """
    sidecar = procs.sidecar()
    ids = [uid("k9") for _ in range(runs)]
    streams: dict[str, list[Any]] = {}

    def stream(action_id: str) -> None:
        got: list[Any] = []
        body = {"crew_id": "slow", "action_id": action_id, "operation": "run", "input": {"topic": action_id}}
        try:
            with (
                httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=60) as http,
                http.stream("POST", "/jobs/stream", json=body, headers={"Idempotency-Key": action_id}) as resp,
            ):
                got.append(("status", resp.status_code))
                got += [data["event"] for _, _, data in sse_events(resp)]
        except httpx2.HTTPError as exc:
            got.append(("broken", type(exc).__name__))
        streams[action_id] = got

    threads = [threading.Thread(target=stream, args=(action_id,)) for action_id in ids]
    for thread in threads:
        thread.start()
    until(
        lambda: len(calls_by_action(procs.call_log)) >= min(running_at_kill, runs),
        timeout=60,
        what="slow jobs calling the model",
    )

    def all_admitted() -> bool:
        with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=10) as http:
            return all(http.get(f"/jobs/{action_id}").status_code == 200 for action_id in ids)

    # Every job admitted before the kill (on a loaded machine the last ones can lag the first model calls).
    until(all_admitted, timeout=60, what="every job admitted")
    sidecar.kill(signal.SIGKILL)
    for thread in threads:
        thread.join(30)
    before = calls_by_action(procs.call_log)
    assert not any(event in TERMINAL for got in streams.values() for event in got), (
        f"a stream saw a terminal event before the kill: {streams}"
    )
    restarted_at = time.time()
    restarted = procs.restart_sidecar(sidecar)
    running = queued = 0
    journaled: list[str] = []
    with httpx2.Client(base_url=restarted.base_url, headers=restarted.headers, timeout=30) as http:
        for action_id in ids:
            if http.get(f"/jobs/{action_id}").status_code == 404:  # the kill came before its admission
                assert not any(isinstance(e, str) for e in streams[action_id]), (
                    f"{action_id}: events were streamed but the job is not in the journal"
                )
                continue
            journaled.append(action_id)
            events = sidecar_events(restarted, action_id)
            terminals = [e for e in events if e["event"] in TERMINAL]
            assert len(terminals) == 1 and events[-1] is terminals[0], f"{action_id}: terminal events {events}"
            assert [e["sequence"] for e in events] == list(range(len(events))), f"{action_id}: sequences {events}"
            data = terminals[0]["data"]
            was_running = events[0]["event"] == "started"
            assert data["status"] == "failed" and data["error_type"] == "SidecarRestarted", f"{action_id}: {data}"
            assert data["uncertain_outcome"] is was_running, f"{action_id}: started={was_running} but {data}"
            assert before[action_id] == 0 or was_running, f"{action_id}: model calls without a started event"
            running += was_running
            queued += not was_running
        assert running >= min(running_at_kill, runs), f"only {running} jobs were running at the kill"
        for action_id in journaled[:2]:  # the same request again: answered from the journal, never re-run
            body = {"crew_id": "slow", "action_id": action_id, "operation": "run", "input": {"topic": action_id}}
            again = http.post("/jobs", json=body, headers={"Idempotency-Key": action_id})
            assert again.status_code == 502 and again.json()["error_type"] == "SidecarRestarted", again.text
    assert calls_by_action(procs.call_log, since=restarted_at) == {}, "the restarted sidecar called the model"
    assert calls_by_action(procs.call_log) == before, "model calls changed after the kill"
    restarted.kill(signal.SIGTERM)
    return {"runs": runs, "running": running, "queued": queued}


def host_kill9(procs: Processes, sidecar: Sidecar, after_events: int) -> dict[str, Any]:
    """kill -9 the host after the tenant read ``after_events`` SSE events of a
    slow run, restart it on the same store and port, resume with
    ``Last-Event-ID``.

    Invariants: the events read before the kill plus the resumed ones are the
    action's full stored history (``sse_0..sse_n``), each exactly once; the
    history holds one chunk per sidecar event (nothing the sidecar streamed
    while the host was down is missing); the action settles with the sidecar
    job's outcome; the job was admitted once and ran once (never re-dispatched).
    """
    name = uid("hostkill")
    host = procs.host(sidecar.base_url, name=name)
    action_id = uid("hk")
    job_id = f"acme:{action_id}"
    seen: list[str] = []
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:slow", {"topic": "tides"}, action_id, action_id)
        assert pending.status_code == 202, pending.text
        assert approve(host, pending).status_code == 200
        try:
            with app.stream(
                "GET", f"/aip/v1/actions/{action_id}/events", headers={"Accept": "text/event-stream"}
            ) as resp:
                for _, sse_id, _ in sse_events(resp):
                    seen.append(sse_id or "")
                    if len(seen) == after_events:
                        host.kill(signal.SIGKILL)
        except httpx2.HTTPError:
            pass
    assert len(seen) == after_events and host.process.returncode == -signal.SIGKILL, seen
    restarted = procs.host(sidecar.base_url, name=name, port=host.port)
    resumed: list[tuple[str, str]] = []
    with restarted.http("acme-app") as app:
        with app.stream(
            "GET",
            f"/aip/v1/actions/{action_id}/events",
            headers={"Accept": "text/event-stream", "Last-Event-ID": seen[-1]},
        ) as resp:
            resumed = [(event, sse_id or "") for event, sse_id, _ in sse_events(resp)]
        history = host_history(app, action_id)
        stored = chunk_count(app, action_id)
        result = app.get(f"/aip/v1/actions/{action_id}/result").json()["body"]["action_result"]
    events = sidecar_events(sidecar, job_id)
    assert resumed and resumed[-1][0] == "result", f"the resumed stream did not end with the result: {resumed}"
    assert seen + [sse_id for _, sse_id in resumed] == history, f"seen {seen} + resumed {resumed} != {history}"
    assert history == [f"sse_{n}" for n in range(len(history))], f"history ids {history}"
    assert stored == len(events), f"{stored} stored chunks for {len(events)} sidecar events"
    assert result["status"] == events[-1]["event"] == sidecar_view(sidecar, job_id)["status"], result
    assert admitted(sidecar, job_id) == 1, "the job was admitted more than once"
    assert calls_by_action(procs.call_log)[job_id] == CALLS_PER_RUN, "the job ran more than once"
    restarted.kill(signal.SIGTERM)
    return {"after_events": after_events, "resumed": len(resumed), "history": len(history)}


# -------------------------------------------------------------------- races


def _pool_map(fn: Any, items: list[Any]) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(fn, items))


def duplicate_requests(procs: Processes, sidecar: Sidecar, host: Host, n: int = 20) -> dict[str, Any]:
    """N concurrent identical requests, then N concurrent repeats after approval,
    then N concurrent requests sharing one key with different action ids.

    Invariants: one action, one approval, one sidecar admission, one execution;
    every repeat gets the same result; one key never creates two actions.
    """
    action_id, key = uid("dup"), uid("key")
    job_id = f"acme:{action_id}"

    def call(_: int) -> tuple[int, dict[str, Any]]:
        with host.http("acme-app") as app:
            response = post_action(app, "cap:crewai:echo", {"topic": "duplicates"}, action_id, key)
            return response.status_code, response.json()

    first = _pool_map(call, list(range(n)))
    assert {status for status, _ in first} == {202}, first
    approvals = {body["body"]["action_result"]["output"]["approval_id"] for _, body in first}
    assert len(approvals) == 1, f"{len(approvals)} approvals for one action"
    assert approve(host, httpx2.Response(202, json=first[0][1])).status_code == 200
    with host.http("acme-app") as app:
        wait_action(app, action_id)
    repeats = _pool_map(call, list(range(n)))
    outputs = {str(body["body"]["action_result"].get("output")) for _, body in repeats}
    assert {status for status, _ in repeats} == {200} and len(outputs) == 1, repeats[:2]
    assert admitted(sidecar, job_id) == 1, "admitted more than once"
    assert calls_by_action(procs.call_log)[job_id] == CALLS_PER_RUN, "executed more than once"

    shared = uid("shared-key")
    others = [uid("dupk") for _ in range(n)]

    def keyed(other: str) -> int:
        with host.http("acme-app") as app:
            return post_action(app, "cap:crewai:echo", {"topic": "one key"}, other, shared).status_code

    assert set(_pool_map(keyed, others)) == {202}
    with host.http("acme-app") as app:
        existing = [other for other in others if app.get(f"/aip/v1/actions/{other}").status_code == 200]
    assert len(existing) == 1, f"one idempotency key created {len(existing)} actions"
    return {"requests": 3 * n}


def decision_race(host: Host, n: int = 10) -> dict[str, Any]:
    """N concurrent approve/deny decisions of one approval: exactly one 200, the
    rest 409, and the action follows the winning decision."""
    action_id = uid("dec")
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "decide"}, action_id, action_id)
    approval_id = pending.json()["body"]["action_result"]["output"]["approval_id"]
    # Each with a reason of its own: the same decision again (same reason) is answered 200 as recorded.
    decisions = [("approved" if i % 2 else "denied", f"race {i}") for i in range(n)]
    random.shuffle(decisions)

    def decide(decision_and_reason: tuple[str, str]) -> tuple[str, int]:
        decision, reason = decision_and_reason
        with host.http("acme-approver") as approver:
            answer = approver.post(
                f"/aip/v1/approvals/{approval_id}/decision", json={"decision": decision, "reason": reason}
            )
            return decision, answer.status_code

    answers = _pool_map(decide, decisions)
    winners = [decision for decision, status in answers if status == 200]
    assert len(winners) == 1 and all(status in (200, 409) for _, status in answers), answers
    with host.http("acme-app") as app:
        final = wait_action(app, action_id)
        result = app.get(f"/aip/v1/actions/{action_id}/result").json()["body"]["action_result"]
    if winners[0] == "approved":
        assert final["state"] == "completed", result
    else:
        assert final["state"] == "failed" and result["error"]["code"] == "policy.approval_denied", result
    return {"decisions": n, "winner": winners[0]}


def cancel_race(sidecar: Sidecar, host: Host, delay_s: float) -> dict[str, Any]:
    """Approve a fast run, cancel it ``delay_s`` later (racing its completion).

    Invariant: both processes end in the same terminal state (the host action's
    status equals the sidecar job's status), whichever side won; an action
    dequeued before its start was sent (``provider_effect: none``) has no job
    at the sidecar.
    """
    action_id = uid("cxl")
    job_id = f"acme:{action_id}"
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "race"}, action_id, action_id)
        approve(host, pending)
        if delay_s > 0:
            threading.Event().wait(delay_s)  # the race offset itself, not a wait for a result
        answer = app.post(f"/aip/v1/actions/{action_id}/cancel")
        assert answer.status_code == 200, answer.text
        final = wait_action(app, action_id)
        output = app.get(f"/aip/v1/actions/{action_id}/result").json()["body"]["action_result"].get("output") or {}
    if final["state"] == "cancelled" and output.get("provider_effect") == "none":
        # Dequeued before its start was sent (lifecycle CANCEL_OUTCOMES, DEQUEUE): the sidecar never admits it.
        assert "status" not in sidecar_view(sidecar, job_id), "a dequeued action reached the sidecar"
        return {"status": "cancelled"}
    view = until(
        lambda: v if (v := sidecar_view(sidecar, job_id)).get("status") in TERMINAL else None,
        timeout=30,
        what="the sidecar job to be terminal",
    )
    assert final["state"] == view["status"], f"host {final['state']} but sidecar {view['status']}"
    return {"status": final["state"]}
