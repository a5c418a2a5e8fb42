"""ASGI plumbing shared by both processes (no I/O of its own).

:class:`CloseOnUnreadBody`: a response that starts before the request body
was read to its end (a 401 from authentication that never reads the body, a
413 on a declared length) gets ``Connection: close``. The server cannot reuse
such a connection (the unread body is still on it) and closes it after the
response; without the header a keep-alive client sends its next request on
the dying connection and gets "server disconnected without a response", a
transport error the host would have to count as an uncertain dispatch.

:class:`BoundedBody`: every request body is bounded by its route BEFORE it is
read: a declared ``Content-Length`` above the bound fails the first read, and
a body that grows past it (chunked) fails the read that crosses it, so at
most the bound is ever handed to the application. The failure is the
exception the app chose, raised inside the handler's read, so the app's own
error handler renders it (413). :class:`MediaTypes`: a body not declared JSON is refused with the app's
415 by :func:`read_bounded`, before any of it is read.

:class:`ClientGone`: a client that goes away while its body is being read
(Starlette's ``ClientDisconnect``) is not a server error: one debug line
(``client_disconnected``), no traceback, no 500; nobody is left to answer.
The scope gets ``aip.client_gone = True`` so a request log can say so.

:class:`RefuseAmbiguousFraming`: a request with both ``Content-Length`` and
``Transfer-Encoding`` is answered by the app's chosen 400 with
``Connection: close`` before any handler runs (RFC 9112 §6.3: such a message
"ought to be handled as an error" and the connection closed; a proxy framing
by ``Content-Length`` would otherwise disagree with us on where the next
request starts).

:class:`BodyDeadline`: a request body must keep arriving: a pause between two
body chunks longer than ``idle_s``, or a whole body taking longer than
``total_s``, fails the handler's read with the app's timeout error (408); once
the body is complete (or there is none) the wrapper steps aside, so long
responses (SSE) are never cut. Complements the server's header/idle timeout.

:class:`InFlightLimit`: at most ``limit`` requests are handled at once (SSE
streams included); one more is answered by the app's 503 with
``Connection: close`` before any handler runs.

:class:`BodyBudget` with :class:`ReleaseBodyBudget`: the bytes of all request
bodies one process reads BEFORE their request is authenticated (a signed
envelope, an RFC 9421 signed request, any body of a sidecar serving without a
token) are bounded in total, since each connection's own bounds (its body
bound, 60 s, the connection bound) do not bound their sum. A body takes its
declared ``Content-Length`` from the budget at its first read (a chunked body:
each piece as it arrives) and gives it back once its request is authenticated
or ends; a body that does not fit is refused with the app's 503 (with
``Retry-After``). Bodies read after authentication (a bearer token checked
from the headers first) never touch the budget, so authenticated traffic keeps
its own share.

:class:`BoundedHead`: a request line plus headers longer than the bound is
answered by the app's 431 with ``Connection: close`` before any handler runs.
Hypercorn's h11 bounds only a head still incomplete (one arriving in pieces);
a whole head read at once (up to 64 KiB per socket read) is measured here, as
:func:`head_size` counts it.

Source: RFC 6585 §5 (431), RFC 9112 §9.6 (``close`` connection option), §6.3 (message body
length), docs/security.md "Security" (request bodies,
aborted uploads, framing).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger(__name__)
#: Scope key set by :class:`ClientGone` when the client went away mid-request.
CLIENT_GONE_KEY = "aip.client_gone"
#: Scope key of the request's log facts (``request_id``; ``tenant``, ``principal`` once authenticated):
#: the request log's summary line adds ``tenant`` and ``principal`` from it.
SCOPE_LOG_KEY = "aip.log"
#: Request methods logged and counted under their own name; any other is ``other``.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


class CloseOnUnreadBody:
    """Pure ASGI middleware: ``Connection: close`` on responses to requests whose body was not fully read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        read = False

        async def receive_wrapper() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.disconnect" or (
                message["type"] == "http.request" and not message.get("more_body", False)
            ):
                read = True
            return message

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive_wrapper, send_wrapper)


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` as an integer; None when absent or not one decimal number."""
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() and len(text) <= 19 else None
    return None


#: Scope key: bytes this request's body holds of the process's :class:`BodyBudget`.
BUDGET_HELD_KEY = "aip.body_budget_held"


class BodyBudget:
    """The total byte budget of request bodies one process reads before authentication (see the module
    docstring). One instance per app; every method runs on the event loop (no lock needed).

    Args:
        limit_bytes: the budget, bytes.
        exhausted: ``limit_bytes -> exception`` raised by :meth:`take` when a body does not fit (503).

    Source: docs/security.md "Security" (bodies before authentication).
    """

    def __init__(self, limit_bytes: int, exhausted: Callable[[int], Exception]) -> None:
        self.limit_bytes = limit_bytes
        self.exhausted = exhausted
        self.used_bytes = 0

    def take(self, scope: Scope, size: int) -> None:
        """Hold ``size`` more bytes for the request of ``scope``.

        Raises:
            ``exhausted(limit_bytes)``: they do not fit; nothing is taken.
        """
        if self.used_bytes + size > self.limit_bytes:
            log.info("request_refused", reason="body_budget_exhausted", limit_bytes=self.limit_bytes)
            raise self.exhausted(self.limit_bytes)
        self.used_bytes += size
        scope[BUDGET_HELD_KEY] = scope.get(BUDGET_HELD_KEY, 0) + size

    def release(self, scope: Scope) -> None:
        """Give back everything the request of ``scope`` holds (idempotent)."""
        self.used_bytes -= scope.pop(BUDGET_HELD_KEY, 0)


class ReleaseBodyBudget:
    """Pure ASGI middleware: whatever a request still holds of ``budget`` is given back when it ends
    (however it ends: answered, refused, failed, or its client gone)."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self.budget.release(scope)


@dataclass(frozen=True)
class MediaTypes:
    """The media types a route's body may be declared as (``accepted``: lower-case ``type/subtype``), and the
    app's refusal of any other (``refused``: ``(message, details=...) -> exception``, a 415 of its own shape)."""

    accepted: frozenset[str]
    refused: Callable[..., Exception]

    def check(self, request: Request) -> None:
        """Refuse a ``Content-Type`` (compared without its parameters, any case: ``application/json;
        charset=utf-8`` is ``application/json``) that is absent or not one of :attr:`accepted`.

        Raises:
            ``refused(message, details={"content_type", "accepted"})``: the message names both.
        """
        raw = request.headers.get("content-type", "")
        if raw.partition(";")[0].strip().lower() in self.accepted:
            return
        names = sorted(self.accepted)
        shown = raw if len(raw) <= 100 else raw[:100] + "…"
        got = f"Content-Type {shown!r}" if raw else "no Content-Type"
        raise self.refused(
            f"the request body must be JSON, declared as Content-Type {' or '.join(names)}; this one has {got}",
            details={"content_type": raw[:100], "accepted": names},
        )


async def read_bounded(
    request: Request,
    limit: int,
    too_large: Callable[[int], Exception],
    *,
    budget: BodyBudget | None = None,
    media: MediaTypes | None = None,
) -> bytes:
    """The request body, at most ``limit`` bytes, never buffered beyond it: the one bounded body reader of
    both processes' routes.

    Args:
        budget: the process's budget of bodies read before authentication, for a request not yet
            authenticated: the declared length is taken before the first read (a chunked body's pieces
            as they arrive); the caller releases it (:meth:`BodyBudget.release`) once the request is
            authenticated, else :class:`ReleaseBodyBudget` does at its end. None: an authenticated request.
        media: the media types the body may be declared as, checked before anything else (nothing of the
            body is read, no budget taken); None: any.

    Raises:
        ``media.refused(...)``: the ``Content-Type`` is absent or another (:meth:`MediaTypes.check`).
        ``too_large(limit)``: the declared ``Content-Length`` or the bytes received exceed ``limit``.
        ``budget.exhausted(budget.limit_bytes)``: the body does not fit in the budget.

    Source: docs/security.md "Security" (request bodies; bodies before authentication).
    """
    if media is not None:
        media.check(request)
    declared = declared_length(request.scope)
    if declared is not None and declared > limit:
        raise too_large(limit)
    if budget is not None and declared is not None:
        budget.take(request.scope, declared)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise too_large(limit)
        if budget is not None and declared is None:
            budget.take(request.scope, len(piece))
    return bytes(data)


class BoundedBody:
    """Pure ASGI middleware: bound each request body by route before it is read.

    Args:
        app: the wrapped application.
        limit_for: ``scope -> bytes`` allowed for this request's body (by method and path).
        too_large: ``limit_bytes -> exception`` raised from the application's
            ``receive()`` when the declared or received body exceeds the limit.
    """

    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int], too_large: Callable[[int], Exception]) -> None:
        self.app = app
        self.limit_for = limit_for
        self.too_large = too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        declared = declared_length(scope)
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            if declared is not None and declared > limit:
                raise self.too_large(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self.too_large(limit)
            return message

        await self.app(scope, bounded_receive, send)


class ClientGone:
    """Pure ASGI middleware: a ``ClientDisconnect`` from the application is logged at
    debug level without a traceback and ends the request quietly (no response)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            scope[CLIENT_GONE_KEY] = True
            log.debug("client_disconnected", method=scope.get("method"), path=scope.get("path"))


def ambiguous_framing(scope: Scope) -> bool:
    """Whether the request carries both ``Content-Length`` and ``Transfer-Encoding``."""
    names = {name.lower() for name, _ in scope.get("headers") or ()}
    return b"content-length" in names and b"transfer-encoding" in names


class RefuseAmbiguousFraming:
    """Pure ASGI middleware: refuse a request framed both ways (see the module docstring).

    Args:
        app: the wrapped application.
        reject: ``() -> ASGI app`` answering the refusal (a 400 response of the app's own error shape);
            ``Connection: close`` is added to it.
    """

    def __init__(self, app: ASGIApp, reject: Callable[[], ASGIApp]) -> None:
        self.app = app
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not ambiguous_framing(scope):
            await self.app(scope, receive, send)
            return

        log.info("request_refused", reason="content_length_and_transfer_encoding")
        await self.reject()(scope, receive, _closing(send))


def _closing(send: Send) -> Send:
    """``send`` adding ``Connection: close`` to the response start."""

    async def send_close(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return send_close


class BodyDeadline:
    """Pure ASGI middleware: a request body must arrive in time (see the module docstring).

    Args:
        app: the wrapped application.
        idle_s: longest pause between two body chunks, seconds.
        total_s: longest time for the whole body, seconds (from the first read).
        timed_out: ``seconds -> exception`` raised from ``receive()`` on a timeout.
    """

    def __init__(self, app: ASGIApp, idle_s: float, total_s: float, timed_out: Callable[[float], Exception]) -> None:
        self.app = app
        self.idle_s, self.total_s = idle_s, total_s
        self.timed_out = timed_out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        done = False
        deadline: float | None = None

        async def timed_receive() -> Message:
            nonlocal done, deadline
            if done:  # the body is complete: later reads only wait for a disconnect (SSE)
                return await receive()
            now = loop.time()
            deadline = now + self.total_s if deadline is None else deadline
            wait = min(self.idle_s, deadline - now)
            try:
                with anyio.fail_after(max(wait, 0.0)):
                    message = await receive()
            except TimeoutError:
                limit = self.idle_s if wait >= self.idle_s else self.total_s
                raise self.timed_out(limit) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        await self.app(scope, timed_receive, send)


def head_size(scope: Scope) -> int:
    """The request head's size, bytes, as the server parsed it: the request line ``METHOD SP target SP
    HTTP/x.y CRLF`` (target: raw path, and ``?query`` when there is one), each header as ``name: value CRLF``,
    and the final CRLF: a client writing its head that way (one space after each colon, no padding) sends
    exactly this many bytes."""
    query = scope.get("query_string") or b""
    target = len(scope.get("raw_path") or scope.get("path", "").encode("utf-8")) + (len(query) + 1 if query else 0)
    line = len(scope.get("method", "")) + 1 + target + 1 + len("HTTP/") + len(scope.get("http_version", "1.1")) + 2
    return line + sum(len(name) + 2 + len(value) + 2 for name, value in scope.get("headers") or ()) + 2


class BoundedHead:
    """Pure ASGI middleware: a request head over ``limit_bytes`` (:func:`head_size`) is refused.

    Args:
        app: the wrapped application.
        limit_bytes: the largest head served, bytes.
        reject: ``() -> ASGI app`` answering the refusal (431 in the app's own error shape);
            ``Connection: close`` is added to it.

    Source: docs/security.md "Security" (timeouts and request heads).
    """

    def __init__(self, app: ASGIApp, limit_bytes: int, reject: Callable[[], ASGIApp]) -> None:
        self.app = app
        self.limit_bytes = limit_bytes
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or head_size(scope) <= self.limit_bytes:
            await self.app(scope, receive, send)
            return
        log.info("request_refused", reason="request_head_too_large", limit_bytes=self.limit_bytes)
        await self.reject()(scope, receive, _closing(send))


class InFlightLimit:
    """Pure ASGI middleware: at most ``limit`` requests handled at once.

    Args:
        app: the wrapped application.
        limit: requests in flight (SSE streams included).
        reject: ``() -> ASGI app`` answering a request over the limit (503); ``Connection: close`` is added.
    """

    def __init__(self, app: ASGIApp, limit: int, reject: Callable[[], ASGIApp]) -> None:
        self.app = app
        self.limit = limit
        self.reject = reject
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            log.info("request_refused", reason="too_many_in_flight", limit=self.limit)
            await self.reject()(scope, receive, _closing(send))
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def method_label(method: str) -> str:
    """``method`` when it is one of :data:`KNOWN_METHODS`, else ``other`` (never the raw request bytes)."""
    return method if method in KNOWN_METHODS else "other"


class InternalErrors:
    """Pure ASGI middleware: an unexpected exception raised before the response started is logged once
    (``request_failed``, with its traceback) and answered with ``render(info)`` (``info``: the request's
    log facts, :data:`SCOPE_LOG_KEY`). Placed inside the CORS middleware, so a 500 carries the CORS
    headers of an allowed origin like every other error (a browser can read it); :class:`RequestLog`
    still counts and logs it. One that started its response propagates (nothing can be answered).

    Source: docs/reference/configuration.md "Browsers" (every error response carries CORS headers).
    """

    def __init__(self, app: ASGIApp, *, render: Callable[[dict[str, Any]], ASGIApp]) -> None:
        self.app = app
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if started:
                raise
            log.exception("request_failed")
            info = scope.get(SCOPE_LOG_KEY)
            await self.render(info if isinstance(info, dict) else {})(scope, receive, send)


class RequestLog:
    """Pure ASGI middleware of both processes: ONE summary line per request.

    Binds ``request_id`` into structlog's contextvars for the request's own lines and writes one
    ``request_finished`` line (method, route template, status, duration_ms, response_bytes, and the
    ``tenant``/``principal`` of :data:`SCOPE_LOG_KEY`; never headers, the raw path, the query or bodies;
    probe routes at debug level). A request whose client closed it before any answer is logged 499.

    Args:
        app: the wrapped application.
        probe_paths: routes logged at debug level (health probes).
        echo_request_id: take a sane inbound ``X-Request-ID`` (else a new ``req_<hex>``) and echo it in
            the response (the host); otherwise a new 16-hex id, not echoed (the sidecar).
        observe: ``(route, method, status, duration_s) -> None`` (request metrics), or None.
        on_error: the ASGI response sent for an unexpected exception raised before the response started
            (the traceback is logged once, ``request_failed``), from the request's log facts; None: the
            exception propagates to the app's own handler.

    Source: docs/operating.md "Logs" (the summary line of both processes).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        probe_paths: Collection[str] = (),
        echo_request_id: bool = False,
        observe: Callable[[str, str, int, float], None] | None = None,
        on_error: Callable[[dict[str, Any]], ASGIApp] | None = None,
    ) -> None:
        self.app = app
        self.probe_paths = probe_paths
        self.echo_request_id = echo_request_id
        self.observe = observe
        self.on_error = on_error

    def _request_id(self, scope: Scope) -> str:
        if not self.echo_request_id:
            return uuid.uuid4().hex[:16]
        inbound = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), "")
        return inbound if _REQUEST_ID_RE.match(inbound) else f"req_{uuid.uuid4().hex}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = self._request_id(scope)
        info: dict[str, Any] = {"request_id": request_id}
        scope[SCOPE_LOG_KEY] = info
        echo = [(b"x-request-id", request_id.encode("latin-1"))] if self.echo_request_id else []
        saved = structlog.contextvars.get_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        outcome = {"status": 500, "started": False, "bytes": 0}
        started = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                outcome["status"], outcome["started"] = message["status"], True
                if echo:
                    message = {**message, "headers": [*message.get("headers", []), *echo]}
            elif message["type"] == "http.response.body":
                outcome["bytes"] = int(outcome["bytes"]) + len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if self.on_error is None:
                raise
            log.exception("request_failed")
            if outcome["started"]:
                raise
            await self.on_error(info)(scope, receive, send_wrapper)
        finally:
            if scope.get(CLIENT_GONE_KEY) and not outcome["started"]:
                outcome["status"] = 499  # the client closed the request (no answer was sent)
            duration = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = method_label(scope.get("method", ""))
            if self.observe is not None:
                self.observe(route, method, int(outcome["status"]), duration)
            extra = {k: info[k] for k in ("tenant", "principal") if k in info}
            (log.debug if route in self.probe_paths else log.info)(
                "request_finished",
                method=method,
                route=route,
                status=outcome["status"],
                duration_ms=round(duration * 1000, 3),
                response_bytes=outcome["bytes"],
                **extra,
            )
            structlog.contextvars.clear_contextvars()
            structlog.contextvars.bind_contextvars(**saved)
