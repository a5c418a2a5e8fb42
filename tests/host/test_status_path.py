"""The host's own work on a key-less blocking ``:status`` read of a run (ARCHITECTURE.md §9, a key-less read
answered inline), over HTTP in-process with the final-view cache off: one write recording the read with its
target check, one sidecar request, the bearer checked once; what is answered and recorded, and every refusal.
"""

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
    running,
    sign,
)
from kits.hostapp import post_message as post

from aip_crewai.host.http.state import host_setup, host_state

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
    assert calls == ["_write_now"], calls  # a one-sidecar host reads no placement before the hop
    assert view_reads(fake) == before + 1
    monkeypatch.undo()
    shown = await http.get("/aip/v1/actions/act_s1", headers=bearer("acme-invoker"))  # the read is recorded
    assert shown.status_code == 200 and shown.json()["state"] == "completed"
    assert shown.json()["result"] == result


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
    # the refused write, its target check inside it (a sidecar's 404 first reads what the host knows of the run)
    assert calls[-1] == "_write_now" and calls.count("_write_now") == 1
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
