"""The one background sender of a host (docs/webhooks.md): claims due outbox rows, makes one attempt each,
and records it.

Loop: claim up to the free slots of :data:`CONCURRENCY` due deliveries (:meth:`Store.claim_deliveries`: one
host at a time, events of one action in order, a dead host's claims expire), then wait :data:`POLL_S` or a
:meth:`WebhookSender.wake`. Each claimed delivery is its own task, so a slow receiver holds one slot and
delays no other tenant's delivery, and never an action (the action's transaction only wrote the row).

One attempt, bounded whole by the endpoint's ``timeout_seconds``: resolve the URL's name, check every address
(:mod:`.safety`), connect to the checked address (TLS still names and verifies the URL's host), POST the
stored body with a fresh signature (:mod:`.signing`), no redirects followed, at most
:data:`MAX_RESPONSE_BYTES` of the answer read. A 2xx is ``delivered``; anything else (another status, a
timeout, a connection error, a refused destination) is retried on :mod:`.schedule`'s backoff until the
deadline, then ``expired``. The secret, the URL (its query may carry a token) and response bodies are never
logged; logs carry the delivery id, endpoint id, outcome and status.

Source: docs/webhooks.md; ARCHITECTURE.md §10 (one sender per host; claims on the database's clock).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
import structlog

from ..store.outbox import DELIVERED, EXPIRED, PENDING
from ..store.records import ClaimedDelivery, StoreUnavailable
from ..store.store import Store
from .config import Endpoint, WebhookSettings
from .safety import Resolver, checked_address, system_resolver
from .schedule import backoff_s
from .signing import signed_headers

log = structlog.get_logger(__name__)

#: Deliveries in flight per host.
CONCURRENCY = 16
#: How often the outbox is polled for due deliveries, seconds.
POLL_S = 0.25
#: The bytes of a receiver's answer read (the rest is dropped).
MAX_RESPONSE_BYTES = 4096
#: A claim outlives the longest attempt by this much, ms.
CLAIM_MARGIN_MS = 30_000


def webhook_client(transport: httpx2.AsyncBaseTransport | None = None) -> httpx2.AsyncClient:
    """The sender's HTTP client: no redirects, no proxies from the environment, TLS verified, and no timeout of
    its own: an attempt is bounded whole by its endpoint's ``timeout_seconds`` (:meth:`WebhookSender.attempt`),
    which httpx's default of 5 s per phase would otherwise cut short (docs/webhooks.md)."""
    return httpx2.AsyncClient(transport=transport, follow_redirects=False, trust_env=False, timeout=None)


