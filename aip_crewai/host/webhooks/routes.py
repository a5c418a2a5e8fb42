"""``GET /aip/v1/webhooks/deliveries``: a tenant's webhook deliveries and their attempts, for its operators.

Query: ``endpoint`` (an endpoint id, ``whe_`` + 24 hex digits), ``event_type`` (one of
:data:`~.config.EVENT_TYPES`), ``status`` (``pending``, ``delivered``, ``expired``), ``action_id``,
``cursor`` (opaque: the previous page's), ``limit`` (1..:data:`MAX_LIMIT`, default :data:`DEFAULT_LIMIT`).
Newest first. The answer is a :class:`DeliveryList`: ``done`` is true on the last page, and ``cursor``
(null then) continues the listing. A bad value is a 400 ``message.invalid_envelope`` naming the parameter
(a bad cursor: 400 ``request.invalid_cursor``); a principal without the operator role gets 403
``policy.forbidden``. No URL, secret or body is listed: only ids, times (RFC 3339), outcomes and statuses.

Thin handler: :meth:`Store.list_deliveries` reads, :func:`delivery_view` renders (pure).

Source: docs/webhooks.md "Listing deliveries"; docs/reference/configuration.md "Configuration reference".
"""

from __future__ import annotations

import re

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...contracts.errors import Forbidden, InvalidEnvelope
from ...contracts.inputs import ACTION_ID_PATTERN
from ..http.authenticate import authenticate
from ..http.state import host_state
from ..store.outbox import DELIVERED, EXPIRED, PENDING, delivery_cursor
from ..store.records import DeliveryRecord, ms_to_rfc3339
from .config import EVENT_TYPES
from .notifications import get_notifications

#: A page's size bounds.
DEFAULT_LIMIT, MAX_LIMIT = 50, 200
STATUSES = (PENDING, DELIVERED, EXPIRED)
_ENDPOINT_RE = re.compile(r"^whe_[0-9a-f]{24}(?!\n)$")
_ACTION_ID_RE = re.compile(ACTION_ID_PATTERN)
_MAX_ACTION_ID = 256


class DeliveryAttemptView(msgspec.Struct, frozen=True):
    """One attempt: ``outcome`` is ``delivered``, ``http_error``, ``timeout``, ``connect_error``, ``refused``
    or ``endpoint_removed``; ``status_code`` the receiver's, when it answered."""

    attempt: int
    host_id: str
    started_at: str
    duration_ms: int
    outcome: str
    status_code: int | None


class DeliveryView(msgspec.Struct, frozen=True):
    """One delivery (one event to one endpoint; ``delivery_id`` is its ``webhook-id`` header).
    ``next_attempt_at`` only while pending; ``finished_at`` once delivered or expired; ``attempts`` counts
    them all, ``history`` lists the latest 20, oldest first."""

    delivery_id: str
    endpoint_id: str
    event_type: str
    action_id: str
    status: str
    attempts: int
    created_at: str
    deadline_at: str
    next_attempt_at: str | None
    finished_at: str | None
    last_outcome: str | None
    history: list[DeliveryAttemptView]


class DeliveryList(msgspec.Struct, frozen=True):
    """One page of deliveries, newest first; ``cursor`` (null when ``done``) asks for the next."""

    deliveries: list[DeliveryView]
    cursor: str | None
    done: bool


def delivery_view(record: DeliveryRecord) -> DeliveryView:
    """``record`` as listed (pure)."""
    return DeliveryView(
        delivery_id=record.delivery_id,
        endpoint_id=record.endpoint_id,
        event_type=record.event_type,
        action_id=record.action_id,
        status=record.status,
        attempts=record.attempts,
        created_at=ms_to_rfc3339(record.created_at),
        deadline_at=ms_to_rfc3339(record.deadline_at),
        next_attempt_at=ms_to_rfc3339(record.next_attempt_at) if record.status == PENDING else None,
        finished_at=ms_to_rfc3339(record.finished_at) if record.finished_at is not None else None,
        last_outcome=record.last_outcome,
        history=[
            DeliveryAttemptView(
                attempt=a.attempt,
                host_id=a.host_id,
                started_at=ms_to_rfc3339(a.started_at),
                duration_ms=a.duration_ms,
                outcome=a.outcome,
                status_code=a.status_code,
            )
            for a in record.history
        ],
    )


def _one_of(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    value = request.query_params.get(name)
    if value is not None and value not in allowed:
        raise InvalidEnvelope(
            f"{name} must be one of {', '.join(allowed)}, not {value[:64]!r}", details={"parameter": name}
        )
    return value


def _matching(request: Request, name: str, pattern: re.Pattern[str], max_chars: int, what: str) -> str | None:
    value = request.query_params.get(name)
    if value is not None and (len(value) > max_chars or not pattern.match(value)):
        raise InvalidEnvelope(f"{name} must be {what}", details={"parameter": name})
    return value


def _limit(request: Request) -> int:
    text = request.query_params.get("limit", str(DEFAULT_LIMIT))
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIMIT:  # not ², not ٣
        raise InvalidEnvelope(f"limit must be an integer 1..{MAX_LIMIT}", details={"parameter": "limit"})
    return int(text)


async def list_deliveries(request: Request) -> Response:
    """``GET /aip/v1/webhooks/deliveries``: one :class:`DeliveryList` page (the module docstring's rules)."""
    principal = await authenticate(request)
    if not principal.has_role("operator"):
        raise Forbidden("webhook deliveries are for the tenant's operators")
    status = _one_of(request, "status", STATUSES)
    event_type = _one_of(request, "event_type", EVENT_TYPES)
    endpoint = _matching(request, "endpoint", _ENDPOINT_RE, 28, "an endpoint id (whe_ and 24 hex digits)")
    action_id = _matching(request, "action_id", _ACTION_ID_RE, _MAX_ACTION_ID, "an action id")
    limit = _limit(request)
    records = await host_state(request).store.list_deliveries(
        principal.tenant,
        status=status,
        event_type=event_type,
        action_id=action_id,
        endpoint_id=endpoint,
        limit=limit + 1,
        before=request.query_params.get("cursor"),
    )
    page, done = records[:limit], len(records) <= limit
    body = DeliveryList(
        deliveries=[delivery_view(r) for r in page],
        cursor=None if done else delivery_cursor(page[-1]),
        done=done,
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


def routes() -> list[Route]:
    """The webhook routes, mounted by the host app: the operators' listing, and the approval notification
    state the approval console reads (:mod:`.notifications`)."""
    return [
        Route("/aip/v1/webhooks/deliveries", list_deliveries, methods=["GET"]),
        Route("/aip/v1/approvals/{approval_id:str}/notifications", get_notifications, methods=["GET"]),
    ]
