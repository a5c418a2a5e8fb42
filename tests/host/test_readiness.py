"""Readiness follows the sidecar's /health (ARCHITECTURE.md §7), on demand and by polling."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx2
import pytest
from kits.hostapp import running
from kits.poll import until_async

from aip_crewai.host.crews.descriptors import load_descriptors
from aip_crewai.host.http.state import host_setup, host_state
from aip_crewai.host.sidecars.readiness import evaluate_health

CREWS = load_descriptors(b'[{"id": "a", "name": "A"}, {"id": "b", "name": "B", "allowed_operations": ["train"]}]')
GOOD = {
    "status": "ready",
    "crews": ["a", "b", "extra"],
    "durable_journal": True,
    "operations": ["cancel", "events", "run", "status", "train"],
}


def test_agreeing_health_is_ready():
    assert evaluate_health(GOOD, CREWS) is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"status": "starting"}, "'starting'"),
        ({"durable_journal": False}, "not durable"),
        ({"durable_journal": None}, "not durable"),
        ({"crews": ["a"]}, "lacks configured crews: b"),
        ({"operations": ["run", "status", "events", "cancel"]}, "lacks allowed operations: train"),
        ({"crews": None}, "lacks the crews"),
    ],
)
def test_each_disagreement_is_a_reason(change, words):
    reason = evaluate_health({**GOOD, **change}, CREWS)
    assert reason is not None and words in reason


def test_non_object_health():
    assert "not a JSON object" in evaluate_health(["ready"], CREWS)


def test_long_lists_are_truncated():
    many = load_descriptors(("[" + ",".join(f'{{"id": "c{i:02}", "name": "C"}}' for i in range(30)) + "]").encode())
    reason = evaluate_health({**GOOD, "crews": []}, many)
    assert reason.endswith("(+20 more)")


async def test_ready_flips_with_the_sidecar_on_demand(make_app, sidecar):
    sidecar.health["status"] = "starting"
    async with running(make_app()) as client:
        response = await client.get("/ready")
        assert response.status_code == 503
        assert response.json() == {"status": "unready", "reason": "sidecar status is 'starting', not 'ready'"}
        sidecar.health["status"] = "ready"
        assert (await client.get("/ready")).json() == {"status": "ready"}  # re-checked on demand while unready
        assert (await client.get("/health")).json() == {"status": "alive"}


async def test_background_poll_notices_a_regression(make_app, settings, sidecar):
    app = make_app(dataclasses.replace(settings, readiness_interval_s=0.01))
    async with running(app) as client:
        await until_async(lambda: host_state(app).readiness.ready, interval=0.005)
        assert (await client.get("/ready")).status_code == 200
        sidecar.health["crews"] = ["alpha"]
        await until_async(lambda: not host_state(app).readiness.ready, interval=0.005)
        response = await client.get("/ready")
        assert response.status_code == 503 and response.json() == {
            "status": "unready",
            "reason": "sidecar lacks configured crews",
        }
        assert "beta" not in response.text and "gamma" not in response.text  # anonymous: no tenant data
        assert host_setup(app).metrics.ready.value() == 0


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda s: setattr(s, "health_status", 401), "HTTP 401"),
        (lambda s: setattr(s, "health", httpx2.ConnectError("refused")), "unreachable (ConnectError)"),
        (lambda s: setattr(s, "health", "not an object"), "not a JSON object"),
    ],
)
async def test_sidecar_failures_keep_the_host_unready(make_app, sidecar, setup, words):
    setup(sidecar)
    async with running(make_app()) as client:
        response = await client.get("/ready")
        assert response.status_code == 503 and words in response.json()["reason"]


async def test_health_requests_carry_the_sidecar_bearer(make_app, sidecar):
    async with running(make_app()) as client:
        await client.get("/ready")
    request = sidecar.requests[-1]
    assert request.headers["authorization"] == "Bearer sidecar-secret-token"
    assert str(request.url) == "http://127.0.0.1:8090/health"


async def test_readiness_metrics(make_app):
    app = make_app()
    async with running(app) as client:
        await client.get("/ready")
        await until_async(lambda: host_setup(app).metrics.ready.value() == 1, interval=0.005)
        assert host_setup(app).metrics.readiness_checks.value(result="ready") >= 1


async def test_concurrent_refreshes_share_one_request(make_app, sidecar):
    app = make_app()
    async with running(app):
        await until_async(lambda: host_state(app).readiness.state.checked_at is not None, interval=0.005)
        before = len(sidecar.requests)
        await asyncio.gather(*[host_state(app).readiness.refresh() for _ in range(10)])
        assert len(sidecar.requests) - before == 1


async def test_each_sidecar_has_its_own_ready_gauge_and_the_host_gauge_is_the_groups():
    """Issue 21 item 3: with several sidecars, ``sidecar_ready{sidecar=...}`` per sidecar, and
    ``ready`` 1 while any sidecar is (no sidecar's check overwrites another's)."""
    from aip_crewai.host.metrics import Metrics
    from aip_crewai.host.sidecars.readiness import Readiness, ReadinessGroup

    up = {"one": True, "two": True}

    def sidecar(name: str, crews: list[str]) -> httpx2.AsyncClient:
        def answer(request: httpx2.Request) -> httpx2.Response:
            if not up[name]:
                return httpx2.Response(503, json={"status": "starting"})
            return httpx2.Response(200, json={**GOOD, "crews": crews})

        return httpx2.AsyncClient(base_url=f"http://{name}.invalid", transport=httpx2.MockTransport(answer))

    metrics = Metrics()
    a, b = ([crew for crew in CREWS if crew.id == crew_id] for crew_id in ("a", "b"))
    group = ReadinessGroup(
        [
            ("one", Readiness(sidecar("one", ["a"]), a, metrics, name="one")),
            ("two", Readiness(sidecar("two", ["b"]), b, metrics, name="two")),
        ]
    )
    await group.refresh()
    assert (
        metrics.ready.value(),
        metrics.sidecar_ready.value(sidecar="one"),
        metrics.sidecar_ready.value(sidecar="two"),
    ) == (1, 1, 1)
    up["two"] = False
    await group.refresh()
    assert (
        metrics.ready.value(),
        metrics.sidecar_ready.value(sidecar="one"),
        metrics.sidecar_ready.value(sidecar="two"),
    ) == (1, 1, 0)
    assert 'aip_host_sidecar_ready{sidecar="two"} 0' in metrics.render()
    up["one"] = False
    await group.refresh()
    assert (metrics.ready.value(), metrics.sidecar_ready.value(sidecar="one")) == (0, 0)


async def test_the_host_is_unready_while_its_store_is_unavailable(make_app, monkeypatch):
    """/ready asks the store whether it can take a write (Store.writable): 503 while it cannot, 200 again
    by itself once it can (the PostgreSQL faults themselves: tests/host/test_store_faults.py)."""
    from aip_crewai.host.store import store as store_module

    monkeypatch.setattr(store_module, "PROBE_FRESH_S", 0.0)
    app = make_app()
    async with running(app) as client:
        await until_async(lambda: host_state(app).readiness.ready, interval=0.005)
        store = host_state(app).store
        writable = {"now": False}

        async def probe() -> bool:
            return writable["now"]

        monkeypatch.setattr(store, "probe", probe)
        answer = await client.get("/ready")
        assert answer.status_code == 503 and answer.json() == {
            "status": "unready",
            "reason": "the host store is unavailable",
        }
        writable["now"] = True
        await until_async(lambda: store._probe is not None and store._probe.done(), interval=0.005)
        assert (await client.get("/ready")).status_code == 200


async def test_health_probes_do_not_share_the_connection_pool_of_the_jobs(make_app):
    """Under load every pooled connection of the jobs' client may hold a run's stream: a probe waiting
    behind them would call a healthy sidecar unreachable (a load balancer would drop the host), so the
    probes use a client (and so a connection pool) of their own."""
    app = make_app()
    async with running(app):
        state = host_state(app)
        probe_clients = {id(member.http) for _, member in state.readiness.members}
        assert probe_clients.isdisjoint({id(client) for client in state.sidecar_http.values()})


async def test_ready_answers_promptly_while_an_unready_sidecars_health_check_hangs(make_app, sidecar):
    """A frozen sidecar (SIGSTOP) never answers ``/health``: ``/ready`` of an unready host re-checks it but
    waits at most READY_WAIT_S, then answers 503 with the last verdict (not after HEALTH_TIMEOUT_S, past a
    load balancer's probe timeout); the check goes on and its verdict is the next answer's."""
    from aip_crewai.host.sidecars.readiness import HEALTH_TIMEOUT_S

    thawed = asyncio.Event()
    frozen = {"now": False}

    async def answer(request: httpx2.Request) -> httpx2.Response:
        if frozen["now"]:
            await thawed.wait()
        return sidecar.handle(request)

    sidecar.health["status"] = "starting"
    app = make_app(sidecar_transport=httpx2.MockTransport(answer))
    async with running(app) as client:
        readiness = host_state(app).readiness
        await until_async(lambda: readiness.state.checked_at is not None, interval=0.005)
        frozen["now"] = True
        response = await asyncio.wait_for(client.get("/ready"), HEALTH_TIMEOUT_S)
        assert response.status_code == 503
        assert response.json() == {"status": "unready", "reason": "sidecar status is 'starting', not 'ready'"}
        assert not thawed.is_set()  # answered while the check still waits for the sidecar
        sidecar.health["status"] = "ready"
        thawed.set()
        await until_async(lambda: readiness.ready, interval=0.005)
        assert (await client.get("/ready")).json() == {"status": "ready"}
