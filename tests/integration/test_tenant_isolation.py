"""Two tenants routed to one crew share no crew state.

Through the real sidecar (job ids ``<tenant>:<action id>``, as the host sends
them) and, for memory and replay, through the real host with tenants acme
and beta both routed to the same crews. Crews: ``aip_crewai.examples.maintenance_crews``
(``memory_a`` remembers every run; its offline agent calls the memory tool
first and quotes it: "No relevant memories found." or "Found memories").

One sidecar serves the module (``sidecar``): each test has tenants of its own
(:func:`tenants`; the host test alone uses ``acme`` and ``beta``, the host's
tenants), so no test sees another's memory, knowledge, replay runs or training
artifacts, and counts model calls, namespaces and files per tenant. A test that
restarts on its journal, replaces it, or refuses a start has a sidecar of its own.
"""

from __future__ import annotations

import hashlib
import signal
import stat
import subprocess
from collections.abc import Iterator

import httpx2
import pytest
from kits.host import start_host
from kits.poll import until
from kits.sidecar import Sidecar, SidecarFactory, launch, post_job, start_with_training_dir

from aip_crewai.client import new_id
from aip_crewai.sidecar.tenancy import namespace_digest, namespace_key, private_collection_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420), pytest.mark.host_processes, pytest.mark.sidecar_jobs]

OPS = "run,replay,train,knowledge_query,memory_reset"
REGISTRY = "aip_crewai.examples.maintenance_crews:CREWS"
NO_MEMORY = "No relevant memories found."
MEMORY = "Found memories"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """The module's sidecar (maintenance crews, every operation of :data:`OPS`, a training directory)."""
    workdir = tmp_path_factory.mktemp("tenant-sidecar")
    workdir.chmod(0o700)
    factory = SidecarFactory(workdir)
    try:
        yield start_with_training_dir(factory, tmp_path_factory.mktemp("tenant-training"), REGISTRY, OPS)
    finally:
        factory.close()


@pytest.fixture
def private_sidecar(sidecar_factory, tmp_path):
    """A sidecar of the test's own, for a test that replaces its journal or restarts on it."""
    return start_with_training_dir(sidecar_factory, tmp_path, REGISTRY, OPS)


post = post_job


def tenants(test: str) -> tuple[str, str]:
    """The two tenants of one test on the module's sidecar: ``acme-<test>`` and ``beta-<test>``."""
    return f"acme-{test}", f"beta-{test}"


def calls_of(sidecar, tenant: str) -> list[str]:
    """The model calls logged for jobs of ``tenant`` (the call log's last column is the job id; ``-`` for a
    call made outside a job, with ``tenant="-"``)."""
    return [line for line in sidecar.calls() if line.split()[-1] == tenant or line.split()[-1].startswith(f"{tenant}:")]


def memory_namespaces(sidecar) -> set[str]:
    """The namespace directories (``namespace_digest(tenant, crew)``) that hold a memory."""
    namespaces = sidecar.state_dir / "namespaces"  # beside CrewAI's storage (the worker sandbox grants one)
    return {p.name for p in namespaces.iterdir() if (p / "memory").is_dir()} if namespaces.is_dir() else set()


def ok(response):
    assert response.status_code == 200, response.text
    return response.json()


def test_memory_of_one_tenant_is_neither_recalled_nor_reset_by_another(sidecar):
    acme, beta = tenants("memory")
    before = memory_namespaces(sidecar)
    assert NO_MEMORY in ok(post(sidecar, f"{acme}:m1", "memory_a", "run", {"topic": "tides"}))["raw"]
    assert MEMORY in ok(post(sidecar, f"{acme}:m2", "memory_a", "run", {"topic": "tides"}))["raw"]
    # beta, same crew: nothing of acme's is recalled
    assert NO_MEMORY in ok(post(sidecar, f"{beta}:m1", "memory_a", "run", {"topic": "tides"}))["raw"]
    reset = ok(post(sidecar, f"{beta}:r1", "memory_a", "memory_reset", {"command_type": "memory"}))
    assert reset["reset_targets"] == ["memory"]
    # beta's reset left acme's memories alone
    assert MEMORY in ok(post(sidecar, f"{acme}:m3", "memory_a", "run", {"topic": "tides"}))["raw"]
    # two memories, one per tenant: this test's jobs made exactly these
    assert memory_namespaces(sidecar) - before == {
        namespace_digest(acme, "memory_a"),
        namespace_digest(beta, "memory_a"),
    }


