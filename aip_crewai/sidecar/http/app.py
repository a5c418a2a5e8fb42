"""The sidecar HTTP contract (Starlette): routes, SSE, error bodies.

| route | answer |
|---|---|
| ``GET /health`` | readiness and limits |
| ``GET /metrics`` | Prometheus text (our addition, see :mod:`metrics`) |
| ``POST /jobs`` | admit (or find), block until terminal: 200 output, 502 failed, 409 cancelled, 504 wait timeout |
| ``POST /jobs/stream`` | admit (or find), SSE of the job's events from 0 (or after ``Last-Event-ID``) until terminal |
| ``GET /jobs/{id}`` | job view |
| ``GET /jobs/{id}/events?cursor=N`` | JSON page, or SSE with ``Accept: text/event-stream``; 416 outside the journal |
| ``POST /jobs/{id}/cancel`` | body ``{crew_id, action_id, reason?}``; path id must equal body id (400) |
| ``DELETE /jobs/{id}`` | archive; ``X-AIP-Archive-Confirmation: <id>`` (428), 409 while not terminal |

Every error body is ``{"detail": <message>}`` (routing 404/405 and 500s
included; a 500 logs its traceback, never its text to the client). SSE
frames carry ``id: <sequence>``, ``event: <name>``, ``data: <compact JSON of
the whole event>``; ``: keep-alive`` comments every ``sse_keepalive_seconds``;
headers ``Cache-Control: no-cache`` and ``X-Accel-Buffering: no``.

The lifespan owns the journal (opens and recovers it unless ``main`` already
did, closes it at shutdown) and the :class:`Runtime`.

Source: ARCHITECTURE.md §4, ARCHITECTURE.md §2.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypedDict

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from aip_crewai.contracts.errors import (
    AipError,
    AmbiguousFraming,
    BodyBudgetExhausted,
    BodyTimeout,
    Category,
    Overloaded,
    RequestHeadTooLarge,
    UnsupportedMediaType,
)
from aip_crewai.contracts.sidecar import CancelRequest
from aip_crewai.plumbing.asgi import (
    BodyBudget,
    BodyDeadline,
    BoundedHead,
    ClientGone,
    CloseOnUnreadBody,
    InFlightLimit,
    MediaTypes,
    RefuseAmbiguousFraming,
    ReleaseBodyBudget,
    RequestLog,
    read_bounded,
)
from aip_crewai.plumbing.serving import (
    BODY_IDLE_TIMEOUT_S,
    BODY_TOTAL_TIMEOUT_S,
    MAX_HEADER_BYTES,
    MAX_IN_FLIGHT,
    PROBE_PATHS,
)
from aip_crewai.sidecar.config import Settings
from aip_crewai.sidecar.errors import (
    ArchiveConfirmationRequired,
    BadRequest,
    InvalidJobRequest,
    JobCancelledError,
    JobFailedError,
    JournalWriteFailed,
    RequestTooLarge,
)
from aip_crewai.sidecar.http.auth import BearerAuth
from aip_crewai.sidecar.isolation.pool import WorkerPool
from aip_crewai.sidecar.jobs.admission import MAX_BODY_BYTES
from aip_crewai.sidecar.jobs.model import EventRow, JobStatus
from aip_crewai.sidecar.jobs.runtime import Executor, Runtime
from aip_crewai.sidecar.journal.store import Journal
from aip_crewai.sse import encode_comment, encode_event, encode_page, page_template
from aip_crewai.tracing import attached, context_of

log = structlog.get_logger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Bound on a cancel request body, bytes.
MAX_CANCEL_BODY_BYTES = 65_536
#: The media type of every request body (the reference host sends it): another, or none, is 415.
JSON_BODY = MediaTypes(frozenset({"application/json"}), UnsupportedMediaType)


class JSONResponse(Response):
    """A JSON response encoded with msgspec (``msgspec.Raw`` values pass through)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def create_app(
    settings: Settings,
    *,
    crews: Collection[str] | None = None,
    executor: Executor | None = None,
    journal: Journal | None = None,
    crew_facts: CrewFacts | None = None,
    workers: WorkerPool | None = None,
) -> Starlette:
    """Build the sidecar ASGI app.

    Args:
        settings: validated settings.
        crews, executor: the registered crew ids and the operation executor;
            both default to the crew registry ``settings.registry`` run by
            ``aip_crewai.sidecar.operations`` (which imports CrewAI).
        journal: an already opened and recovered journal (``main`` opens it
            before serving); None: the lifespan opens and recovers
            ``settings.journal``. Either way the lifespan closes it.
        crew_facts: what the start-up check found per crew
            (:class:`CrewFacts`), published in ``/health``.
        workers: the job worker pool (``--isolation process``), then also the
            executor; the lifespan starts it before serving and closes it
            (killing its workers) after the runtime's shutdown.

    Returns:
        The Starlette app; ``app.state.runtime`` is set during the lifespan.
    """
    if workers is not None:
        executor = workers
    if crews is None or executor is None:
        crews, executor, _none = registry_executor(settings.registry)
    crew_ids, run = frozenset(crews), executor
    facts = crew_facts or CrewFacts()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned = journal
        if owned is None:
            if settings.journal is None:
                raise RuntimeError("settings.journal is not set")
            owned = await Journal.open(settings.journal)
            await recover(owned)
        try:
            if workers is not None:
                await workers.start()
            runtime = Runtime(settings, owned, crew_ids, run, crew_problems=facts.problems, crew_inputs=facts.inputs)
        except BaseException:
            if workers is not None:
                await workers.close()
            await owned.close()
            raise
        app.state.runtime = runtime
        try:
            yield
        finally:
            try:
                await runtime.shutdown(settings.shutdown_grace_seconds)
            finally:
                if workers is not None:
                    await workers.close()
                await owned.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/jobs", post_job, methods=["POST"]),
        Route("/jobs/stream", post_job_stream, methods=["POST"]),
        Route("/jobs/{action_id}", get_job, methods=["GET"]),
        Route("/jobs/{action_id}", delete_job, methods=["DELETE"]),
        Route("/jobs/{action_id}/events", get_events, methods=["GET"]),
        Route("/jobs/{action_id}/cancel", cancel_job, methods=["POST"]),
        # The reference sidecar's legacy names for run jobs (docs/operating.md "Migrating from the reference sidecar").
        Route("/runs", post_run, methods=["POST"]),
        Route("/runs/stream", post_run_stream, methods=["POST"]),
        Route("/runs/{action_id}", get_job, methods=["GET"]),
        Route("/runs/{action_id}/cancel", cancel_job, methods=["POST"]),
    ]
    # Without a token every body is read unauthenticated: all of them share one budget (docs/security.md "Security").
    budget = BodyBudget(settings.body_budget_bytes, BodyBudgetExhausted)
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(CloseOnUnreadBody),
            Middleware(RequestLog, probe_paths=PROBE_PATHS),
            Middleware(
                BoundedHead,
                limit_bytes=MAX_HEADER_BYTES,
                reject=lambda: _refusal(RequestHeadTooLarge(MAX_HEADER_BYTES)),
            ),
            Middleware(InFlightLimit, limit=MAX_IN_FLIGHT, reject=lambda: _refusal(Overloaded(MAX_IN_FLIGHT))),
            Middleware(RefuseAmbiguousFraming, reject=lambda: _refusal(AmbiguousFraming())),
            Middleware(BearerAuth, token=settings.token),
            Middleware(BodyDeadline, idle_s=BODY_IDLE_TIMEOUT_S, total_s=BODY_TOTAL_TIMEOUT_S, timed_out=BodyTimeout),
            Middleware(ReleaseBodyBudget, budget=budget),
            Middleware(ClientGone),
        ],
        exception_handlers={AipError: aip_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.body_budget = budget if settings.token is None else None
    app.state.workers = workers
    return app


async def recover(journal: Journal) -> None:
    """Run the crash fence and log what it did (ARCHITECTURE.md §5)."""
    for action_id, previous in await journal.recover():
        log.warning(
            "job_failed_by_restart",
            action_id=action_id,
            previous_status=previous.value,
            uncertain_outcome=previous is JobStatus.RUNNING,
        )


def registry_executor(spec: str, *, preflight: bool = False) -> tuple[frozenset[str], Executor, CrewFacts]:
    """Load the crew registry ``spec`` and wrap ``operations.execute`` (imports CrewAI).

    Returns:
        ``(crew ids, executor, crew facts)``; the facts
        (``operations.startup.preflight.preflight``: problems and inputs per crew)
        are only looked for with ``preflight=True`` (each crew is built
        once), else empty.

    Raises:
        RegistryError, ImportError: the spec cannot be loaded.
    """
    from aip_crewai.sidecar.operations import execute
    from aip_crewai.sidecar.registry import load_registry

    registry = load_registry(spec)
    facts = CrewFacts()
    if preflight:
        from aip_crewai.sidecar.operations.startup.preflight import preflight as check_crews

        found = check_crews(registry)
        facts = CrewFacts(found.problems, found.inputs)
    return frozenset(registry), executor_for(registry, execute), facts


@dataclass(frozen=True)
class CrewFacts:
    """Per-crew facts published in ``/health`` (``operations.startup.preflight``): ``problems``
    ``{crew_id: [code]}`` and ``inputs`` ``{crew_id: {"placeholders": [name], "defaults": bool}}``."""

    problems: Mapping[str, list[str]] = field(default_factory=dict)
    inputs: Mapping[str, dict[str, Any]] = field(default_factory=dict)


def executor_for(registry: Mapping[str, Any], execute: Any) -> Executor:
    async def run(crew_id: str, operation: str, input: dict[str, Any], ctx: Any) -> dict[str, Any]:
        result: dict[str, Any] = await execute(registry[crew_id], operation, input, ctx)
        return result

    return run


# ------------------------------------------------------------------ routes


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _body_budget(request: Request) -> BodyBudget | None:
    """The budget of bodies read unauthenticated: set only when the sidecar serves without a token."""
    budget: BodyBudget | None = request.app.state.body_budget
    return budget


async def health(request: Request) -> Response:
    return JSONResponse(_runtime(request).health())


async def metrics(request: Request) -> Response:
    from aip_crewai.sidecar.http.metrics import CONTENT_TYPE

    budget = _body_budget(request)
    workers: WorkerPool | None = request.app.state.workers
    gauges = {"unauthenticated_body_bytes": budget.used_bytes} if budget is not None else {}
    return Response(
        _runtime(request).render_metrics({**gauges, **(workers.gauges() if workers is not None else {})}),
        headers={"Content-Type": CONTENT_TYPE},
    )


async def post_job(request: Request, body: bytes | None = None) -> Response:
    runtime = _runtime(request)
    body = await _body(request, MAX_BODY_BYTES) if body is None else body
    with attached(context_of(request.headers.get("traceparent"))):  # the job's span continues the caller's trace
        adm = await runtime.admit(body, **_admission_headers(request))
    record = await runtime.reads.wait(adm.action_id, adm.timeout_ms)
    if record.status is JobStatus.COMPLETED:
        return Response(record.output or b"null", media_type="application/json")
    if record.status is JobStatus.FAILED:
        error = msgspec.json.decode(record.error) if record.error else {}
        raise JobFailedError(
            str(error.get("message") or "the job failed"), details={**error, "action_id": record.action_id}
        )
    if record.status is JobStatus.CANCELLED:
        raise JobCancelledError(details={"status": "cancelled", "action_id": record.action_id})
    raise JournalWriteFailed(
        "the job's terminal result could not be recorded",
        details={"status": record.status.value, "action_id": record.action_id},
    )


async def post_job_stream(request: Request, body: bytes | None = None) -> Response:
    runtime = _runtime(request)
    body = await _body(request, MAX_BODY_BYTES) if body is None else body
    cursor = _last_event_cursor(request, default=0)  # a bad header is refused before anything is admitted
    with attached(context_of(request.headers.get("traceparent"))):  # the job's span continues the caller's trace
        adm = await runtime.admit(body, **_admission_headers(request), resume_cursor=cursor)
    return await _sse(runtime, adm.action_id, cursor)


async def post_run(request: Request) -> Response:
    """``POST /runs``: the reference's legacy ``POST /jobs``, for ``run`` only (400 otherwise)."""
    return await post_job(request, await _run_body(request))


async def post_run_stream(request: Request) -> Response:
    """``POST /runs/stream``: the reference's legacy ``POST /jobs/stream``, for ``run`` only (400 otherwise)."""
    return await post_job_stream(request, await _run_body(request))


async def _run_body(request: Request) -> bytes:
    """The body of a legacy run route; :class:`BadRequest` when it names another operation than ``run``
    (an absent ``operation`` is ``run``; any other defect is left to the admission's own checks)."""
    body = await _body(request, MAX_BODY_BYTES)
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return body
    if isinstance(value, dict) and value.get("operation", "run") != "run":
        raise BadRequest("legacy run route only accepts run")
    return body


async def get_job(request: Request) -> Response:
    return JSONResponse(await _runtime(request).reads.view(request.path_params["action_id"]))


async def get_events(request: Request) -> Response:
    runtime = _runtime(request)
    action_id = request.path_params["action_id"]
    cursor = _last_event_cursor(request, default=_int_param(request.query_params.get("cursor"), "cursor", 0))
    if "text/event-stream" in request.headers.get("accept", ""):
        return await _sse(runtime, action_id, cursor)
    status, events, _count = await runtime.reads.page(action_id, cursor)
    return JSONResponse(
        {
            "action_id": action_id,
            "cursor": cursor,
            "next_cursor": cursor + len(events),
            "status": status.value,
            "events": [msgspec.Raw(row.to_json()) for row in events],
        }
    )


async def cancel_job(request: Request) -> Response:
    action_id = request.path_params["action_id"]
    try:
        body = msgspec.json.decode(await _body(request, MAX_CANCEL_BODY_BYTES), type=CancelRequest)
    except msgspec.ValidationError as exc:
        raise InvalidJobRequest(f"invalid cancel request: {exc}") from None
    except msgspec.DecodeError:
        raise InvalidJobRequest("the request body is not valid JSON") from None
    except RecursionError:  # msgspec's nesting bound
        raise InvalidJobRequest("the request body is nested too deeply") from None
    if body.action_id != action_id:
        raise BadRequest("the body's action_id does not match the path")
    return JSONResponse(await _runtime(request).cancel(action_id, body.crew_id))


async def delete_job(request: Request) -> Response:
    action_id = request.path_params["action_id"]
    if request.headers.get("x-aip-archive-confirmation") != action_id:
        raise ArchiveConfirmationRequired()
    return JSONResponse(await _runtime(request).archive(action_id))


# ----------------------------------------------------------------- helpers


class _AdmissionHeaders(TypedDict):
    idempotency_key: str | None
    header_action_id: str | None


def _admission_headers(request: Request) -> _AdmissionHeaders:
    return {
        "idempotency_key": request.headers.get("idempotency-key"),
        "header_action_id": request.headers.get("x-aip-action-id"),
    }


async def _body(request: Request, limit: int) -> bytes:
    """The request body, declared ``application/json`` (else 415, unread), refused with 413 past ``limit`` bytes
    (never buffered beyond it); without a token, within the budget of bodies being read (503 past it), given back
    once the body is read."""
    budget = _body_budget(request)
    body = await read_bounded(request, limit, _too_large, budget=budget, media=JSON_BODY)
    if budget is not None:
        budget.release(request.scope)
    return body


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body exceeds {limit} bytes")


def _int_param(raw: str | None, name: str, default: int) -> int:
    if raw is None:
        return default
    text = raw.strip()
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:  # str.isdigit alone takes ² and ٣
        raise BadRequest(f"{name} must be an integer")
    return int(text)


def _last_event_cursor(request: Request, *, default: int) -> int:
    """``Last-Event-ID: N`` resumes after sequence N (wins over ``cursor``)."""
    raw = request.headers.get("last-event-id")
    if raw is None or not raw.strip():
        return default
    return _int_param(raw, "Last-Event-ID", 0) + 1


async def _sse(runtime: Runtime, action_id: str, cursor: int) -> Response:
    pages = await runtime.reads.open_pages(action_id, cursor)  # 404/416 before the stream starts

    async def frames() -> AsyncIterator[bytes]:
        async for page in pages:
            yield KEEPALIVE if page is None else sse_frames(page)

    return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)


