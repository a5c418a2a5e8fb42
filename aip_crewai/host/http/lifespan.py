"""The host app's lifespan: what opens before the first request and closes after the last.

In order: the store; ONE connection pool per sidecar for its jobs (:class:`~..sidecars.client.SidecarHttp`)
and one ``httpx2.AsyncClient`` for its health probes;
readiness over the crews each serves; the
action service over them (:func:`serve_actions`: the approval-expiry sweep, restart reconciliation,
lease renewal, the store's change listener); then :class:`~.state.HostState` is set and the
extensions' lifespans are entered; the readiness poller and the message-id purge start and systemd
hears ``READY=1``. Shutdown runs the other way: in-flight dispatches get :data:`DRAIN_S` seconds.

Source: ARCHITECTURE.md §6, §10; docs/reference/configuration.md "Configuration reference".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx2
import structlog
from starlette.applications import Starlette

from ...plumbing.serving import HEADER_TIMEOUT_S
from ...plumbing.wakeup import cancel_all
from ..actions import dispatch_task, recovery
from ..actions.dispatch import Dispatcher
from ..actions.service import ActionService
from ..ledger.sealer import Sealer
from ..settings import Settings, SidecarSettings
from ..sidecars.client import SidecarClient
from ..sidecars.connection import SidecarHttp, sidecar_headers
from ..sidecars.placement import Placement
from ..sidecars.readiness import Readiness, ReadinessGroup, notify_systemd
from ..store.notify import listen
from ..store.store import Store, StoreError, StoreUnavailable
from ..webhooks.events import WebhookEvents
from ..webhooks.sender import WebhookSender, webhook_client
from .state import HostSetup, HostState, host_setup, record_startup_error

log = structlog.get_logger(__name__)


#: Sidecar connect timeout, seconds (ARCHITECTURE.md §7); reads are unbounded (streams).
SIDECAR_CONNECT_TIMEOUT_S = 10.0
#: Requests of one sidecar that run a job (a run's stream, a blocking start), at once (httpx's default pool
#: size): a job beyond them waits for a connection.
SIDECAR_CONNECTIONS = 100
#: Idle job connections kept for reuse. httpx's httpcore 1.0 checked every idle connection (a socket poll and a
#: ``getpeername`` through anyio, plus a count of all connections) each time a request started or ended, so 100
#: kept connections cost a loaded host more than opening new ones (session 24 of bench/results/HISTORY.md: 3 of
#: its 15 ms of CPU per run at 200 concurrent runs). httpx2's pool (httpcore2) checks each connection once per
#: pass without touching its socket and keeps up to this many idle ones whatever the pool holds in all; 16 stay,
#: as 100 did not lower the host's CPU per loaded run (session 32).
SIDECAR_KEEPALIVE_CONNECTIONS = 16
#: Connections of one sidecar's short requests (status reads, events pages, cancels), all kept alive: a pool of
#: their own, so they never wait behind jobs holding every job connection.
SIDECAR_REQUEST_CONNECTIONS = 16
#: How long an idle sidecar connection is reused, seconds: well under the idle bound our sidecar (hypercorn
#: ``keep_alive_timeout``, :data:`~aip_crewai.plumbing.serving.HEADER_TIMEOUT_S`, 5 s) and the reference's
#: server keep, so the host does not send a start on a connection the sidecar is closing (under load that race
#: cost a broken stream, a job view and a retried start: no run lost, but work for nothing).
SIDECAR_KEEPALIVE_EXPIRY_S = HEADER_TIMEOUT_S / 2.5
#: How often expired message-id claims are purged, seconds.
PURGE_INTERVAL_S = 60.0


async def _purge_loop(store: Store) -> None:
    while True:
        await asyncio.sleep(PURGE_INTERVAL_S)
        try:
            await store.purge_message_ids()
        except StoreUnavailable:  # logged by the store (no traceback: a fault, not a bug); purged next time
            pass
        except Exception:  # keep purging later; never kill the host for housekeeping
            log.exception("message_id_purge_failed")


def _sidecars(settings: Settings) -> tuple[SidecarSettings, ...]:
    """The configured sidecars (settings built by hand in tests may name only the first one's fields)."""
    return settings.sidecars or (
        SidecarSettings(
            "sidecar",
            settings.sidecar_url,
            settings.sidecar_token,
            settings.sidecar_proxy,
            settings.sidecar_keepalive_s,
        ),
    )


#: The pool of one sidecar's short requests (and of its health probes): all kept alive.
REQUEST_LIMITS = httpx2.Limits(
    max_connections=SIDECAR_REQUEST_CONNECTIONS,
    max_keepalive_connections=SIDECAR_REQUEST_CONNECTIONS,
    keepalive_expiry=SIDECAR_KEEPALIVE_EXPIRY_S,
)
#: The pool of one sidecar's requests that run a job: :data:`SIDECAR_KEEPALIVE_CONNECTIONS` of them kept.
JOB_LIMITS = httpx2.Limits(
    max_connections=SIDECAR_CONNECTIONS,
    max_keepalive_connections=SIDECAR_KEEPALIVE_CONNECTIONS,
    keepalive_expiry=SIDECAR_KEEPALIVE_EXPIRY_S,
)


def _transport(sidecar: SidecarSettings, transport: Any) -> Any:
    """``transport``: one for every sidecar, or name -> transport (tests), or None (real HTTP)."""
    return transport.get(sidecar.name) if isinstance(transport, dict) else transport


def _sidecar_http(sidecar: SidecarSettings, transport: Any) -> SidecarHttp:
    """The lifespan-owned connection of one sidecar's jobs (:class:`SidecarHttp`)."""
    return SidecarHttp.of(
        sidecar.url,
        token=sidecar.token,
        transport=_transport(sidecar, transport),
        connect_timeout_s=SIDECAR_CONNECT_TIMEOUT_S,
        limits=REQUEST_LIMITS,
        job_limits=JOB_LIMITS,
        proxy=sidecar.proxy,  # the explicit one only: HTTP(S)_PROXY would get the bearer (docs/security.md)
        verify=sidecar.verify(),
    )


def _probe_http(sidecar: SidecarSettings, transport: Any) -> httpx2.AsyncClient:
    """The lifespan-owned client of one sidecar's health probes: the same settings as
    :func:`_sidecar_http`, a pool of its own."""
    return httpx2.AsyncClient(
        base_url=sidecar.url,
        headers=sidecar_headers(sidecar.token),
        transport=_transport(sidecar, transport),
        follow_redirects=False,
        timeout=httpx2.Timeout(None, connect=SIDECAR_CONNECT_TIMEOUT_S),
        trust_env=False,
        limits=REQUEST_LIMITS,
        proxy=sidecar.proxy,
        verify=sidecar.verify(),
    )


def _readiness(setup: HostSetup, clients: Mapping[str, httpx2.AsyncClient]) -> ReadinessGroup:
    """One :class:`Readiness` per sidecar over the crews it serves, grouped (ARCHITECTURE.md §10,
    "Several sidecars"). Crew inputs reported by each sidecar are merged into the capability index;
    what each can cancel is published for its own crews."""
    settings, capabilities = setup.settings, setup.capabilities
    reported: dict[str, dict[str, Any]] = {}

    def inputs_of(name: str) -> Callable[[dict[str, Any]], None]:
        def update(found: dict[str, Any]) -> None:
            reported[name] = found
            capabilities.set_crew_inputs(
                {crew: schema for inputs in reported.values() for crew, schema in inputs.items()}
            )

        return update

    def cancellable_of(crew_ids: list[str]) -> Callable[[frozenset[str]], None]:
        return lambda cancellable: capabilities.set_cancellable(cancellable, crew_ids)

    members = []
    for sidecar in _sidecars(settings):
        crews = [crew for crew in settings.crews if sidecar.serves(crew.id)]
        members.append(
            (
                sidecar.name,
                Readiness(
                    clients[sidecar.name],
                    crews,
                    setup.metrics,
                    clock=setup.clock,
                    name=sidecar.name,
                    on_crew_inputs=inputs_of(sidecar.name),
                    on_cancellable=cancellable_of([crew.id for crew in crews]),
                ),
            )
        )
    return ReadinessGroup(members)


def app_lifespan(transport: httpx2.AsyncBaseTransport | None, modules: list[Any]) -> Callable[[Starlette], Any]:
    """The lifespan of :func:`~.app.create_app`'s app; ``modules``: the extensions whose ``lifespan(app)``
    is entered once :class:`HostState` is set. A store that cannot be opened raises StoreError (kept for
    ``host.main``: :func:`~.state.record_startup_error`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        setup = host_setup(app)
        settings = setup.settings
        # Dispatch leases where hosts share the store (PostgreSQL); a SQLite store has one host (its lock file).
        shared = not isinstance(settings.store_path, Path)
        try:
            store = await Store.open(
                settings.store_path,
                clock=setup.clock,
                owner=settings.host_id if shared else None,
                lease_ms=int(settings.lease_s * 1000),
                pool_size=settings.store_pool_size,
                timeouts=settings.store_timeouts,
            )
        except StoreError as exc:  # the process reports it in one line and exits 2 (host/main.py)
            record_startup_error(app, exc)
            raise
        if settings.webhooks.endpoints:  # each state change's webhook events, in its own transaction
            store.outbox_events = WebhookEvents(settings.webhooks, setup.crews)
        hooks_http = webhook_client() if settings.webhooks.endpoints else None
        clients = {sidecar.name: _sidecar_http(sidecar, transport) for sidecar in _sidecars(settings)}
        # Health probes get connections of their own: under load every pooled connection of ``clients`` may
        # hold a run's stream, and a probe waiting behind them would call a healthy sidecar unreachable.
        probes = {sidecar.name: _probe_http(sidecar, transport) for sidecar in _sidecars(settings)}
        tasks: list[asyncio.Task[None]] = []
        try:
            setup.authenticator.claims = store
            readiness = _readiness(setup, probes)
            async with contextlib.AsyncExitStack() as stack:
                actions = await stack.enter_async_context(serve_actions(setup, store, clients, readiness))
                app.state.host = HostState.started(
                    setup,
                    store=store,
                    http=next(iter(clients.values())),
                    sidecar_http=clients,
                    readiness=readiness,
                    actions=actions,
                )
                for module in modules:
                    if hasattr(module, "lifespan"):
                        await stack.enter_async_context(module.lifespan(app))
                tasks.append(asyncio.create_task(readiness.run(settings.readiness_interval_s)))
                tasks.append(asyncio.create_task(_purge_loop(store)))
                if hooks_http is not None:  # the one webhook sender of this host (docs/webhooks.md)
                    sender = WebhookSender(
                        store, settings.webhooks, hooks_http, host_id=settings.host_id, metrics=setup.metrics
                    )
                    tasks.append(asyncio.create_task(sender.run()))
                log.info(
                    "host_started",
                    bind=settings.bind,
                    crews=len(settings.crews),
                    tenants=len(settings.tenants),
                    principals=len(settings.principals),
                )
                notify_systemd(settings.notify_socket)
                try:
                    yield
                finally:
                    await cancel_all(tasks)
        finally:
            app.state.host = None
            setup.authenticator.claims = None
            for jobs in clients.values():
                await jobs.aclose()
            for client in [*probes.values(), *([hooks_http] if hooks_http else [])]:
                await client.aclose()
            await store.close()
            log.info("host_stopped")

    return lifespan


#: How long shutdown waits for in-flight dispatches, seconds, before cancelling them.
DRAIN_S = 20.0


@contextlib.asynccontextmanager
async def serve_actions(
    setup: HostSetup, store: Store, clients: Mapping[str, SidecarHttp], readiness: ReadinessGroup
) -> AsyncIterator[ActionService]:
    """The :class:`ActionService` over the store and sidecar clients the lifespan opened, with its
    background work: the approval-expiry sweep, reconciliation after a restart, lease renewal, and the
    listener of a shared store's changes. On exit, in-flight dispatches may finish for up to
    :data:`DRAIN_S` seconds, then are cancelled; the records of reads already answered are then written
    (at most :data:`DRAIN_S` seconds more)."""
    settings = setup.settings

    def keepalive_of(name: str, configured: float) -> Callable[[], float]:
        def keepalive_s() -> float:  # the sidecar's /health says, else the configured interval
            member = next((m for n, m in readiness.members if n == name), None)
            published = getattr(member if member is not None else readiness, "keepalive_s", None)
            return published if published is not None else configured

        return keepalive_s

    sidecars = _sidecars(settings)
    by_name = {
        sidecar.name: SidecarClient(
            clients[sidecar.name],
            max_response_bytes=settings.max_response_bytes,
            keepalive_s=keepalive_of(sidecar.name, sidecar.keepalive_s),
        )
        for sidecar in sidecars
    }
    # Each new job goes to a ready sidecar of its crew, least loaded first; follow-ups go where the store
    # says the job is (docs/operating.md "Several sidecars").
    placement = Placement([(sidecar.name, sidecar.crews) for sidecar in sidecars], ready=readiness.is_ready)

    async def locate(tenant: str, action_id: str) -> str | None:
        record = await store.get_action(tenant, action_id)
        return record.sidecar if record is not None else None

    allowed = {
        tenant: {crew: frozenset(operations) for crew, operations in setup.capabilities.visible_crews(tenant).items()}
        for tenant in settings.tenants
    }
    service = ActionService(
        store,
        Dispatcher(
            next(iter(by_name.values())),
            max_response_bytes=settings.max_response_bytes,
            clients=by_name,
            placement=placement,
            locate=locate,
            await_start=functools.partial(dispatch_task.await_target_start, store),
        ),
        allowed,
        metrics=setup.metrics,
        authenticator=setup.authenticator,
        principals=setup.principals,
        dispatch_deadline_s=settings.dispatch_deadline_s,
        status_cache_entries=settings.status_cache_entries,
    )
    # Usage (priced by [pricing]) and signed receipts of every stored result (docs/observing.md "Observing actions").
    service.writer.sealer = Sealer(pricing=settings.pricing, keys=settings.receipt_keys, metrics=setup.metrics)
    tasks = [
        asyncio.create_task(recovery.sweep_expired(service)),
        asyncio.create_task(recovery.reconcile_all(service)),
        asyncio.create_task(recovery.renew_leases(service)),
    ]
    store_url = store.url
    stop_listening = (
        listen(store_url, service.remote, asyncio.get_running_loop(), settings.store_timeouts) if store_url else None
    )
    try:
        yield service
    finally:
        if stop_listening is not None:
            await asyncio.to_thread(stop_listening)
        for task in tasks:
            task.cancel()
        live = service.live.tasks()
        if live:
            log.info("draining_dispatches", count=len(live))
            await asyncio.wait(live, timeout=DRAIN_S)
        await cancel_all([*tasks, *live])
        await service.writer.drain_answered(DRAIN_S)  # the records of reads already answered
