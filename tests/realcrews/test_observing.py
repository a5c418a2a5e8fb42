"""Issue 33's "Done", end to end through the real host and sidecar with a real CrewAI crew against the fake
provider (docs/observing.md "Observing actions"): a governed run sent with a ``traceparent`` gives one trace
holding host, sidecar and CrewAI spans; its result carries ``usage`` equal to the provider's counts (and the
configured price) and a ``receipt`` that the CLI verifies offline and refuses after a one-byte change; the
``/metrics`` usage counters and ``GET /aip/v1/usage`` agree with the provider's counts for that run.

The session's ``deployment`` exports both processes' spans to the session's ``otlp`` receiver, signs
receipts and prices the ``tools`` crew (realkit); counters are compared before and after this run, the usage
query over this run's time window (the deployment's tests run one after another on one worker).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from fake_provider import text, tool_call
from kits.poll import Deadline, until
from realkit import PRICES, Deployment

from aip_crewai.client import new_id

pytestmark = [
    pytest.mark.realcrews,
    pytest.mark.integration,
    pytest.mark.sidecar_jobs,
    pytest.mark.host_processes,
    pytest.mark.timeout(300),
]

_SAMPLE = re.compile(r'^(aip_host_(?:tokens|cost)_total)\{tenant="([^"]*)",crew="([^"]*)",\w+="([^"]*)"\} (\S+)$')
#: The spans of one governed run (docs/observing.md "Traces"), by the service that exports them.
SPANS = {
    "aip.action.submit": "aip-crewai-host",
    "aip.approval.wait": "aip-crewai-host",
    "aip.action.dispatch": "aip-crewai-host",
    "aip.sidecar.job": "aip-crewai-sidecar",
    "crewai.kickoff": "aip-crewai-sidecar",
    "crewai.task": "aip-crewai-sidecar",
    "crewai.llm": "aip-crewai-sidecar",
    "crewai.tool": "aip-crewai-sidecar",
}


def usage_counters(deployment: Deployment) -> dict[tuple[str, str, str, str], Decimal]:
    """``/metrics``' usage samples: ``(metric, tenant, crew, kind or currency)`` -> value."""
    with deployment.operator() as operator:
        answer = operator.get("/metrics")
    assert answer.status_code == 200, answer.text
    found = {}
    for line in answer.text.splitlines():
        if (sample := _SAMPLE.match(line)) is not None:
            metric, tenant, crew, label, value = sample.groups()
            found[(metric, tenant, crew, label)] = Decimal(value)
    return found