KEEPALIVE = encode_comment("keep-alive")


def sse_frame(row: EventRow) -> bytes:
    """One SSE frame: ``id``, ``event`` and the whole event as compact JSON ``data``
    (:meth:`EventRow.to_json`); :func:`sse_frames` of the one row."""
    return sse_frames((row,))


def sse_frames(rows: Sequence[EventRow]) -> bytes:
    """The SSE frames of ``rows``, concatenated: one write for a page of events.

    Compact JSON escapes every CR and LF, and event names are ours, so a page is
    built directly: each frame equals ``sse.encode_event(row.to_json(), event=...,
    id=...)`` (checked by a property test) when its event name is in
    ``[a-z_]{1,32}`` and its data holds no CR or LF. That is checked on the whole
    page at once (four LFs per frame, no CR); a page that fails it, or holds a
    name not seen before, is built frame by frame, through ``encode_event`` where
    the direct frame would not be equal.
    """
    names = _FRAME_NAMES
    try:
        values = [(row.sequence, name, name, row.sequence, row.data) for row in rows for name in (names[row.event],)]
    except KeyError:  # a name not seen before: frame by frame, which records it when it is safe
        return b"".join(map(_checked_frame, rows))
    return encode_page(_FRAME, values, lambda i: _checked_frame(rows[i]))


