"""Faults of a shared PostgreSQL store, each against the real throwaway server (tests/pgserver.py): every
store call and request is answered within the store's bound (typed 503 ``store.unavailable`` with
``Retry-After`` when the store cannot serve it), ``/ready`` tells the truth within the same bound and
recovers by itself, and the LISTEN connection that died silently is noticed and replaced.

docs/operating.md "Faults and their bounds". Skipped with one line without PostgreSQL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager

import httpx2
import pgserver
import psycopg
import pytest
from kits.hostapp import action_env, bearer, running
from kits.poll import until_async

from aip_crewai.host.http.state import host_state
from aip_crewai.host.settings import Settings
from aip_crewai.host.store import store as store_module
from aip_crewai.host.store.engines.postgres import WRITER_LOCK, StoreTimeouts
from aip_crewai.host.store.notify import RemoteChanges, listen
from aip_crewai.host.store.store import Store, StoreUnavailable

pytestmark = pytest.mark.timeout(300)  # a SIGSTOPped cluster on a loaded machine: generous, as every wait here

T0 = 1_790_000_000_000
#: Small bounds so the faults show quickly: statement 1 s, lock 0.5 s, idle transaction 1 s (call: 2 s).
TIMEOUTS = StoreTimeouts(statement_ms=1000, lock_ms=500, idle_in_transaction_ms=1000)
BOUND_S = TIMEOUTS.call_ms / 1000
#: What a slow, shared CI machine may add to a bound (scheduling, not waiting): answers are checked
#: against the bound plus this. Generous on purpose: what it tells apart is a bounded answer from a
#: request hanging as long as the fault lasts (45 s and more before the bound existed).
SLACK_S = 10.0


def _admin(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True)


def _database(url: str) -> str:
    return url.rsplit("/", 1)[1].split("?")[0]


async def _until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """:func:`kits.poll.until_async` with this file's pace (``condition`` may return a coroutine)."""
    await until_async(condition, timeout=timeout, interval=0.05, what=what)


@contextmanager
def _outside_transaction(url: str, statement: str, params: tuple[object, ...]) -> Iterator[None]:
    """An outside session in a transaction that ran ``statement`` (and holds the locks it took)."""
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("BEGIN")
        other.execute(statement, params)
        try:
            yield
        finally:
            other.execute("ROLLBACK")


def _writer_lock_held(url: str) -> AbstractContextManager[None]:
    """An outside session in a transaction holding the store's writer lock (a host frozen mid-write)."""
    return _outside_transaction(url, "SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))


@contextmanager
def _read_only(url: str) -> Iterator[None]:
    """The store's database read-only for new sessions (what a failover to a standby looks like); the
    store's sessions are ended so the pool's new ones are read-only."""
    database = _database(url)
    with _admin(url) as admin:
        admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))


async def _timed(call: Callable[[], object]) -> tuple[float, object]:
    started = time.monotonic()
    try:
        value = call()
        if asyncio.iscoroutine(value):
            value = await value
    except Exception as exc:  # the outcome is asserted by the caller
        value = exc
    return time.monotonic() - started, value


# --- the store itself -------------------------------------------------------------------------------


async def _create(store: Store, action_id: str, tenant: str = "acme") -> object:
    return await store.create_action(
        tenant, action_id, "cap:crewai:alpha", "alpha", "run", "{}", "h", "p", None, "pending_approval"
    )


async def test_a_held_writer_lock_fails_writes_typed_within_the_bound_and_reads_go_on(postgres_url: str) -> None:
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2, timeouts=TIMEOUTS)
    try:
        with _writer_lock_held(postgres_url):
            for n in range(4):  # more writes than pooled connections: none parks a connection
                took, outcome = await _timed(functools.partial(_create, store, f"act_{n}"))
                assert isinstance(outcome, StoreUnavailable) and outcome.status == 503, outcome
                assert outcome.retry_after_ms == 1000 and took < BOUND_S + SLACK_S
            took, outcome = await _timed(lambda: store.get_action("acme", "act_0"))
            assert outcome is None and took < BOUND_S + SLACK_S  # a read needs no writer lock
            assert not await store.probe()
        assert await store.probe()
        await _create(store, "act_after")
    finally:
        await store.close()


