"""A streaming LLM's pieces reach the tenant as AIP data chunks in order; CrewAI's own model calls (the
knowledge query rewrite) arrive as progress, never as the answer."""

from __future__ import annotations

import pytest
from fake_provider import text, tool_call
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


def test_an_agents_forced_final_answer_after_max_iter_is_data_not_progress(deployment, provider):
    # After max_iter (4) tool calls CrewAI asks for the final answer in a call without the task: its chunks
    # carried no task_id and went out as progress, so the run had no data chunk at all.
    pieces = ("Thought: done.\nFinal Answer: ", "forced ", "(mx-1)")
    provider.script(("TOOLS-RUN", "mx-1"), tool_call("parallel_count", words="mx-1 aa"))  # a tool call, every time
    provider.script(("TOOLS-RUN", "mx-1", "MUST give your absolute best final answer"), text("".join(pieces), *pieces))
    outcome = run_action(deployment, "tools", {"words": "mx-1 aa"})
    assert outcome.result["status"] == "completed", outcome.result
    assert outcome.texts("data")[-len(pieces) :] == list(pieces), outcome.texts("data")
    assert "(mx-1)" not in "".join(outcome.texts("progress"))
