"""Token usage of a real crew equals what the (fake, OpenAI-compatible) provider reported for each
completion it answered (docs/observing.md "Observing actions")."""

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


def test_the_results_usage_equals_the_providers_counts(deployment, provider):
    provider.script(("PLAIN-RUN", "us-1"), text("Thought: done.\nFinal Answer: counted (us-1)"))
    outcome = run_action(deployment, "plain", {"prompt": "us-1 hello"})
    assert outcome.result["status"] == "completed", outcome.result
    answered = [r for r in provider.requests(("PLAIN-RUN", "us-1")) if r["_status"] == 200]
    assert answered
    n = len(answered)  # the provider reports 10 prompt + 5 completion tokens per completion
    tokens = outcome.result["usage"]["tokens"]
    assert tokens == {"prompt": 10 * n, "completion": 5 * n, "total": 15 * n, "cached": 0, "requests": n}, (
        outcome.result["output"]["token_usage"]
    )
    assert outcome.result["usage"]["latency_ms"] >= 0
