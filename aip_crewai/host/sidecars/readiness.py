"""Readiness: does the sidecar agree with the host's configuration?

:func:`evaluate_health` is pure: given the sidecar's ``GET /health`` body and
the admitted descriptors it returns None (ready) or the reason the host is
unready: ``status`` is not ``ready``, ``durable_journal`` is not true, a
configured crew is missing from ``crews``, or an allowed operation of some
descriptor is missing from ``operations``. :class:`Readiness` polls the
sidecar (a background task in the app lifespan, every
``readiness_interval_s``) and on demand (``/ready`` re-checks while unready,
so the host turns ready as soon as the sidecar does; a regression is seen by
the next poll). Concurrent refreshes share one request.

Also here: :func:`notify_systemd`, the one-datagram ``sd_notify``.

Source: ARCHITECTURE.md §7 (readiness), §6 (``/ready``), docs/reference/http-api.md "Capabilities"
("Understand discovery projection").
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx2
import msgspec
import structlog

from ..crews.descriptors import CrewDescriptor
from ..crews.inputs import CrewInputs, parse_crew_inputs
from ..metrics import Metrics

log = structlog.get_logger(__name__)

#: Bound of one health request, seconds (the sidecar client itself has no read timeout).
HEALTH_TIMEOUT_S = 5.0
#: How long ``/ready`` waits for an on-demand re-check of an unready sidecar, seconds: past it, ``/ready``
#: answers the last verdict (503) and the check goes on (a frozen sidecar: a prompt 503, not one after
#: :data:`HEALTH_TIMEOUT_S`; below the 1 s timeout of a Kubernetes probe; ARCHITECTURE.md §8).
READY_WAIT_S = 0.5
#: Bound of a health body, bytes.
MAX_HEALTH_BYTES = 1024 * 1024
_LIST_PREVIEW = 10


def _preview(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" (+{len(names) - _LIST_PREVIEW} more)" if len(names) > _LIST_PREVIEW else ""
    return ", ".join(names[:_LIST_PREVIEW]) + more


def evaluate_health(body: Any, crews: Iterable[CrewDescriptor]) -> str | None:
    """Compare a sidecar health body with the admitted descriptors.

    Args:
        body: the decoded ``GET /health`` JSON.
        crews: the admitted descriptors.

    Returns:
        None when ready, else a one-line reason for the operator's log (it
        names crew ids and operations: :func:`public_reason` is what an
        anonymous caller sees).
    """
    if not isinstance(body, dict):
        return "sidecar health is not a JSON object"
    if body.get("status") != "ready":
        return f"sidecar status is {str(body.get('status'))[:64]!r}, not 'ready'"
    if body.get("durable_journal") is not True:
        return "sidecar journal is not durable"
    served_crews, served_ops = body.get("crews"), body.get("operations")
    if not isinstance(served_crews, list) or not isinstance(served_ops, list):
        return "sidecar health lacks the crews or operations list"
    crews = list(crews)
    missing_crews = unserved_crews(body, crews)
    if missing_crews:
        return f"sidecar lacks configured crews: {_preview(missing_crews)}"
    missing_ops = {op for c in crews for op in c.allowed_operations} - {o for o in served_ops if isinstance(o, str)}
    if missing_ops:
        return f"sidecar lacks allowed operations: {_preview(missing_ops)}"
    return None


def unserved_crews(body: Any, crews: Iterable[CrewDescriptor]) -> frozenset[str]:
    """The admitted crew ids a sidecar ``/health`` body does not list in ``crews``
    (empty when the body has no such list: nothing is known)."""
    served = body.get("crews") if isinstance(body, dict) else None
    if not isinstance(served, list):
        return frozenset()
    return frozenset({c.id for c in crews} - {c for c in served if isinstance(c, str)})


#: Bounds of a published keep-alive interval the host accepts, seconds.
KEEPALIVE_BOUNDS_S = (0.01, 3600.0)


def published_keepalive_s(body: Any) -> float | None:
    """The optional ``sse_keepalive_seconds`` of a sidecar ``/health`` body,
    seconds, or None when absent or not a number within
    :data:`KEEPALIVE_BOUNDS_S` (a peer sidecar without the field: the host's
    configured ``[sidecar] keepalive_seconds`` applies). Pure."""
    value = body.get("sse_keepalive_seconds") if isinstance(body, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    low, high = KEEPALIVE_BOUNDS_S
    return float(value) if low <= value <= high else None


#: What a sidecar without ``cancellable_operations`` in its ``/health`` can cancel (the reference sidecar).
DEFAULT_CANCELLABLE = frozenset({"run", "batch_run"})


def published_cancellable(body: Any) -> frozenset[str]:
    """The operations a sidecar ``/health`` body says it can cancel (``cancellable_operations``),
    or :data:`DEFAULT_CANCELLABLE` when the field is absent or not a list of strings. Pure."""
    value = body.get("cancellable_operations") if isinstance(body, dict) else None
    if not isinstance(value, list) or not all(isinstance(op, str) for op in value):
        return DEFAULT_CANCELLABLE
    return frozenset(value)


#: Reasons whose detail (after the colon) names configured crews or operations.
_DETAILED = ("sidecar lacks configured crews", "sidecar lacks allowed operations")


def public_reason(reason: str) -> str:
    """What an anonymous ``/ready`` caller may read of ``reason``: no crew ids,
    operations or other tenant data (docs/security.md "Security": anonymous health)."""
    for prefix in _DETAILED:
        if reason.startswith(prefix):
            return prefix
    return reason


@dataclass(frozen=True)
class ReadinessState:
    """The last verdict. ``reason`` is public (:func:`public_reason`; the detailed
    one is logged with ``readiness_changed``); ``checked_at`` is epoch seconds
    (None: never checked)."""

    ready: bool
    reason: str
    checked_at: float | None = None


class Readiness:
    """Holds the readiness verdict and refreshes it from the sidecar.

    Args:
        http: the lifespan-owned sidecar client (base URL and bearer set).
        crews: the admitted descriptors.
        metrics: where the ``ready`` and ``sidecar_ready`` gauges and check counters live.
        clock: epoch seconds.
        name: the sidecar's configured name (the ``sidecar_ready`` gauge's label).
    """

    def __init__(
        self,
        http: httpx2.AsyncClient,
        crews: Iterable[CrewDescriptor],
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        name: str = "sidecar",
        on_crew_inputs: Callable[[dict[str, CrewInputs]], None] | None = None,
        on_cancellable: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self.http = http
        self.name = name
        #: Whether the whole host is ready (the ``ready`` gauge): this sidecar alone, unless a
        #: :class:`ReadinessGroup` holds it (then: any of its sidecars).
        self.host_ready: Callable[[], bool] = lambda: self.state.ready
        self.on_crew_inputs = on_crew_inputs
        self.on_cancellable = on_cancellable
        #: What the sidecar can cancel as its last ``/health`` said; None: not known yet (our own table applies).
        self.cancellable: frozenset[str] | None = None
        self.crew_inputs: dict[str, CrewInputs] = {}
        #: Admitted crews the sidecar's last health answer did not list: submissions to them are refused.
        self.unserved_crews: frozenset[str] = frozenset()
        self.crews = tuple(crews)
        self.metrics = metrics
        self.clock = clock
        self.state = ReadinessState(False, "sidecar health not checked yet")
        self._detail: str | None = self.state.reason
        self._inflight: asyncio.Task[ReadinessState] | None = None
        #: The sidecar's SSE keep-alive interval as its last ``/health`` published it
        #: (``sse_keepalive_seconds``), seconds; None: not published (a peer sidecar), use the configured one.
        self.keepalive_s: float | None = None

    @property
    def ready(self) -> bool:
        return self.state.ready

    async def _probe(self) -> str | None:
        try:
            async with self.http.stream("GET", "/health", timeout=httpx2.Timeout(HEALTH_TIMEOUT_S)) as response:
                body = b""
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > MAX_HEALTH_BYTES:
                        return "sidecar health body is too large"
        except httpx2.HTTPError as exc:
            return f"sidecar unreachable ({type(exc).__name__})"
        if response.status_code != 200:
            return f"sidecar /health answered HTTP {response.status_code}"
        try:
            decoded = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):  # RecursionError: nested deeper than msgspec allows
            return "sidecar health is not valid JSON (or nests too deeply)"
        self._observe_crew_inputs(decoded)
        unserved = unserved_crews(decoded, self.crews)
        if unserved != self.unserved_crews:
            if unserved:
                log.warning(
                    "crews_not_served",
                    crews=sorted(unserved),
                    hint="the crews file lists them, the sidecar's registry does not; calls to them "
                    "are refused with capability.unavailable",
                )
            self.unserved_crews = unserved
        self.keepalive_s = published_keepalive_s(decoded)
        cancellable = published_cancellable(decoded)
        if cancellable != self.cancellable:
            self.cancellable = cancellable
            if self.on_cancellable is not None:
                self.on_cancellable(cancellable)
        return evaluate_health(decoded, self.crews)

    def _observe_crew_inputs(self, body: Any) -> None:
        """Keep the ``crew_inputs`` a sidecar reports (:func:`..crews.inputs.parse_crew_inputs`); tell the listener on change."""
        found = parse_crew_inputs(body.get("crew_inputs") if isinstance(body, dict) else None)
        if found != self.crew_inputs:
            self.crew_inputs = found
            log.info("crew_inputs_changed", crews=len(found))
            if self.on_crew_inputs is not None:
                self.on_crew_inputs(found)

    async def _check(self) -> ReadinessState:
        reason = await self._probe()
        state = ReadinessState(reason is None, public_reason(reason or "ready"), self.clock())
        if state.ready != self.state.ready or reason != self._detail:
            (log.info if state.ready else log.warning)("readiness_changed", ready=state.ready, reason=reason or "ready")
        self.state, self._detail = state, reason
        self.metrics.sidecar_ready.set(1 if state.ready else 0, sidecar=self.name)
        self.metrics.ready.set(1 if self.host_ready() else 0)
        self.metrics.readiness_checks.inc(result="ready" if state.ready else "unready")
        return state

    async def refresh(self, wait_s: float | None = None) -> ReadinessState:
        """Check the sidecar now (joining a check already in flight) and return the new verdict.

        With ``wait_s`` (seconds), wait at most that long: a check still running then goes on in the
        background, and the verdict returned is the last one (:data:`READY_WAIT_S`, ``/ready``)."""
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._check())
        if wait_s is None:
            return await asyncio.shield(self._inflight)
        done, _ = await asyncio.wait({self._inflight}, timeout=wait_s)
        return self._inflight.result() if done else self.state

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` seconds until cancelled (never raises otherwise)."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a check must not stop the poller
                log.exception("readiness_check_failed")
            await asyncio.sleep(interval_s)


def notify_systemd(address: str | None, message: bytes = b"READY=1") -> bool:
    """Send one ``sd_notify`` datagram to ``address`` (``NOTIFY_SOCKET``; a
    leading ``@`` means the abstract namespace). Returns False when there is
    no address or the send fails (logged, never raised)."""
    if not address:
        return False
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message, target)
    except OSError as exc:
        log.warning("systemd_notify_failed", error=type(exc).__name__)
        return False
    return True


class ReadinessGroup:
    """The readiness of several sidecars, each serving its crews (``[[sidecars]]``, ARCHITECTURE.md §10), with the
    interface of one :class:`Readiness` for ``/ready``, submissions and dispatch.

    The host is ready while at least one sidecar is (a load balancer keeps sending it work). A crew its
    sidecar does not list is unavailable (``unserved_crews``: submissions to it get
    ``capability.unavailable`` before any approval); a crew whose sidecar is unready is answered as with
    one sidecar: accepted, its start retried until the dispatch deadline (docs/operating.md "Failure behaviour").
    ``members``: ``(name, readiness)`` pairs, each :class:`Readiness` built over its sidecar's crews.
    """

    def __init__(self, members: list[tuple[str, Readiness]]) -> None:
        if not members:
            raise ValueError("a readiness group needs at least one sidecar")
        self.members = members
        for _, member in members:
            member.host_ready = lambda: self.ready  # the ``ready`` gauge is the group's verdict

    @property
    def ready(self) -> bool:
        return any(member.ready for _, member in self.members)

    @property
    def state(self) -> ReadinessState:
        return self._combined()

    def _combined(self) -> ReadinessState:
        if len(self.members) == 1:
            return self.members[0][1].state
        ready = [m for _, m in self.members if m.ready]
        unready = [(name, m) for name, m in self.members if not m.ready]
        checked = [m.state.checked_at for _, m in self.members if m.state.checked_at is not None]
        if ready:
            return ReadinessState(True, "ready", max(checked) if checked else None)
        name, first = unready[0]
        return ReadinessState(
            False, f"no sidecar is ready (sidecar {name}: {first.state.reason})", max(checked) if checked else None
        )

    @property
    def unserved_crews(self) -> frozenset[str]:
        """The crews NO configured sidecar of theirs lists (a crew on several sidecars stays available while
        one of them serves it; the placement sends its jobs to the ready ones)."""
        crews: set[str] = set()
        for _, member in self.members:
            crews |= member.unserved_crews
        return frozenset(
            crew
            for crew in crews
            if all(crew in m.unserved_crews for _, m in self.members if any(c.id == crew for c in m.crews))
        )

    def member_for(self, crew_id: str) -> Readiness | None:
        """The readiness of the first sidecar serving ``crew_id``."""
        return next((m for _, m in self.members if any(c.id == crew_id for c in m.crews)), None)

    def is_ready(self, name: str) -> bool:
        """Whether the sidecar named ``name`` is ready now (its last check; False for an unknown name):
        only ready sidecars get new jobs (:mod:`.placement`)."""
        return any(member.ready for member_name, member in self.members if member_name == name)

    @property
    def keepalive_s(self) -> float | None:
        """The first sidecar's published keep-alive interval (single-sidecar callers)."""
        return self.members[0][1].keepalive_s

    async def refresh(self, wait_s: float | None = None) -> ReadinessState:
        """Check every sidecar now (concurrently; each waited for at most ``wait_s`` seconds, as
        :meth:`Readiness.refresh`); the combined state."""
        await asyncio.gather(*(member.refresh(wait_s) for _, member in self.members))
        return self._combined()

    async def run(self, interval_s: float) -> None:
        """Poll every sidecar every ``interval_s`` seconds until cancelled."""
        await asyncio.gather(*(member.run(interval_s) for _, member in self.members))