def test_replay_never_reaches_another_tenants_run(sidecar):
    acme, beta = tenants("replay")
    run = ok(post(sidecar, f"{acme}:run-1", "trainable", "run", {"topic": "acme-secret-topic"}))
    task_id = run["tasks_output"][-1]["task_id"]
    foreign = post(
        sidecar, f"{beta}:replay-1", "trainable", "replay", {"task_id": task_id, "inputs": {"topic": "beta"}}
    )
    assert foreign.status_code == 422, foreign.text
    assert "acme-secret-topic" not in foreign.text
    assert calls_of(sidecar, acme) and not calls_of(sidecar, beta)  # no model call for beta
    own = ok(
        post(
            sidecar,
            f"{acme}:replay-1",
            "trainable",
            "replay",
            {"task_id": task_id, "inputs": {"topic": "acme-secret-topic"}},
        )
    )
    assert "acme-secret-topic" in own["raw"]
    # a job id without a tenant (a peer host) is the default tenant: it does not see acme's runs either
    assert (
        post(sidecar, "replay-2", "trainable", "replay", {"task_id": task_id, "inputs": {"topic": "x"}}).status_code
        == 422
    )


def test_a_knowledge_reset_of_one_tenant_leaves_the_other_tenants_knowledge(sidecar):
    acme, beta = tenants("knowledge")
    query = {"query": ["glacier"]}
    found = ok(post(sidecar, f"{acme}:kq-1", "shared_knowledge_x", "knowledge_query", query))["results"]
    assert found and "glacier" in found[0]["content"].lower()
    assert ok(post(sidecar, f"{beta}:kr-1", "shared_knowledge_x", "memory_reset", {"command_type": "knowledge"}))[
        "reset_targets"
    ] == ["knowledge"]
    # each tenant had a collection of its own; beta's reset deleted beta's only
    collections = knowledge_collections(sidecar)
    assert "knowledge_" + private_collection_name(namespace_key(acme, "shared_knowledge_x"), "crew") in collections
    assert "knowledge_" + private_collection_name(namespace_key(beta, "shared_knowledge_x"), "crew") not in collections
    assert ok(post(sidecar, f"{acme}:kq-2", "shared_knowledge_x", "knowledge_query", query))["results"] == found


def knowledge_collections(sidecar) -> set[str]:
    """The names of the collections in CrewAI's Chroma store of the sidecar (read-only)."""
    import sqlite3

    path = sidecar.state_dir / "crewai" / "chroma.sqlite3"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return {name for (name,) in conn.execute("SELECT name FROM collections")}


def training_files(sidecar) -> set[str]:
    """The files under the sidecar's training directory, relative to it."""
    return {str(p.relative_to(sidecar.training_dir)) for p in sidecar.training_dir.rglob("*") if p.is_file()}


def test_training_artifacts_of_two_tenants_never_overwrite_each_other(sidecar):
    acme, beta = tenants("training")
    before = training_files(sidecar)
    for tenant in (acme, beta):
        out = ok(
            post(sidecar, f"{tenant}:train-1", "trainable", "train", {"n_iterations": 1, "artifact_name": "journal.db"})
        )
        assert out["artifact_name"] == "journal.db"
    # this test's two jobs wrote exactly these (and changed no file that was there)
    assert training_files(sidecar) == before | {f"{acme}/trainable/journal.db", f"{beta}/trainable/journal.db"}
    assert not any(name.startswith((f"{acme}/", f"{beta}/")) for name in before)
    assert ok(httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers))["status"] == "ready"


@pytest.mark.parametrize("where", ["journal_dir", "parent_of_journal_dir", "state_dir"])
def test_a_training_dir_that_is_or_contains_the_journal_or_state_dir_is_refused(tmp_path, where):
    root = tmp_path / "root"
    workdir = root / "sidecar"
    workdir.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    training = {"journal_dir": workdir, "parent_of_journal_dir": root, "state_dir": state}[where]
    process = launch(
        workdir,
        args=[
            "--registry",
            REGISTRY,
            "--allowed-operations",
            OPS,
            "--training-dir",
            str(training),
            "--state-dir",
            str(state),
        ],
    )
    try:
        assert process.wait(timeout=60) == 2
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    stderr = (workdir / "stderr.log").read_text()
    assert "--training-dir" in stderr and "must not be, or contain" in stderr
    assert not (workdir / "journal.db").exists()  # refused before anything was created


# ----------------------------------------------------------------- through the host

