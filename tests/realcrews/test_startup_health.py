"""Start-up: a registry that starts a thread at import leaves the fork server single-threaded and
its jobs complete; CrewAI's telemetry left at its defaults sends nothing off loopback; crews whose knowledge
or LLM cannot work are reported in ``/health`` and their runs fail typed and certain."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx2
import pytest
from fake_provider import text
from realkit import BROKEN_CREWS, CREW_PROBLEMS, run_action

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split() if (task / "children").exists() else []
        found += [int(child) for child in children]
    return found


def _forkserver_pid(sidecar_pid: int) -> int | None:
    for child in _children(sidecar_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"forkserver" in cmdline:
            return child
    return None


def test_jobs_of_a_registry_that_starts_a_thread_at_import_complete_and_the_fork_server_has_one_thread(
    deployment, provider
):
    provider.script(("PLAIN-RUN", "th-"), text("Thought: fine.\nFinal Answer: threaded ok"))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(lambda i: run_action(deployment, "plain", {"prompt": f"th-{i} hello"}), range(4)))
    assert [o.result["status"] for o in outcomes] == ["completed"] * 4, [o.result for o in outcomes]
    server = _forkserver_pid(deployment.sidecar.process.pid)
    if server is None:
        pytest.skip("in-process isolation: no fork server")
    assert len(list(Path(f"/proc/{server}/task").iterdir())) == 1


def test_telemetry_at_its_defaults_sends_nothing_off_loopback(deployment, provider):
    """The suite never disables CrewAI's telemetry or tracing; every proxy-aware client of the sidecar's
    processes goes through the recording proxy, which no connection may reach."""
    provider.script(("PLAIN-RUN", "tm-1"), text("Thought: fine.\nFinal Answer: quiet"))
    assert run_action(deployment, "plain", {"prompt": "tm-1 hello"}).result["status"] == "completed"
    assert deployment.escapes.attempts == 0


def test_crews_whose_knowledge_memory_or_llm_cannot_work_are_in_health_and_fail_typed_and_certain(deployment):
    sidecar = deployment.sidecar
    health = httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers, timeout=30).json()
    assert health["crew_problems"] == CREW_PROBLEMS
    for crew, (_code, error_type) in BROKEN_CREWS.items():
        result = run_action(deployment, crew, {"question": "x"}).result
        assert result["status"] == "failed", result
        assert result["error"]["details"]["event"]["error_type"] == error_type
        assert result["error"]["details"]["uncertain_outcome"] is False
