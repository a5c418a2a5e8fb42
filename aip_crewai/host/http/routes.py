"""HTTP handlers for actions: ``POST /aip/v1/messages`` and the action history routes. Thin: authenticate,
decode, call :class:`ActionService`, render AIP envelopes (JSON or SSE).

Source: ARCHITECTURE.md §6 (routes, SSE profile), §7 (fences), §8 (cancellation).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ...contracts.aip import (
    AIP_VERSION,
    CONTENT_TYPE,
    Ack,
    Action,
    ActionEvents,
    ActionResult,
    ActionStatus,
    Body,
    Envelope,
    ErrorBody,
    Event,
    ProtocolError,
    StreamChunk,
)
from ...contracts.errors import CrewUnavailable, InvalidEnvelope, MessageTooLarge
from ...contracts.inputs import path_segment, plain_rule, too_deep, too_deep_text
from ...plumbing import httpsig
from ...plumbing.asgi import read_bounded
from ...sse import encode_comment, encode_event, encode_page, page_template
from .. import stream_positions
from .. import tracing as host_tracing
from ..actions.lifecycle import ActionState, ack_reason, ack_status, is_terminal, lifecycle_state
from ..actions.live import follow_page
from ..actions.recovery import is_final
from ..actions.service import ActionService
from ..auth.principals import FULL, INPUT_PATH, MAX_ENVELOPE_DEPTH, Principal, envelope_too_deep, require_role
from ..auth.stream_tokens import action_scope
from ..crews.inputs import check_crew_inputs
from ..ledger.routes import include_receipts, receipt_chain
from ..store.store import ActionRecord, ChunkRecord, InvalidCursor, StoreUnavailable, ms_to_rfc3339
from ..stream_positions import Position
from .authenticate import authenticate, authenticate_stream
from .limits import JSON_BODY, MAX_MESSAGE_BYTES
from .state import host_state
from .stopping import after_store_fault, unless_stopping, until_stopping

#: Keep-alive comment interval on tenant SSE streams, seconds (ARCHITECTURE.md §4).
KEEPALIVE_S = 15.0
#: Longest a stream of a pending action waits before reading its state again (a decision through another host), s.
PENDING_POLL_S = 2.0
#: Longest a blocking JSON call waits for the result, seconds, beyond the action timeout.
WAIT_MARGIN_S = 30.0
_encode = msgspec.json.Encoder()
_chunk_decoder = msgspec.json.Decoder(StreamChunk)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def envelope(
    message_type: str, body: Body, *, correlation_id: str | None = None, sent_at: str | None = None
) -> Envelope:
    """A host-originated envelope with a fresh message id (``sent_at``: now, unless given)."""
    if sent_at is None:
        sent_at = ms_to_rfc3339(int(time.time() * 1000))
    return Envelope(
        aip_version=AIP_VERSION,
        message_type=message_type,
        message_id="msg_" + secrets.token_hex(12),
        sent_at=sent_at,
        body=body,
        correlation_id=correlation_id,
    )


def aip_json(value: Any, status: int = 200) -> Response:
    return Response(_encode.encode(value), status_code=status, media_type=CONTENT_TYPE)


def result_envelope(result: ActionResult) -> Envelope:
    return envelope("aip.core.v1.action_result", Body(action_result=result), correlation_id=result.action_id)


async def _read_body(request: Request) -> tuple[bytes, Principal | None]:
    """The message body (at most MAX_MESSAGE_BYTES, declared JSON: else 415) and the principal of a bearer
    credential, checked from the header BEFORE the body is read (401 without reading it); only a request without
    one (a signed envelope) needs its body first, and gets None (docs/security.md "Security": authenticate from
    headers first). An RFC 9421 signed request is checked once, with its body (its ``content-digest``)."""
    if "authorization" in request.headers and not httpsig.is_signed(request.headers.keys()):
        principal = await authenticate(request)
        return await read_bounded(request, MAX_MESSAGE_BYTES, MessageTooLarge, media=JSON_BODY), principal
    budget = host_state(request).body_budget  # read before authentication: within the process's budget
    return await read_bounded(request, MAX_MESSAGE_BYTES, MessageTooLarge, budget=budget, media=JSON_BODY), None


def _service(request: Request) -> ActionService:
    return host_state(request).actions


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def ack_envelope(record: ActionRecord, *, streaming: bool) -> Envelope:
    """The ``aip.core.v1.ack`` envelope of an accepted action (status per :func:`.lifecycle.ack_status`)."""
    ack = Ack(
        action_id=record.action_id,
        status=ack_status(record.status, record.dispatch, streaming=streaming),
        reason=ack_reason(record.status),
    )
    return envelope("aip.core.v1.ack", Body(ack=ack), correlation_id=record.action_id)


def _decode_envelope(obj: Any) -> Envelope:
    try:
        return msgspec.convert(obj, Envelope, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidEnvelope(f"invalid envelope: {plain_rule(str(exc))}") from exc


async def post_message(request: Request) -> Response:
    """``POST /aip/v1/messages``: an ``aip.core.v1.action`` or ``aip.core.v1.cancel`` envelope.

    Action modes: ``sync`` (default) blocks for the result; ``async``
    answers 202 with an ack at once (follow ``/aip/v1/actions/{id}``);
    ``streaming`` (or ``Accept: text/event-stream``) answers the SSE stream.
    A cancel envelope cancels the named action (same rules as ``POST
    /aip/v1/actions/{id}/cancel``) and answers its result.
    """
    raw, bearer = await _read_body(request)
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested deeper than msgspec allows
        await authenticate(request, raw, None)
        if isinstance(exc, RecursionError):  # deeper than msgspec decodes: the path is found in the text
            raise envelope_too_deep(too_deep_text(raw, MAX_ENVELOPE_DEPTH) or "$") from exc
        raise InvalidEnvelope("the body is not JSON") from exc
    principal = await authenticate(request, raw, obj if isinstance(obj, dict) else None, checked=bearer)
    require_role(principal, "invoker")
    env = _decode_envelope(obj)
    if (deep := too_deep(obj, MAX_ENVELOPE_DEPTH)) and not deep.startswith((f"{INPUT_PATH}.", f"{INPUT_PATH}[")):
        raise envelope_too_deep(deep)  # extensions (an input past its bound is refused later, its path from the input)
    service = _service(request)
    if env.body.cancel is not None:
        target = env.body.cancel.target.action
        if target is None:
            raise InvalidEnvelope('this host cancels actions only: cancel.target must be {"action": id}')
        return aip_json(result_envelope(await service.cancel(principal, target)))
    action = env.body.action
    if action is None:
        raise InvalidEnvelope("this route accepts aip.core.v1.action and aip.core.v1.cancel envelopes")
    # The span of the submission, child of the request's W3C traceparent (docs/observing.md "Observing actions").
    with host_tracing.submission(request.headers.get("traceparent")) as span:
        host_tracing.describe(span, principal.tenant, action.id, action.capability_id)
        record, response = await _submit(request, service, principal, env, action)
        host_tracing.record_outcome(span, record)
        return response


async def _submit(
    request: Request, service: ActionService, principal: Principal, env: Envelope, action: Action
) -> tuple[ActionRecord, Response]:
    """Admit ``action`` (the capability served, its crew inputs, :meth:`ActionService.submit`) and answer it
    in its mode; returns the record answered and the response."""
    stream = _wants_sse(request) or action.streaming
    index = host_state(request).capabilities
    resolved = index.resolve(principal.tenant, action.capability_id)
    # A crew its sidecar's registry lacks cannot run: refused before any approval. A crew whose sidecar is
    # unready (stopped, starting) is accepted: its start is retried until the dispatch deadline (docs/operating.md
    # "Failure behaviour").
    if resolved.crew.id in host_state(request).readiness.unserved_crews:
        raise CrewUnavailable(details={"capability_id": action.capability_id})
    check_crew_inputs(resolved.spec.name, action.input, index.crew_inputs.get(resolved.crew.id))
    record = await service.submit(
        principal, action, env.idempotency_key, stream=stream, blocking=action.mode != "async"
    )
    if stream and _wants_sse(request):
        return record, await _stream_answer(request, service, record, _resume_at(request))
    if action.mode == "async":
        if is_terminal(record.status) or record.status == ActionState.PENDING_APPROVAL:
            return record, await _result_response(service, record)
        return record, aip_json(ack_envelope(record, streaming=False), 202)
    if record.status == ActionState.RUNNING:  # else ended, or pending its approval: nothing to wait for
        timeout_s = (record.timeout_ms or 600_000) / 1000 + WAIT_MARGIN_S
        record = await unless_stopping(host_state(request).stopping, service.wait(record, timeout_s), record)
    return record, await _result_response(service, record)


async def _result_response(service: ActionService, record: ActionRecord) -> Response:
    result = await service.result(record)
    if result is None:  # still running past the wait: tell the caller where to look
        return aip_json(ack_envelope(record, streaming=False), 202)
    return aip_json(result_envelope(result), 202 if result.status == "pending_approval" else 200)


async def _stream_answer(
    request: Request, service: ActionService, record: ActionRecord, after: Position | None
) -> Response:
    """The SSE answer of an action's stream after position ``after`` (None: from the start), for the GET
    route and a re-POST of the envelope alike: ``204 No Content`` when the tenant holds the whole stream
    of an ended action (:func:`.stream_positions.delivered`; ``EventSource`` then stops reconnecting)."""
    if after is not None and is_terminal(record.status):
        result = await service.result(record)
        error, final = result is not None and result.error is not None, is_final(record, result)
        if result is not None and stream_positions.delivered(after, record.chunk_count, error=error, final=final):
            return Response(status_code=204)  # all delivered: EventSource stops reconnecting
    return _sse_response(request, service, record, after)


def _sse_response(
    request: Request, service: ActionService, record: ActionRecord, after: Position | None
) -> StreamingResponse:
    frames = until_stopping(host_state(request).stopping, follow(service, record, after))
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


def _frame(ident: str, name: str, env: Envelope) -> bytes:
    return encode_event(_encode.encode(env).decode(), event=name, id=ident)


class _ChunkKind(msgspec.Struct):
    kind: str


_chunk_kind_decoder = msgspec.json.Decoder(_ChunkKind)


class ChunkFrames:
    """SSE frames of stored chunks, for one page of one action's stream.

    Each frame: position ``sse_<1+sequence>``, event ``done`` for a done chunk
    else ``chunk``, data a ``stream_chunk`` envelope with a fresh message id,
    the page's ``sent_at`` and the stored chunk JSON spliced in as is: the host
    encoded it itself from a valid :class:`StreamChunk`, so it is neither
    decoded nor encoded again, and the envelope around it is a byte template in
    :class:`Envelope`'s own field order (``aip_version``, ``message_type``,
    ``message_id``, ``sent_at``, ``body``, ``correlation_id``). A test checks the
    frame equals ``encode_event`` of the encoded :class:`Envelope`, message id
    aside. Compact JSON has no line ends; a stored row that does hold one goes
    through ``encode_event``. Source: docs/reference/http-api.md "AIP 1.0 conformance" (streams); ARCHITECTURE.md §4 (frame layout).
    """

    def __init__(self, action_id: str, sent_at: str) -> None:
        head = (
            b'{"aip_version":'
            + _encode.encode(AIP_VERSION)
            + b',"message_type":"aip.core.v1.stream_chunk","message_id":"msg_'
        )
        middle = b'","sent_at":' + _encode.encode(sent_at) + b',"body":{"stream_chunk":'
        tail = b'},"correlation_id":' + _encode.encode(action_id) + b"}"
        # id, event, then data = head + message id + middle + the stored chunk + tail
        self._template = page_template(
            head.replace(b"%", b"%%") + b"%s" + middle.replace(b"%", b"%%") + b"%s" + tail.replace(b"%", b"%%"),
            id_prefix=b"sse_",
        )
        self._parts = (head, middle, tail)

    def frame(self, chunk: ChunkRecord, message_id: bytes | None = None) -> bytes:
        """The frame of one stored chunk, bytes (``message_id``: 24 hex digits, fresh when None)."""
        return self._frame(chunk, message_id if message_id is not None else secrets.token_hex(12).encode())

    def page(self, chunks: list[ChunkRecord]) -> bytes:
        """The frames of a page of stored chunks, in order, as one write.

        One draw of random bytes gives the page's message ids; a page whose bytes hold any CR, or more
        than a frame's four LFs per chunk, is built again frame by frame (a stored row with a line end)."""
        ids = secrets.token_hex(12 * len(chunks)).encode()
        values = [
            (1 + chunk.sequence, _kind(chunk.chunk_json), ids[24 * i : 24 * i + 24], chunk.chunk_json.encode())
            for i, chunk in enumerate(chunks)
        ]
        return encode_page(self._template, values, lambda i: self._frame(chunks[i], ids[24 * i : 24 * i + 24]))

    def _frame(self, chunk: ChunkRecord, message_id: bytes) -> bytes:
        name = _kind(chunk.chunk_json)
        head, middle, tail = self._parts
        data = b"".join((head, message_id, middle, chunk.chunk_json.encode(), tail))
        if b"\n" in data or b"\r" in data:
            return encode_event(data.decode(), event=name.decode(), id=f"sse_{1 + chunk.sequence}")
        return _ONE_FRAME % (1 + chunk.sequence, name, data)


