"""Tracing's configuration from the standard variables, the W3C traceparent codec, and "nothing is set up
without an endpoint" (``aip_crewai/tracing.py``, ``host/tracing.py``, ``sidecar/tracing.py``)."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace

from aip_crewai import tracing
from aip_crewai.host import tracing as host_tracing
from aip_crewai.sidecar import tracing as sidecar_tracing
from aip_crewai.tracing import TraceSettings, TracingConfigError, format_traceparent, parse_traceparent

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "BatchSpanProcessor" in t.name or "OtelBatch" in t.name]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, None),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"}, None),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, None),
        (ENDPOINT, TraceSettings("http/protobuf", False)),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"},
            TraceSettings("http/protobuf", False),
        ),
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, TraceSettings("grpc", False)),
        (
            {**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
            TraceSettings("http/protobuf", False),
        ),
        ({**ENDPOINT, "AIP_CREWAI_OTEL_CAPTURE_CONTENT": "true"}, TraceSettings("http/protobuf", True)),
        ({**ENDPOINT, "AIP_CREWAI_OTEL_CAPTURE_CONTENT": "false"}, TraceSettings("http/protobuf", False)),
    ],
)
def test_trace_settings_come_from_the_standard_variables(env, expected):
    assert tracing.trace_settings(env) == expected


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({**ENDPOINT, "AIP_CREWAI_OTEL_CAPTURE_CONTENT": "yes"}, "AIP_CREWAI_OTEL_CAPTURE_CONTENT"),
        ({**ENDPOINT, "OTEL_SDK_DISABLED": "1"}, "OTEL_SDK_DISABLED"),
    ],
)
def test_a_value_we_cannot_honour_is_a_typed_error_naming_its_variable(env, names):
    with pytest.raises(TracingConfigError, match=names):
        tracing.trace_settings(env)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        VALID.upper(),  # upper-case hex
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # version ff
        VALID + "-extra",  # version 00 has exactly four fields
        "00-0af7651916cd43dd8448eb211c80319-b7ad6b7169203331-01",  # 31 hex digits
        "01-" + "a" * 600,  # longer than 512 characters
    ],
)
def test_an_invalid_traceparent_is_ignored(value):
    assert parse_traceparent(value) is None
    assert tracing.context_of(value) is None


def test_a_later_version_is_read_by_its_first_four_fields():
    found = parse_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future")
    assert found is not None and found.is_remote and format_traceparent(found) == VALID


@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.booleans())
def test_format_and_parse_are_inverse(trace_id, span_id, sampled):
    context = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(int(sampled)))
    text = format_traceparent(context)
    assert text is not None and len(text) == 55
    parsed = parse_traceparent(text)
    assert parsed is not None
    assert (parsed.trace_id, parsed.span_id, parsed.trace_flags.sampled) == (trace_id, span_id, sampled)


def test_without_an_endpoint_nothing_is_set_up():
    """No provider, no exporter thread; the host keeps only the caller's context to pass on."""
    before = _exporter_threads()
    sidecar_tracing.configure(tracing.trace_settings({}))
    assert sidecar_tracing.install() is None
    assert host_tracing.active() is None
    with host_tracing.submission(VALID) as span:
        assert span is None
        assert tracing.current_traceparent() == VALID  # stored with the action, passed on to the sidecar
        assert host_tracing.outgoing_headers() == {"traceparent": VALID}
    with host_tracing.submission(None) as span:
        assert span is None and tracing.current_traceparent() is None
        assert host_tracing.outgoing_headers() == {}
    with sidecar_tracing.job_span("acme:act_1", "c", "run") as job:
        assert job is None
    assert sidecar_tracing.crew_spans(VALID, {}) is None
    assert _exporter_threads() == before
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_with_an_endpoint_our_provider_is_private_and_ignores_the_sdk_switch_crewai_needs(monkeypatch):
    """``install`` builds a working provider although ``OTEL_SDK_DISABLED=true`` is set (for CrewAI's own
    telemetry), and never becomes the global provider that libraries would export into."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    installed = tracing.install(TraceSettings("http/protobuf", False), "test-service")
    try:
        with installed.tracer.start_as_current_span("probe") as span:
            assert span.is_recording()
        assert _exporter_threads()  # the batch processor's thread: what "nothing is set up" looks for
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        assert os.environ["OTEL_SDK_DISABLED"] == "true"
    finally:
        installed.shutdown()


def test_error_code_reads_a_stored_result():
    assert host_tracing.error_code('{"status":"failed","error":{"code":"policy.approval_denied"}}') == (
        "policy.approval_denied"
    )
    assert host_tracing.error_code('{"status":"completed","output":{}}') is None
    assert host_tracing.error_code(None) is None
    assert host_tracing.error_code("not json") is None
