"""Knowledge reaches the model's prompt during a run (issue 27): crew knowledge (a string and a file source),
agent knowledge, under ``akickoff``, through the real host and sidecar, in both isolation modes."""

from __future__ import annotations

import json

import pytest

from fake_provider import message_text, text
from realkit import FILE_FACT_TEXT, KNOWLEDGE_FACT_TEXT, AGENT_FACT_TEXT, run_action

pytestmark = [pytest.mark.realcrews, pytest.mark.integration, pytest.mark.sidecar_jobs, pytest.mark.host_processes,
              pytest.mark.timeout(300)]


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
