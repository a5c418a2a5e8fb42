"""The host's HTTP client of the sidecar: one boundary where transport errors (httpx2's, and those
the aiohttp read pool raises as httpx2's) and sidecar statuses become connector errors.

The connection of each sidecar (:class:`~.connection.SidecarHttp`: its pools, bearer
token from a 0600 file, base URL https or loopback http, no redirects, connect
timeout 10 s) is owned by the host lifespan; this module only uses it. Every request sends ``Idempotency-Key`` (for
job starts) and ``X-AIP-Action-ID`` (= the sidecar job id of the body, as the
reference host does; the AIP action id is tenant-scoped, see :func:`sidecar_job_id`). ``DispatchProgress`` records honestly how far a
request got: ``not_sent`` (no connection), ``sent`` (bytes may have reached
the sidecar, no answer), ``acknowledged`` (the sidecar answered).

Source: ARCHITECTURE.md §4 (sidecar contract), §7 (sidecar client), §8 (errors).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2
import msgspec

from ...contracts.aip import StreamChunk
from ...contracts.errors import (
    ConnectorAuthentication,
    ConnectorConfigurationOrInput,
    ConnectorCrewBusy,
    ConnectorError,
    ConnectorRemoteRejected,
    ConnectorRemoteTemporary,
    ConnectorResponseTooLarge,
    ConnectorStreamSilent,
    ConnectorTransport,
)
from ...contracts.operations import OperationSpec
from ...contracts.sidecar import DEFAULT_TIMEOUT_MS, JobEvent
from ..actions.lifecycle import DispatchState
from ..actions.normalize import StreamNormalizer
from ..tracing import outgoing_headers
from .connection import ResponseTooLarge, SidecarHttp, SidecarReads

#: Longest silence accepted while reading a JSON (non-stream) answer, seconds: a frozen sidecar
#: must not hang a status read or a cancel forever (a blocking start adds its ``timeout_ms``).
JSON_READ_TIMEOUT_S = 30.0
#: The same bound for a cancel, seconds: a sidecar answers one once recorded (before its worker's grace), and
#: a frozen one gives a prompt, uncertain ``cancelled_unconfirmed`` (docs/operating.md "Frozen sidecar").
CANCEL_READ_TIMEOUT_S = 5.0
#: Bound on a JSON (non-stream) sidecar answer, bytes: the 4 MiB output plus envelope room.
MAX_JSON_RESPONSE_BYTES = 8 * 1024 * 1024
_MAX_DETAIL_CHARS = 512
#: Keep-alive intervals an event stream may miss before it counts as silent (ARCHITECTURE.md §8).
MISSED_KEEPALIVES = 3
#: The shortest silence that counts, seconds (a loaded machine delays a keep-alive now and then).
MIN_SILENCE_S = 2.0
#: Statuses of a start the sidecar answered before admitting anything (ARCHITECTURE.md §4 admission order).
_REFUSED_BEFORE_ADMISSION = (503, 507)


def silence_bound_s(keepalive_s: float) -> float:
    """How long an event stream may send nothing before it is silent:
    :data:`MISSED_KEEPALIVES` keep-alive intervals, at least
    :data:`MIN_SILENCE_S`; ``keepalive_s`` in seconds, > 0.

    Raises: ValueError (``keepalive_s`` not positive)."""
    if not keepalive_s > 0:
        raise ValueError("the keep-alive interval must be positive")
    return max(MISSED_KEEPALIVES * keepalive_s, MIN_SILENCE_S)


def not_admitted(error: ConnectorError) -> bool:
    """Whether a failed start was provably not admitted by the sidecar: no
    connection was made (``dispatch: not_sent``), or the sidecar refused it
    before admission (``admitted: false`` in the details: a 503, or a 507
    that names no job). Such a start is retried (ARCHITECTURE.md §9)."""
    return error.dispatch == "not_sent" or error.details.get("admitted") is False


#: Characters that would change a sidecar URL path's meaning (query, fragment, escapes).
_PATH_UNSAFE = frozenset("?#%\\")


def sidecar_job_id(tenant: str, action_id: str) -> str:
    """The sidecar job id of a tenant's action: ``<tenant>:<action_id>``, or
    ``<tenant>:sha256:<hex of the action id>`` when that would exceed 256
    characters, or the action id holds anything but visible ASCII, or one of
    ``? # % \\`` (the id travels in URL paths and the ``X-AIP-Action-ID``
    header, which take neither), or starts with ``sha256:``.

    Sidecar job ids are global while AIP action ids are tenant-scoped, so two
    tenants reusing one action id never collide at the sidecar (tenant names
    hold no ``:``, so the prefix is unambiguous; a plain id never looks hashed).
    """
    plain = f"{tenant}:{action_id}"
    if (
        len(plain) <= 256
        and action_id.isascii()
        and action_id.isprintable()
        and " " not in action_id
        and not _PATH_UNSAFE.intersection(action_id)
        and not action_id.startswith("sha256:")
    ):
        return plain
    return f"{tenant}:sha256:" + hashlib.sha256(action_id.encode("utf-8")).hexdigest()


def sidecar_idempotency_key(key: str) -> str:
    """The ``Idempotency-Key`` header value for a tenant's key: the key itself
    when it is visible ASCII (an HTTP header takes nothing else), else
    ``sha256:<hex of the key>`` (deterministic, so a repeat has the same request hash)."""
    if key.isascii() and key.isprintable() and key == key.strip() and not key.startswith("sha256:"):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass
class DispatchProgress:
    """How far one request got (ARCHITECTURE.md §8)."""

    state: DispatchState = DispatchState.NOT_SENT


#: The sidecar's code of a refusal that says "try later": another job of the crew is active (409).
CREW_BUSY = "sidecar.crew_busy"
#: The sidecar's code of a ``replay`` whose task id names no run it holds (422, before admission): with a
#: crew on several sidecars the run may be on another one (docs/operating.md "Several sidecars").
TASK_RUN_NOT_FOUND = "sidecar.task_run_not_found"


def error_for_status(
    status: int, spec: OperationSpec, *, detail: str | None, dispatch: str = "acknowledged", code: str | None = None
) -> ConnectorError:
    """Map a sidecar HTTP status (and the ``code`` of its body, when it names one) to a connector error
    (ARCHITECTURE.md §8).

    409 ``sidecar.crew_busy`` → crew_busy (retryable: nothing ran); 401/403 → authentication;
    404/413/422/428 → configuration_or_input; 429 and ≥ 500 → remote_temporary; other 4xx → remote_rejected.
    """
    kwargs: dict[str, Any] = dict(
        operation=spec.name,
        remote_status=status,
        uncertain_outcome=spec.mutation and status >= 500,
        read_only=spec.read_only,
        dispatch=dispatch,
        details={"remote_detail": detail[:_MAX_DETAIL_CHARS]} if detail else None,
    )
    if status == 409 and code == CREW_BUSY:
        kwargs.update(uncertain_outcome=False)
        # Not ``admitted: false`` (:func:`not_admitted`): the host does not retry it on its own; the tenant does.
        return ConnectorCrewBusy(**kwargs)
    if status in (401, 403):
        return ConnectorAuthentication(**kwargs)
    if status == 422 and code == TASK_RUN_NOT_FOUND:
        kwargs.update(uncertain_outcome=False, details={**(kwargs["details"] or {}), "remote_code": code})
    if status in (404, 413, 422, 428):
        return ConnectorConfigurationOrInput(**kwargs)
    if status == 429 or status >= 500:
        return ConnectorRemoteTemporary(**kwargs)
    return ConnectorRemoteRejected(**kwargs)


def _refused_before_admission(error: ConnectorError) -> None:
    """Mark a start refusal the sidecar made before admitting anything: nothing ran."""
    error.uncertain_outcome = False
    error.details.update(admitted=False, uncertain_outcome=False)


def _silent(spec: OperationSpec, dispatch: DispatchProgress, silence_s: float | None) -> ConnectorStreamSilent:
    return ConnectorStreamSilent(
        f"the sidecar sent nothing for {silence_s} s",
        operation=spec.name,
        uncertain_outcome=spec.mutation and dispatch.state != DispatchState.NOT_SENT,
        read_only=spec.read_only,
        dispatch=dispatch.state,
        details={"silence_seconds": silence_s},
    )


def _transport_error(spec: OperationSpec, dispatch: DispatchProgress, exc: Exception) -> ConnectorTransport:
    return ConnectorTransport(
        f"the sidecar could not be reached ({type(exc).__name__})",
        operation=spec.name,
        uncertain_outcome=spec.mutation and dispatch.state != DispatchState.NOT_SENT,
        read_only=spec.read_only,
        dispatch=dispatch.state,
    )


def _too_large(spec: OperationSpec, status: int, limit: int) -> ConnectorResponseTooLarge:
    return ConnectorResponseTooLarge(
        f"sidecar response exceeded {limit} bytes",
        operation=spec.name,
        remote_status=status,
        uncertain_outcome=spec.mutation,
        read_only=spec.read_only,
        dispatch="acknowledged",
        details={"limit_bytes": limit},
    )


def _failure(
    spec: OperationSpec, dispatch: DispatchProgress, exc: httpx2.HTTPError, silence_s: float | None
) -> ConnectorError:
    """The connector error of a request's transport failure (``silence_s``: a stream's silence bound, whose
    read timeout is a silence; None: a plain transport failure). Nothing reached the sidecar after a
    connect or pool failure: ``dispatch`` goes back to ``not_sent``."""
    if isinstance(exc, (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)):
        dispatch.state = DispatchState.NOT_SENT
    elif isinstance(exc, httpx2.ReadTimeout) and silence_s is not None:
        return _silent(spec, dispatch, silence_s)
    return _transport_error(spec, dispatch, exc)


async def _read_bounded(response: httpx2.Response, limit: int, spec: OperationSpec) -> bytes:
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > limit:
            raise _too_large(spec, response.status_code, limit)
    return bytes(body)


def _field(body: bytes, name: str) -> Any:
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested deeper than msgspec allows
        return None
    return value.get(name) if isinstance(value, dict) else None


def _detail(body: bytes) -> str | None:
    detail = _field(body, "detail")
    return detail if isinstance(detail, str) else None


class SidecarClient:
    """Typed calls to the sidecar routes of ARCHITECTURE.md §4.

    Args:
        http: the lifespan-owned :class:`SidecarHttp` (base URL and bearer set).
        max_response_bytes: bound on one streamed response, bytes.
        keepalive_s: the sidecar's SSE keep-alive interval now, seconds (a
            callable: its ``/health`` may say; see :func:`silence_bound_s`).
    """

    def __init__(
        self, http: SidecarHttp, *, max_response_bytes: int, keepalive_s: Callable[[], float] = lambda: 15.0
    ) -> None:
        self.http = http
        self.max_response_bytes = max_response_bytes
        self.keepalive_s = keepalive_s

    async def _send(
        self,
        method: str,
        path: str,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        *,
        headers: dict[str, str],
        json: Any,
        params: dict[str, Any] | None,
        read_timeout_s: float | None = None,
        runs_job: bool = False,
        silent_is_distinct: bool = False,
    ) -> httpx2.Response:
        """Send one request (streamed response; ``runs_job``: it runs a job, through
        :attr:`SidecarHttp.job_transport`; ``silent_is_distinct``: its read timeout is a stream's silence),
        moving ``dispatch`` honestly:
        ``sent`` once we try, back to ``not_sent`` when no connection was made,
        ``acknowledged`` when the sidecar answered."""
        try:
            dispatch.state = DispatchState.SENT
            headers = {
                **headers,
                **outgoing_headers(),
            }  # the current span's W3C traceparent (docs/observing.md "Observing actions")
            request = self.http.request(
                method, path, headers=headers, json=json, params=params, read_timeout_s=read_timeout_s
            )
            transport = self.http.job_transport if runs_job else self.http.transport
            response = await transport.handle_async_request(request)
        except httpx2.HTTPError as exc:
            raise _failure(spec, dispatch, exc, read_timeout_s if silent_is_distinct else None) from exc
        dispatch.state = DispatchState.ACKNOWLEDGED
        return response

    async def _read(
        self,
        reads: SidecarReads,
        path: str,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        *,
        headers: dict[str, str],
        params: dict[str, Any] | None,
        read_timeout_s: float,
    ) -> tuple[int, bytes]:
        """A read-only JSON ``GET`` through :attr:`SidecarHttp.reads` → ``(status, whole body)``, moving
        ``dispatch`` as :meth:`_send` does."""
        dispatch.state = DispatchState.SENT

        def acknowledged() -> None:
            dispatch.state = DispatchState.ACKNOWLEDGED

        try:
            return await reads.get(
                path,
                headers={**headers, **outgoing_headers()},
                params=params,
                read_timeout_s=read_timeout_s,
                limit=MAX_JSON_RESPONSE_BYTES,
                on_head=acknowledged,
            )
        except httpx2.HTTPError as exc:
            raise _failure(spec, dispatch, exc, None) from exc
        except ResponseTooLarge as exc:
            raise _too_large(spec, exc.status, MAX_JSON_RESPONSE_BYTES) from exc

    async def _json(
        self,
        method: str,
        path: str,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        *,
        headers: dict[str, str],
        json: Any = None,
        params: dict[str, Any] | None = None,
        ok: tuple[int, ...] = (200,),
        read_timeout_s: float | None = None,
        runs_job: bool = False,
    ) -> tuple[int, Any]:
        timeout_s = JSON_READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        if self.http.reads is not None and method == "GET":  # a sidecar reached directly (ARCHITECTURE.md §8)
            status, body = await self._read(
                self.http.reads, path, spec, dispatch, headers=headers, params=params, read_timeout_s=timeout_s
            )
        else:
            response = await self._send(
                method,
                path,
                spec,
                dispatch,
                headers=headers,
                json=json,
                params=params,
                read_timeout_s=timeout_s,
                runs_job=runs_job,
            )
            try:
                status, body = response.status_code, await _read_bounded(response, MAX_JSON_RESPONSE_BYTES, spec)
            except httpx2.HTTPError as exc:
                raise _transport_error(spec, dispatch, exc) from exc
            finally:
                await response.aclose()
        if status not in ok:
            code = _field(body, "code")
            error = error_for_status(status, spec, detail=_detail(body), code=code if isinstance(code, str) else None)
            job_status = _field(body, "status")
            if isinstance(job_status, str):
                error.details["remote_job_status"] = job_status[:64]
            raise error
        try:
            return status, msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested deeper than msgspec allows
            raise ConnectorRemoteRejected(
                "the sidecar answered with invalid JSON",
                operation=spec.name,
                remote_status=status,
                uncertain_outcome=spec.mutation,
                read_only=spec.read_only,
                dispatch="acknowledged",
            ) from exc

    async def start_job(
        self,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        *,
        job_id: str,
        crew_id: str,
        input: Any,
        idempotency_key: str,
        timeout_ms: int | None,
    ) -> tuple[int, Any]:
        """Blocking ``POST /jobs``: returns ``(status, body)`` for 200 (the
        output), and for 409/502/504 (the caller reads the job to tell a
        failed, cancelled or still-running job apart); other statuses raise."""
        body = {"crew_id": crew_id, "action_id": job_id, "operation": spec.name, "input": input}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        headers = {"Idempotency-Key": sidecar_idempotency_key(idempotency_key), "X-AIP-Action-ID": job_id}
        try:
            # The sidecar answers 504 once timeout_ms passed; a silent peer past that is a transport failure.
            wait_s = (timeout_ms or DEFAULT_TIMEOUT_MS) / 1000 + JSON_READ_TIMEOUT_S
            return await self._json(
                "POST", "/jobs", spec, dispatch, headers=headers, json=body, read_timeout_s=wait_s, runs_job=True
            )
        except ConnectorError as exc:
            if exc.remote_status in (409, 502, 504) and not isinstance(exc, ConnectorCrewBusy):
                return exc.remote_status, exc.details.get("remote_detail")
            # A blocking start's 507 after admission names the job's status (the outcome was not recorded).
            if exc.remote_status in _REFUSED_BEFORE_ADMISSION and "remote_job_status" not in exc.details:
                _refused_before_admission(exc)
            raise

    async def stream(
        self,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        normalizer: StreamNormalizer,
        on_chunks: Callable[[list[StreamChunk]], Awaitable[None]],
        *,
        method: str,
        path: str,
        action_id: str,
        headers: dict[str, str] | None = None,
        json: Any = None,
        params: dict[str, Any] | None = None,
    ) -> JobEvent:
        """Run one SSE request to its terminal event, feeding the normalizer.

        ``on_chunks`` is awaited with every batch of normalized chunks as they
        arrive. Returns the terminal sidecar event.

        Raises: ConnectorError (status, transport, invalid stream, too large).
        """
        all_headers = {"Accept": "text/event-stream", "X-AIP-Action-ID": action_id, **(headers or {})}
        silence_s = silence_bound_s(self.keepalive_s())
        response = await self._send(
            method,
            path,
            spec,
            dispatch,
            headers=all_headers,
            json=json,
            params=params,
            read_timeout_s=silence_s,
            runs_job=True,
            silent_is_distinct=True,
        )
        try:
            if response.status_code != 200:
                body = await _read_bounded(response, MAX_JSON_RESPONSE_BYTES, spec)
                code = _field(body, "code")
                raise error_for_status(
                    response.status_code, spec, detail=_detail(body), code=code if isinstance(code, str) else None
                )
            async for piece in response.aiter_bytes():
                chunks = normalizer.feed(piece)
                if chunks:
                    await on_chunks(chunks)
            return normalizer.close()
        except httpx2.ReadTimeout as exc:
            raise _silent(spec, dispatch, silence_s) from exc
        except httpx2.HTTPError as exc:
            raise _transport_error(spec, dispatch, exc) from exc
        finally:
            await response.aclose()

    async def start_stream(
        self,
        spec: OperationSpec,
        dispatch: DispatchProgress,
        normalizer: StreamNormalizer,
        on_chunks: Callable[[list[StreamChunk]], Awaitable[None]],
        *,
        job_id: str,
        crew_id: str,
        input: Any,
        idempotency_key: str,
        timeout_ms: int | None,
    ) -> JobEvent:
        """``POST /jobs/stream`` to the terminal event (see :meth:`stream`).
        Any refusal status of a stream start comes before admission (the SSE
        answer starts only once the job is admitted): a 503 or 507 is marked
        ``admitted: false`` (:func:`not_admitted`)."""
        body = {"crew_id": crew_id, "action_id": job_id, "operation": spec.name, "input": input}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        try:
            return await self.stream(
                spec,
                dispatch,
                normalizer,
                on_chunks,
                method="POST",
                path="/jobs/stream",
                action_id=job_id,
                headers={"Idempotency-Key": sidecar_idempotency_key(idempotency_key)},
                json=body,
            )
        except ConnectorError as exc:
            if (
                exc.remote_status in _REFUSED_BEFORE_ADMISSION
                and dispatch.state == "acknowledged"
                and normalizer.events == 0
            ):
                _refused_before_admission(exc)
            raise

    async def get_job(self, spec: OperationSpec, dispatch: DispatchProgress, *, job_id: str) -> Any:
        """``GET /jobs/{job_id}`` → the job view."""
        return (await self._json("GET", f"/jobs/{job_id}", spec, dispatch, headers={"X-AIP-Action-ID": job_id}))[1]

    async def get_events(self, spec: OperationSpec, dispatch: DispatchProgress, *, job_id: str, cursor: int) -> Any:
        """``GET /jobs/{job_id}/events?cursor=N`` as JSON → the events page."""
        return (
            await self._json(
                "GET",
                f"/jobs/{job_id}/events",
                spec,
                dispatch,
                headers={"X-AIP-Action-ID": job_id},
                params={"cursor": cursor},
            )
        )[1]

    async def cancel(
        self, spec: OperationSpec, dispatch: DispatchProgress, *, job_id: str, crew_id: str, reason: str | None
    ) -> Any:
        """``POST /jobs/{job_id}/cancel`` → the job view after cancellation; the answer is awaited at most
        :data:`CANCEL_READ_TIMEOUT_S` (else a :class:`ConnectorError`, as for any unanswered request)."""
        body: dict[str, Any] = {"crew_id": crew_id, "action_id": job_id}
        if reason is not None:
            body["reason"] = reason
        path, headers = f"/jobs/{job_id}/cancel", {"X-AIP-Action-ID": job_id}
        return (
            await self._json(
                "POST", path, spec, dispatch, headers=headers, json=body, read_timeout_s=CANCEL_READ_TIMEOUT_S
            )
        )[1]
