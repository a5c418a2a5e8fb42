"""Ordinary CrewAI crew shapes end to end through the real host and sidecar: structured outputs,
hierarchical and sequential processes, tools (a thread pool, an async tool, one that raises), memory per
tenant."""

from __future__ import annotations

import json

import pytest
from fake_provider import message_text, text, tool_call
from realkit import API_KEY, run_action

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]


def test_output_pydantic_and_output_json_fields_arrive_as_json_in_the_result(deployment, provider):
    provider.script(("STRUCTURED-PYDANTIC", "st-1"), text('{"label": "urgent", "score": 7}'))
    provider.script(("STRUCTURED-JSON", "st-1"), text('{"label": "calm", "score": 2}'))
    outcome = run_action(deployment, "structured", {"subject": "st-1 a flooded pier"})
    assert outcome.result["status"] == "completed", outcome.result
    output = outcome.result["output"]
    first, second = output["tasks_output"]
    assert first["pydantic"] == {"label": "urgent", "score": 7}
    assert second["json_dict"] == {"label": "calm", "score": 2}
    assert output["json_dict"] == {"label": "calm", "score": 2}


def test_a_hierarchical_crew_delegates_through_its_manager_llm(deployment, provider):
    provider.script(
        ("HIERARCHICAL-RUN", "hi-1", "Crew Manager"),
        tool_call(
            "delegate_work_to_coworker",
            task="DELEGATED-LINE hi-1 write the line",
            context="about tides",
            coworker="Writer",
        ),
        text("Thought: done.\nFinal Answer: The tide turns at noon (hi-1)."),
    )
    provider.script(("DELEGATED-LINE hi-1",), text("Thought: easy.\nFinal Answer: The tide turns at noon."))
    outcome = run_action(deployment, "hierarchical", {"topic": "hi-1 tides"})
    assert outcome.result["status"] == "completed", outcome.result
    worker = [r for r in provider.requests("DELEGATED-LINE hi-1") if "You are Writer" in message_text(r)]
    assert worker, "the manager's delegation never reached the Writer"
    assert outcome.result["output"]["raw"].endswith("The tide turns at noon (hi-1).")
    assert "DELEGATED-LINE" not in "".join(outcome.texts("data")), "the manager's delegation streamed as the answer"


def test_a_sequential_task_reads_the_previous_task_through_its_context(deployment, provider):
    provider.script(("SEQUENTIAL-FIRST", "sq-1"), text("Thought: found.\nFinal Answer: Otters-3141 hold hands."))
    provider.script(("SEQUENTIAL-SECOND",), text("Thought: polished.\nFinal Answer: Otters hold hands (sq-1)."))
    outcome = run_action(deployment, "sequential", {"topic": "sq-1 otters"})
    assert outcome.result["status"] == "completed", outcome.result
    second = [message_text(r) for r in provider.requests("SEQUENTIAL-SECOND")]
    assert any("Otters-3141" in prompt for prompt in second), "the first task's output is not in the second's prompt"
    assert [t["raw"] for t in outcome.result["output"]["tasks_output"]][-1].endswith("(sq-1).")


def test_a_thread_pool_tool_and_an_async_tool_run_and_their_results_reach_the_model(deployment, provider):
    provider.script(
        ("TOOLS-RUN", "tl-1"),
        tool_call("parallel_count", words="aa bbb"),
        tool_call("async_echo", text="hi-42"),
        text("Thought: done.\nFinal Answer: tools ok (tl-1)"),
    )
    outcome = run_action(deployment, "tools", {"words": "tl-1 aa bbb"})
    assert outcome.result["status"] == "completed", outcome.result
    seen = "\n".join(json.dumps(r["messages"]) for r in provider.requests("tl-1"))
    assert "counts=[2, 3]" in seen and "echo=hi-42" in seen
    assert "tool_errors" not in outcome.result["output"]


def test_a_tool_that_raises_is_named_with_its_exception_type_and_no_secret(deployment, provider):
    provider.script(
        ("FAILING-TOOL-RUN", "ft-1"),
        tool_call("failing_lookup", query="ledger"),
        text("Thought: the archive failed.\nFinal Answer: no record (ft-1)"),
    )
    outcome = run_action(deployment, "failing-tool", {"query": "ft-1 ledger"})
    assert outcome.result["status"] == "completed", outcome.result
    assert outcome.result["output"]["tool_errors"] == [{"tool": "failing_lookup", "error_type": "LookupFailed"}]
    published = json.dumps([env for _, env in outcome.events])
    assert "sk-live-SECRET" not in published and API_KEY not in published and "Traceback" not in published


def test_memory_is_recalled_by_a_later_run_of_the_same_tenant_and_never_by_another(deployment, provider):
    provider.script(("MEMORY-RUN", "mem-1"), text("Thought: noted.\nFinal Answer: noted Heron-8080"))
    first = run_action(deployment, "memory", {"note": "mem-1 remember the code word Heron-8080"})
    assert first.result["status"] == "completed", first.result
    provider.script(("MEMORY-RUN", "mem-2"), text("Thought: recalled.\nFinal Answer: recalled"))
    again = run_action(deployment, "memory", {"note": "mem-2 what was the code word Heron?"})
    assert again.result["status"] == "completed", again.result
    recalled = [message_text(r) for r in provider.requests(("MEMORY-RUN", "mem-2"))]
    assert any("Heron-8080" in prompt for prompt in recalled), "the same tenant's later run did not recall"
    provider.script(("MEMORY-RUN", "mem-3"), text("Thought: recalled.\nFinal Answer: recalled"))
    other = run_action(deployment, "memory", {"note": "mem-3 what was the code word Heron?"}, tenant="beta")
    assert other.result["status"] == "completed", other.result
    assert not any("Heron-8080" in message_text(r) for r in provider.requests(("MEMORY-RUN", "mem-3")))
