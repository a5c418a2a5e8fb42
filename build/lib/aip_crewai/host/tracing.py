"""The host's spans of an action: its submission, the approval wait, its dispatch (docs/observing.md "Observing actions").

- ``aip.action.submit`` (kind server): ``POST /aip/v1/messages`` with an action, child of the request's W3C
  ``traceparent`` when it has a valid one; one ``aip.fence`` event per fence decision (idempotency,
  approval) with ``aip.fence`` and ``aip.fence.decision``.
- ``aip.approval.wait``: a governed action, from its approval request (the action's creation) to its
  dispatch after the approval; ``aip.approval_id``.
- ``aip.action.dispatch`` (kind client): the job on the sidecar until the result is stored; the sidecar's
  requests carry its ``traceparent``.

The action row keeps the trace context current at its creation (``actions.trace_parent``, store
migration 6: :func:`aip_crewai.tracing.current_traceparent`), so the dispatch after an approval, on
whichever host runs it, continues the same trace. With tracing off (:func:`activate` never called), an
incoming ``traceparent`` is still stored and passed on to the sidecar unchanged: nothing else is done.

Attributes: ``aip.tenant``, ``aip.action_id``, ``aip.capability_id``, ``aip.operation``, ``aip.crew_id``,
``aip.status``, ``aip.error_code``: never inputs or outputs.

Source: docs/observing.md "Observing actions" (Traces); ARCHITECTURE.md §9 (dispatch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .. import tracing
from ..tracing import Tracing

__all__ = [
    "TraceRef",
    "activate",
    "active",
    "deactivate",
    "describe",
    "dispatching",
    "error_code",
    "fence_decided",
    "outgoing_headers",
    "record_outcome",
    "submission",
]

_active: Tracing | None = None


def activate(installed: Tracing | None) -> None:
    """Trace this process's actions with ``installed`` (the app's lifespan; None: off)."""
    global _active
    _active = installed


def deactivate() -> Tracing | None:
    """Stop tracing; return what was active (the lifespan shuts it down)."""
    global _active
    installed, _active = _active, None
    return installed


def active() -> Tracing | None:
    """The active tracing, or None (off)."""
    return _active


@dataclass(frozen=True)
class TraceRef:
    """What a dispatch continues (from the action row): ``trace_parent`` (W3C ``traceparent`` or None),
    the action's identity, and ``created_at`` (ms: the approval request of a governed action)."""

    trace_parent: str | None
    tenant: str
    action_id: str
    capability_id: str
    crew_id: str
    operation: str
    approval_id: str | None
    created_at: int

    @classmethod
    def of(cls, record: Any) -> TraceRef:
        """The reference of a stored action record (:class:`~.store.records.ActionRecord`)."""
        return cls(
            record.trace_parent,
            record.tenant,
            record.action_id,
            record.capability_id,
            record.crew_id,
            record.operation,
            record.approval_id,
            record.created_at,
        )

    def attributes(self) -> dict[str, str]:
        return {
            "aip.tenant": self.tenant,
            "aip.action_id": self.action_id,
            "aip.capability_id": self.capability_id,
            "aip.operation": self.operation,
            "aip.crew_id": self.crew_id,
        }


@contextmanager
def submission(traceparent: str | None) -> Iterator[Span | None]:
    """The ``aip.action.submit`` span of one ``POST /aip/v1/messages`` (current for the block), or None.

    Off: a valid ``traceparent`` is made current (stored with the action, passed on to the sidecar).
    An exception leaving the block sets the span's status to error and ``aip.error_code`` when it has a
    ``code``; the exception goes on.
    """
    parent = tracing.context_of(traceparent)
    if _active is None:
        with tracing.attached(parent):
            yield None
        return
    with _active.tracer.start_as_current_span(
        "aip.action.submit", context=parent, kind=SpanKind.SERVER, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            _failed(span, getattr(exc, "code", None) or type(exc).__name__)
            raise


def describe(span: Span | None, tenant: str, action_id: str, capability_id: str) -> None:
    """Name the action on its submission span (nothing when None)."""
    if span is not None and span.is_recording():
        span.set_attributes({"aip.tenant": tenant, "aip.action_id": action_id, "aip.capability_id": capability_id})


def record_outcome(span: Span | None, record: Any) -> None:
    """Set ``aip.crew_id``, ``aip.operation``, ``aip.status`` and ``aip.error_code`` (with an error status)
    from the stored action record (:class:`~.store.records.ActionRecord`) the span answered."""
    if span is None or not span.is_recording():
        return
    span.set_attributes({"aip.crew_id": record.crew_id, "aip.operation": record.operation})
    span.set_attribute("aip.status", getattr(record.status, "value", str(record.status)))
    code = error_code(record.result_json)
    if code is not None:
        _failed(span, code)


class _Coded(msgspec.Struct):
    code: str | None = None


class _Failed(msgspec.Struct):
    error: _Coded | None = None


def error_code(result_json: str | None) -> str | None:
    """The ``error.code`` of a stored AIP ``ActionResult`` (JSON text), or None. Pure."""
    if not result_json:
        return None
    try:
        error = msgspec.json.decode(result_json, type=_Failed).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return None if error is None else error.code


def _failed(span: Span, code: str) -> None:
    span.set_attribute("aip.error_code", str(code))
    span.set_status(Status(StatusCode.ERROR))


def fence_decided(metrics: Any, fence: str, decision: str) -> None:
    """Count a fence decision (``aip_host_fence_decisions_total``) and add it to the current span as an
    ``aip.fence`` event."""
    if metrics is not None:
        metrics.fence_decisions.inc(fence=fence, decision=decision)
    if _active is not None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("aip.fence", {"aip.fence": fence, "aip.fence.decision": decision})


@contextmanager
def dispatching(ref: TraceRef | None, now_ms: int) -> Iterator[Span | None]:
    """The ``aip.action.dispatch`` span of a job (current for the block, so the sidecar client passes it
    on), child of the action's stored trace context; before it, a governed action's ``aip.approval.wait``
    span from ``ref.created_at`` to ``now_ms``. Off: the stored context is made current (passed on)."""
    parent = tracing.context_of(ref.trace_parent) if ref is not None else None
    if _active is None or ref is None:
        with tracing.attached(parent):
            yield None
        return
    attributes = ref.attributes()
    if ref.approval_id is not None:
        wait = _active.tracer.start_span(
            "aip.approval.wait",
            context=parent,
            attributes={**attributes, "aip.approval_id": ref.approval_id},
            start_time=ref.created_at * 1_000_000,
        )
        wait.end(end_time=max(now_ms, ref.created_at) * 1_000_000)
    with _active.tracer.start_as_current_span(
        "aip.action.dispatch",
        context=parent,
        kind=SpanKind.CLIENT,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def outgoing_headers() -> dict[str, str]:
    """``{"traceparent": ...}`` of the current span for a request to the sidecar, or ``{}``."""
    value = tracing.current_traceparent()
    return {} if value is None else {"traceparent": value}
