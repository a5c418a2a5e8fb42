"""Key-less ``:status`` of a final run answered from the host's cache of final job views.

Through the real code paths: :class:`ActionService` over a store on disk and the scripted
sidecar (each test counts the job-view reads that reach it), and the app over HTTP in-process.
Every read is still an action in the store, with its target check.
"""

import json

import pytest
import structlog.testing
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, action_env, bearer, open_action_service, running
from kits.hostapp import completed_run as completed_run_over_http
from kits.hostapp import post_message as post

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import Action
from aip_crewai.contracts.errors import ActionNotFound
from aip_crewai.host.auth.principals import Principal
from aip_crewai.host.http.state import host_state
from aip_crewai.host.metrics import Metrics

pytestmark = pytest.mark.timeout(60)

ALL = frozenset(ops.OPERATION_NAMES)
INVOKER = Principal("svc:acme", "acme", frozenset({"invoker"}))
COLLEAGUE = Principal("svc:acme-2", "acme", frozenset({"invoker"}))  # same tenant, not the run's submitter
APPROVER = Principal("human:acme", "acme", frozenset({"approver"}))
OTHER = Principal("svc:beta", "beta", frozenset({"invoker"}))


async def open_service(tmp_path, **kwargs):
    service, sidecar, http, _ = await open_action_service(
        tmp_path, {"acme": {"support": ALL}, "beta": {"support": ALL}}, metrics=Metrics(), **kwargs
    )
    return service, sidecar, http


@pytest.fixture
async def env(tmp_path):
    service, sidecar, http = await open_service(tmp_path)
    yield service, sidecar
    await http.aclose()
    await service.store.close()


@pytest.fixture
async def env_off(tmp_path):
    service, sidecar, http = await open_service(tmp_path, status_cache_entries=0)
    yield service, sidecar
    await http.aclose()
    await service.store.close()


def run_action(action_id, key):
    return Action(id=action_id, capability_id="cap:crewai:support", input={"ticket": "refund"}, idempotency_key=key)


def status_action(action_id, run_action_id="a1"):
    return Action(id=action_id, capability_id="cap:crewai:support:status", input={"run_action_id": run_action_id})


async def completed_run(service, action_id="a1"):
    """A governed run, approved and completed at the scripted sidecar."""
    record = await service.submit(INVOKER, run_action(action_id, "k-" + action_id), None, stream=False)
    decided = await service.decide(APPROVER, record.approval_id, "approved", "ok", service.now_ms())
    assert decided is not None
    done = await service.wait(await service.get(INVOKER, action_id), 10)
    assert done.status == "completed"
    return done


def view_reads(sidecar, run_action_id="a1", tenant="acme"):
    """The ``GET /jobs/{id}`` requests (job views) of the run that reached the sidecar."""
    return sum(1 for r in sidecar.requests if r.method == "GET" and r.url.path == f"/jobs/{tenant}:{run_action_id}")


async def read_status(service, status_id, run_action_id="a1", caller=INVOKER):
    record = await service.submit(caller, status_action(status_id, run_action_id), None, stream=False, blocking=True)
    return record, await service.result(record)


def without_action_id(result_json: str) -> dict:
    result = json.loads(result_json)
    result.pop("action_id")
    return result


def set_terminal(sidecar, event, data, run_action_id="a1", **view_extra):
    job = sidecar.jobs[f"acme:{run_action_id}"]
    job.events[-1] = {"event": event, "sequence": job.events[-1]["sequence"], "data": data}
    job.view_extra = view_extra


async def test_a_second_status_of_a_completed_run_is_answered_without_the_sidecar(env):
    service, sidecar = env
    await completed_run(service)
    before = view_reads(sidecar)
    first, first_result = await read_status(service, "s1")
    assert view_reads(sidecar) == before + 1
    second, second_result = await read_status(service, "s2")
    assert view_reads(sidecar) == before + 1  # the cached view: no sidecar hop
    # the same answer, byte for byte apart from the action id, and the same stored record shape
    assert second_result.output == first_result.output
    assert second_result.output["action_id"] == "a1" and second_result.output["status"] == "completed"
    assert without_action_id(second.result_json) == without_action_id(first.result_json)
    assert second.result_json == first.result_json.replace('"action_id":"s1"', '"action_id":"s2"', 1)
    assert (second.status, second.dispatch) == (first.status, first.dispatch) == ("completed", "acknowledged")
    # each read is still an action of the tenant's history
    for status_id in ("s1", "s2"):
        stored = await service.get(INVOKER, status_id)
        assert stored.operation == "status" and stored.status == "completed" and stored.principal_id == INVOKER.id
    text = service.metrics.render()
    assert 'aip_host_status_cache_total{result="miss"} 1' in text
    assert 'aip_host_status_cache_total{result="hit"} 1' in text
    assert (service.status_views.hits, service.status_views.misses) == (1, 1)


