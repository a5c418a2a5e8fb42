"""``GET /aip/v1/approvals/{id}/notifications``: did the approval's ``approval.requested`` webhook go out?

For the approval console (docs/webhooks.md "Notification state"): the delivery state of each
``approval.requested`` delivery of one approval, under the approval's own read rules (approvers and
operators of its tenant; 403 ``policy.forbidden`` for anyone else; 404 ``approval.not_found`` for an unknown
approval or another tenant's). States only: no URL, endpoint id, secret, body or receiver answer, so an
approver without the operator role learns whether and when the notification was delivered and nothing about
where it went. Not an AIP object: the approval's own view (``ApprovalRecordView``) is unchanged.

A delivery's ``state`` (:func:`delivery_state`):

| state | the outbox row |
|---|---|
| ``queued`` | pending, not attempted yet |
| ``retrying`` | pending after failed attempts (``attempts``, ``next_attempt_at``, ``last_outcome``) |
| ``delivered`` | the receiver answered 2xx (``delivered_at``) |
| ``expired`` | its deadline passed first, or its entry was removed (``expired_at``) |

The answer's ``state`` sums them up (:func:`overall_state`): ``none`` when the approval has no delivery
(no ``[[webhooks]]`` entry of the tenant subscribed to ``approval.requested`` when it was created), else the
first of ``retrying``, ``queued``, ``expired`` that any delivery is in, else ``delivered`` (all were).

Source: docs/webhooks.md "Notification state"; docs/security.md "Who reads what".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ...contracts.errors import ApprovalNotFound
from ..auth.principals import can_read_approvals
from ..http.authenticate import authenticate
from ..http.state import host_state
from ..store.outbox import DELIVERED, EXPIRED, PENDING
from ..store.records import DeliveryRecord, ms_to_rfc3339
from .config import MAX_WEBHOOKS

#: The event whose deliveries this route reports.
EVENT_TYPE = "approval.requested"
DeliveryState = Literal["queued", "retrying", "delivered", "expired"]
OverallState = Literal["none", "queued", "retrying", "delivered", "expired"]
#: The overall state: the first of these any delivery is in, else ``delivered``.
_PRECEDENCE: tuple[DeliveryState, ...] = ("retrying", "queued", "expired")


class Notification(msgspec.Struct, frozen=True):
    """One delivery of the approval's ``approval.requested`` event. ``delivery_id`` is the ``webhook-id``
    the receiver saw (``msg_`` + 32 hex digits); times are RFC 3339; ``attempts`` counts the attempts made;
    ``next_attempt_at`` only while queued or retrying; ``delivered_at`` / ``expired_at`` once so;
    ``last_outcome`` the last attempt's outcome (``http_error``, ``timeout``, ``connect_error``,
    ``refused``, ``endpoint_removed``, ``delivered``; ``deadline`` when it expired unattempted)."""

    delivery_id: str
    state: DeliveryState
    attempts: int
    created_at: str
    next_attempt_at: str | None
    delivered_at: str | None
    expired_at: str | None
    last_outcome: str | None


class ApprovalNotifications(msgspec.Struct, frozen=True):
    """The route's answer: the approval, the overall ``state`` and each delivery, oldest first."""

    approval_id: str
    action_id: str
    event_type: str
    state: OverallState
    notifications: list[Notification]


def delivery_state(record: DeliveryRecord) -> DeliveryState:
    """``record``'s state (the module table). Pure."""
    if record.status == DELIVERED:
        return "delivered"
    if record.status == EXPIRED:
        return "expired"
    return "retrying" if record.attempts > 0 else "queued"


def notification(record: DeliveryRecord) -> Notification:
    """``record`` as an approver reads it: states and times only. Pure."""
    state = delivery_state(record)
    finished = ms_to_rfc3339(record.finished_at) if record.finished_at is not None else None
    return Notification(
        delivery_id=record.delivery_id,
        state=state,
        attempts=record.attempts,
        created_at=ms_to_rfc3339(record.created_at),
        next_attempt_at=ms_to_rfc3339(record.next_attempt_at) if record.status == PENDING else None,
        delivered_at=finished if state == "delivered" else None,
        expired_at=finished if state == "expired" else None,
        last_outcome=record.last_outcome,
    )


def overall_state(states: Sequence[DeliveryState]) -> OverallState:
    """The summary of the deliveries' ``states``: ``none`` without any, else the first of ``retrying``,
    ``queued``, ``expired`` among them, else ``delivered``. Pure."""
    if not states:
        return "none"
    return next((s for s in _PRECEDENCE if s in states), "delivered")


async def get_notifications(request: Request) -> Response:
    """``GET /aip/v1/approvals/{id}/notifications`` → :class:`ApprovalNotifications` (the module docstring's
    rules: 401 without a credential, 403 for a principal who may not read approvals, 404 unknown or
    another tenant's)."""
    principal = await authenticate(request)
    can_read_approvals(principal)
    state = host_state(request)
    approval = await state.store.get_approval(principal.tenant, request.path_params["approval_id"])
    if approval is None:
        raise ApprovalNotFound(request.path_params["approval_id"])
    records = await state.store.list_deliveries(
        approval.tenant, event_type=EVENT_TYPE, action_id=approval.action_id, limit=MAX_WEBHOOKS
    )
    found = [notification(r) for r in sorted(records, key=lambda r: (r.created_at, r.delivery_id))]
    body = ApprovalNotifications(
        approval_id=approval.approval_id,
        action_id=approval.action_id,
        event_type=EVENT_TYPE,
        state=overall_state([n.state for n in found]),
        notifications=found,
    )
    return Response(msgspec.json.encode(body), media_type="application/json")