def _row_locked(url: str, action_id: str) -> AbstractContextManager[None]:
    """An outside session in a transaction holding one action's row lock (an operator's open
    ``SELECT ... FOR UPDATE`` in psql, say): it holds no lock of the store's."""
    return _outside_transaction(url, "SELECT 1 FROM actions WHERE action_id = %s FOR UPDATE", (action_id,))


async def test_a_row_locked_from_outside_fails_only_its_own_writes_and_the_others_go_on(postgres_url: str) -> None:
    # The default lock timeout (2 s): a writer stuck on the row used to hold the writer lock that long, so
    # the other writers, queued behind two of them, waited past their own lock timeout and failed: one
    # tenant's locked row made every tenant's writes 503.
    timeouts = dataclasses.replace(TIMEOUTS, lock_ms=2000, statement_ms=4000)
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=4, timeouts=timeouts)
    try:
        await _create(store, "act_locked")
        stuck: list[object] = []
        with _row_locked(postgres_url, "act_locked"):

            async def hammer() -> None:  # e.g. retried decisions of that one action
                while len(stuck) < 6:
                    _, outcome = await _timed(
                        lambda: store.update_action(
                            "acme", "act_locked", from_statuses=("pending_approval",), status="cancelled"
                        )
                    )
                    stuck.append(outcome)

            hammers = [asyncio.create_task(hammer()) for _ in range(2)]
            others = [await _timed(functools.partial(_create, store, f"act_other_{n}", "globex")) for n in range(6)]
            await asyncio.gather(*hammers)
            took, read = await _timed(lambda: store.get_action("acme", "act_locked"))
        assert all(isinstance(o, StoreUnavailable) and o.status == 503 for o in stuck), stuck
        assert [type(outcome).__name__ for _, outcome in others] == ["tuple"] * 6, others
        assert getattr(read, "status", None) == "pending_approval" and took < BOUND_S + SLACK_S
        assert await store.update_action("acme", "act_locked", from_statuses=("pending_approval",), status="cancelled")
    finally:
        await store.close()


async def test_a_table_locked_from_outside_makes_the_store_unready_until_released(postgres_url: str) -> None:
    # Every read and write of an action waits for an ACCESS EXCLUSIVE lock (VACUUM FULL, LOCK TABLE); the
    # probe took no table lock and said ready throughout.
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2, timeouts=TIMEOUTS)
    try:
        await _create(store, "act_before")
        with _outside_transaction(postgres_url, "LOCK TABLE actions IN ACCESS EXCLUSIVE MODE", ()):
            took, ready = await _timed(store.probe)
            assert ready is False and took < BOUND_S + SLACK_S
        assert await store.probe()
    finally:
        await store.close()


async def test_a_row_locked_from_outside_does_not_stop_the_renewal_of_the_hosts_other_leases(postgres_url: str) -> None:
    # One statement renews every lease of the host: it used to fail whole on the one locked row, every
    # third of the lease, until all the host's running actions expired and other hosts took them over.
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, owner="host-a", lease_ms=60_000, timeouts=TIMEOUTS)
    try:
        for n in range(3):
            await store.create_action(
                "acme", f"act_run_{n}", "cap:crewai:alpha", "alpha", "run", "{}", "h", "p", None, "running"
            )
        assert await store.renew_leases() == 3
        with _row_locked(postgres_url, "act_run_1"):
            before = {n: (await store.get_action("acme", f"act_run_{n}")).lease_expires_at for n in range(3)}  # type: ignore[union-attr]
            assert await store.renew_leases() == 2
            after = {n: (await store.get_action("acme", f"act_run_{n}")).lease_expires_at for n in range(3)}  # type: ignore[union-attr]
        assert after[1] == before[1] and after[0] > before[0] and after[2] > before[2]  # type: ignore[operator]
        assert store.lost_leases() == set()  # the locked one is still this host's, until its lease expires
        assert store.lease_token("acme", "act_run_1") is not None
        assert await store.renew_leases() == 3
    finally:
        await store.close()