#: One frame of :meth:`ChunkFrames._frame` whose data holds no line end.
_ONE_FRAME = page_template(b"%s", id_prefix=b"sse_")


def _kind(chunk_json: str) -> bytes:
    """The SSE event name of a stored chunk: ``done`` for a done chunk, else ``chunk``. A done chunk's JSON
    holds the string ``"done"`` whatever its spacing; only a chunk holding it is decoded to be sure."""
    if '"done"' in chunk_json and _chunk_kind_decoder.decode(chunk_json).kind == "done":
        return b"done"
    return b"chunk"


def _error_envelope(action_id: str, error: ProtocolError) -> Envelope:
    return envelope("aip.core.v1.error", Body(error=ErrorBody(error=error)), correlation_id=action_id)


#: SSE event name of a failed action's error frame: not ``error``, which browsers hand to
#: ``EventSource.onerror`` (their connection-failure handler). docs/reference/http-api.md "Stream frames".
ERROR_EVENT = "aip_error"


def _ending(
    record: ActionRecord, result: ActionResult, after: Position | None
) -> list[tuple[str, ProtocolError | None]]:
    """The frames ending an ended action's stream that a tenant resuming after ``after`` lacks, in order:
    each its SSE id and the error of an ``aip_error`` frame (None: the ``result`` frame); positions and
    the resume rule in :mod:`.stream_positions` (a provisional result's frames take sub-positions)."""
    error, final = result.error is not None, is_final(record, result)
    frames = stream_positions.ending(record.chunk_count, error=error, final=final)
    held = stream_positions.ending_held(after, record.chunk_count, error=error, final=final)
    return [(p.id, result.error if i == 0 else None) for i, p in enumerate(frames)][held:]


