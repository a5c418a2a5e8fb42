"""Which webhook events a state change makes, and their bodies (pure; docs/webhooks.md).

:class:`WebhookEvents` is the store's outbox hook (:class:`~aip_crewai.host.store.records.OutboxEvents`): the
store asks it, inside the transaction of the change, for the rows to write with it:

| change | event |
|---|---|
| an approval created (``pending``) | ``approval.requested`` |
| an approval ``approved`` or ``denied`` | ``approval.decided`` |
| a FINAL result of an action whose operation starts a sidecar job (``run``, ``batch_run``, …; and a pending action expired or withdrawn) | ``action.completed`` / ``action.failed`` / ``action.cancelled`` |

No event for: an approval expired or withdrawn (its action's ``action.failed`` / ``action.cancelled`` says
it); a provisional failure (its final correction sends the event, ARCHITECTURE.md §9 "Final results");
reads answered inline (``status``, ``events``, ``cancel``: the run they target sends its own).

Body (the Standard Webhooks shape): ``{"type", "timestamp" (RFC 3339, when the change happened), "data"}``;
``data`` is the AIP ``ApprovalRecordView`` without ``evidence_payload`` (no input leaves), or the AIP
``ActionResult`` without ``output`` unless the endpoint has ``include_output = true``. The body is fixed
when the event is written: every attempt sends the same bytes under the same ``webhook-id`` (the row's
``delivery_id``, ``msg_`` + 32 hex digits).

Source: docs/webhooks.md; ARCHITECTURE.md §9, §10.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from ...contracts import operations as ops
from ..actions.lifecycle import ActionState, result_is_final
from ..crews.descriptors import CrewDescriptor
from ..http.approvals import render
from ..store.records import ActionRecord, ApprovalRecord, OutboxRow, ms_to_rfc3339
from .config import Endpoint, WebhookSettings

_encode = msgspec.json.Encoder()
_decode = msgspec.json.Decoder(dict[str, Any])

#: Approval status → event type (others send none).
APPROVAL_EVENTS = {"pending": "approval.requested", "approved": "approval.decided", "denied": "approval.decided"}
#: Final action state → event type.
RESULT_EVENTS = {
    ActionState.COMPLETED: "action.completed",
    ActionState.FAILED: "action.failed",
    ActionState.CANCELLED: "action.cancelled",
}


def new_delivery_id() -> str:
    """A fresh ``webhook-id``: ``msg_`` + 32 hex digits."""
    return "msg_" + secrets.token_hex(16)


def body(event_type: str, timestamp_ms: int, data: Any) -> str:
    """The JSON text of one event: ``{"type", "timestamp", "data"}``."""
    return _encode.encode({"type": event_type, "timestamp": ms_to_rfc3339(timestamp_ms), "data": data}).decode()


def result_data(result_json: str, *, include_output: bool) -> dict[str, Any]:
    """The ``data`` of an action event: the stored ActionResult, without ``output`` unless asked."""
    result = _decode.decode(result_json)
    if not include_output:
        result.pop("output", None)
    return result


class WebhookEvents:
    """The outbox hook over the configured endpoints (see the module docstring). ``crews``: crew id →
    admitted descriptor (an approval view names its crew)."""

    def __init__(self, settings: WebhookSettings, crews: Mapping[str, CrewDescriptor]) -> None:
        self.settings = settings
        self.crews = crews

    def _rows(
        self, endpoints: list[Endpoint], tenant: str, event_type: str, action_id: str, at_ms: int, data: Any
    ) -> list[OutboxRow]:
        return [
            OutboxRow(
                tenant=tenant,
                delivery_id=new_delivery_id(),
                endpoint_id=endpoint.endpoint_id,
                event_type=event_type,
                action_id=action_id,
                body=body(event_type, at_ms, data(endpoint)),
                created_at=at_ms,
                deadline_at=at_ms + int(endpoint.deadline_s * 1000),
            )
            for endpoint in endpoints
        ]

    def for_approval(self, approval: ApprovalRecord) -> list[OutboxRow]:
        """``approval.requested`` / ``approval.decided`` rows for ``approval`` as just written."""
        event_type = APPROVAL_EVENTS.get(approval.status)
        endpoints = self.settings.subscribed(approval.tenant, event_type) if event_type else []
        if not endpoints or event_type is None:
            return []
        at_ms = approval.decided_at if approval.decided_at is not None else approval.created_at
        view = render(approval, at_ms, self.crews, with_payload=False)
        data = msgspec.json.decode(_encode.encode(view))
        return self._rows(endpoints, approval.tenant, event_type, approval.action_id, at_ms, lambda _: data)

    def for_result(self, record: ActionRecord) -> list[OutboxRow]:
        """``action.*`` rows for ``record``'s stored result, when it is final and its operation starts a job."""
        state = ActionState(record.status)
        event_type = RESULT_EVENTS.get(state)
        if event_type is None or record.result_json is None:
            return []
        spec = ops.get(record.operation)
        if not spec.startable:
            return []
        endpoints = self.settings.subscribed(record.tenant, event_type)
        if not endpoints:
            return []
        result = _decode.decode(record.result_json)
        error = result.get("error") if isinstance(result.get("error"), dict) else None
        details = error.get("details") if error is not None and isinstance(error.get("details"), dict) else None
        if not result_is_final(
            state, startable=True, error_code=error.get("code") if error is not None else None, details=details
        ):
            return []
        text = record.result_json
        return self._rows(
            endpoints,
            record.tenant,
            event_type,
            record.action_id,
            record.updated_at,
            lambda endpoint: result_data(text, include_output=endpoint.include_output),
        )