async def test_a_stopped_server_answers_every_call_within_the_bound_and_the_store_recovers(
    postgres_server, postgres_url: str
) -> None:
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2, timeouts=TIMEOUTS)
    try:
        await _create(store, "act_before")
        with pgserver.stopped(postgres_server):
            calls = [lambda: store.get_action("acme", "act_before"), lambda: _create(store, "act_x")] * 3
            for call in calls:  # more calls than pooled connections: the stuck ones are freed
                took, outcome = await _timed(call)
                assert isinstance(outcome, StoreUnavailable), outcome
                assert took < BOUND_S + SLACK_S, took
            took, ok = await _timed(store.probe)
            assert ok is False and took < BOUND_S + SLACK_S
        await _until(store.probe, "the store to answer again after SIGCONT", timeout=60)
        assert (await store.get_action("acme", "act_before")) is not None
    finally:
        await store.close()


async def test_a_read_only_database_is_unavailable_not_an_internal_error(postgres_url: str) -> None:
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2, timeouts=TIMEOUTS)
    try:
        with _read_only(postgres_url):
            outcome: object = None

            async def refused() -> bool:
                nonlocal outcome
                _, outcome = await _timed(lambda: _create(store, "act_ro"))
                return isinstance(outcome, StoreUnavailable)

            await _until(refused, "a write on the read-only database to be refused")
            assert isinstance(outcome, StoreUnavailable) and outcome.code == "store.unavailable"
            assert not await store.probe()  # reads still work, but /ready says the store cannot take writes
        await _until(store.probe, "the store to take writes again")
        await _create(store, "act_rw")
    finally:
        await store.close()


def test_every_session_carries_the_timeouts_and_keepalives(postgres_url: str) -> None:
    kwargs = TIMEOUTS.connect_kwargs(postgres_url + "?options=-c%20work_mem%3D8MB", "aip-test")
    with psycopg.connect(postgres_url, **kwargs) as conn:
        shown = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout", "work_mem")
        }
        assert conn.info.get_parameters().get("application_name") == "aip-test"
    assert shown == {
        "statement_timeout": "1s",
        "lock_timeout": "500ms",
        "idle_in_transaction_session_timeout": "1s",
        "work_mem": "8MB",  # the URL's own options are kept
    }
    assert kwargs["keepalives"] == 1 and kwargs["keepalives_idle"] > 0 and kwargs["tcp_user_timeout"] > 0


# --- the listener ----------------------------------------------------------------------------------


