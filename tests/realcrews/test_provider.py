"""The model provider misbehaving: a 429 once is retried and the run completes; an unreachable
provider fails the run typed and certain, its message naming the connection, with no secret or traceback."""

from __future__ import annotations

import json

import pytest
from fake_provider import text
from realkit import API_KEY, run_action

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]


def test_a_429_once_is_retried_and_the_run_completes(deployment, provider):
    provider.fail_next(("PLAIN-RUN", "rl-1"), 429)
    provider.script(("PLAIN-RUN", "rl-1"), text("Thought: fine.\nFinal Answer: after the limit (rl-1)"))
    outcome = run_action(deployment, "plain", {"prompt": "rl-1 hello"})
    assert outcome.result["status"] == "completed", outcome.result
    assert [r["_status"] for r in provider.requests(("PLAIN-RUN", "rl-1"))][:2] == [429, 200]


def test_an_unreachable_provider_fails_typed_and_certain_naming_the_connection(deployment, provider):
    provider.refuse()
    try:
        outcome = run_action(deployment, "plain", {"prompt": "ur-1 hello"})
    finally:
        provider.accept()
    result = outcome.result
    assert result["status"] == "failed", result
    error = result["error"]
    assert "could not be reached (connection failed: APIConnectionError)" in error["message"], error
    assert error["details"]["event"]["error_type"] == "ProviderUnreachable", error
    assert error["details"].get("uncertain_outcome") is False, error
    published = json.dumps([env for _, env in outcome.events])
    assert API_KEY not in published and "Traceback" not in published