async def test_a_running_run_always_asks_the_sidecar_until_it_is_final(env):
    service, sidecar = env
    await completed_run(service)
    job = sidecar.jobs["acme:a1"]
    terminal = job.events.pop()  # the sidecar says the run still runs
    before = view_reads(sidecar)
    for n in range(3):
        _, result = await read_status(service, f"s{n}")
        assert result.output["status"] == "running"
    assert view_reads(sidecar) == before + 3 and len(service.status_views) == 0
    job.events.append(terminal)  # now it completed: read once more from the sidecar, then from the cache
    _, fresh = await read_status(service, "s10")
    _, cached = await read_status(service, "s11")
    assert fresh.output["status"] == cached.output["status"] == "completed"
    assert view_reads(sidecar) == before + 4


async def test_a_cancelled_run_is_cached_only_once_its_stop_is_confirmed(env):
    service, sidecar = env
    await completed_run(service)
    set_terminal(sidecar, "cancelled", {"status": "cancelled"}, provider_stop_observed=None, uncertain_outcome=True)
    before = view_reads(sidecar)
    for status_id in ("s1", "s2"):
        _, result = await read_status(service, status_id)
        assert result.output["status"] == "cancelled" and result.output["uncertain_outcome"] is True
    assert view_reads(sidecar) == before + 2  # unconfirmed: not cached
    set_terminal(sidecar, "cancelled", {"status": "cancelled"}, provider_stop_observed=True, uncertain_outcome=False)
    for status_id in ("s3", "s4", "s5"):
        _, result = await read_status(service, status_id)
        assert result.output["uncertain_outcome"] is False and result.output["provider_stop_observed"] is True
    assert view_reads(sidecar) == before + 3


async def test_a_failed_run_is_cached_but_not_a_timed_out_one_still_stopping(env):
    service, sidecar = env
    await completed_run(service)
    await completed_run(service, "a2")
    error = {"status": "failed", "error_type": "ValueError", "message": "bad", "uncertain_outcome": False}
    set_terminal(sidecar, "failed", error, error=error)
    timeout = {"status": "failed", "error_type": "ExecutionTimeout", "message": "too long", "uncertain_outcome": True}
    set_terminal(sidecar, "failed", timeout, run_action_id="a2", error=timeout)
    before, before_2 = view_reads(sidecar), view_reads(sidecar, "a2")
    for n in range(3):
        _, failed = await read_status(service, f"s{n}")
        _, stopping = await read_status(service, f"t{n}", "a2")
        assert failed.status == "completed" and failed.output["error"] == error
        assert stopping.output["error"] == timeout and "provider_stop_observed" not in stopping.output
    assert view_reads(sidecar) == before + 1
    assert view_reads(sidecar, "a2") == before_2 + 3  # its provider_stop_observed is still to come
    set_terminal(sidecar, "failed", timeout, run_action_id="a2", error=timeout, provider_stop_observed=True)
    for n in range(3, 5):
        _, stopped = await read_status(service, f"t{n}", "a2")
        assert stopped.output["provider_stop_observed"] is True
    assert view_reads(sidecar, "a2") == before_2 + 4


async def test_another_tenant_or_principal_is_not_answered_from_the_cache(env):
    service, sidecar = env
    await completed_run(service)
    await read_status(service, "s1")
    assert len(service.status_views) == 1
    # another tenant: its own key (a miss), the sidecar does not know beta:a1, the target check refuses
    with pytest.raises(ActionNotFound):
        await read_status(service, "x1", caller=OTHER)
    assert await service.store.get_action("beta", "x1") is None
    # a colleague in the same tenant hits the entry, but the target check (the caller's own run) still refuses
    hits = service.status_views.hits
    with pytest.raises(ActionNotFound):
        await read_status(service, "x2", caller=COLLEAGUE)
    assert service.status_views.hits == hits + 1 and await service.store.get_action("acme", "x2") is None
    assert service.status_views.keys() == [("acme", "support", "a1")]