def verify(receipt: Path, public_key: str) -> subprocess.CompletedProcess[str]:
    """``aip-crewai receipts verify`` as its own process: offline, nothing but the file and the key."""
    command = [sys.executable, "-m", "aip_crewai.cli", "receipts", "verify", str(receipt)]
    return subprocess.run(
        [*command, "--public-key", public_key, "--json"], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_governed_run_is_one_trace_with_usage_counters_query_and_a_receipt_that_verifies_offline(
    deployment, provider, otlp, tmp_path
):
    provider.script(
        ("TOOLS-RUN", "ob-1"),
        tool_call("parallel_count", words="aa bbb"),
        text("Thought: done.\nFinal Answer: observed (ob-1)"),
    )
    before = usage_counters(deployment)
    since = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    secret_input = f"ob-1 zebra-{secrets.token_hex(6)}"
    action_id = new_id("act")
    host = deployment.host
    with host.client("acme-app") as app, host.client("acme-approver") as approver:
        envelope = app.envelope("cap:crewai:tools", {"words": secret_input}, action_id=action_id, idempotency_key="k")
        response = app.http.post(
            "/aip/v1/messages",
            content=json.dumps(envelope),
            headers={"Content-Type": "application/aip+json", "traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
        pending = response.json()["body"]["action_result"]
        assert pending["status"] == "pending_approval", pending
        approver.decide(pending["output"]["approval_id"], "approved", "observing test")
        until(lambda: app.action(action_id)["state"] in ("completed", "failed"), timeout=240, what="the run's end")
        result = app.result(action_id)["body"]["action_result"]
    assert result["status"] == "completed", result

    # 2. usage equal to the provider's counts (10 prompt + 5 completion tokens per answered completion), the cost
    # at the configured price, and a receipt
    answered = [r for r in provider.requests(("TOOLS-RUN", "ob-1")) if r["_status"] == 200]
    n = len(answered)
    assert n == 2, [r["_status"] for r in provider.requests("ob-1")]  # the tool call, then the final answer
    expected = {"prompt": 10 * n, "completion": 5 * n, "total": 15 * n, "cached": 0, "requests": n}
    assert result["usage"]["tokens"] == expected, result["output"].get("token_usage")
    cost = (Decimal(PRICES["prompt"]) * 10 * n + Decimal(PRICES["completion"]) * 5 * n) / 1_000_000
    assert Decimal(result["usage"]["cost"]["amount"]) == cost
    assert result["usage"]["cost"]["currency"] == "USD" and result["usage"]["cost"]["model"] == "fake-chat"
    reference = result["receipt"]

    # 4. the counters moved by exactly this run's counts; the usage query over this run's window says the same
    after = usage_counters(deployment)
    for kind, count in expected.items():
        key = ("aip_host_tokens_total", "acme", "tools", kind)
        assert after.get(key, Decimal(0)) - before.get(key, Decimal(0)) == count, kind  # a 0 is not shown
    key = ("aip_host_cost_total", "acme", "tools", "USD")
    assert abs(after[key] - before.get(key, Decimal(0)) - cost) < Decimal("1e-12")  # a float counter of picos
    with deployment.operator() as operator:
        answer = operator.get("/aip/v1/usage", params={"from": since})
    assert answer.status_code == 200, answer.text
    (row,) = [row for row in answer.json()["crews"] if row["crew_id"] == "tools"]
    assert row["actions"] == 1 and row["tokens"] == expected
    assert row["cost"] == {"amount": result["usage"]["cost"]["amount"], "currency": "USD"}

    # 3. the receipt, as the tenant fetches it, verifies offline with the published key; one changed byte is refused
    with host.http("acme-app") as http:
        document = http.get(f"/aip/v1/receipts/{reference['id']}")
        keys = http.get("/.well-known/aip-receipt-keys").json()["keys"]
    assert document.status_code == 200, document.text
    (published,) = [key["public_key"] for key in keys if key["current"]]
    assert published == deployment.receipt_public_key  # the public half of the 0600 key file
    receipt = tmp_path / "receipt.json"
    receipt.write_bytes(document.content)
    verified = verify(receipt, published)
    assert verified.returncode == 0, verified.stderr
    claims = json.loads(verified.stdout)["receipt"]
    assert json.loads(document.content)["hash"] == reference["hash"]
    assert (claims["action_id"], claims["tenant"], claims["crew_id"], claims["status"]) == (
        action_id,
        "acme",
        "tools",
        "completed",
    )
    assert claims["approval_id"] == pending["output"]["approval_id"]
    changed = document.content.replace(b'"status":"completed"', b'"status":"completes"')
    assert sum(a != b for a, b in zip(changed, document.content, strict=True)) == 1  # one byte
    receipt.write_bytes(changed)
    refused = verify(receipt, published)
    assert refused.returncode == 1 and "receipt refused" in refused.stderr, (refused.returncode, refused.stderr)

    # 1. one trace under the caller's traceparent holding the host's, the sidecar's and CrewAI's spans
    def whole() -> list[dict] | None:
        spans = otlp.of_trace(trace_id)
        return spans if set(SPANS) <= {s["name"] for s in spans} else None

    try:
        spans = until(whole, timeout=90, interval=0.1, what="the run's spans")
    except Deadline:
        raise AssertionError(f"never saw {sorted(SPANS)} in {trace_id}; received {otlp.summary()}") from None
    by_name = {span["name"]: span for span in spans}
    for name, service in SPANS.items():
        assert by_name[name]["service"] == service, name
    assert by_name["aip.action.submit"]["parent_span_id"] == parent_id
    assert by_name["aip.sidecar.job"]["parent_span_id"] == by_name["aip.action.dispatch"]["span_id"]
    assert by_name["crewai.kickoff"]["parent_span_id"] == by_name["aip.sidecar.job"]["span_id"]
    llm = [span for span in spans if span["name"] == "crewai.llm"]
    assert len(llm) == n  # one per model call the provider answered
    for span in (by_name["aip.action.dispatch"], by_name["aip.sidecar.job"], *llm):
        attributes = span["attributes"]
        assert (attributes["aip.tenant"], attributes["aip.action_id"], attributes["aip.crew_id"]) == (
            "acme",
            action_id,
            "tools",
        )
    assert by_name["aip.action.dispatch"]["attributes"]["aip.status"] == "completed"
    assert by_name["crewai.tool"]["attributes"]["gen_ai.tool.name"] == "parallel_count"
    for span in spans:  # no input in any attribute or event
        assert secret_input not in json.dumps([span["attributes"], span["events"]]), span["name"]