async def follow(service: ActionService, record: ActionRecord, after: Position | None) -> AsyncIterator[bytes]:
    """The AIP SSE stream of one action (profile ``aip.sse.stream.v1``) after ``after`` (None: from the ack).

    Positions (:mod:`.stream_positions`): ``sse_0`` ack; ``sse_<1+s>`` the stored chunk of sequence s (event
    ``done`` for a done chunk, else ``chunk``); then ``aip_error`` (failed results) and ``result``, at
    sub-positions ``sse_<C>.1``, ``sse_<C>.2`` for a provisional result; all derived from the store, so
    ``Last-Event-ID`` resumes exactly after it (after a corrected provisional result: at the first chunk the
    tenant lacks). The ack: ``streaming``, ``accepted`` (waiting for its approval: the stream stays open, the
    approval signal or a poll every :data:`PENDING_POLL_S` tells the decision) or ``cached`` (ended). A keep-alive
    comment after :data:`KEEPALIVE_S` of silence, also while the store cannot be read. docs/reference/http-api.md.
    """
    tenant, action_id = record.tenant, record.action_id
    # Frames wait in ``out`` until the stream would block (or ends), or a live action's page is read: one
    # socket write carries the ack, the chunks and the result of an ended action, not one write each.
    out: list[bytes] = [_frame("sse_0", "ack", ack_envelope(record, streaming=True))] if after is None else []
    last_seq = stream_positions.sequence_held(after)
    wrote_at = time.monotonic()
    while True:
        try:
            decided = service.store.approvals_changed  # before reading: a decision after the read wakes us
            decided_seen = decided.version
            watched = service.live.get(tenant, action_id)
            seen = watched.version if watched is not None else None  # before reading: a later change wakes us
            remote = service.remote.signal(tenant, action_id)  # another host's commits (shared store)
            remote_seen = remote.version
            chunks, stored = await follow_page(service.store, watched, record, last_seq, FOLLOW_PAGE_CHUNKS)
            if chunks:
                sent_at = ms_to_rfc3339(int(time.time() * 1000))
                last_seq = chunks[-1].sequence
                out.append(ChunkFrames(action_id, sent_at).page(chunks))
                if record.status == ActionState.RUNNING:  # live: the page goes now, not after the next store read
                    yield b"".join(out)
                    out, wrote_at = [], time.monotonic()
            record = record if stored is record else await service.refresh(stored or record)  # `is`: from the tail
            if record.status == ActionState.PENDING_APPROVAL:
                if out:
                    yield b"".join(out)
                    out, wrote_at = [], time.monotonic()
                if not await decided.wait(PENDING_POLL_S, seen=decided_seen) and (
                    time.monotonic() - wrote_at >= KEEPALIVE_S
                ):
                    yield encode_comment("keep-alive")
                    wrote_at = time.monotonic()
                continue
            if record.status != ActionState.RUNNING and record.chunk_count <= last_seq + 1:
                result = await service.result(record)
                for ident, error in [] if result is None else _ending(record, result, after):
                    if error is not None:
                        out.append(_frame(ident, ERROR_EVENT, _error_envelope(action_id, error)))
                    elif result is not None:
                        out.append(_frame(ident, "result", result_envelope(result)))
                if out:
                    yield b"".join(out)
                return
            if out:
                yield b"".join(out)
                out, wrote_at = [], time.monotonic()
            if record.status == ActionState.RUNNING and record.chunk_count > last_seq + 1:
                continue
            live = service.live.get(tenant, action_id)
            if live is not None and live is not watched:
                continue  # its dispatch registered after this round's read: read again
            if live is not None:
                await live.wait(KEEPALIVE_S, seen=seen)
            elif service.remote.pushed:  # another host's action: its commits are pushed here
                await remote.wait(KEEPALIVE_S, seen=remote_seen)
            else:  # polled: no dispatch of it here, e.g. while its sidecar cannot be reached
                record = await service.wait(record, 1.0)
            comment = encode_comment("keep-alive") if time.monotonic() - wrote_at >= KEEPALIVE_S else None
        except StoreUnavailable:  # logged by the store: the stream stays open and reads again (stopping.py)
            comment = await after_store_fault(wrote_at, KEEPALIVE_S)
        if comment is not None:  # that long without a write, whatever kept it waiting
            yield comment
            wrote_at = time.monotonic()


