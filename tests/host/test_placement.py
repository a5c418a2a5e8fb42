"""Placement of new jobs over the sidecars serving a crew (docs/operating.md "Several sidecars"): the pure choice
(:func:`pick`), then in-process with two scripted sidecars: placement by load and readiness, the placement
recorded before the start is sent, follow-ups routed by placement, a refused start re-placed at once, and a
replay tried on the next sidecar while its task run is not found."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import Clock
from kits.poll import until_async

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.host.actions.dispatch import Dispatcher
from aip_crewai.host.actions.service import ActionService
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.sidecars.client import SidecarClient
from aip_crewai.host.sidecars.connection import SidecarHttp
from aip_crewai.host.sidecars.placement import Placement, pick
from aip_crewai.host.store.store import Store

ALL = frozenset(ops.OPERATION_NAMES)
INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
NAMES = ("a", "b")


# --- the pure choice -----------------------------------------------------------------------------------


def test_pick_prefers_ready_then_least_loaded_then_configuration_order() -> None:
    assert pick(["a", "b", "c"], ready={"a", "b", "c"}, inflight={}) == "a"
    assert pick(["a", "b", "c"], ready={"a", "b", "c"}, inflight={"a": 2, "b": 1, "c": 1}) == "b"
    assert pick(["a", "b"], ready={"b"}, inflight={"b": 9}) == "b"  # an unready one gets no new job
    assert pick(["a", "b"], ready={"a", "b"}, inflight={}, exclude={"a"}) == "b"
    assert pick(["a", "b"], ready={"a", "b"}, inflight={}, exclude={"a", "b"}) is None


def test_pick_without_a_ready_sidecar_places_as_if_all_were_ready_unless_ready_only() -> None:
    assert pick(["a", "b"], ready=set(), inflight={"a": 1}) == "b"
    assert pick(["a", "b"], ready=set(), inflight={}, ready_only=True) is None
    assert pick(["a", "b"], ready={"a"}, inflight={}, exclude={"a"}, ready_only=True) is None


@given(
    st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True),
    st.sets(st.sampled_from("abcdef")),
    st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 5)),
    st.sets(st.sampled_from("abcdef")),
)
def test_pick_is_a_least_loaded_candidate_of_the_best_readiness_class(
    candidates: list[str], ready: set[str], inflight: dict[str, int], exclude: set[str]
) -> None:
    chosen = pick(candidates, ready=ready, inflight=inflight, exclude=exclude)
    allowed = [name for name in candidates if name not in exclude]
    if not allowed:
        assert chosen is None
        return
    usable = [name for name in allowed if name in ready] or allowed
    assert chosen in usable
    least = min(inflight.get(name, 0) for name in usable)
    assert inflight.get(chosen, 0) == least
    assert chosen == next(name for name in usable if inflight.get(name, 0) == least)  # ties: configuration order


def test_placement_routes_crews_and_counts_placements_in_progress() -> None:
    placement = Placement([("a", frozenset({"x"})), ("b", None)])
    assert placement.candidates("x") == ("a", "b") and placement.candidates("y") == ("b",)
    assert placement.home("x") == "a" and placement.home("y") == "b"
    with placement.placing("x") as first, placement.placing("x") as second:
        assert (first, second) == ("a", "b")  # the first choice counts as in flight while it is written
    assert placement.place("x") == "a"
    with pytest.raises(ValueError):
        Placement([])


# --- in-process, two scripted sidecars -----------------------------------------------------------------


@dataclass
class Scripted:
    """A :class:`FakeSidecar` whose start requests may be held (``gate``) or refused (``refuse``: a status
    and error code answered before admission); ``placements`` records the action's stored placement at
    the moment each start arrived."""

    fake: FakeSidecar = field(default_factory=FakeSidecar)
    gate: asyncio.Event | None = None
    refuse: tuple[int, str] | None = None
    refuse_operation: str | None = None
    placements: list[str | None] = field(default_factory=list)
    starts: int = 0
    seen: Callable[[str], Any] | None = None

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "POST" and request.url.path in ("/jobs", "/jobs/stream"):
            body = json.loads(request.content)
            self.starts += 1
            if self.seen is not None:
                self.placements.append(await self.seen(body["action_id"]))
            if self.refuse is not None and self.refuse_operation in (None, body.get("operation")):
                status, code = self.refuse
                return httpx2.Response(status, json={"code": code, "detail": "refused before admission"})
            if self.gate is not None:
                await self.gate.wait()
        return self.fake.handle(request)


@dataclass
class Env:
    service: ActionService
    sidecars: dict[str, Scripted]
    ready: set[str]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    tmp_path.chmod(0o700)
    clock = Clock()
    store = await Store.open(tmp_path / "host.db", clock=lambda: clock.ms / 1000)
    sidecars = {name: Scripted() for name in NAMES}
    ready = set(NAMES)
    https = {
        name: SidecarHttp.of(
            f"http://127.0.0.1:{8090 + index}", token="sidecar-token", transport=httpx2.MockTransport(scripted.handle)
        )
        for index, (name, scripted) in enumerate(sidecars.items())
    }
    clients = {name: SidecarClient(http, max_response_bytes=1 << 20) for name, http in https.items()}

    async def locate(tenant: str, action_id: str) -> str | None:
        record = await store.get_action(tenant, action_id)
        return record.sidecar if record is not None else None

    async def placement_of(job_id: str) -> str | None:
        tenant, action_id = job_id.split(":", 1)
        return await locate(tenant, action_id)

    for scripted in sidecars.values():
        scripted.seen = placement_of
    placement = Placement([(name, None) for name in NAMES], ready=lambda name: name in ready)
    dispatcher = Dispatcher(
        clients["a"], max_response_bytes=1 << 20, clients=clients, placement=placement, locate=locate
    )
    service = ActionService(store, dispatcher, {"acme": {"support": ALL}}, now_ms=clock)
    yield Env(service, sidecars, ready)
    for http in https.values():
        await http.aclose()
    await store.close()


def query(action_id: str) -> Action:
    """A ``knowledge_query``: startable, needs no approval (placed when the action is created)."""
    return Action(
        id=action_id,
        capability_id="cap:crewai:support:knowledge_query",
        input={"query": ["q"]},
        idempotency_key=f"k-{action_id}",
    )


async def finished(service: ActionService, action_id: str) -> Any:
    return await until_async(lambda: _final(service, action_id), what=f"{action_id} finished")


async def _final(service: ActionService, action_id: str) -> Any:
    record = await service.store.get_action("acme", action_id)
    return record if record is not None and record.status in ("completed", "failed", "cancelled") else None


async def test_new_jobs_go_to_the_ready_sidecar_running_fewest_jobs_of_this_host(env: Env) -> None:
    a, b = env.sidecars["a"], env.sidecars["b"]
    a.gate = asyncio.Event()  # the first job stays in flight on a
    await env.service.submit(INVOKER, query("q1"), None, stream=False)
    await until_async(lambda: a.starts == 1, what="q1 sent to a")
    await env.service.submit(INVOKER, query("q2"), None, stream=False)
    second = await finished(env.service, "q2")
    assert second.status == "completed" and second.sidecar == "b" and b.fake.executions == 1
    a.gate.set()
    first = await finished(env.service, "q1")
    assert first.status == "completed" and first.sidecar == "a" and a.fake.executions == 1
    assert (a.placements, b.placements) == (["a"], ["b"])  # recorded before each start was sent
    await env.service.submit(INVOKER, query("q3"), None, stream=False)  # nothing in flight: configuration order
    assert (await finished(env.service, "q3")).sidecar == "a"


async def test_an_unready_sidecar_gets_no_new_jobs(env: Env) -> None:
    env.ready.discard("a")
    for n in range(3):
        await env.service.submit(INVOKER, query(f"q{n}"), None, stream=False)
        assert (await finished(env.service, f"q{n}")).sidecar == "b"
    assert env.sidecars["a"].starts == 0 and env.sidecars["b"].fake.executions == 3


@pytest.mark.parametrize(("status", "code"), [(503, "sidecar.draining"), (507, "sidecar.journal_full")])
async def test_a_start_refused_before_admission_is_placed_on_another_sidecar_at_once(
    env: Env, status: int, code: str
) -> None:
    a, b = env.sidecars["a"], env.sidecars["b"]
    a.refuse = (status, code)  # a drains, and its /health has not said so yet: still "ready"
    record = await env.service.submit(INVOKER, query("q1"), None, stream=False)
    done = await finished(env.service, "q1")
    assert record.sidecar == "a" and done.status == "completed" and done.sidecar == "b"
    assert a.starts == 1 and a.fake.executions == 0 and b.fake.executions == 1
    assert b.placements == ["b"]  # the new placement was recorded before the start went to b


async def test_a_governed_run_is_placed_when_approved_and_followed_where_it_runs(env: Env) -> None:
    a, b = env.sidecars["a"], env.sidecars["b"]
    env.ready.discard("a")
    run = Action(id="r1", capability_id="cap:crewai:support", input={"ticket": "t"}, idempotency_key="k-r1")
    pending = await env.service.submit(INVOKER, run, None, stream=False)
    assert pending.status == "pending_approval" and pending.sidecar is None
    await env.service.decide(APPROVER, pending.approval_id or "", "approved", "ok", env.service.now_ms())
    done = await finished(env.service, "r1")
    assert done.status == "completed" and done.sidecar == "b" and b.placements == ["b"]
    env.ready.add("a")  # a is ready again: follow-ups still go where the run is
    before = len(a.fake.requests)
    status = Action(id="s1", capability_id="cap:crewai:support:status", input={"run_action_id": "r1"})
    answered = await env.service.submit(INVOKER, status, None, stream=False, blocking=True)
    result = await env.service.result(answered)
    assert result is not None and result.status == "completed" and result.output["status"] == "completed"
    events = Action(id="e1", capability_id="cap:crewai:support:events", input={"run_action_id": "r1"})
    page = await env.service.result(await env.service.submit(INVOKER, events, None, stream=False, blocking=True))
    assert page is not None and [e["event"] for e in page.output["events"]][-1] == "completed"
    terminal = await env.service.dispatcher.terminal_event(env.service.job(done, stream=False))
    assert terminal is not None and terminal.event == "completed"
    assert len(a.fake.requests) == before  # nothing about r1 went to a


async def test_the_cancel_capability_and_runtime_cancel_go_to_the_sidecar_holding_the_run(env: Env) -> None:
    a, b = env.sidecars["a"], env.sidecars["b"]
    env.ready.discard("a")
    record = await env.service.submit(INVOKER, query("q1"), None, stream=False)
    await finished(env.service, "q1")
    env.ready.add("a")
    job = env.service.job(await env.service.record("acme", "q1"), stream=True)
    confirmed, _ = await env.service.dispatcher.cancel_remote(job)
    assert confirmed and record.sidecar == "b"
    cancels = [r for r in b.fake.requests if r.url.path.endswith("/cancel")]
    assert len(cancels) == 1 and not [r for r in a.fake.requests if r.url.path.endswith("/cancel")]


async def test_a_replay_is_tried_on_the_next_sidecar_while_its_task_run_is_not_found(env: Env) -> None:
    a, b = env.sidecars["a"], env.sidecars["b"]
    a.refuse, a.refuse_operation = (422, "sidecar.task_run_not_found"), "replay"
    replay = Action(id="p1", capability_id="cap:crewai:support:replay", input={"task_id": "t-1"}, idempotency_key="k")
    pending = await env.service.submit(INVOKER, replay, None, stream=False)
    await env.service.decide(APPROVER, pending.approval_id or "", "approved", "ok", env.service.now_ms())
    done = await finished(env.service, "p1")
    assert done.status == "completed" and done.sidecar == "b" and b.fake.executions == 1
    assert a.starts == 1 and b.placements == ["b"]


async def test_a_replay_no_sidecar_holds_fails_with_the_sidecars_answer(env: Env) -> None:
    for scripted in env.sidecars.values():
        scripted.refuse, scripted.refuse_operation = (422, "sidecar.task_run_not_found"), "replay"
    replay = Action(id="p1", capability_id="cap:crewai:support:replay", input={"task_id": "t-1"}, idempotency_key="k")
    pending = await env.service.submit(INVOKER, replay, None, stream=False)
    await env.service.decide(APPROVER, pending.approval_id or "", "approved", "ok", env.service.now_ms())
    done = await finished(env.service, "p1")
    result = await env.service.result(done)
    assert done.status == "failed" and result is not None and result.error is not None
    assert (result.error.details or {}).get("remote_code") == "sidecar.task_run_not_found"
    assert [s.starts for s in env.sidecars.values()] == [1, 1]
