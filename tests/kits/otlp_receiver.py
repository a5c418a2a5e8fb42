"""A real OTLP/HTTP trace receiver on loopback (docs/observing.md "Observing actions": Traces), for the
tracing and real-crew suites.

:class:`OtlpReceiver` serves ``POST /v1/traces`` (protobuf ``ExportTraceServiceRequest``) in a thread and
keeps every span it decodes; :func:`otel_env` is the standard variables pointing a process at it.
"""

from __future__ import annotations

import http.server
import threading
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback: ``POST /v1/traces`` (protobuf) → :attr:`spans`.

    Each span is kept as ``{"service", "name", "trace_id", "span_id", "parent_span_id", "attributes",
    "events", "status"}`` (ids in lower-case hex, attribute values as strings or ints)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter appends ``/v1/traces``)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {
                        a.key: a.value.string_value if a.value.HasField("string_value") else a.value.int_value
                        for a in span.attributes
                    }
                    event_attributes = [
                        {a.key: a.value.string_value for a in event.attributes} for event in span.events
                    ]
                    with self.lock:
                        self.spans.append(
                            {
                                "service": service,
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "attributes": attributes,
                                "events": event_attributes,
                                "status": span.status.code,
                            }
                        )

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        """The spans received so far of the trace ``trace_id`` (32 lower-case hex digits)."""
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]

    def summary(self) -> list[tuple[str, str, str]]:
        """``(service, name, trace id)`` of every span received, for failure messages."""
        with self.lock:
            return sorted({(s["service"], s["name"], s["trace_id"]) for s in self.spans})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def otel_env(endpoint: str) -> dict[str, str]:
    """The standard variables only; a short batch delay so a test's poll ends sooner (no timing is asserted).

    ``OTEL_SDK_DISABLED`` is not among them: the suite's conftest sets it to ``true`` in the test process (for
    CrewAI), so a caller passing the test process's environment on must drop or override it."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