#: Most stored chunks a follower reads and writes at once. Memory stays bounded by the action's whole
#: stream, which ``[host] max_response_bytes`` bounds (docs/reference/configuration.md "Configuration reference").
FOLLOW_PAGE_CHUNKS = 2048


def _resume_at(request: Request) -> Position | None:
    """Position after which to resume: ``Last-Event-ID`` or ``?cursor=`` (:func:`.stream_positions.parse`,
    400 ``request.invalid_cursor`` otherwise); None: neither, the stream from its start."""
    value = request.headers.get("last-event-id") or request.query_params.get("cursor")
    return stream_positions.parse(value) if value else None


async def _principal_action(
    request: Request,
    *,
    stream: bool = False,
) -> tuple[Principal, ActionService, ActionRecord]:
    """The caller, the service and the action it may read in full; ``stream``: the
    ``/events`` route, which also takes a stream token for this action (:mod:`.authenticate`)."""
    if stream:
        principal = await authenticate_stream(request, scope=action_scope(request.path_params["action_id"]))
    else:
        principal = await authenticate(request)
    service = _service(request)
    record = await service.get(principal, request.path_params["action_id"])
    return principal, service, record


def metadata_of(result: ActionResult) -> ActionResult:
    """A result as an operator may read it: status and error code/category, no output, parts or details."""
    error = None
    if result.error is not None:
        error = ProtocolError(
            code=result.error.code,
            message=result.error.code,
            category=result.error.category,
            retryable=result.error.retryable,
        )
    return ActionResult(action_id=result.action_id, status=result.status, error=error)


