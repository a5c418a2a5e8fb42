"""Knowledge reaches the model's prompt during a run: crew knowledge (a string and a file source),
agent knowledge, under ``akickoff``, through the real host and sidecar, in both isolation modes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fake_provider import message_text, text
from kits.sidecar import child_env
from realkit import (
    AGENT_FACT_TEXT,
    CREW_PROBLEMS,
    FILE_FACT_TEXT,
    KNOWLEDGE_FACT_TEXT,
    SUITE_REGISTRY,
    run_action,
    sidecar_env,
    start_deployment,
)

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]


def _answer_prompts(provider, marker):
    """The recorded chat requests of the agent's task (not the query rewrite), as text."""
    return [message_text(r) for r in provider.requests(marker) if "rewrite the user query" not in message_text(r)]


def test_crew_knowledge_from_a_string_and_a_file_reaches_the_prompt_during_the_run(deployment, provider):
    provider.script("KNOWLEDGE-RUN q-k1", text("Thought: I know.\nFinal Answer: Marmalade-7731"))
    outcome = run_action(deployment, "knowledge", {"question": "q-k1 What is the cat called and the tide code?"})
    assert outcome.result["status"] == "completed", outcome.result
    prompts = _answer_prompts(provider, "KNOWLEDGE-RUN q-k1")
    assert prompts, "the agent made no model call"
    assert any(KNOWLEDGE_FACT_TEXT in p for p in prompts), "the string source's fact never reached a prompt"
    assert any(FILE_FACT_TEXT in p for p in prompts), "the file source's fact never reached a prompt"


def test_agent_knowledge_reaches_the_prompt_during_the_run(deployment, provider):
    provider.script("AGENT-KNOWLEDGE-RUN q-a1", text("Thought: I know.\nFinal Answer: Biscuit-5150"))
    outcome = run_action(deployment, "agent-knowledge", {"question": "q-a1 What is the parrot called?"})
    assert outcome.result["status"] == "completed", outcome.result
    assert any(AGENT_FACT_TEXT in p for p in _answer_prompts(provider, "AGENT-KNOWLEDGE-RUN q-a1"))


def test_a_knowledge_search_that_fails_during_the_run_fails_the_job_typed_and_certain(deployment, provider):
    """CrewAI catches a failed search and runs on without the knowledge; the job must not end completed."""
    provider.script(("KNOWLEDGE-RUN", "kf-1"), text("Thought: guess.\nFinal Answer: no idea"))
    provider.script(("KNOWLEDGE-RUN", "kf-1", "rewrite the user query"), text("EMBEDFAIL kf-1"))  # tried first
    provider.fail_next("EMBEDFAIL kf-1", 500, times=8, path="/v1/embeddings")
    result = run_action(deployment, "knowledge", {"question": "kf-1 What is the cat called?"}).result
    assert result["status"] == "failed", result
    assert result["error"]["details"]["event"]["error_type"] == "KnowledgeSearchFailed"
    assert result["error"]["details"]["uncertain_outcome"] is False
    assert [r["_status"] for r in provider.requests("EMBEDFAIL kf-1", path="/v1/embeddings")][0] == 500


@pytest.fixture(scope="module")
def inprocess(provider, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("realcrews-inprocess")
    workdir.chmod(0o700)
    started = start_deployment(workdir, provider, isolation="inprocess")
    try:
        yield started
    finally:
        started.close()


def test_crew_knowledge_reaches_the_prompt_with_jobs_in_the_sidecar_process(inprocess, provider):
    provider.script(("KNOWLEDGE-RUN", "q-ip1"), text("Thought: I know.\nFinal Answer: Marmalade-7731"))
    outcome = run_action(inprocess, "knowledge", {"question": "q-ip1 What is the cat called?"})
    assert outcome.result["status"] == "completed", outcome.result
    assert any(KNOWLEDGE_FACT_TEXT in p for p in _answer_prompts(provider, "KNOWLEDGE-RUN q-ip1"))


def test_doctor_reports_the_crews_whose_knowledge_memory_or_llm_cannot_work(deployment, provider, tmp_path):
    env = {**child_env(tmp_path / "calls.log", sidecar_env(provider, deployment.escapes))}
    done = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "doctor", "--registry", SUITE_REGISTRY, "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stderr.decode(errors="replace")
    assert json.loads(done.stdout)["crew_problems"] == CREW_PROBLEMS
