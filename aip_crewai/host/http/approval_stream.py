"""``GET /aip/v1/approvals/events``: the approver's tenant's approval events, live (SSE).

Frames (docs/approvals.md "Approval events"):

The stream opens with ``retry: 3000`` (:data:`RETRY_MS`): the reconnection time a client waits (plus
its own jitter, as the console adds) before it resumes with ``Last-Event-ID``.

| SSE event | id | when | ``data`` |
|---|---|---|---|
| ``pending`` | none | a fresh connection: one per approval pending now (the snapshot) | an AIP ``Event`` |
| ``ready`` | ``apv_<n>`` | after the snapshot: the position live events continue from | ``{"position": "apv_<n>"}`` |
| ``pending`` | ``apv_<n>`` | an approval was requested | an AIP ``Event`` |
| ``decided`` | ``apv_<n>`` | approved or denied | an AIP ``Event`` |
| ``expired`` | ``apv_<n>`` | its TTL ran out (the 5 s sweep, or a read) | an AIP ``Event`` |
| ``withdrawn`` | ``apv_<n>`` | its action was cancelled first | an AIP ``Event`` |

The ``Event`` (schema ``event``): ``id`` the position, ``kind``
``approval.<event>``, ``occurred_at``, ``action_id``, ``actor`` (the
requester, the decider, or the host for an expiry), and ``data`` the
approval's ``ApprovalRecordView`` as it is NOW (without the input: read it
with ``GET /aip/v1/approvals/{id}``). Positions come from the store's
approval event log (per tenant, from 1; written by triggers in the same
transaction as each change), so ``Last-Event-ID: apv_<n>`` (or
``?cursor=apv_<n>``) resumes exactly after n, across host restarts. A
keep-alive comment goes out every :data:`KEEPALIVE_S` seconds of silence (also while the store
cannot be read: the stream stays open and reads again, :func:`.stopping.after_store_fault`);
at shutdown the stream ends with the resume comment (:mod:`.stopping`).

Who: approvers and operators of the tenant (403 otherwise), by bearer
token, signed request, or a stream token of scope ``approvals``
(:mod:`.authenticate`).

Source: docs/approvals.md "Approval events"; ARCHITECTURE.md §10 (live followers, the approval event log).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ...contracts.aip import Event
from ...sse import encode_comment, encode_event, encode_retry
from ..actions.lifecycle import ApprovalStatus
from ..actions.service import ActionService
from ..auth.principals import can_read_approvals
from ..auth.stream_tokens import APPROVALS_SCOPE
from ..store.store import ApprovalRecord, InvalidCursor, StoreUnavailable, ms_to_rfc3339
from .approvals import HOST_PRINCIPAL, principal_view, render
from .authenticate import authenticate_stream
from .routes import SSE_HEADERS
from .state import host_state
from .stopping import after_store_fault, until_stopping

#: Keep-alive comment interval, seconds (as on action streams).
KEEPALIVE_S = 15.0
#: The ``retry`` the stream opens with: the reconnection time, milliseconds (docs/approvals.md "Approval events").
RETRY_MS = 3000
#: Events read per store query.
PAGE_EVENTS = 500
#: SSE event name per stored approval status.
EVENT_NAMES = {
    "pending": "pending",
    "approved": "decided",
    "denied": "decided",
    "expired": "expired",
    "withdrawn": "withdrawn",
}
_encode = msgspec.json.Encoder()


def position(seq: int) -> str:
    """The SSE id of event ``seq``: ``apv_<seq>``."""
    return f"apv_{seq}"


def parse_position(text: str) -> int:
    """``apv_<n>`` (or ``<n>``) → n. Raises InvalidCursor (400)."""
    digits = text[4:] if text.startswith("apv_") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:  # str.isdigit alone takes ² and ٣
        raise InvalidCursor("Last-Event-ID (or cursor) must be apv_<n>")
    return int(digits)


def approval_event(
    approval: ApprovalRecord, status: str, seq: int | None, now_ms: int, crews: Mapping[str, Any]
) -> tuple[str, Event]:
    """The SSE event name and AIP ``Event`` of one logged change (``status``
    is the status the change set; ``seq`` None for a snapshot entry). Pure."""
    name = EVENT_NAMES.get(status, "pending")
    if name == "decided" and approval.decided_at is not None:
        at, actor = approval.decided_at, principal_view(approval.decided_by or "")
    elif name == "expired":
        at, actor = approval.expires_at, HOST_PRINCIPAL
    elif name == "withdrawn":
        at, actor = now_ms, principal_view(approval.requested_by)
    else:
        at, actor = approval.created_at, principal_view(approval.requested_by)
    event = Event(
        id=position(seq) if seq is not None else f"{approval.approval_id}:pending",
        kind=f"approval.{name}",
        occurred_at=ms_to_rfc3339(at),
        action_id=approval.action_id,
        correlation_id=approval.approval_id,
        actor=actor,
        data=render(approval, now_ms, crews, with_payload=False),
    )
    return name, event


async def follow_approvals(
    service: ActionService, tenant: str, crews: Mapping[str, Any], after: int | None
) -> AsyncIterator[bytes]:
    """The frames of a tenant's approval stream (module table), forever.

    Args:
        after: resume after this position; None for a fresh connection
            (the snapshot of pending approvals, then ``ready``).
    """
    store = service.store
    signal = store.approvals_changed
    yield encode_retry(RETRY_MS)
    wrote_at = time.monotonic()
    while True:
        comment: bytes | None = None
        try:
            if after is None:
                after, snapshot = await _snapshot(service, tenant, crews)
                yield snapshot
                wrote_at = time.monotonic()
            seen = signal.version  # before reading: a change after the read wakes the wait below
            events = await store.list_approval_events(tenant, after, PAGE_EVENTS)
            if events:
                now = service.now_ms()
                frames = []
                for logged in events:
                    found = await store.get_approval(tenant, logged.approval_id)
                    if found is not None:
                        name, event = approval_event(found, logged.status, logged.seq, now, crews)
                        frames.append(encode_event(_encode.encode(event).decode(), event=name, id=position(logged.seq)))
                    after = logged.seq
                if frames:
                    yield b"".join(frames)
                    wrote_at = time.monotonic()
                if len(events) == PAGE_EVENTS:
                    continue
            if not await signal.wait(KEEPALIVE_S, seen=seen):
                comment = encode_comment("keep-alive")
        except StoreUnavailable:  # logged by the store: the stream stays open and reads again (stopping.py)
            comment = await after_store_fault(wrote_at, KEEPALIVE_S)
        if comment is not None:
            yield comment
            wrote_at = time.monotonic()


async def _snapshot(service: ActionService, tenant: str, crews: Mapping[str, Any]) -> tuple[int, bytes]:
    """A fresh connection's start: the position of the tenant's latest approval event and the frames of
    its pending approvals (as of now), then ``ready`` at that position."""
    store = service.store
    after = await store.last_approval_event(tenant)
    await service.expire_due()
    now = service.now_ms()
    frames = []
    cursor = None
    while True:
        page = await store.list_approvals(tenant, status="pending", cursor=cursor, limit=200)
        for approval in page.items:
            if approval.effective_status(now) is ApprovalStatus.PENDING:
                name, event = approval_event(approval, "pending", None, now, crews)
                frames.append(encode_event(_encode.encode(event).decode(), event=name))
        if page.done:
            break
        cursor = page.next_cursor
    frames.append(
        encode_event(_encode.encode({"position": position(after)}).decode(), event="ready", id=position(after))
    )
    return after, b"".join(frames)


async def get_approval_events(request: Request) -> Response:
    """``GET /aip/v1/approvals/events`` (``Accept: text/event-stream``): the
    tenant's approval events (module docstring); 403 for a principal that is
    neither approver nor operator; 400 a malformed ``Last-Event-ID``/``cursor``
    or one past the latest event."""
    principal = await authenticate_stream(request, scope=APPROVALS_SCOPE)
    can_read_approvals(principal)
    state = host_state(request)
    service = state.actions
    value = request.headers.get("last-event-id") or request.query_params.get("cursor")
    after = parse_position(value) if value else None
    if after is not None and after > await service.store.last_approval_event(principal.tenant):
        raise InvalidCursor("Last-Event-ID is past the latest approval event of this tenant")
    frames = follow_approvals(service, principal.tenant, state.crews, after)
    return StreamingResponse(
        until_stopping(state.stopping, frames), media_type="text/event-stream", headers=SSE_HEADERS
    )


def routes() -> list[Route]:
    """The approval stream route (mounted before ``/aip/v1/approvals/{id}``)."""
    return [Route("/aip/v1/approvals/events", get_approval_events, methods=["GET"])]