def action_links(action_id: str, approval_id: str | None) -> dict[str, str]:
    """The typed links of an ActionStatus (relative URLs; each id one percent-encoded path segment: an
    action id may hold ``?``, ``#`` or ``%``, or be ``..``)."""
    base = f"/aip/v1/actions/{path_segment(action_id)}"
    links = {
        "self": base,
        "result": f"{base}/result",
        "events": f"{base}/events",
        "chunks": f"{base}/chunks",
        "cancel": f"{base}/cancel",
    }
    if approval_id:
        links["approval"] = f"/aip/v1/approvals/{path_segment(approval_id)}"
    return links


async def get_action(request: Request) -> Response:
    """``GET /aip/v1/actions/{id}``: the ActionStatus (state, result status, links; the result once final;
    ``?include_receipts=true``: its receipt chain). An operator gets the metadata only: the result
    carries its status and error code, no output or details."""
    principal = await authenticate(request)
    service = _service(request)
    record, level = await service.read(principal, request.path_params["action_id"])
    result = await service.result(record) if is_terminal(record.status) else None
    if result is not None and level != FULL:
        result = metadata_of(result)
    status = ActionStatus(
        action_id=record.action_id,
        capability_id=record.capability_id,
        correlation_id=record.action_id,
        state=lifecycle_state(record.status, record.dispatch),
        updated_at=ms_to_rfc3339(record.updated_at),
        result_status=result.status if result is not None else None,
        approval_id=record.approval_id,
        completed_at=ms_to_rfc3339(record.updated_at) if result is not None else None,
        result=result,
        links=action_links(record.action_id, record.approval_id),
        receipt_chain=await receipt_chain(service.store, record.tenant, record.action_id, record.action_id)
        if include_receipts(request)
        else None,
    )
    return aip_json(status)