CREWS = [
    {"id": crew, "name": crew, "allowed_operations": ["run", "status", "events", "cancel", "replay", "memory_reset"]}
    for crew in ("memory_a", "trainable")
]


@pytest.fixture
def memory_host(sidecar, tmp_path):
    host = start_host(
        tmp_path / "host",
        sidecar.base_url,
        sidecar.token,
        crews=CREWS,
        tenants={"acme": ["memory_a", "trainable"], "beta": ["memory_a", "trainable"]},
    )
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
            approver.decide(result["output"]["approval_id"], "approved", "tenant isolation test")
        until(
            lambda: app.action(action_id)["state"] in ("completed", "failed", "cancelled"),
            timeout=240,
            interval=0.1,
            what=f"action {action_id} final",
        )
        return app.result(action_id)["body"]["action_result"]


def test_two_tenants_through_the_host_share_no_memory_and_no_replay(memory_host):
    host = memory_host
    first = invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})
    assert first["status"] == "completed", first
    assert MEMORY in invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]
    assert NO_MEMORY in invoke(host, "beta", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]
    assert invoke(host, "beta", "cap:crewai:memory_a:memory_reset", {"command_type": "memory"})["status"] == "completed"
    assert MEMORY in invoke(host, "acme", "cap:crewai:memory_a", {"topic": "tides"})["output"]["raw"]

    run = invoke(host, "acme", "cap:crewai:trainable", {"topic": "acme-only"})
    task_id = run["output"]["tasks_output"][-1]["task_id"]
    foreign = invoke(host, "beta", "cap:crewai:trainable:replay", {"task_id": task_id, "inputs": {"topic": "b"}})
    assert foreign["status"] == "failed" and "acme-only" not in str(foreign)
    own = invoke(host, "acme", "cap:crewai:trainable:replay", {"task_id": task_id, "inputs": {"topic": "acme-only"}})
    assert own["status"] == "completed" and "acme-only" in own["output"]["raw"]


def test_a_journal_replaced_while_running_is_refused_now_and_at_restart(sidecar_factory, private_sidecar):
    sidecar = private_sidecar
    ok(post(sidecar, "acme:before", "trainable", "run", {"topic": "x"}))
    foreign = sidecar.journal.parent / "foreign.db"
    foreign.write_bytes(b"\x80\x04not a journal")  # e.g. a pickle written where the journal was
    foreign.chmod(0o600)
    foreign.replace(sidecar.journal)
    refused = post(sidecar, "acme:after", "trainable", "run", {"topic": "x"})
    assert refused.status_code == 503 and "replaced" in refused.json()["detail"]
    assert ok(httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers))["status"] == "degraded"
    sidecar.kill()
    with pytest.raises(AssertionError, match="exited with 2"):
        sidecar_factory.restart(sidecar)


def job_status(sidecar, job_id):
    return httpx2.get(f"{sidecar.base_url}/jobs/{job_id}", headers=sidecar.headers).json()["status"]


def wait_for(condition, deadline_s=60.0):
    until(condition, timeout=deadline_s, interval=0.05)


def test_memory_reset_is_refused_while_a_job_of_the_same_tenant_and_crew_runs(sidecar):
    """Item 6: 409 sidecar.crew_busy, not a reset that the running job's memories would undo."""
    import threading

    acme, beta = tenants("busy")
    slow = f"{acme}:slow-1"
    blocking = threading.Thread(target=post, args=(sidecar, slow, "trainable_slow", "run", {"topic": "t"}))
    blocking.start()
    try:
        wait_for(
            lambda: (
                httpx2.get(f"{sidecar.base_url}/jobs/{slow}", headers=sidecar.headers).status_code == 200
                and job_status(sidecar, slow) == "running"
            )
        )
        busy = post(sidecar, f"{acme}:reset-1", "trainable_slow", "memory_reset", {"command_type": "all"})
        assert busy.status_code == 409, busy.text
        assert "memory_reset is refused" in busy.json()["detail"] and busy.json()["code"] == "sidecar.crew_busy"
        assert httpx2.get(f"{sidecar.base_url}/jobs/{acme}:reset-1", headers=sidecar.headers).status_code == 404
        # another tenant's reset of the same crew is not held up by acme's run
        assert (
            ok(post(sidecar, f"{beta}:reset-1", "trainable_slow", "memory_reset", {"command_type": "all"}))["status"]
            == "completed"
        )
    finally:
        blocking.join(timeout=120)
    assert job_status(sidecar, slow) == "completed"
    assert (
        ok(post(sidecar, f"{acme}:reset-2", "trainable_slow", "memory_reset", {"command_type": "all"}))["status"]
        == "completed"
    )


