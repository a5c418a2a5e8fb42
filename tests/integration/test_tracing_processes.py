"""OpenTelemetry traces through the real host and sidecar processes (docs/observing.md "Observing actions": Traces).

A real OTLP/HTTP receiver on loopback (:class:`kits.otlp_receiver.OtlpReceiver`: decodes each protobuf
``ExportTraceServiceRequest``) takes the spans of both processes and of the sidecar's job worker; a
governed run sent with a ``traceparent`` gives ONE trace under that parent, holding the host's
submission, approval wait and dispatch, the sidecar's job and CrewAI's kickoff, task, LLM and tool
calls, and no attribute holds the input.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from kits.host import start_host
from kits.otlp_receiver import OtlpReceiver, otel_env
from kits.poll import Deadline, until

from aip_crewai.client import new_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240), pytest.mark.host_processes, pytest.mark.sidecar_jobs]

CREWS = [{"id": "tool_user", "name": "Tool user", "allowed_operations": ["run", "status"]}]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    found = OtlpReceiver()
    try:
        yield found
    finally:
        found.close()


def wait_for(found: Any, what: Any, deadline_s: float = 90) -> Any:
    """Poll ``found()`` until it is truthy (:func:`kits.poll.until`); ``what()`` (or ``what``) names it in
    the failure, with what was received by then."""
    try:
        return until(found, timeout=deadline_s, interval=0.1)
    except Deadline:
        raise AssertionError(f"never saw {what() if callable(what) else what}") from None


def test_a_governed_run_is_one_trace_from_the_tenant_to_each_llm_and_tool_call(
    sidecar_factory, tmp_path, receiver, monkeypatch
):
    env = otel_env(receiver.endpoint)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)  # the suite's conftest set it for CrewAI in this process
    sidecar = sidecar_factory.start(env={**env, "OTEL_SERVICE_NAME": "test-sidecar"})
    for name, value in env.items():  # the host inherits the test process's environment
        monkeypatch.setenv(name, value)
    host = start_host(
        tmp_path / "host", sidecar.base_url, sidecar.token, crews=CREWS, tenants={"acme": ["tool_user"], "beta": []}
    )
    try:
        trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
        secret_input = f"zebra-{secrets.token_hex(6)}"
        action_id = new_id("act")
        with host.client("acme-app") as app, host.client("acme-approver") as approver:
            envelope = app.envelope(
                "cap:crewai:tool_user", {"topic": secret_input}, action_id=action_id, idempotency_key=new_id("key")
            )
            response = app.http.post(
                "/aip/v1/messages",
                content=json.dumps(envelope),
                headers={"Content-Type": "application/aip+json", "traceparent": f"00-{trace_id}-{parent_id}-01"},
            )
            result = response.json()["body"]["action_result"]
            assert result["status"] == "pending_approval"
            approver.decide(result["output"]["approval_id"], "approved", "tracing test")
            wait_for(lambda: app.action(action_id)["state"] == "completed", "the run completed")

        names = {
            "aip.action.submit",
            "aip.approval.wait",
            "aip.action.dispatch",
            "aip.sidecar.job",
            "crewai.kickoff",
            "crewai.task",
            "crewai.llm",
            "crewai.tool",
        }
        spans = wait_for(
            lambda: (found := receiver.of_trace(trace_id)) and names <= {s["name"] for s in found} and found,
            lambda: f"the spans {sorted(names)} in trace {trace_id}; received {receiver.summary()}",
        )
        by_name = {span["name"]: span for span in spans}
        submit = by_name["aip.action.submit"]
        assert submit["parent_span_id"] == parent_id  # the tenant's traceparent is its parent
        assert submit["service"] == "aip-crewai-host" and by_name["aip.sidecar.job"]["service"] == "test-sidecar"
        assert by_name["crewai.llm"]["service"] == "test-sidecar"  # from the job's worker process
        assert {"aip.fence": "approval", "aip.fence.decision": "requested"} in submit["events"]
        ids = {span["span_id"]: span for span in spans}
        assert by_name["aip.action.dispatch"]["parent_span_id"] == submit["span_id"]
        assert by_name["aip.sidecar.job"]["parent_span_id"] == by_name["aip.action.dispatch"]["span_id"]
        assert by_name["crewai.kickoff"]["parent_span_id"] == by_name["aip.sidecar.job"]["span_id"]
        assert ids[by_name["crewai.task"]["parent_span_id"]]["name"] == "crewai.kickoff"
        assert ids[by_name["crewai.llm"]["parent_span_id"]]["name"] == "crewai.task"
        for span in (by_name["aip.action.dispatch"], by_name["aip.sidecar.job"], by_name["crewai.llm"]):
            attributes = span["attributes"]
            assert attributes["aip.tenant"] == "acme" and attributes["aip.action_id"] == action_id
            assert attributes["aip.crew_id"] == "tool_user" and attributes["aip.operation"] == "run"
        assert by_name["aip.action.dispatch"]["attributes"]["aip.status"] == "completed"
        assert by_name["aip.action.dispatch"]["attributes"]["aip.capability_id"] == "cap:crewai:tool_user"
        assert by_name["crewai.tool"]["attributes"]["gen_ai.tool.name"] == "word_counter"
        assert by_name["crewai.llm"]["attributes"]["gen_ai.request.model"] == "offline-tools"
        for span in spans:  # no input string in any attribute or event, unless content capture is on
            assert secret_input not in json.dumps([span["attributes"], span["events"]]), span["name"]
    finally:
        host.stop()


def test_without_an_endpoint_nothing_is_traced_but_the_traceparent_reaches_the_sidecar(
    sidecar_factory, tmp_path, receiver, monkeypatch
):
    """No OTLP endpoint: no span is exported (nothing is set up); the host still passes the caller's
    trace context on, so a traced sidecar continues the caller's trace."""
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    sidecar = sidecar_factory.start(env=otel_env(receiver.endpoint))
    host = start_host(
        tmp_path / "host", sidecar.base_url, sidecar.token, crews=CREWS, tenants={"acme": ["tool_user"], "beta": []}
    )
    try:
        trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
        action_id = new_id("act")
        with host.client("acme-app") as app, host.client("acme-approver") as approver:
            envelope = app.envelope(
                "cap:crewai:tool_user", {"topic": "tides"}, action_id=action_id, idempotency_key="k1"
            )
            response = app.http.post(
                "/aip/v1/messages",
                content=json.dumps(envelope),
                headers={"Content-Type": "application/aip+json", "traceparent": f"00-{trace_id}-{parent_id}-01"},
            )
            approver.decide(response.json()["body"]["action_result"]["output"]["approval_id"], "approved", "test")
            wait_for(lambda: app.action(action_id)["state"] == "completed", "the run completed")
        job = wait_for(
            lambda: [s for s in receiver.of_trace(trace_id) if s["name"] == "aip.sidecar.job"], "the job span"
        )[0]
        assert job["parent_span_id"] == parent_id  # the host passed the stored traceparent on unchanged
        assert not [s for s in receiver.of_trace(trace_id) if s["service"] == "aip-crewai-host"]
    finally:
        host.stop()
