"""A cancel on one host racing an approval on another, both on one PostgreSQL store, is honoured in every
interleaving (ARCHITECTURE.md §8): either the action is cancelled before any start is
sent (the dispatch then sends nothing), or the start is sent and the cancel reaches the job once the sidecar
admitted it (a 404 while the start is in flight is retried, also when the start is answered while that 404
is on its way back) and stops it. Each interleaving is forced with asyncio events, not timing: 5 interleavings x
11 rounds. Per round: one outcome, `cancelled` as the tenant
was told and as stored, nothing executed or the job cancelled at the sidecar, every chunk of the job stored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest
from kits.poll import until_async

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.host.actions.dispatch import Dispatcher
from aip_crewai.host.actions.service import ActionService
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.sidecars.client import SidecarClient
from aip_crewai.host.sidecars.connection import SidecarHttp
from aip_crewai.host.store.store import Store
from aip_crewai.sse import encode_event

pytestmark = pytest.mark.timeout(600)

INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
TENANTS = {"acme": {"support": frozenset(ops.OPERATION_NAMES)}}
MODES = ("cancel_first", "before_mark_sent", "start_in_flight", "answered_after_404", "after_admission")
ROUNDS = 11


class GatedSidecar:
    """A sidecar whose jobs run until cancelled: ``POST /jobs/stream`` waits for ``admit_gate`` (a start in
    flight), admits, streams ``started`` and two chunks, then ``cancelled`` once a cancel reached the job."""

    def __init__(self) -> None:
        self.admit_gate: asyncio.Event | None = None
        self.in_flight = asyncio.Event()  # a start reached the gate
        self.admitted: dict[str, asyncio.Event] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.cancels: list[tuple[str, int]] = []
        self.executions: list[str] = []
        #: Awaited before a cancel's 404 is answered (None: answered at once).
        self.on_cancel_404: Callable[[], Awaitable[None]] | None = None
        #: Whether a live stream journals the `cancelled` end as it sends it (else the cancel journals it).
        self.follows_stop = True

    def _view(self, job_id: str) -> dict[str, Any]:
        status = "cancelled" if self.stops[job_id].is_set() else "running"
        return {
            "action_id": job_id,
            "crew_id": "support",
            "operation": "run",
            "status": status,
            "event_count": len(self.events[job_id]),
            "output": None,
        }

    async def _stream(self, job_id: str):
        events = self.events[job_id]
        sent = len(events)
        for event in events[:sent]:
            yield encode_event(json.dumps(event), event=event["event"], id=str(event["sequence"]))
        await self.stops[job_id].wait()
        if self.follows_stop:
            events.append({"event": "cancelled", "sequence": len(events), "data": {"status": "cancelled"}})
        for event in events[sent:]:
            yield encode_event(json.dumps(event), event=event["event"], id=str(event["sequence"]))

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path == "/jobs/stream":
            body = json.loads(request.content)
            job_id = body["action_id"]
            if self.admit_gate is not None:
                self.in_flight.set()
                await self.admit_gate.wait()
            if job_id not in self.events:
                self.executions.append(job_id)
                self.stops[job_id] = asyncio.Event()
                self.events[job_id] = [
                    {"event": "started", "sequence": 0, "data": {"status": "running", "operation": "run"}},
                    {"event": "chunk", "sequence": 1, "data": {"content": "a", "channel": "llm"}},
                    {"event": "chunk", "sequence": 2, "data": {"content": "b", "channel": "llm"}},
                ]
            self.admitted.setdefault(job_id, asyncio.Event()).set()
            return httpx2.Response(200, content=self._stream(job_id), headers={"content-type": "text/event-stream"})
        parts = path.split("/")
        job_id = parts[2] if len(parts) > 2 else ""
        if job_id not in self.events:
            if path.endswith("/cancel"):
                self.cancels.append((job_id, 404))
                if self.on_cancel_404 is not None:
                    await self.on_cancel_404()
            return httpx2.Response(404, json={"detail": "unknown job"})
        if path.endswith("/cancel"):
            self.cancels.append((job_id, 200))
            self.stops[job_id].set()
            if not self.follows_stop:  # nobody reads the stream: the sidecar journals the end itself
                self.events[job_id].append(
                    {"event": "cancelled", "sequence": len(self.events[job_id]), "data": {"status": "cancelled"}}
                )
        if path.endswith("/events"):  # the journal read back (the terminal event's page, or the whole stream)
            events = self.events[job_id][int(request.url.params.get("cursor", "0")) :]
            if "text/event-stream" in request.headers.get("accept", ""):
                frames = [encode_event(json.dumps(e), event=e["event"], id=str(e["sequence"])) for e in events]
                return httpx2.Response(200, content=b"".join(frames), headers={"content-type": "text/event-stream"})
            return httpx2.Response(200, json={"action_id": job_id, "events": events})
        return httpx2.Response(200, json=self._view(job_id))


async def _host(url: str, owner: str, sidecar: GatedSidecar) -> tuple[ActionService, SidecarHttp]:
    store = await Store.open(url, owner=owner, lease_ms=30_000)
    http = SidecarHttp.of(
        "http://127.0.0.1:8090", token="sidecar-token", transport=httpx2.MockTransport(sidecar.handle)
    )
    client = SidecarClient(http, max_response_bytes=1 << 20)
    return ActionService(store, Dispatcher(client, max_response_bytes=1 << 20), TENANTS), http


async def _until(condition, what: str, bound_s: float = 60.0) -> None:
    """:func:`kits.poll.until_async` at this test's pace (a loaded machine stretches a round's 10 s bounds)."""
    await until_async(condition, timeout=bound_s, interval=0.01, what=what)


async def _round(a: ActionService, c: ActionService, sidecar: GatedSidecar, mode: str, n: int) -> None:
    action_id = f"act_{mode}_{n}"
    job_id = f"acme:{action_id}"
    act = Action(
        id=action_id, capability_id="cap:crewai:support", input={"ticket": str(n)}, idempotency_key=f"k-{action_id}"
    )
    record = await a.submit(INVOKER, act, None, stream=False)
    assert record.approval_id is not None
    sidecar.admit_gate = None
    held = asyncio.Event()
    release = asyncio.Event()
    take_lease = c.store.take_lease
    if mode == "before_mark_sent":  # host C's dispatch is held after the approval, before its start is claimed

        async def gated(tenant: str, aid: str) -> bool:
            held.set()
            await release.wait()
            return await take_lease(tenant, aid)

        c.store.take_lease = gated  # type: ignore[method-assign,assignment]
    if mode in ("start_in_flight", "answered_after_404"):  # the start reaches the sidecar only after a cancel's 404
        sidecar.admit_gate, sidecar.in_flight = asyncio.Event(), asyncio.Event()
    if mode == "answered_after_404":  # ... and host C stores the start's answer before that 404 reaches host A

        async def answered() -> None:
            sidecar.on_cancel_404 = None
            sidecar.admit_gate.set()  # type: ignore[union-attr]
            await _until(_dispatch_is(c.store, action_id, "acknowledged"), "host C's start answered")

        sidecar.on_cancel_404 = answered
    try:
        if mode == "cancel_first":
            told = await a.cancel(INVOKER, action_id)
            assert await c.decide(APPROVER, record.approval_id, "approved", "ok", c.now_ms()) is None
        else:
            assert await c.decide(APPROVER, record.approval_id, "approved", "ok", c.now_ms()) is not None
            if mode == "before_mark_sent":
                await held.wait()
                told = await a.cancel(INVOKER, action_id)
                release.set()
            elif mode == "start_in_flight":
                await sidecar.in_flight.wait()  # host C sent the start; the sidecar has not admitted it
                cancelling = asyncio.create_task(a.cancel(INVOKER, action_id))
                await _until(_async(lambda: (job_id, 404) in sidecar.cancels), "a cancel overtook the start")
                sidecar.admit_gate.set()  # type: ignore[union-attr]
                told = await cancelling
            elif mode == "answered_after_404":
                await sidecar.in_flight.wait()  # host C sent the start; the sidecar has not admitted it
                told = await a.cancel(INVOKER, action_id)
            else:
                admitted = sidecar.admitted.setdefault(job_id, asyncio.Event())
                await admitted.wait()
                await _until(_chunks_at_least(c.store, action_id, 1), "a chunk stored")
                told = await a.cancel(INVOKER, action_id)
        # Every dispatch of the round has ended (nothing more can be sent or stored).
        await _until(_async(lambda: c.live.get("acme", action_id) is None), "host C's dispatch ended")
    finally:
        c.store.take_lease = take_lease  # type: ignore[method-assign]
        sidecar.on_cancel_404 = None
        release.set()
        if sidecar.admit_gate is not None:
            sidecar.admit_gate.set()
    stored = await a.store.get_action("acme", action_id)
    assert stored is not None
    assert told.status == stored.status == "cancelled", (mode, n, told, stored.status)  # one outcome, never failed
    executed = job_id in sidecar.executions
    if mode in ("cancel_first", "before_mark_sent"):
        assert not executed, (mode, n)
    else:  # the start won: the job ran and was stopped at the sidecar, every chunk it streamed stored
        assert executed and sidecar.stops[job_id].is_set(), (mode, n)
        chunks = await a.store.list_chunks("acme", action_id)
        assert [c.sequence for c in chunks] == [e["sequence"] for e in sidecar.events[job_id]], (mode, n)
    assert sidecar.executions.count(job_id) <= 1


def _async(predicate):
    async def check() -> bool:
        return bool(predicate())

    return check


def _dispatch_is(store: Store, action_id: str, dispatch: str):
    async def check() -> bool:
        record = await store.get_action("acme", action_id)
        return record is not None and record.dispatch == dispatch

    return check


def _chunks_at_least(store: Store, action_id: str, count: int):
    async def check() -> bool:
        return len(await store.list_chunks("acme", action_id)) >= count

    return check


async def test_a_cancel_racing_an_approval_on_another_host_is_honoured_in_every_interleaving(
    postgres_url: str,
) -> None:
    sidecar = GatedSidecar()
    a, http_a = await _host(postgres_url, "host-a", sidecar)
    c, http_c = await _host(postgres_url, "host-c", sidecar)
    try:
        for n in range(ROUNDS):
            for mode in MODES:
                await _round(a, c, sidecar, mode, n)
        assert len(sidecar.executions) == 3 * ROUNDS  # the start won exactly in the three interleavings after it
    finally:
        for http, service in ((http_a, a), (http_c, c)):
            await http.aclose()
            await service.store.close()


async def test_a_cancel_while_the_lease_holder_is_frozen_stores_the_whole_stream_ending_with_done(
    postgres_url: str,
) -> None:
    """Host C dispatches and stores the first chunk, then freezes (its chunk writes hang; its lease expires,
    unrenewed); the tenant cancels on host A. Host A stores the `cancelled` end, and with it every chunk of the
    job's journal that C never stored, the `done` chunk included: a `cancelled` result is final, so the stream
    used to stay short for good. C, resumed, writes nothing more."""
    sidecar = GatedSidecar()
    sidecar.follows_stop = False  # the stream of the frozen host is not read any more
    a, http_a = await _host(postgres_url, "host-a", sidecar)
    c, http_c = await _host(postgres_url, "host-c", sidecar)
    c.store.lease_ms = 300  # expires soon: nothing renews it here (a frozen host renews nothing)
    frozen, thaw = asyncio.Event(), asyncio.Event()
    append = c.store.append_chunks

    async def freezing(tenant: str, action_id: str, chunks: Any, **kwargs: Any) -> Any:
        stored = await append(tenant, action_id, chunks[:1], **kwargs)  # the first chunk; then nothing
        frozen.set()
        await thaw.wait()
        return stored + await append(tenant, action_id, chunks[1:], **kwargs)

    c.store.append_chunks = freezing  # type: ignore[method-assign]
    try:
        act = Action(id="act_frozen", capability_id="cap:crewai:support", input={"t": "x"}, idempotency_key="k-fz")
        record = await a.submit(INVOKER, act, None, stream=False)
        assert await c.decide(APPROVER, record.approval_id or "", "approved", "ok", c.now_ms()) is not None
        await asyncio.wait_for(frozen.wait(), 60)
        await _until(_lease_expired(a.store, "act_frozen"), "host C's lease to expire")
        told = await a.cancel(INVOKER, "act_frozen")
        thaw.set()
        await _until(_async(lambda: c.live.get("acme", "act_frozen") is None), "host C's dispatch ended")
        chunks = await a.store.list_chunks("acme", "act_frozen")
        assert told.status == "cancelled" and (await a.store.get_action("acme", "act_frozen")).status == "cancelled"  # type: ignore[union-attr]
        assert [x.sequence for x in chunks] == [e["sequence"] for e in sidecar.events["acme:act_frozen"]]
        assert json.loads(chunks[-1].chunk_json)["kind"] == "done", chunks[-1]
    finally:
        thaw.set()
        for http, service in ((http_a, a), (http_c, c)):
            await http.aclose()
            await service.store.close()


def _lease_expired(store: Store, action_id: str):
    async def check() -> bool:
        record = await store.get_action("acme", action_id)
        return record is not None and not store.lease_is_foreign(record)

    return check