# ----------------------------------------------------- replay state kept with the run (items 4, 5)


def journal_rows(sidecar, sql, params=()):
    import sqlite3

    conn = sqlite3.connect(f"file:{sidecar.journal}?mode=ro", uri=True)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def test_replay_of_an_older_run_needs_no_inputs_and_explicit_inputs_still_win(sidecar):
    """Item 4: the inputs of every retained run are kept with it (a 0600 file), removed on archive, never logged."""
    acme, _ = tenants("inputs")
    old = f"{acme}:old"
    older = ok(post(sidecar, old, "trainable", "run", {"topic": "otters-7f2"}))
    ok(post(sidecar, f"{acme}:new", "trainable", "run", {"topic": "badgers"}))
    task_id = older["tasks_output"][1]["task_id"]
    replayed = ok(post(sidecar, f"{acme}:rp-1", "trainable", "replay", {"task_id": task_id}))
    assert [t["raw"].split(": ", 1)[1] for t in replayed["tasks_output"]] == [
        "Summarize the topic otters-7f2.",
        "Restate the summary of otters-7f2.",
    ]
    override = ok(
        post(sidecar, f"{acme}:rp-2", "trainable", "replay", {"task_id": task_id, "inputs": {"topic": "voles"}})
    )
    assert override["tasks_output"][1]["raw"].endswith("Restate the summary of voles.")
    # a replay's own output is replayable without inputs too (its inputs were kept)
    again = ok(
        post(sidecar, f"{acme}:rp-3", "trainable", "replay", {"task_id": override["tasks_output"][1]["task_id"]})
    )
    assert again["tasks_output"][1]["raw"].endswith("Restate the summary of voles.")
    kept = sidecar.state_dir / "replay-inputs" / (hashlib.sha256(old.encode()).hexdigest() + ".json")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
    assert b"otters-7f2" in kept.read_bytes()
    assert journal_rows(sidecar, "SELECT COUNT(*) FROM run_state WHERE action_id = ?", (old,)) == [(1,)]
    archived = httpx2.delete(
        f"{sidecar.base_url}/jobs/{old}", headers={**sidecar.headers, "X-AIP-Archive-Confirmation": old}
    )
    assert archived.status_code == 200, archived.text
    assert not kept.exists()
    assert journal_rows(sidecar, "SELECT COUNT(*) FROM run_state WHERE action_id = ?", (old,)) == [(0,)]
    assert "otters-7f2" not in sidecar.stderr()


def test_replay_after_the_crew_definition_changed_is_refused_naming_the_change(sidecar_factory, private_sidecar):
    """Item 5: same task count, other order: a typed failure before any model call, not a wrong replay."""
    sidecar = private_sidecar
    run = ok(post(sidecar, "acme:v1", "variant", "run", {"topic": "moss"}))
    task_id = run["tasks_output"][1]["task_id"]
    sidecar.kill()
    changed = sidecar_factory.restart(sidecar, env={"AIP_CREWAI_TEST_CREW_VARIANT": "swapped"})
    calls = len(changed.calls())
    refused = post(changed, "acme:v-replay", "variant", "replay", {"task_id": task_id})
    assert refused.status_code == 502, refused.text
    error = refused.json()
    assert error["error_type"] == "CrewDefinitionChanged"
    assert "task 1: description changed; task 2: description changed" in error["detail"]
    assert len(changed.calls()) == calls
    # a run made with the current definition replays normally
    fresh = ok(post(changed, "acme:v2", "variant", "run", {"topic": "moss"}))
    assert ok(post(changed, "acme:v2-replay", "variant", "replay", {"task_id": fresh["tasks_output"][1]["task_id"]}))


def test_a_crew_asking_for_human_input_fails_typed_without_model_calls_or_stdin(sidecar):
    """Item 8: refused at the start of the job (before any model call); stdin is never read."""
    acme, _ = tenants("human")
    outside_jobs = len(calls_of(sidecar, "-"))
    failed = post(sidecar, f"{acme}:human-run", "asks_human", "run", {"topic": "x"})
    assert failed.status_code == 502, failed.text
    assert failed.json()["error_type"] == "HumanInputUnsupported"
    assert "task 2" in failed.json()["detail"]
    assert calls_of(sidecar, acme) == []  # the tenant's only job made no model call
    assert len(calls_of(sidecar, "-")) == outside_jobs  # nor did anything outside a job meanwhile