class WebhookSender:
    """Delivers the outbox of ``store`` for ``settings``' endpoints as ``host_id``.

    Args:
        client: the HTTP client (:func:`webhook_client`; tests pass one with a loopback-only transport).
        resolver: ``(host, port) -> addresses`` (default: the system's; tests inject one).
        metrics: the host :class:`~aip_crewai.host.metrics.Metrics` (attempts and deliveries by outcome).
        clock: epoch seconds (signatures' timestamps, attempt times).
        draw: uniform [0, 1) (the backoff jitter).
    """

    def __init__(
        self,
        store: Store,
        settings: WebhookSettings,
        client: httpx2.AsyncClient,
        *,
        host_id: str,
        resolver: Resolver = system_resolver,
        metrics: Any = None,
        clock: Callable[[], float] = time.time,
        draw: Callable[[], float] = random.random,
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.settings = settings
        self.client = client
        self.host_id = host_id
        self.resolver = resolver
        self.metrics = metrics
        self.clock = clock
        self.draw = draw
        self.poll_s = poll_s
        longest = max((e.timeout_s for e in settings.endpoints), default=10.0)
        self.claim_ms = int(longest * 1000) + CLAIM_MARGIN_MS
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Look for due deliveries now."""
        self._wake.set()

    async def run(self) -> None:
        """Deliver until cancelled (then the in-flight attempts are cancelled; their claims expire).

        The wait between steps is a timer setting the wake event, not ``asyncio.wait_for``: before Python
        3.12, ``wait_for`` swallows a cancellation that arrives as the awaited event completes (a delivery
        ending wakes the loop), and the sender, hence the host's shutdown, would never stop."""
        loop = asyncio.get_running_loop()
        try:
            await self._take_back_claims()
            while True:
                await self.step()
                self._wake.clear()
                timer = loop.call_later(self.poll_s, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _take_back_claims(self) -> None:
        """A previous process of this ``host_id`` (crashed or stopped mid-attempt) left claims: release them so
        their deliveries go out now, not when the claims expire (``Store.release_claims``); a store outage
        leaves them to expire as before."""
        try:
            released = await self.store.release_claims(self.host_id)
        except StoreUnavailable:
            return
        if released:
            log.info("webhook_claims_taken_back", deliveries=released)

    async def step(self) -> int:
        """Claim what is due (up to the free slots) and start its attempts. Returns how many started."""
        free = CONCURRENCY - len(self._tasks)
        if free <= 0:
            return 0
        try:
            claimed = await self.store.claim_deliveries(self.host_id, self.claim_ms, free)
        except StoreUnavailable:
            return 0
        for delivery in claimed:
            task = asyncio.create_task(self.deliver(delivery))
            self._tasks.add(task)
            task.add_done_callback(self._done)
        return len(claimed)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()  # a slot is free, and the next event of that action may be due
        if not task.cancelled() and task.exception() is not None:
            log.error("webhook_delivery_crashed", error=type(task.exception()).__name__)

    async def deliver(self, claimed: ClaimedDelivery) -> None:
        """One attempt of ``claimed``, recorded (see the module docstring)."""
        endpoint = self.settings.endpoint(claimed.endpoint_id)
        started = self.clock()
        if endpoint is None:
            outcome, code = "endpoint_removed", None
        else:
            outcome, code = await self.attempt(endpoint, claimed)
        duration_ms = max(0, int((self.clock() - started) * 1000))
        if outcome == "delivered":
            status, retry_ms = DELIVERED, 0
        elif endpoint is None:
            status, retry_ms = EXPIRED, 0
        else:
            wait = backoff_s(claimed.attempts + 1, endpoint.retry_initial_s, endpoint.retry_max_s, self.draw)
            status, retry_ms = PENDING, max(1, int(wait * 1000))
        final = await self.store.finish_attempt(
            claimed,
            self.host_id,
            status=status,
            outcome=outcome,
            status_code=code,
            started_at=int(started * 1000),
            duration_ms=duration_ms,
            retry_in_ms=retry_ms,
        )
        log.info(
            "webhook_attempt",
            delivery_id=claimed.delivery_id,
            endpoint_id=claimed.endpoint_id,
            event_type=claimed.event_type,
            attempt=claimed.attempts + 1,
            outcome=outcome,
            status_code=code,
            duration_ms=duration_ms,
            result=final or "claim_lost",
        )
        if self.metrics is not None:
            self.metrics.webhook_attempts.inc(outcome=outcome)
            if final in (DELIVERED, EXPIRED):
                self.metrics.webhook_deliveries.inc(outcome=final)

    async def attempt(self, endpoint: Endpoint, claimed: ClaimedDelivery) -> tuple[str, int | None]:
        """POST ``claimed``'s body to ``endpoint`` once. Returns ``(outcome, status code or None)``:
        ``delivered`` (2xx), ``http_error``, ``timeout``, ``connect_error`` or ``refused``."""
        try:
            with anyio.fail_after(endpoint.timeout_s):
                return await self._post(endpoint, claimed)
        except TimeoutError:
            return "timeout", None

    async def _post(self, endpoint: Endpoint, claimed: ClaimedDelivery) -> tuple[str, int | None]:
        parts = urlsplit(endpoint.url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address, reason = await checked_address(host, port, self.resolver, self.settings.allow_cidrs)
        if address is None:
            log.warning("webhook_destination_refused", endpoint_id=endpoint.endpoint_id, reason=reason)
            return "refused", None
        url = httpx2.URL(endpoint.url).copy_with(host=address)
        headers = signed_headers(endpoint.signer, claimed.delivery_id, self.clock(), claimed.body)
        headers["host"] = parts.netloc.rpartition("@")[2]
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        try:
            request = self.client.build_request(
                "POST", url, content=claimed.body.encode("utf-8"), headers=headers, extensions=extensions
            )
            response = await self.client.send(request, stream=True)
        except httpx2.TimeoutException:
            return "timeout", None
        except httpx2.HTTPError:
            return "connect_error", None
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= MAX_RESPONSE_BYTES:
                    break
        except httpx2.HTTPError:
            pass  # the status decides; the body is only drained
        finally:
            await response.aclose()
        return ("delivered" if 200 <= response.status_code < 300 else "http_error"), response.status_code