async def get_result(request: Request) -> Response:
    """``GET /aip/v1/actions/{id}/result``: the stored result (202 ack while running)."""
    _, service, record = await _principal_action(request)
    return await _result_response(service, record)


#: Most chunks in one JSON page of ``/events`` or ``/chunks``.
PAGE_CHUNKS = 1000


async def get_events(request: Request) -> Response:
    """``GET /aip/v1/actions/{id}/events``: the action's history; SSE (following
    live) with ``Accept: text/event-stream``, else one ActionEvents page.

    The page holds the stream positions after ``Last-Event-ID``/``cursor``
    (``sse_<n>``): the ack (kind ``aip.core.v1.ack``), the chunks (in
    ``chunks`` and as ``aip.core.v1.stream_chunk`` events), and, once the
    action ended, the error and result. ``cursor`` is the last position in
    the page (pass it back to continue); None once the whole history of an
    ended action was delivered.
    """
    _, service, record = await _principal_action(request, stream=True)
    after = _resume_at(request)
    if _wants_sse(request):
        return await _stream_answer(request, service, record, after)
    action_id = record.action_id
    events: list[Event] = []
    if after is None:
        ack = ack_envelope(record, streaming=False).body.ack
        events.append(
            Event(
                id="sse_0",
                kind="aip.core.v1.ack",
                occurred_at=ms_to_rfc3339(record.created_at),
                action_id=action_id,
                correlation_id=action_id,
                data=ack,
            )
        )
    rows = await service.store.list_chunks(record.tenant, action_id, stream_positions.sequence_held(after), PAGE_CHUNKS)
    chunks = [_chunk_decoder.decode(row.chunk_json) for row in rows]
    # Chunks carry no time of their own: they are stamped with the action's last update.
    updated = ms_to_rfc3339(record.updated_at)
    events += [
        Event(
            id=f"sse_{1 + c.sequence}",
            kind="aip.core.v1.stream_chunk",
            occurred_at=updated,
            action_id=action_id,
            correlation_id=action_id,
            data=c,
        )
        for c in chunks
    ]
    last = chunks[-1].sequence if chunks else stream_positions.sequence_held(after)
    terminal = is_terminal(record.status)
    done = False
    if terminal and last + 1 >= record.chunk_count:
        result = await service.result(record)
        for ident, error in [] if result is None else _ending(record, result, after):
            events.append(
                Event(
                    id=ident,
                    kind="aip.core.v1.error" if error is not None else "aip.core.v1.action_result",
                    occurred_at=updated,
                    action_id=action_id,
                    correlation_id=action_id,
                    data=ErrorBody(error=error) if error is not None else result,
                )
            )
        done = True
    cursor = None if done else (events[-1].id if events else (after.id if after is not None else None))
    return aip_json(ActionEvents(action_id=action_id, events=events, chunks=chunks, cursor=cursor, terminal=terminal))