def _checked_frame(row: EventRow) -> bytes:
    name = _FRAME_NAMES.get(row.event)
    if name is None and _FRAME_SAFE_EVENT.fullmatch(row.event):
        name = row.event.encode("ascii")
        if len(_FRAME_NAMES) < _MAX_FRAME_NAMES:
            _FRAME_NAMES[row.event] = name
    if name is not None and b"\n" not in row.data and b"\r" not in row.data:
        return _FRAME % (row.sequence, name, name, row.sequence, row.data)
    return encode_event(row.to_json().decode("utf-8"), event=row.event, id=str(row.sequence))


#: A frame-safe event's SSE frame: ``id``, ``event``, and ``data`` = :meth:`EventRow.to_json` written out.
_FRAME = page_template(b'{"event":"%s","sequence":%d,"data":%s}')
_FRAME_SAFE_EVENT = re.compile(r"[a-z_]{1,32}")
#: Frame-safe event names seen so far, as ASCII bytes (ours are a handful; the bound keeps a journal of
#: odd names from growing it).
_FRAME_NAMES: dict[str, bytes] = {}
_MAX_FRAME_NAMES = 256


# ------------------------------------------------------------------ errors


async def aip_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, AipError):  # registered for AipError only
        raise exc
    body = {**exc.details, "detail": exc.message}
    if exc.category is Category.TEMPORARY:  # a refusal that says "try later" names itself (sidecar.crew_busy)
        body["code"] = exc.code
    return JSONResponse(body, status_code=exc.status, headers=_retry_after(exc))


async def http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):  # registered for HTTPException only
        raise exc
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


def _refusal(exc: AipError) -> Response:
    """The sidecar's error response for a refusal made by middleware (before routing)."""
    return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=_retry_after(exc))


def _retry_after(exc: AipError) -> dict[str, str] | None:
    """``Retry-After`` (whole seconds, at least 1) of a retryable refusal, else None."""
    return {"Retry-After": str(max(1, exc.retry_after_ms // 1000))} if exc.retry_after_ms else None


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled_error", error_type=type(exc).__name__, path=request.url.path, exc_info=exc)
    return JSONResponse({"detail": "internal error"}, status_code=500)
