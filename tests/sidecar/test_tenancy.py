"""Tenants at the sidecar: tenant of a job id, private names, and per-tenant knowledge."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from aip_crewai.sidecar.jobs.model import JobStatus, NewJob, TaskRunRef
from aip_crewai.sidecar.journal.store import Journal
from aip_crewai.sidecar.tenancy import crew_dir_name, namespace_key, tenant_dir_name, tenant_of

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("job_id", "tenant"),
    [
        ("acme:act-1", "acme"),
        ("acme:sha256:abc", "acme"),
        ("beta.eu-1:a:b", "beta.eu-1"),
        ("act-1", ""),  # a peer host: the default tenant
        (":act-1", ""),
        ("acme:", ""),
        ("-x:act", ""),  # not a tenant name
        ("a b:act", ""),
    ],
)
def test_tenant_of_reads_the_job_id_prefix_only_when_it_is_a_tenant_name(job_id: str, tenant: str) -> None:
    assert tenant_of(job_id) == tenant


def test_private_names_never_coincide_across_tenants_or_crews() -> None:
    pairs = [("", "a:b"), ("a", "b"), ("a", "b:c"), ("a:b", "c"), ("", "c"), ("acme", "c")]
    assert len({namespace_key(t, c) for t, c in pairs}) == len(pairs)
    assert namespace_key("", "crew") == "crew"  # the default tenant keeps the pre-tenancy names
    assert tenant_dir_name("") == "_default" and tenant_dir_name("acme") == "acme"
    assert crew_dir_name("echo") == "echo"
    assert crew_dir_name("../x").startswith("crew-") and crew_dir_name("..").startswith("crew-")


async def test_the_replay_index_answers_only_the_tenant_of_the_run(tmp_path: Path) -> None:
    journal = await Journal.open(tmp_path / "journal.db")
    try:
        output = b'{"raw":"x","tasks_output":[{"task_id":"t1"}]}'
        await journal.admit(NewJob("acme:r1", "echo", "run", "h", "k", None), max_retained_runs=10, max_bytes=1 << 30)
        assert await journal.transition("acme:r1", JobStatus.RUNNING, first_sequence=0)
        assert await journal.transition(
            "acme:r1", JobStatus.COMPLETED, first_sequence=0, output=output, task_runs=[TaskRunRef("t1")]
        )
        assert await journal.find_task_run("echo", "t1", "acme") == output
        assert await journal.find_task_run("echo", "t1", "beta") is None
        assert await journal.find_task_run("echo", "t1") is None  # the default tenant
    finally:
        await journal.close()


async def test_a_knowledge_reset_of_one_tenant_leaves_the_other_tenants_collection(
    crewai_state_dir: Path,
) -> None:
    from aip_crewai.sidecar import operations
    from aip_crewai.sidecar.jobs.context import JobContext
    from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace
    from aip_crewai.sidecar.registry import load_registry

    source = load_registry("aip_crewai.examples.maintenance_crews:CREWS")["shared_knowledge_x"]
    with knowledge_namespace("shared_knowledge_x", "acme"):
        acme = source.new_crew()  # embeds acme's copy of the crew's knowledge now
    ctx = JobContext(
        action_id="beta:reset-1",
        crew_id="shared_knowledge_x",
        operation="memory_reset",
        emit_chunk=lambda _data: None,
        cancel_flag=threading.Event(),
        state_dir=crewai_state_dir,
        tenant="beta",
    )
    out = await operations.execute(source, "memory_reset", {"command_type": "knowledge"}, ctx)
    assert out["reset_targets"] == ["knowledge"]
    results = await asyncio.to_thread(acme.query_knowledge, ["glacier fjord"], 3, 0.0)
    assert results and "glacier" in results[0]["content"].lower()