async def get_chunks(request: Request) -> Response:
    """``GET /aip/v1/actions/{id}/chunks?cursor=N``: one ActionEvents page of the
    stored chunks from sequence N (``events`` empty); ``cursor`` is the next
    sequence as a string, None once an ended action's chunks are all delivered."""
    _, service, record = await _principal_action(request)
    raw = request.query_params.get("cursor", "0")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:  # str.isdigit alone takes ² and ٣
        raise InvalidCursor("cursor must be a non-negative integer")
    cursor = int(raw)
    rows = await service.store.list_chunks(record.tenant, record.action_id, cursor - 1, PAGE_CHUNKS)
    next_cursor = rows[-1].sequence + 1 if rows else cursor
    terminal = is_terminal(record.status)
    done = terminal and next_cursor >= record.chunk_count
    return aip_json(
        ActionEvents(
            action_id=record.action_id,
            events=[],
            chunks=[_chunk_decoder.decode(row.chunk_json) for row in rows],
            cursor=None if done else str(next_cursor),
            terminal=terminal,
        )
    )


async def post_cancel(request: Request) -> Response:
    """``POST /aip/v1/actions/{id}/cancel``: runtime cancellation (ARCHITECTURE.md §8)."""
    principal = await authenticate(request)
    require_role(principal, "invoker")  # the action's own tenant, as a caller (not an approver or operator)
    result = await _service(request).cancel(principal, request.path_params["action_id"])
    return aip_json(result_envelope(result))


def routes() -> list[Route]:
    """The action routes, mounted by the host app."""
    return [
        Route("/aip/v1/messages", post_message, methods=["POST"]),
        Route("/aip/v1/actions/{action_id:str}", get_action, methods=["GET"]),
        Route("/aip/v1/actions/{action_id:str}/result", get_result, methods=["GET"]),
        Route("/aip/v1/actions/{action_id:str}/events", get_events, methods=["GET"]),
        Route("/aip/v1/actions/{action_id:str}/chunks", get_chunks, methods=["GET"]),
        Route("/aip/v1/actions/{action_id:str}/cancel", post_cancel, methods=["POST"]),
    ]
