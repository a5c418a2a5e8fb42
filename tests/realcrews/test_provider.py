"""The model provider misbehaving: a 429 once is retried and the run completes; an unreachable
provider fails the run typed and certain, its message naming the connection, with no secret or traceback; a
provider whose error quotes the API key fails the run typed, and the key reaches no log line."""

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


def test_a_provider_error_quoting_the_api_key_leaves_it_out_of_every_log(deployment, provider):
    quoted = f"Incorrect API key provided: {API_KEY}. You can find your API key in your account."
    provider.fail_next(("PLAIN-RUN", "key-1"), 401, times=5, message=quoted)
    outcome = run_action(deployment, "plain", {"prompt": "key-1 hello"})
    assert outcome.result["status"] == "failed", outcome.result
    assert API_KEY not in json.dumps([env for _, env in outcome.events])
    lines = deployment.sidecar.stderr_path.read_text().splitlines()
    assert not [line for line in lines if API_KEY in line]
    logged = [json.loads(line) for line in lines if line.startswith("{") and "library_log" in line]
    assert {"library": "root", "label": "OpenAI API call failed"} in [
        {k: e.get(k) for k in ("library", "label")} for e in logged
    ], logged
    assert not [line for line in lines if line.startswith("ERROR:")]  # Python's plain-text fallback format