async def test_the_hosts_own_view_of_an_unsent_run_and_errors_are_not_cached(env):
    """A run pending its approval is answered from the host's view (the sidecar's 404 is expected: an info line,
    no warning); a run the sidecar admitted and then lost fails the read, with a ``dispatch_failed`` warning an
    operator should chase. Neither is cached."""
    service, sidecar = env
    await service.submit(INVOKER, run_action("p1", "k-p1"), None, stream=False)  # pending its approval
    with structlog.testing.capture_logs() as logs:
        for status_id in ("s1", "s2"):
            _, result = await read_status(service, status_id, "p1")
            assert result.output["status"] == "pending_approval"
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []
    assert [e["event"] for e in logs if e["event"] == "read_unknown_to_sidecar"] == ["read_unknown_to_sidecar"] * 2
    assert view_reads(sidecar, "p1") == 2 and len(service.status_views) == 0
    await completed_run(service)
    del sidecar.jobs["acme:a1"]  # the sidecar lost it: a 404, a failed read, never cached
    with structlog.testing.capture_logs() as logs:
        for status_id in ("s3", "s4"):
            _, result = await read_status(service, status_id)
            assert result.status == "failed" and result.error.details["remote_status"] == 404
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["event"], e["code"]) for e in warned] == [
        ("dispatch_failed", "connector.crewai.configuration_or_input")
    ] * 2
    assert len(service.status_views) == 0


async def test_a_repeated_status_action_id_replays_its_stored_answer(env):
    service, sidecar = env
    await completed_run(service)
    first, _ = await read_status(service, "s1")
    again, _ = await read_status(service, "s1")  # now a cache hit, but the stored record is the answer
    assert again == first


async def test_with_the_cache_off_every_read_asks_the_sidecar(env_off):
    service, sidecar = env_off
    await completed_run(service)
    before = view_reads(sidecar)
    for n in range(3):
        record, result = await read_status(service, f"s{n}")
        assert result.output["status"] == "completed" and record.dispatch == "acknowledged"
    assert view_reads(sidecar) == before + 3
    assert not service.status_views.enabled and len(service.status_views) == 0
    assert "aip_host_status_cache_total{" not in service.metrics.render()


# --- over HTTP, in-process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("entries", [None, 0])
async def test_status_over_http_answers_the_same_bytes_cached_or_not(make_app, settings, entries):
    import dataclasses

    fake = FakeSidecar(SIDECAR_TOKEN)
    app_settings = settings if entries is None else dataclasses.replace(settings, status_cache_entries=entries)
    app = make_app(app_settings, sidecar_transport=fake.transport())
    async with running(app) as http:
        await completed_run_over_http(http)
        before = view_reads(fake, "act_run")
        answers = []
        for n in range(3):
            env = action_env(f"msg_s{n}", f"act_s{n}", "cap:crewai:beta:status", {"run_action_id": "act_run"})
            response = await post(http, "acme-invoker", env)
            assert response.status_code == 200, response.text
            answers.append(response.json()["body"]["action_result"])
        assert view_reads(fake, "act_run") == before + (1 if entries is None else 3)
        for n, answer in enumerate(answers):
            assert answer.pop("action_id") == f"act_s{n}"
        assert answers[0] == answers[1] == answers[2] and answers[0]["output"]["status"] == "completed"
        assert answers[0]["output"]["action_id"] == "act_run"
        for n in range(3):  # every read is recorded: GET the action shows it, finished, with its result
            shown = await http.get(f"/aip/v1/actions/act_s{n}", headers=bearer("acme-invoker"))
            assert shown.status_code == 200
            assert shown.json()["state"] == "completed" and shown.json()["result_status"] == "completed"
        # another tenant's status of the same run id: not found, cached or not
        foreign = action_env("msg_g", "act_g", "cap:crewai:gamma:status", {"run_action_id": "act_run"})
        assert (await post(http, "globex-invoker", foreign)).status_code in (403, 404)
        metrics = (await http.get("/metrics", headers=bearer("acme-operator"))).text
        if entries is None:
            assert 'aip_host_status_cache_total{result="hit"} 2' in metrics
        assert host_state(app).actions.status_views.enabled is (entries is None)
