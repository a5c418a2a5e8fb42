"""OpenTelemetry traces of both processes: configured from the standard variables only, off by default.

Tracing is on when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``), unless ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``.
Off, nothing is set up: no tracer provider, no exporter, no thread (:func:`trace_settings` answers
None and :func:`install` is never called). On, :func:`install` builds one SDK ``TracerProvider`` of
our own (never the OpenTelemetry *global* provider, so a library instrumented against the global API,
CrewAI included, never exports into it), whose sampler (``OTEL_TRACES_SAMPLER``, ``..._ARG``),
resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), exporter (``OTEL_EXPORTER_OTLP_*``:
headers, timeout, certificates) and batch processor (``OTEL_BSP_*``) read those variables
themselves. ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``
(the default) or ``grpc`` (needs ``opentelemetry-exporter-otlp-proto-grpc``); anything else is a
:class:`TracingConfigError`.

Attributes never hold inputs, outputs, prompts or secrets unless ``AIP_CREWAI_OTEL_CAPTURE_CONTENT=true``
(:data:`CAPTURE_CONTENT_ENV`).

The sidecar forces ``OTEL_SDK_DISABLED=true`` for CrewAI's own telemetry (``sidecar/crewai_env.py``):
it reads :func:`trace_settings` from the operator's environment *before* that, and :func:`install`
builds our provider as enabled whatever ``OTEL_SDK_DISABLED`` says then. CrewAI's telemetry stays off
(``CREWAI_DISABLE_TELEMETRY`` alone turns it off, and it never sees our provider).

Also the W3C ``traceparent`` codec (:func:`parse_traceparent`, :func:`format_traceparent`) and the
context helpers both processes propagate with.

Source: docs/observing.md "Observing actions" (Traces).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

__all__ = [
    "CAPTURE_CONTENT_ENV",
    "Tracing",
    "TraceSettings",
    "TracingConfigError",
    "attached",
    "context_of",
    "current_traceparent",
    "format_traceparent",
    "install",
    "parse_traceparent",
    "trace_settings",
]

#: Our switch for content capture: ``true`` adds task names, agent roles, prompts, answers and tool
#: arguments and outputs to the CrewAI spans (each cut at :data:`MAX_CONTENT_CHARS`); ``false`` (default).
CAPTURE_CONTENT_ENV = "AIP_CREWAI_OTEL_CAPTURE_CONTENT"
#: Longest captured content attribute, characters.
MAX_CONTENT_CHARS = 4096
#: The protocols we export with.
PROTOCOLS = ("http/protobuf", "grpc")
#: The instrumentation scope of every span of ours.
TRACER_NAME = "aip_crewai"

# W3C Trace Context §3.2: version 00, lower-case hex, trace id and span id not all zeros.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_env_lock = threading.Lock()


class TracingConfigError(ValueError):
    """A tracing variable holds a value we cannot honour (its message names the variable)."""


@dataclass(frozen=True)
class TraceSettings:
    """Tracing as the environment asks for it (:func:`trace_settings`).

    Attributes:
        protocol: ``http/protobuf`` or ``grpc``.
        capture_content: :data:`CAPTURE_CONTENT_ENV` is ``true``.
    """

    protocol: str
    capture_content: bool


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "false"):
        return False
    if value == "true":
        return True
    raise TracingConfigError(f"{name} must be true or false, not {env.get(name)!r}")


def trace_settings(env: Mapping[str, str] | None = None) -> TraceSettings | None:
    """Whether and how to trace, from the standard variables. Pure over ``env``.

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        None (no tracing: no endpoint, ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``),
        else the :class:`TraceSettings`.

    Raises:
        TracingConfigError: a protocol other than :data:`PROTOCOLS`, ``OTEL_TRACES_EXPORTER`` other than
            ``otlp``/``none``, or :data:`CAPTURE_CONTENT_ENV` neither ``true`` nor ``false``.
    """
    env = os.environ if env is None else env
    capture = _flag(env, CAPTURE_CONTENT_ENV)
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter not in ("otlp", "none"):
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER must be otlp or none, not {exporter!r}")
    if not endpoint or not endpoint.strip() or exporter == "none" or _flag(env, "OTEL_SDK_DISABLED"):
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
    return TraceSettings(protocol, capture)


class Tracing:
    """Our installed tracer provider and its tracer (:func:`install`).

    Attributes:
        tracer: the tracer every span of the process starts from.
        capture_content: see :data:`CAPTURE_CONTENT_ENV`.
    """

    def __init__(self, provider: Any, capture_content: bool) -> None:
        self._provider = provider
        self.tracer: trace.Tracer = provider.get_tracer(TRACER_NAME)
        self.capture_content = capture_content

    def flush(self, timeout_ms: int) -> bool:
        """Export what was ended so far, waiting at most ``timeout_ms`` milliseconds. True when done."""
        return bool(self._provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        """Flush and stop the exporter thread (bounded by the exporter's own timeout)."""
        self._provider.shutdown()


def install(settings: TraceSettings, default_service_name: str) -> Tracing:
    """Build our tracer provider, its OTLP exporter and batch processor (one exporter thread).

    Call after any fork (the batch processor starts a thread). ``OTEL_SDK_DISABLED`` is ignored here:
    the caller decided with :func:`trace_settings` (see the module docstring).

    Args:
        settings: from :func:`trace_settings`.
        default_service_name: ``service.name`` when neither ``OTEL_SERVICE_NAME`` nor
            ``OTEL_RESOURCE_ATTRIBUTES`` names one (``aip-crewai-host``, ``aip-crewai-sidecar``).

    Raises:
        TracingConfigError: ``grpc`` without its exporter installed.
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter: Any
    if settings.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as exc:
            raise TracingConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc installed"
            ) from exc
        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    with _env_lock:  # the provider reads OTEL_SDK_DISABLED once, here; the sidecar forces it for CrewAI
        saved = os.environ.pop("OTEL_SDK_DISABLED", None)
        try:
            provider = TracerProvider(resource=resource)
        finally:
            if saved is not None:
                os.environ["OTEL_SDK_DISABLED"] = saved
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, settings.capture_content)


# --------------------------------------------------------------------------- W3C trace context


def parse_traceparent(value: str | None) -> trace.SpanContext | None:
    """A remote span context from a W3C ``traceparent`` header value, or None when absent or invalid.

    Version ``00`` must be exactly 55 characters; a higher version is read by its first four fields
    (W3C Trace Context §3.2.4); ``ff``, all-zero ids and upper-case hex are invalid. Pure.
    """
    if not value or len(value) > 512:
        return None
    found = _TRACEPARENT.match(value.strip())
    if found is None:
        return None
    version, trace_id, span_id, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if int(trace_id, 16) == 0 or int(span_id, 16) == 0:
        return None
    return trace.SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=trace.TraceFlags(int(flags, 16) & 0x01)
    )


def format_traceparent(span_context: trace.SpanContext) -> str | None:
    """The ``traceparent`` value of a span context (version 00), or None for an invalid one. Pure."""
    if not span_context.is_valid:
        return None
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """An OpenTelemetry context whose current span is the remote parent ``traceparent``, or None."""
    parent = parse_traceparent(traceparent)
    return None if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span current in this context (ours, or a remote parent), or None."""
    return format_traceparent(trace.get_current_span().get_span_context())


@contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make ``ctx`` the current OpenTelemetry context for the block (nothing when None)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def bounded(value: Any) -> str:
    """Captured content as an attribute value: ``str(value)`` cut at :data:`MAX_CONTENT_CHARS`."""
    return str(value)[:MAX_CONTENT_CHARS]
