"""The PostgreSQL host store's connection pool: one pooled connection per store
method, reads not queued behind a write waiting for the writer lock, fences held across the pool's
threads and across two stores (two hosts), a connection the server dropped replaced.

Against a real throwaway PostgreSQL server (tests/pgserver.py); skipped with one line without it.
"""

from __future__ import annotations

import asyncio
import itertools

import psycopg
import pytest
from kits.poll import until_async

from aip_crewai.host.store.engines.postgres import WRITER_LOCK
from aip_crewai.host.store.store import Store

pytestmark = pytest.mark.timeout(60)

T0 = 1_790_000_000_000  # ms


def _backends(url: str) -> int:
    """Connections the host store holds on the server (its ``application_name``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'aip-crewai-host'"
            " AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


async def test_the_pool_holds_its_size_in_connections_and_closes_them(postgres_url: str):
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=3)
    try:
        assert _backends(postgres_url) == 3
        assert await store.claim_message_id("acme", "m-1", T0 + 60_000)
    finally:
        await store.close()
    await until_async(lambda: _backends(postgres_url) == 0, what="the pool's connections to close")


async def test_a_read_is_not_queued_behind_a_write_waiting_for_the_writer_lock(postgres_url: str):
    """Another host holds the writer lock: this host's write waits for it on one pooled connection
    while a read runs on another (with one connection the read would wait behind the write)."""
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2)
    other_host = psycopg.connect(postgres_url, autocommit=True)
    try:
        other_host.execute("BEGIN")
        other_host.execute("SELECT pg_advisory_xact_lock(%s)", (WRITER_LOCK,))
        write = asyncio.create_task(store.expire_approvals(T0))  # one locked write transaction

        def waiting_for_the_lock() -> bool:
            with psycopg.connect(postgres_url, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = %s",
                    (WRITER_LOCK,),
                ).fetchone()
            return bool(row and row[0])

        await until_async(waiting_for_the_lock, what="the store's write to wait for the writer lock")
        assert await asyncio.wait_for(store.get_action("acme", "act-none"), timeout=5) is None
        assert not write.done()
        other_host.execute("COMMIT")
        assert await asyncio.wait_for(write, timeout=5) == []
    finally:
        other_host.close()
        await store.close()


async def test_a_message_id_is_claimed_once_across_the_pool_and_across_two_hosts(postgres_url: str):
    """Issue 21 item 2: a signed message id is claimed once, whichever host and connection claims it."""
    host_a = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=4)
    host_b = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=4)
    try:
        for n in range(5):
            claims = [
                store.claim_message_id("acme", f"m-{n}", T0 + 60_000, key_id="approver-key")
                for _ in range(8)
                for store in (host_a, host_b)
            ]
            assert sorted(await asyncio.gather(*claims)) == [False] * 15 + [True]
    finally:
        await host_a.close()
        await host_b.close()


async def test_a_connection_the_server_dropped_is_replaced_not_handed_out(postgres_url: str):
    """A database restart or an idle timeout drops the pool's connections: every later store method
    still succeeds (each connection is tried as it leaves the pool)."""
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2)
    try:
        assert await store.claim_message_id("acme", "before", T0 + 60_000)
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'aip-crewai-host' AND datname = current_database()"
            )
        for n in range(6):  # more calls than connections: each dropped one is met at least once
            assert await store.claim_message_id("acme", f"after-{n}", T0 + 60_000)
            assert await store.get_action("acme", "act-none") is None
    finally:
        await store.close()


async def test_an_outage_is_a_typed_retryable_error_and_the_store_recovers(postgres_url: str):
    """The database refuses every connection (as while it is down): a store method fails with
    StoreUnavailable (503, retryable) once no pooled connection comes within the call bound, never a
    driver error; once the database is back, store methods succeed again."""
    from aip_crewai.host.store.engines.postgres import StoreTimeouts
    from aip_crewai.host.store.store import StoreUnavailable

    database = postgres_url.rsplit("/", 1)[1].split("?")[0]
    store = await Store.open(postgres_url, clock=lambda: T0 / 1000, pool_size=2, timeouts=StoreTimeouts(500, 300, 1000))
    try:
        with psycopg.connect(postgres_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
            with pytest.raises(StoreUnavailable) as raised:
                await store.get_action("acme", "act-none")
            assert raised.value.status == 503 and raised.value.retryable and raised.value.code == "store.unavailable"
            assert store.unavailable  # /ready says unready meanwhile
            admin.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')

        attempts = itertools.count()

        async def recovered() -> bool:  # the pool reconnects in the background, backing off
            try:  # a fresh id each time: an attempt that timed out may still have committed its claim
                assert await store.claim_message_id("acme", f"after-the-outage-{next(attempts)}", T0 + 60_000)
            except StoreUnavailable:
                return False
            assert not store.unavailable
            return True

        await until_async(recovered, timeout=60, interval=0, what="the store recovered")
    finally:
        await store.close()