def _listen_backends(url: str) -> set[int]:
    """The server processes of the listener's connections (a stopped one stays until it is resumed)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'aip-crewai-host-listen' "
            "AND datname = current_database()"
        ).fetchall()
    return {int(row[0]) for row in rows}


@pytest.mark.parametrize("fault", ["stopped", "terminated"])
async def test_a_listen_connection_that_dies_is_replaced_and_followers_keep_receiving(
    postgres_url: str, fault: str
) -> None:
    # The writer keeps the default bounds: only the listener's are under test, and on a loaded machine a
    # 1 s idle-in-transaction bound ended the writer's own transaction between two of its statements.
    writer = await Store.open(postgres_url, clock=lambda: T0 / 1000, owner="host-a")
    changes = RemoteChanges()
    stop = listen(postgres_url, changes, asyncio.get_running_loop(), TIMEOUTS)
    try:
        await asyncio.wait_for(changes.listening().wait(), 30)
        await writer.create_action("acme", "act_1", "cap:crewai:alpha", "alpha", "run", "{}", "h", "p", "k", "running")
        follower = changes.signal("acme", "act_1")
        (old,) = _listen_backends(postgres_url)
        seen = follower.version
        if fault == "stopped":  # silent: TCP up, nothing delivered
            os.kill(old, signal.SIGSTOP)
        else:
            with psycopg.connect(postgres_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (old,))
        try:
            lost_at = time.monotonic()
            # Noticed: the follower is woken to poll (pushed False), then a new backend listens.
            assert await follower.wait(30, seen=seen)
            await _until(lambda: changes.pushed and _listen_backends(postgres_url) - {old}, "a new listener")
            replaced_after = time.monotonic() - lost_at
        finally:
            if fault == "stopped":
                os.kill(old, signal.SIGCONT)
        seen = follower.version
        await writer.append_chunks("acme", "act_1", [(0, '{"kind":"data"}')])
        assert await follower.wait(10, seen=seen)  # delivered by the new listener
        print(f"listener replaced {replaced_after:.2f} s after the fault ({fault})")
    finally:
        await asyncio.to_thread(stop)
        await writer.close()


# --- the host over HTTP ------------------------------------------------------------------------------


@asynccontextmanager
async def _host(make_app, settings: Settings, url: str) -> AsyncIterator[httpx2.AsyncClient]:
    shared = dataclasses.replace(
        settings, store_path=url, host_id="host-faults", store_timeouts=TIMEOUTS, cors_origins=(ORIGIN,)
    )
    async with running(make_app(shared)) as client:
        yield client


ORIGIN = "https://console.example"


async def _submit(client: httpx2.AsyncClient, n: int) -> httpx2.Response:
    env = action_env(f"msg_f{n}_{time.monotonic_ns()}", f"act_f{n}", "cap:crewai:alpha", {"topic": "x"}, f"key-{n}")
    return await client.post("/aip/v1/messages", json=env, headers={**bearer("acme-invoker"), "Origin": ORIGIN})


def _typed_503(answer: httpx2.Response) -> bool:
    return (
        answer.status_code == 503
        and answer.json()["body"]["error"]["error"]["code"] == "store.unavailable"
        and answer.headers.get("retry-after") == "1"
        and answer.headers.get("access-control-allow-origin") == ORIGIN
    )


async def test_over_http_a_held_writer_lock_gives_typed_503s_and_an_unready_host_within_the_bound(
    make_app, settings: Settings, postgres_url: str, monkeypatch
) -> None:
    monkeypatch.setattr(store_module, "PROBE_FRESH_S", 0.0)
    async with _host(make_app, settings, postgres_url) as client:
        await _until(lambda: host_state(client._transport.app).readiness.ready, "the sidecar to be ready")  # type: ignore[attr-defined]
        assert (await client.get("/ready")).status_code == 200
        with _writer_lock_held(postgres_url):
            took, answer = await _timed(lambda: _submit(client, 1))
            assert isinstance(answer, httpx2.Response) and _typed_503(answer), answer
            assert took < BOUND_S + SLACK_S
            took, ready = await _timed(lambda: client.get("/ready"))
            assert isinstance(ready, httpx2.Response) and ready.status_code == 503 and took < BOUND_S + SLACK_S
            took, read = await _timed(lambda: client.get("/aip/v1/actions/act_f1", headers=bearer("acme-invoker")))
            assert isinstance(read, httpx2.Response) and read.status_code in (404, 503) and took < BOUND_S + SLACK_S
        await _until(lambda: _ready(client), "/ready to recover by itself")
        assert (await _submit(client, 2)).status_code != 503


async def _ready(client: httpx2.AsyncClient) -> bool:
    return (await client.get("/ready")).status_code == 200


async def test_over_http_a_stopped_server_answers_within_the_bound_and_ready_tells_the_truth(
    make_app, settings: Settings, postgres_server, postgres_url: str, monkeypatch
) -> None:
    monkeypatch.setattr(store_module, "PROBE_FRESH_S", 0.0)
    async with _host(make_app, settings, postgres_url) as client:
        await _until(lambda: _ready(client), "the host to be ready")
        with pgserver.stopped(postgres_server):
            for n in range(3):
                took, answer = await _timed(functools.partial(_submit, client, 10 + n))
                assert isinstance(answer, httpx2.Response) and _typed_503(answer), answer
                assert took < BOUND_S + SLACK_S, took
            took, ready = await _timed(lambda: client.get("/ready"))
            assert isinstance(ready, httpx2.Response) and ready.status_code == 503 and took < BOUND_S + SLACK_S
        await _until(lambda: _ready(client), "/ready to recover after SIGCONT", timeout=60)


async def test_over_http_a_read_only_database_gives_typed_503s_never_500(
    make_app, settings: Settings, postgres_url: str, monkeypatch
) -> None:
    monkeypatch.setattr(store_module, "PROBE_FRESH_S", 0.0)
    async with _host(make_app, settings, postgres_url) as client:
        await _until(lambda: _ready(client), "the host to be ready")
        with _read_only(postgres_url):
            answers: list[httpx2.Response] = []

            async def refused() -> bool:
                answers.append(await _submit(client, 20 + len(answers)))
                return answers[-1].status_code == 503

            await _until(refused, "a submission on the read-only database to be refused")
            assert all(a.status_code != 500 for a in answers) and _typed_503(answers[-1])
            assert (await client.get("/ready")).status_code == 503
        await _until(lambda: _ready(client), "/ready to recover once the database takes writes")
