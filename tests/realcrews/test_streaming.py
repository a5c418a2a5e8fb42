"""A streaming LLM's pieces reach the tenant as AIP data chunks in order; CrewAI's own model calls (the
knowledge query rewrite) arrive as progress, never as the answer."""

from __future__ import annotations

import pytest
from fake_provider import text
from realkit import run_action

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]


def test_the_providers_pieces_arrive_as_data_chunks_in_order(deployment, provider):
    pieces = ("Thought: ready.\nFinal Answer: ", "Alpha ", "Beta ", "Gamma ", "(sm-1)")
    provider.script(("PLAIN-RUN", "sm-1"), text("".join(pieces), *pieces))
    outcome = run_action(deployment, "plain", {"prompt": "sm-1 say three words"})
    assert outcome.result["status"] == "completed", outcome.result
    assert outcome.texts("data") == list(pieces)


def test_the_knowledge_query_rewrite_is_progress_not_the_answers_data(deployment, provider):
    pieces = ("Thought: I know.\nFinal Answer: ", "Marmalade", "-7731")
    provider.script(("KNOWLEDGE-RUN", "ks-1"), text("".join(pieces), *pieces))
    provider.script(
        ("KNOWLEDGE-RUN", "ks-1", "rewrite the user query"),
        text("REWRITTEN ks-1 cat name", "REWRITTEN ", "ks-1 cat name"),
    )
    outcome = run_action(deployment, "knowledge", {"question": "ks-1 What is the cat called?"})
    assert outcome.result["status"] == "completed", outcome.result
    assert outcome.texts("data") == list(pieces)
    assert "".join(outcome.texts("progress")).count("REWRITTEN ks-1 cat name") == 1