def test_a_replay_cancelled_during_a_blocked_model_call_runs_no_tool_and_says_so(sidecar):
    """Item 9: the in-flight call still answers with a tool call; the tool never runs, then the stop is confirmed."""
    import threading

    acme, _ = tenants("blocked")
    job = f"{acme}:bt-replay"
    run = ok(post(sidecar, f"{acme}:bt-run", "blocked_tool_user", "run", {"topic": "three little words"}))
    assert any(f"tool:tally {acme}:bt-run" in line for line in sidecar.calls())  # the crew does use its tool
    task_id = run["tasks_output"][0]["task_id"]
    replay = threading.Thread(target=post, args=(sidecar, job, "blocked_tool_user", "replay", {"task_id": task_id}))
    replay.start()
    try:
        wait_for(lambda: any(f"offline-blocked-tools {job}" in line for line in sidecar.calls()))
        cancelled = httpx2.post(
            f"{sidecar.base_url}/jobs/{job}/cancel",
            headers=sidecar.headers,
            json={"crew_id": "blocked_tool_user", "action_id": job},
        )
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
    finally:
        replay.join(timeout=120)

    def view():
        return httpx2.get(f"{sidecar.base_url}/jobs/{job}", headers=sidecar.headers).json()

    wait_for(lambda: view()["provider_stop_observed"] is not None)  # the worker returned
    final = view()
    assert final["provider_stop_observed"] is True and final["uncertain_outcome"] is False
    replay_lines = [line for line in sidecar.calls() if line.endswith(f" {job}")]
    assert not any("tool:tally" in line for line in replay_lines), replay_lines
    assert len(replay_lines) == 1  # the blocked call only: no model call after the cancel


def test_knowledge_that_cannot_initialise_is_a_typed_error_without_its_text(tmp_path):
    """Item 7: /health names the crew at start-up; knowledge_query and run fail KnowledgeUnavailable (not 200
    {"results": []} or a run without retrieval); CrewAI's printed "Failed to init knowledge: <secret>" reaches
    the log by its label only, and nothing reaches fd 1."""
    from kits.sidecar import TOKEN, Sidecar, wait_ready

    fake_secret = (
        "sk-test-SECRET-7f3a9c"  # aip_crewai.examples.offline_llm.FAKE_SECRET: importing it would import CrewAI here
    )

    workdir = tmp_path / "kq"
    workdir.mkdir(mode=0o700)
    stdout = workdir / "stdout.log"
    (tmp_path / "training").mkdir(mode=0o700, exist_ok=True)
    process = launch(
        workdir,
        args=["--registry", REGISTRY, "--allowed-operations", OPS, "--training-dir", str(tmp_path / "training")],
        stdout=stdout,
    )
    try:
        base_url = wait_ready(process, workdir / "stderr.log")
    except AssertionError:
        process.kill()
        raise
    sidecar = Sidecar(
        process, base_url, TOKEN, workdir / "journal.db", workdir, workdir / "calls.log", workdir / "stderr.log"
    )

    health = ok(httpx2.get(f"{base_url}/health", headers=sidecar.headers))
    assert health["crew_problems"]["broken_knowledge"] == ["knowledge_unavailable"]
    assert health["crew_problems"]["asks_human"] == ["human_input"]
    assert "trainable" not in health["crew_problems"]
    for job_id, operation, input in (
        ("acme:kq-broken", "knowledge_query", {"query": ["glacier"]}),
        ("acme:run-broken", "run", {"topic": "glacier"}),
    ):
        failed = post(sidecar, job_id, "broken_knowledge", operation, input)
        assert failed.status_code == 502, failed.text
        assert failed.json()["error_type"] == "KnowledgeUnavailable"
        assert failed.json()["uncertain_outcome"] is False  # refused before any model call
        assert fake_secret not in failed.text
    stderr = sidecar.stderr()
    assert fake_secret not in stderr
    # CrewAI printed "Failed to init knowledge: <error with the secret>": logged by its label only
    assert '"crewai_printed_error"' in stderr and "Failed to init knowledge" in stderr
    working = ok(post(sidecar, "acme:kq-ok", "shared_knowledge_x", "knowledge_query", {"query": ["glacier"]}))
    assert working["results"] and "glacier" in working["results"][0]["content"].lower()
    sidecar.kill(signal.SIGTERM)
    assert stdout.read_bytes() == b""  # nothing CrewAI printed reached fd 1
