"""Two tenants routed to one crew share no crew state (issue 15: items 1, 2, 3).

Through the real sidecar (job ids ``<tenant>:<action id>``, as the host sends
them) and, for memory and replay, through the real host with tenants acme
and beta both routed to the same crews. Crews: ``examples.maintenance_crews``
(``memory_a`` remembers every run; its offline agent calls the memory tool
first and quotes it: "No relevant memories found." or "Found memories").
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from aip_crewai.client import new_id
from host_process import start_host
from sidecar_process import launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

OPS = "run,replay,train,knowledge_query,memory_reset"
REGISTRY = "examples.maintenance_crews:CREWS"
NO_MEMORY = "No relevant memories found."
MEMORY = "Found memories"


@pytest.fixture
def sidecar(sidecar_factory, tmp_path):
    training = tmp_path / "training"
    training.mkdir(mode=0o700)
    process = sidecar_factory.start(args=["--registry", REGISTRY, "--allowed-operations", OPS,
                                          "--training-dir", str(training)])
    process.training_dir = training
    return process


def post(sidecar, job_id, crew, operation, input):
    body = {"crew_id": crew, "action_id": job_id, "operation": operation, "input": input}
    return httpx.post(f"{sidecar.base_url}/jobs", json=body, timeout=240,
                      headers={**sidecar.headers, "Idempotency-Key": f"key-{job_id}"})


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def test_memory_of_one_tenant_is_neither_recalled_nor_reset_by_another(sidecar):
    assert NO_MEMORY in ok(post(sidecar, "acme:m1", "memory_a", "run", {"topic": "tides"}))["raw"]
    assert MEMORY in ok(post(sidecar, "acme:m2", "memory_a", "run", {"topic": "tides"}))["raw"]
    # beta, same crew: nothing of acme's is recalled
    assert NO_MEMORY in ok(post(sidecar, "beta:m1", "memory_a", "run", {"topic": "tides"}))["raw"]
    assert ok(post(sidecar, "beta:r1", "memory_a", "memory_reset", {"command_type": "memory"}))[
        "reset_targets"] == ["memory"]
    # beta's reset left acme's memories alone
    assert MEMORY in ok(post(sidecar, "acme:m3", "memory_a", "run", {"topic": "tides"}))["raw"]
    namespaces = sidecar.state_dir / "crewai" / "namespaces"
    assert len([p for p in namespaces.iterdir() if (p / "memory").is_dir()]) == 2


def test_replay_never_reaches_another_tenants_run(sidecar):
    run = ok(post(sidecar, "acme:run-1", "trainable", "run", {"topic": "acme-secret-topic"}))
    task_id = run["tasks_output"][-1]["task_id"]
    foreign = post(sidecar, "beta:replay-1", "trainable", "replay",
                   {"task_id": task_id, "inputs": {"topic": "beta"}})
    assert foreign.status_code == 422, foreign.text
    assert "acme-secret-topic" not in foreign.text
    assert sidecar.calls() and not any("beta" in line for line in sidecar.calls())  # no model call for beta
    own = ok(post(sidecar, "acme:replay-1", "trainable", "replay",
                  {"task_id": task_id, "inputs": {"topic": "acme-secret-topic"}}))
    assert "acme-secret-topic" in own["raw"]
    # a job id without a tenant (a peer host) is the default tenant: it does not see acme's runs either
    assert post(sidecar, "replay-2", "trainable", "replay", {"task_id": task_id,
                                                             "inputs": {"topic": "x"}}).status_code == 422


def test_training_artifacts_of_two_tenants_never_overwrite_each_other(sidecar):
    for tenant in ("acme", "beta"):
        out = ok(post(sidecar, f"{tenant}:train-1", "trainable", "train",
                      {"n_iterations": 1, "artifact_name": "journal.db"}))
        assert out["artifact_name"] == "journal.db"
    files = sorted(str(p.relative_to(sidecar.training_dir)) for p in sidecar.training_dir.rglob("*") if p.is_file())
    assert files == ["acme/trainable/journal.db", "beta/trainable/journal.db"]
    assert ok(httpx.get(f"{sidecar.base_url}/health", headers=sidecar.headers))["status"] == "ready"


@pytest.mark.parametrize("where", ["journal_dir", "parent_of_journal_dir", "state_dir"])
def test_a_training_dir_that_is_or_contains_the_journal_or_state_dir_is_refused(tmp_path, where):
    root = tmp_path / "root"
    workdir = root / "sidecar"
    workdir.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    training = {"journal_dir": workdir, "parent_of_journal_dir": root, "state_dir": state}[where]
    process = launch(workdir, args=["--registry", REGISTRY, "--allowed-operations", OPS, "--training-dir",
                                    str(training), "--state-dir", str(state)])
    try:
        assert process.wait(timeout=60) == 2
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    stderr = (workdir / "stderr.log").read_text()
    assert "--training-dir" in stderr and "must not be, or contain" in stderr
    assert not (workdir / "journal.db").exists()  # refused before anything was created


# ----------------------------------------------------------------- through the host

CREWS = [{"id": crew, "name": crew, "allowed_operations": ["run", "status", "events", "cancel", "replay",
                                                           "memory_reset"]}
         for crew in ("memory_a", "trainable")]


@pytest.fixture
def stack(sidecar, tmp_path):
    host = start_host(tmp_path / "host", sidecar.base_url, sidecar.token, crews=CREWS,
                      tenants={"acme": ["memory_a", "trainable"], "beta": ["memory_a", "trainable"]})
    try:
        yield host
    finally:
        host.stop()


def invoke(host, tenant, capability, input):
    """Call as ``<tenant>-app``, approve as ``<tenant>-approver``, return the final action_result."""
    action_id = new_id("act")
    with host.client(f"{tenant}-app") as app:
        pending = app.call(capability, input, action_id=action_id, idempotency_key=new_id("key"))
        result = pending["body"]["action_result"]
        assert result["status"] == "pending_approval", result
        with host.client(f"{tenant}-approver") as approver:
            approver.decide(result["approval"]["approval_id"], "approved", "tenant isolation test")
        deadline = time.monotonic() + 240
        while True:
            status = app.action(action_id)
            if status["status"] in ("completed", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.1)  # polling a condition with a deadline
        return app.result(action_id)["body"]["action_result"]


def test_two_tenants_through_the_host_share_no_memory_and_no_replay(stack):
    host = stack
    first = invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})
    assert first["status"] == "completed", first
    assert MEMORY in invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]
    assert NO_MEMORY in invoke(host, "beta", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]
    assert invoke(host, "beta", "cap:crewai:memory_a:memory_reset", {"command_type": "memory"})[
        "status"] == "completed"
    assert MEMORY in invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]

    run = invoke(host, "acme", "cap:crewai:trainable", {"topic": "acme-only"})
    task_id = run["output"]["tasks_output"][-1]["task_id"]
    foreign = invoke(host, "beta", "cap:crewai:trainable:replay", {"task_id": task_id, "inputs": {"topic": "b"}})
    assert foreign["status"] == "failed" and "acme-only" not in str(foreign)
    own = invoke(host, "acme", "cap:crewai:trainable:replay", {"task_id": task_id, "inputs": {"topic": "acme-only"}})
    assert own["status"] == "completed" and "acme-only" in own["output"]["raw"]


def test_a_journal_replaced_while_running_is_refused_now_and_at_restart(sidecar_factory, sidecar):
    ok(post(sidecar, "acme:before", "trainable", "run", {"topic": "x"}))
    foreign = sidecar.journal.parent / "foreign.db"
    foreign.write_bytes(b"\x80\x04not a journal")  # e.g. a pickle written where the journal was
    foreign.chmod(0o600)
    foreign.replace(sidecar.journal)
    refused = post(sidecar, "acme:after", "trainable", "run", {"topic": "x"})
    assert refused.status_code == 503 and "replaced" in refused.json()["detail"]
    assert ok(httpx.get(f"{sidecar.base_url}/health", headers=sidecar.headers))["status"] == "degraded"
    sidecar.kill()
    with pytest.raises(AssertionError, match="exited with 2"):
        sidecar_factory.restart(sidecar)
