"""The host store: migrations, file safety, tenant-keyed atomic fences (ARCHITECTURE.md §7)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from aip_crewai.host.store.records import ActionRecord, ApprovalRecord, LeaseLost
from aip_crewai.host.store.store import (
    MIGRATIONS,
    InsecureStorePath,
    InvalidCursor,
    MissingTarget,
    Store,
    StoreError,
    ms_to_rfc3339,
    rfc3339_to_ms,
)


async def decide(store, *args):
    """Record one decision and start nothing: True when this call decided (the store's decide_and_start)."""
    decided, _ = await store.decide_and_start(*args, start_if=lambda approval, action: False)
    return decided is not None


T0 = 1_790_000_000_000  # ms
DAY = 86_400_000


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state / "host.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, db_path: Path) -> Path | str:
    """Where the store lives: a SQLite file, or a fresh database on a real PostgreSQL server (
    skipped with one line without PostgreSQL). Tests about the SQLite file itself use ``db_path``."""
    if request.param == "sqlite":
        return db_path
    return request.getfixturevalue("postgres_url")


@pytest.fixture
async def store(location: Path | str):
    opened = await Store.open(location, clock=lambda: T0 / 1000)
    yield opened
    await opened.close()


@pytest.fixture
async def sqlite_store(db_path: Path):
    """For the tests about the SQLite file itself."""
    opened = await Store.open(db_path, clock=lambda: T0 / 1000)
    yield opened
    await opened.close()


def schema(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    return [*rows, ("user_version", version)]


async def make_action(store: Store, tenant: str = "acme", action_id: str = "act_1", status: str = "running", **kw):
    return await store.create_action(
        tenant,
        action_id,
        "cap:crewai:alpha",
        "alpha",
        "run",
        '{"a":1}',
        "h1",
        "svc:acme",
        kw.pop("key", "key-1"),
        status,
        **kw,
    )


# --- migrations and files ---------------------------------------------------------


# A fresh store's schema against an independent snapshot: test_store_schema_snapshot.py.


async def test_reopening_applies_nothing_twice(db_path: Path):
    for _ in range(2):
        opened = await Store.open(db_path)
        await opened.close()
    assert schema(db_path)[-1] == ("user_version", len(MIGRATIONS))


async def test_newer_schema_is_refused(db_path: Path):
    await (await Store.open(db_path)).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError, match="schema is version"):
        await Store.open(db_path)


async def test_postgresql_applies_every_migration_once_and_refuses_a_newer_or_foreign_schema(postgres_url: str):
    """Issue 21 item 1: the SQLite migrations, written once, applied in PostgreSQL's dialect."""
    import psycopg

    from aip_crewai.host.store.migrations import PG_MIGRATIONS

    for _ in range(2):
        await (await Store.open(postgres_url)).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM aip_schema_version").fetchall() == [(len(PG_MIGRATIONS),)]
        columns: dict[str, str] = dict(
            conn.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'actions'"
            ).fetchall()
        )
        assert columns["created_at"] == "bigint" and columns["status"] == "text"
        conn.execute("UPDATE aip_schema_version SET version = version + 1")
    with pytest.raises(StoreError, match="newer|knows up to"):
        await Store.open(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP TABLE aip_schema_version")
    with pytest.raises(StoreError, match="its own database"):
        await Store.open(postgres_url)


async def test_file_is_created_0600_in_wal_mode(sqlite_store: Store, db_path: Path):
    assert os.stat(db_path).st_mode & 0o777 == 0o600
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for companion in (Path(f"{db_path}-wal"), Path(f"{db_path}-shm")):
        if companion.exists():
            assert os.stat(companion).st_mode & 0o077 == 0


async def test_wider_existing_file_is_refused(db_path: Path):
    db_path.touch()
    db_path.chmod(0o644)
    with pytest.raises(InsecureStorePath, match="0644"):
        await Store.open(db_path)


async def test_group_writable_directory_is_refused(db_path: Path):
    db_path.parent.chmod(0o770)
    with pytest.raises(InsecureStorePath, match="group- or world-writable"):
        await Store.open(db_path)


async def test_symlinked_file_is_refused(db_path: Path, tmp_path: Path):
    real = tmp_path / "state" / "real.db"
    real.touch(mode=0o600)
    db_path.symlink_to(real)
    with pytest.raises(InsecureStorePath, match="symlink"):
        await Store.open(db_path)


async def test_missing_directory_is_refused(tmp_path: Path):
    with pytest.raises(InsecureStorePath, match="does not exist"):
        await Store.open(tmp_path / "nope" / "host.db")


def test_rfc3339_round_trip():
    assert ms_to_rfc3339(T0) == "2026-09-21T14:13:20.000Z"
    assert rfc3339_to_ms("2026-09-21T14:13:20Z") == T0
    assert rfc3339_to_ms("2026-09-21T16:13:20.5+02:00") == T0 + 500
    for bad in ["2026-09-21", "2026-09-21T14:13:20", "yesterday", "2026-09-21T14:13:20.Z", None]:
        with pytest.raises(ValueError):
            rfc3339_to_ms(bad)


@pytest.mark.parametrize(
    "text",
    ["0001-01-01T00:00:00.000Z", "0999-06-01T12:00:00.000Z", "1969-12-31T23:59:59.500Z", "9999-12-31T23:59:59.999Z"],
)
def test_rfc3339_round_trips_at_the_year_edges_with_four_digit_years(text: str):
    assert ms_to_rfc3339(rfc3339_to_ms(text)) == text  # 0999 was rendered 999, 0001 as 1


@pytest.mark.parametrize("text", ["9999-12-31T23:59:59-00:01", "0001-01-01T00:00:00+00:01"])
def test_rfc3339_instants_outside_years_1_to_9999_in_utc_are_refused(text: str):
    with pytest.raises(ValueError):
        rfc3339_to_ms(text)


# --- message ids ------------------------------------------------------------------


async def test_message_ids_are_claimed_once_per_tenant(store: Store):
    assert await store.claim_message_id("acme", "msg_1", T0 + 1000)
    assert not await store.claim_message_id("acme", "msg_1", T0 + 1000)
    assert await store.claim_message_id("globex", "msg_1", T0 + 1000)  # another tenant's key space


async def test_expired_message_claims_can_be_reclaimed_and_purged(store: Store):
    assert await store.claim_message_id("acme", "msg_1", T0 + 10)
    assert await store.claim_message_id("acme", "msg_1", T0 + 20_000, now=T0 + 10)
    assert await store.purge_message_ids(T0 + 20_000) == 1


# --- idempotency ------------------------------------------------------------------


async def idempotency_row(store: Store, tenant: str, key: str) -> tuple[Any, ...] | None:
    """The stored reservation ``(action_id, input_hash, expires_at)`` of a key, read directly (no store API needs it)."""
    rows = await store._fetch(
        "SELECT action_id, input_hash, expires_at FROM idempotency WHERE tenant = ? AND key = ?", (tenant, key)
    )
    return rows[0] if rows else None


async def reservation(store: Store, tenant: str, key: str) -> tuple[Any, ...]:
    """The stored reservation of a key that the test has made."""
    row = await idempotency_row(store, tenant, key)
    assert row is not None
    return row


async def stored_action(store: Store, tenant: str, action_id: str) -> ActionRecord:
    """The stored action the test has made."""
    record = await store.get_action(tenant, action_id)
    assert record is not None
    return record


async def stored_approval(store: Store, tenant: str, approval_id: str) -> ApprovalRecord:
    """The stored approval the test has made."""
    record = await store.get_approval(tenant, approval_id)
    assert record is not None
    return record


async def test_fifty_concurrent_admissions_under_one_key_create_exactly_one_action(store: Store):
    results = await asyncio.gather(
        *[make_action(store, action_id=f"act_{i}", key="key-1", key_expires_at=T0 + DAY) for i in range(50)]
    )
    assert sum(created for created, _ in results) == 1
    assert len({record.action_id for _, record in results}) == 1


async def test_concurrent_admissions_across_two_connections(store: Store, location: Path | str):
    """Two connections stand for two hosts on one database (the key fence across replicas)."""
    second = await Store.open(location, clock=lambda: T0 / 1000)
    try:
        results = await asyncio.gather(
            *[
                make_action(store if i % 2 else second, action_id=f"act_{i}", key="key-x", key_expires_at=T0 + DAY)
                for i in range(40)
            ]
        )
    finally:
        await second.close()
    assert sum(created for created, _ in results) == 1 and len({r.action_id for _, r in results}) == 1


async def test_a_live_key_returns_its_action_and_an_expired_one_is_taken_over(store: Store):
    assert (await make_action(store, action_id="act_1", key="k", key_expires_at=T0 + DAY))[0]
    created, holder = await make_action(store, action_id="act_2", key="k", key_expires_at=T0 + DAY)
    assert not created and holder.action_id == "act_1"
    later, record = await make_action(store, action_id="act_3", key="k", key_expires_at=T0 + 2 * DAY, now=T0 + DAY)
    assert later and record.action_id == "act_3" and (await reservation(store, "acme", "k"))[0] == "act_3"
    assert (await make_action(store, tenant="globex", action_id="act_9", key="k", key_expires_at=T0 + DAY))[0]


async def test_a_refused_action_reserves_no_key_and_a_created_one_reserves_it_in_the_same_transaction(store: Store):
    """Issue 16 item 1: the reservation exists only beside the action row it points at."""
    await make_action(store, action_id="act_1", key="key-1", key_expires_at=T0 + DAY)
    assert (await reservation(store, "acme", "key-1"))[0] == "act_1"
    # act_1 again under another key: the existing row comes back, key-2 stays free
    created, existing = await make_action(store, action_id="act_1", key="key-2", key_expires_at=T0 + DAY)
    assert not created and existing.idempotency_key == "key-1"
    assert await idempotency_row(store, "acme", "key-2") is None
    # a missing target refuses the request: no row, no reservation
    with pytest.raises(MissingTarget):
        await store.create_action(
            "acme",
            "st_1",
            "cap:crewai:alpha:status",
            "alpha",
            "status",
            "{}",
            "h",
            "p",
            "key-3",
            "running",
            target=("nope", ("run",)),
            key_expires_at=T0 + DAY,
        )
    assert await idempotency_row(store, "acme", "key-3") is None and await store.get_action("acme", "st_1") is None
    # key-1 held by act_1: another action id gets act_1 back and nothing is written
    created, holder = await make_action(store, action_id="act_2", key="key-1", key_expires_at=T0 + DAY)
    assert not created and holder.action_id == "act_1" and await store.get_action("acme", "act_2") is None


async def test_a_reservation_without_its_action_row_is_taken_over(store: Store):
    """A key wedged by an older version's crash between two commits no longer answers 404 for 24 h."""
    await store._change(
        "INSERT INTO idempotency (tenant, key, capability_id, action_id, input_hash, created_at, "
        "expires_at) VALUES ('acme', 'key-w', 'cap:crewai:alpha', 'act_lost', 'h1', ?, ?)",
        (T0, T0 + DAY),
    )  # what the old two-commit admission left after a crash
    created, record = await make_action(store, action_id="act_2", key="key-w", key_expires_at=T0 + DAY)
    assert created and record.action_id == "act_2"
    assert (await reservation(store, "acme", "key-w"))[0] == "act_2"


# --- actions ----------------------------------------------------------------------


async def test_create_action_once_and_return_the_existing(store: Store):
    created, record = await make_action(store, timeout_ms=5000)
    assert created and record.status == "running" and record.dispatch == "not_sent" and record.timeout_ms == 5000
    again, existing = await store.create_action(
        "acme", "act_1", "cap", "alpha", "run", "{}", "other", "p", None, "running"
    )
    assert not again and existing.input_hash == "h1"
    assert await store.get_action("globex", "act_1") is None
    with pytest.raises(ValueError):
        await make_action(store, action_id="act_2", status="completed")


async def test_create_action_can_insert_an_action_already_finished(store: Store):
    """A key-less read answered inline: admit and its result in one insert."""
    created, record = await store.create_action(
        "acme",
        "st_1",
        "cap",
        "alpha",
        "status",
        "{}",
        "h",
        "p",
        None,
        "running",
        dispatch="acknowledged",
        durable=False,
        result=("completed", '{"status":"completed"}'),
    )
    assert created and record.status == "completed" and record.result_json == '{"status":"completed"}'
    assert record == await store.get_action("acme", "st_1")
    for status, result in (("running", "running"), ("pending_approval", "completed"), ("running", "unknown")):
        with pytest.raises(ValueError):  # only what the lifecycle allows after the starting state
            await store.create_action(
                "acme", "st_2", "cap", "alpha", "status", "{}", "h", "p", None, status, result=(result, "{}")
            )
    assert await store.get_action("acme", "st_2") is None


async def test_create_action_checks_its_target_in_the_same_call(store: Store):
    await make_action(store, action_id="run_1")  # a run of crew alpha
    await store.create_action(
        "acme", "st_0", "cap:crewai:alpha:status", "alpha", "status", "{}", "h", "p", None, "running"
    )
    ok_target = ("run_1", ("run", "train"))
    for run_action_id, crew_id, operations in [
        ("nope", "alpha", ("run",)),
        ("run_1", "beta", ("run",)),
        ("run_1", "alpha", ("train",)),
        ("st_0", "alpha", ("run",)),
    ]:
        with pytest.raises(MissingTarget):
            await store.create_action(
                "acme",
                "st_1",
                "cap:crewai:alpha:status",
                crew_id,
                "status",
                "{}",
                "h",
                "p",
                None,
                "running",
                target=(run_action_id, operations),
            )
        assert await store.get_action("acme", "st_1") is None  # nothing written
    with pytest.raises(MissingTarget):  # another tenant's run is no target
        await store.create_action(
            "globex",
            "st_1",
            "cap:crewai:alpha:status",
            "alpha",
            "status",
            "{}",
            "h",
            "svc:acme",
            None,
            "running",
            target=ok_target,
        )
    with pytest.raises(MissingTarget):  # nor another principal's run of the same tenant (least privilege)
        await store.create_action(
            "acme",
            "st_1",
            "cap:crewai:alpha:status",
            "alpha",
            "status",
            "{}",
            "h",
            "p",
            None,
            "running",
            target=ok_target,
        )
    created, record = await store.create_action(
        "acme",
        "st_1",
        "cap:crewai:alpha:status",
        "alpha",
        "status",
        "{}",
        "h",
        "svc:acme",
        None,
        "running",
        dispatch="sent",
        target=ok_target,
    )
    assert created and record.dispatch == "sent" and record.status == "running"
    with pytest.raises(ValueError):
        await make_action(store, action_id="act_9", dispatch="maybe")


async def test_update_action_returns_the_updated_record(store: Store):
    await make_action(store)
    record = await store.update_action(
        "acme",
        "act_1",
        from_statuses=["running"],
        status="completed",
        dispatch="acknowledged",
        result_json='{"ok":true}',
    )
    assert record is not None and record == await store.get_action("acme", "act_1")
    assert (record.status, record.dispatch, record.result_json) == ("completed", "acknowledged", '{"ok":true}')
    assert await store.update_action("acme", "act_1", from_statuses=["running"], status="failed") is None


async def test_transitions_are_enforced_in_the_where_clause(store: Store):
    await make_action(store, status="pending_approval")
    assert not await store.update_action("acme", "act_1", from_statuses=["running"], status="completed")
    assert await store.update_action(
        "acme", "act_1", from_statuses=["pending_approval"], status="running", approval_id="apr_1"
    )
    assert await store.update_action(
        "acme", "act_1", from_statuses=["running"], status="completed", result_json='{"ok":true}'
    )
    # A stale writer (still believing it is running) changes nothing.
    assert not await store.update_action("acme", "act_1", from_statuses=["running"], status="failed", error_json="{}")
    record = await stored_action(store, "acme", "act_1")
    assert (record.status, record.result_json, record.error_json, record.approval_id) == (
        "completed",
        '{"ok":true}',
        None,
        "apr_1",
    )
    with pytest.raises(ValueError):
        await store.update_action("acme", "act_1", from_statuses=["completed"], status="running")
    with pytest.raises(ValueError):
        await store.update_action("acme", "act_1", from_statuses=[], status="running")


async def test_dispatch_only_moves_forward(store: Store):
    await make_action(store)
    for dispatch, expected in [
        ("sent", "sent"),
        ("acknowledged", "acknowledged"),
        ("sent", "acknowledged"),
        ("not_sent", "acknowledged"),
    ]:
        await store.update_action("acme", "act_1", from_statuses=["running"], status="running", dispatch=dispatch)
        assert (await stored_action(store, "acme", "act_1")).dispatch == expected


async def test_other_tenants_cannot_update(store: Store):
    await make_action(store)
    assert not await store.update_action("globex", "act_1", from_statuses=["running"], status="failed")


async def test_list_in_flight(store: Store):
    await make_action(store, action_id="a1")
    await make_action(store, action_id="a2", status="pending_approval")
    await make_action(store, tenant="globex", action_id="a3")
    assert {r.action_id for r in await store.list_in_flight()} == {"a1", "a3"}
    assert [r.action_id for r in await store.list_in_flight("globex")] == ["a3"]


# --- chunks -----------------------------------------------------------------------


async def test_chunks_append_list_and_count(store: Store):
    await make_action(store)
    assert await store.append_chunks("acme", "act_1", [(0, '{"s":0}'), (1, '{"s":1}'), (2, '{"s":2}')]) == 3
    assert await store.append_chunks("acme", "act_1", [(2, "dup"), (3, '{"s":3}')]) == 1
    assert [c.sequence for c in await store.list_chunks("acme", "act_1")] == [0, 1, 2, 3]
    assert [c.chunk_json for c in await store.list_chunks("acme", "act_1", after_sequence=1, limit=1)] == ['{"s":2}']
    assert (await stored_action(store, "acme", "act_1")).chunk_count == 4
    assert await store.list_chunks("globex", "act_1") == []
    with pytest.raises(StoreError):
        await store.append_chunks("globex", "act_1", [(0, "{}")])


async def test_a_follow_page_is_the_chunks_then_the_action_in_one_store_call(store: Store, monkeypatch):
    """A stream follower's read (``follow_page``): the chunks after a sequence, bounded by its limit, and
    the action row as it is after them (None for an action the tenant lacks), in ONE hop to the worker."""
    await make_action(store)
    await store.append_chunks("acme", "act_1", [(0, '{"s":0}'), (1, '{"s":1}'), (2, '{"s":2}')])
    hops: list[object] = []
    run = store._run

    async def counted(fn, *args):
        hops.append(fn)
        return await run(fn, *args)

    monkeypatch.setattr(store, "_run", counted)
    chunks, action = await store.follow_page("acme", "act_1", 0, 1)
    assert [c.chunk_json for c in chunks] == ['{"s":1}']
    assert action is not None and action.action_id == "act_1" and action.chunk_count == 3
    assert len(hops) == 1
    assert await store.follow_page("globex", "act_1", -1, 10) == ([], None)


async def test_no_chunk_is_appended_once_the_action_is_terminal(store: Store):
    """A late batch of a cancelled dispatch (on another pooled connection or host) never follows the result."""
    await make_action(store)
    assert await store.append_chunks("acme", "act_1", [(0, "{}")]) == 1
    await store.update_action("acme", "act_1", from_statuses=["running"], status="cancelled", result_json="{}")
    assert await store.append_chunks("acme", "act_1", [(1, "{}"), (2, "{}")]) == 0
    assert [c.sequence for c in await store.list_chunks("acme", "act_1")] == [0]
    assert (await stored_action(store, "acme", "act_1")).chunk_count == 1


async def test_chunk_append_moves_dispatch_forward_in_the_same_transaction(store: Store):
    await make_action(store)
    await store.append_chunks("acme", "act_1", [(0, "{}")], dispatch="acknowledged", durable=False)
    record = await stored_action(store, "acme", "act_1")
    assert (record.dispatch, record.chunk_count) == ("acknowledged", 1)
    await store.append_chunks("acme", "act_1", [(1, "{}")], dispatch="sent")
    assert (await stored_action(store, "acme", "act_1")).dispatch == "acknowledged"
    with pytest.raises(ValueError):
        await store.append_chunks("acme", "act_1", [(2, "{}")], dispatch="lost")


async def test_non_durable_writes_are_visible_and_the_connection_stays_full(sqlite_store: Store, db_path: Path):
    store = sqlite_store
    """durable=False relaxes fsync for that write only; the connection goes back to synchronous=FULL."""
    created, _ = await make_action(store, action_id="read_1", key=None, durable=False)
    assert created
    assert await store.update_action(
        "acme", "read_1", from_statuses=["running"], status="completed", result_json="{}", durable=False
    )
    assert (await stored_action(store, "acme", "read_1")).status == "completed"
    assert (await store._fetch("PRAGMA synchronous"))[0][0] == 2  # FULL
    with sqlite3.connect(db_path) as other:  # committed: another connection sees it
        assert other.execute("SELECT status FROM actions WHERE action_id = 'read_1'").fetchone() == ("completed",)


# --- approvals --------------------------------------------------------------------


async def approval(
    store: Store,
    approval_id: str = "apr_1",
    *,
    tenant: str = "acme",
    action_id: str = "act_1",
    expires_at: int = T0 + 900_000,
    now: int = T0,
):
    if await store.get_action(tenant, action_id) is None:
        await make_action(store, tenant=tenant, action_id=action_id, status="pending_approval")
    return await store.create_approval(
        tenant, approval_id, action_id, "cap:crewai:alpha", "ph", "svc:acme", '{"a":1}', expires_at, now=now
    )


async def test_create_and_read_approvals_per_tenant(store: Store):
    created = await approval(store)
    assert created.status == "pending" and created.created_at == T0
    assert await store.get_approval("acme", "apr_1") == created
    assert await store.get_approval("globex", "apr_1") is None
    with pytest.raises(StoreError):
        await approval(store)  # same id
    with pytest.raises(StoreError):
        await store.create_approval("acme", "apr_x", "no_such_action", "cap", "ph", "p", "{}", T0 + 1)


async def test_listing_pages_with_a_cursor_and_a_done_flag(store: Store):
    for i in range(5):
        await approval(store, f"apr_{i}", action_id=f"act_{i}", now=T0 + i)
    await approval(store, "apr_g", tenant="globex", action_id="act_g")
    seen, cursor, pages = [], None, 0
    while True:
        page = await store.list_approvals("acme", cursor=cursor, limit=2)
        pages += 1
        seen += [a.approval_id for a in page.items]
        assert (page.next_cursor is None) == page.done
        if page.done:
            break
        cursor = page.next_cursor
    assert seen == [f"apr_{i}" for i in range(5)] and pages == 3
    exact = await store.list_approvals("acme", limit=5)
    assert exact.done and exact.next_cursor is None and len(exact.items) == 5
    with pytest.raises(InvalidCursor):
        await store.list_approvals("acme", cursor="!!not-a-cursor")
    with pytest.raises(ValueError):
        await store.list_approvals("acme", limit=0)


async def test_a_cursor_time_is_a_64_bit_integer_at_most(store: Store):
    """A crafted cursor past a SQL INTEGER (2**63) was a 500 (OverflowError from the driver): it is an
    invalid cursor, like a negative time; the largest one pages as any other."""
    from aip_crewai.host.store.records import encode_cursor

    await approval(store, "apr_1", action_id="act_1")
    for edge in (0, 2**63 - 1):
        page = await store.list_approvals("acme", cursor=encode_cursor(edge, "apr_0"))
        assert page.done and len(page.items) == (1 if edge == 0 else 0)
    for bad in (2**63, -1, 10**26):
        with pytest.raises(InvalidCursor):
            await store.list_approvals("acme", cursor=encode_cursor(bad, "apr_0"))


async def test_status_filter(store: Store):
    await approval(store, "apr_1", action_id="act_1")
    await approval(store, "apr_2", action_id="act_2")
    assert await decide(store, "acme", "apr_1", "approved", "ok", "human:acme", T0 + 1)
    assert [a.approval_id for a in (await store.list_approvals("acme", status="pending")).items] == ["apr_2"]


async def test_status_filter_of_several_statuses_newest_first_with_a_cursor(store: Store):
    for i in range(4):
        await approval(store, f"apr_{i}", action_id=f"act_{i}", now=T0 + i)
    assert await decide(store, "acme", "apr_0", "approved", "ok", "human:acme", T0 + 10)
    assert await decide(store, "acme", "apr_2", "denied", "no", "human:acme", T0 + 10)
    assert await decide(store, "acme", "apr_3", "approved", "ok", "human:acme", T0 + 10)
    seen, cursor = [], None
    while True:
        page = await store.list_approvals(
            "acme", status=("approved", "denied"), cursor=cursor, limit=2, newest_first=True
        )
        seen += [a.approval_id for a in page.items]
        if page.done:
            break
        cursor = page.next_cursor
    assert seen == ["apr_3", "apr_2", "apr_0"]
    newest = await store.list_approvals("acme", newest_first=True)
    assert [a.approval_id for a in newest.items] == ["apr_3", "apr_2", "apr_1", "apr_0"]


async def test_decision_exactly_once(store: Store):
    await approval(store)
    assert not await decide(store, "acme", "apr_1", "approved", "self", "svc:acme", T0 + 1)  # requester
    assert not await decide(store, "globex", "apr_1", "approved", "x", "human:g", T0 + 1)
    assert await decide(store, "acme", "apr_1", "denied", "no", "human:acme", T0 + 1)
    assert not await decide(store, "acme", "apr_1", "approved", "late", "human:other", T0 + 2)
    decided = await stored_approval(store, "acme", "apr_1")
    assert (decided.status, decided.decision_reason, decided.decided_by, decided.decided_at) == (
        "denied",
        "no",
        "human:acme",
        T0 + 1,
    )
    with pytest.raises(ValueError):
        await decide(store, "acme", "apr_1", "maybe", "", "human:acme", T0)


async def test_concurrent_decisions_have_one_winner(store: Store):
    await approval(store)
    outcomes = await asyncio.gather(
        *[
            decide(store, "acme", "apr_1", "approved" if i % 2 else "denied", "r", f"human:{i}", T0 + 1)
            for i in range(20)
        ]
    )
    assert sum(outcomes) == 1


async def test_decide_and_start_moves_the_action_in_the_same_commit(store: Store):
    await approval(store)
    seen = []

    def admits(approval, action):
        seen.append((approval.status, action.status))
        return True

    assert await store.decide_and_start("acme", "apr_1", "approved", "x", "svc:acme", T0 + 1, start_if=admits) == (
        None,
        None,
    )  # the requester
    assert await store.decide_and_start("globex", "apr_1", "approved", "x", "human:g", T0 + 1, start_if=admits) == (
        None,
        None,
    )  # another tenant
    assert seen == []
    decided, started = await store.decide_and_start(
        "acme", "apr_1", "approved", "ok", "human:acme", T0 + 1, start_if=admits
    )
    assert seen == [("approved", "pending_approval")]
    assert decided is not None and started is not None
    assert decided == await store.get_approval("acme", "apr_1") and decided.decided_by == "human:acme"
    assert started == await store.get_action("acme", "act_1")
    assert (started.status, started.dispatch, started.updated_at) == ("running", "sent", T0 + 1)
    assert await store.decide_and_start("acme", "apr_1", "denied", "late", "human:b", T0 + 2, start_if=admits) == (
        None,
        None,
    )  # decided once


async def test_decide_and_start_leaves_the_action_when_denied_or_not_admitted(store: Store):
    await approval(store, "apr_1", action_id="act_1")
    await approval(store, "apr_2", action_id="act_2")
    decided, started = await store.decide_and_start(
        "acme", "apr_1", "denied", "no", "human:acme", T0 + 1, start_if=lambda a, r: True
    )
    assert decided is not None and decided.status == "denied" and started is None
    decided, started = await store.decide_and_start(
        "acme", "apr_2", "approved", "ok", "human:acme", T0 + 1, start_if=lambda a, r: False
    )
    assert decided is not None and decided.status == "approved" and started is None
    for action_id in ("act_1", "act_2"):
        assert (await stored_action(store, "acme", action_id)).status == "pending_approval"
    with pytest.raises(ValueError):
        await store.decide_and_start("acme", "apr_1", "maybe", "", "human:acme", T0, start_if=lambda a, r: True)


async def test_decide_and_start_rolls_back_the_decision_when_the_check_fails(store: Store):
    await approval(store)

    def broken(approval, action):
        raise RuntimeError("check failed")

    with pytest.raises(RuntimeError):
        await store.decide_and_start("acme", "apr_1", "approved", "ok", "human:acme", T0 + 1, start_if=broken)
    assert (await stored_approval(store, "acme", "apr_1")).status == "pending"  # one transaction: nothing kept


async def test_expired_approvals_cannot_be_decided_and_are_swept(store: Store):
    await approval(store, expires_at=T0 + 10)
    assert (await stored_approval(store, "acme", "apr_1")).effective_status(T0 + 10) == "expired"
    assert not await decide(store, "acme", "apr_1", "approved", "late", "human:acme", T0 + 10)
    expired = await store.expire_approvals(T0 + 10)
    assert [(a.tenant, a.approval_id, a.status) for a in expired] == [("acme", "apr_1", "expired")]
    assert await store.expire_approvals(T0 + 20) == []


def test_a_damaged_store_file_is_refused_before_anything_is_written(tmp_path: Path):
    """The shared integrity check (storage.integrity_problems) refuses a damaged file, read-only."""
    from aip_crewai.host.store.store import UnusableStore, check_store_file

    path = tmp_path / "host.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE actions (a TEXT)")
        conn.execute("CREATE INDEX actions_a ON actions (a)")
        conn.executemany("INSERT INTO actions VALUES (?)", [(f"row-{i:06d}" * 8,) for i in range(4000)])
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    for offset in range(3 * page, len(data) - page, 7 * page):  # scramble the middle of several pages
        data[offset + 100 : offset + 400] = bytes(300)
    path.write_bytes(bytes(data))
    before = path.read_bytes()
    with pytest.raises(UnusableStore, match="corrupt|not a SQLite"):
        check_store_file(path)
    assert path.read_bytes() == before


async def test_provisional_results_are_listed_and_final_ones_are_not(store: Store):
    """Issue 17 item 3: the reconciler's prefilter lists failures the sidecar may still contradict, never a
    final failure that merely mentions a provisional code (a dispatch deadline's `last_cause`) or a result
    marked reconciled; a correction replaces only the result it read."""
    import dataclasses

    from aip_crewai.contracts.aip import ActionResult
    from aip_crewai.contracts.errors import ConnectorCancelledUnconfirmed, ConnectorDispatchDeadline
    from aip_crewai.host.actions.lifecycle import PROVISIONAL_CODES, PROVISIONAL_MARKERS
    from aip_crewai.host.actions.normalize import failed_result
    from aip_crewai.host.actions.writer import ActionWriter

    writer = ActionWriter(store)
    unconfirmed = ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=True, dispatch="acknowledged")
    results = {
        "provisional": failed_result("provisional", unconfirmed),
        "deadline": failed_result(
            "deadline",
            ConnectorDispatchDeadline(
                operation="run",
                uncertain_outcome=False,
                dispatch="not_sent",
                details={"last_cause": "connector.crewai.transport"},
            ),
        ),
        "reconciled": failed_result(
            "reconciled",
            ConnectorCancelledUnconfirmed(
                operation="run", uncertain_outcome=True, details={"reconciled": "job_unknown"}
            ),
        ),
    }
    for action_id, result in results.items():
        await make_action(store, action_id=action_id, key=f"key-{action_id}")
        assert await writer.finish("acme", action_id, result, "acknowledged") is not None
    listed = await store.list_failed_with(sorted(PROVISIONAL_CODES), PROVISIONAL_MARKERS)
    assert [r.action_id for r in listed] == ["provisional"]
    record = listed[0]
    assert record.result_json is not None
    stale = dataclasses.replace(record, result_json=record.result_json.replace("true", "false"))
    done = failed_result("provisional", ConnectorCancelledUnconfirmed(operation="run", uncertain_outcome=False))
    assert await writer.correct(stale, done) is None  # not the stored result: a concurrent writer won
    corrected = await writer.correct(
        record, ActionResult(action_id="provisional", status="completed", output={"ok": True})
    )
    assert corrected is not None and corrected.status == "completed" and corrected.dispatch == "acknowledged"
    assert await store.list_failed_with(sorted(PROVISIONAL_CODES), PROVISIONAL_MARKERS) == []


# --- dispatch leases -------------------------------------------------------


async def db_now(store: Store) -> int:
    """The database's clock, ms: PostgreSQL's ``now()``; a SQLite store's own clock."""
    if store.engine == "sqlite":
        return store.now_ms()
    rows = await store._fetch("SELECT CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)")
    return int(rows[0][0])


async def expire_lease(store: Store, action_id: str) -> None:
    """The database's clock passes the action's lease expiry (as when its holder stops renewing)."""
    await store._change("UPDATE actions SET lease_expires_at = 0 WHERE tenant = 'acme' AND action_id = ?", (action_id,))


async def test_a_lease_belongs_to_one_host_until_it_expires_and_is_then_taken_over(location: Path | str):
    a = await Store.open(location, clock=lambda: T0 / 1000, owner="host-a", lease_ms=60_000)
    b = await Store.open(location, clock=lambda: T0 / 1000, owner="host-b", lease_ms=60_000)
    try:
        before = await db_now(a)
        _, record = await make_action(a, action_id="act_1")
        assert record.lease_owner == "host-a" and record.lease_epoch == 1
        assert before + 60_000 <= (record.lease_expires_at or 0) <= await db_now(a) + 60_000  # the database's clock
        assert await a.take_lease("acme", "act_1") and not await b.take_lease("acme", "act_1")
        assert a.lease_token("acme", "act_1") == 1 and b.lease_token("acme", "act_1") is None
        expiry = record.lease_expires_at or 0
        assert b.lease_is_foreign(record, now=expiry - 1) and not a.lease_is_foreign(record, now=expiry - 1)
        assert not b.lease_is_foreign(record, now=expiry)  # expired as read: worth trying to take
        assert await a.renew_leases() == 1 and await b.renew_leases() == 0
        assert not await b.take_lease("acme", "act_1")
        await expire_lease(a, "act_1")  # expired: b takes it (the next token), a no longer renews it
        assert await b.take_lease("acme", "act_1") and not await a.take_lease("acme", "act_1")
        assert b.lease_token("acme", "act_1") == 2 and a.lease_token("acme", "act_1") is None
        assert await a.renew_leases() == 0
        assert (await stored_action(a, "acme", "act_1")).lease_owner == "host-b"
        # pending and finished actions have no lease to take
        await make_action(a, action_id="act_2", status="pending_approval", key="key-2")
        assert not await b.take_lease("acme", "act_2")
        unleased = await Store.open(location, clock=lambda: T0 / 1000)
        try:
            assert await unleased.take_lease("acme", "act_1")  # no owner: no lease mode
        finally:
            await unleased.close()
    finally:
        await a.close()
        await b.close()


async def test_a_second_process_under_the_same_host_id_takes_the_lease_with_a_new_token(location: Path | str):
    # A replacement started under the id of a frozen host (its id lock lost to a database restart) used to
    # keep the token: the frozen one, resumed, went on writing chunks and the result beside it for seconds.
    first = await Store.open(location, clock=lambda: T0 / 1000, owner="host-a", lease_ms=60_000)
    second = await Store.open(location, clock=lambda: T0 / 1000, owner="host-a", lease_ms=60_000)
    try:
        await make_action(first, action_id="act_1")
        assert first.lease_token("acme", "act_1") == 1 and await first.take_lease("acme", "act_1")
        assert first.lease_token("acme", "act_1") == 1  # the holder keeps its token
        assert await second.take_lease("acme", "act_1") and second.lease_token("acme", "act_1") == 2
        with pytest.raises(LeaseLost):
            await first.update_action("acme", "act_1", from_statuses=("running",), status="cancelled")
        assert (await stored_action(second, "acme", "act_1")).status == "running"
        assert await second.take_lease("acme", "act_1") and second.lease_token("acme", "act_1") == 2
    finally:
        await first.close()
        await second.close()


async def test_the_deciding_host_holds_the_lease_of_the_action_it_starts(location: Path | str):
    store = await Store.open(location, clock=lambda: T0 / 1000, owner="host-a", lease_ms=2000)
    try:
        before = await db_now(store)
        _, action = await make_action(store, action_id="act_1", status="pending_approval", approval_id="apr_1")
        assert action.lease_owner is None
        await store.create_approval("acme", "apr_1", "act_1", "cap:crewai:alpha", "ph", "svc:acme", "{}", T0 + DAY)
        approval, started = await store.decide_and_start(
            "acme", "apr_1", "approved", "ok", "human:x", T0, start_if=lambda approval, action: True
        )
        assert approval is not None and started is not None
        assert (started.status, started.lease_owner, started.lease_epoch) == ("running", "host-a", 1)
        assert before + 2000 <= (started.lease_expires_at or 0) <= await db_now(store) + 2000
        assert store.lease_token("acme", "act_1") == 1
    finally:
        await store.close()


async def test_migration_4_keeps_older_approvals_and_logs_every_later_change(db_path: Path):
    """A store written before migration 4 (decision proofs, the approval event log): its approvals read
    back without a proof, and every later creation or status change is logged per tenant, in order."""
    from aip_crewai.host.store.migrations import MIGRATIONS as ALL

    with sqlite3.connect(db_path) as conn:
        for number, script in enumerate(ALL[:3], start=1):
            conn.executescript(script)
            conn.execute(f"PRAGMA user_version = {number}")
        conn.execute(
            "INSERT INTO actions (tenant, action_id, capability_id, crew_id, operation, input_json, "
            "input_hash, principal_id, idempotency_key, status, dispatch, result_json, error_json, "
            "approval_id, timeout_ms, chunk_count, created_at, updated_at) VALUES ('acme', 'old', 'cap', "
            "'alpha', 'run', '{}', 'h', 'p', 'k', 'pending_approval', 'not_sent', NULL, NULL, 'apr_old', "
            f"NULL, 0, {T0}, {T0})"
        )
        conn.execute(
            "INSERT INTO approvals VALUES ('acme', 'apr_old', 'old', 'cap', 'ph', 'p', '{}', 'pending', "
            f"NULL, NULL, NULL, {T0}, {T0 + 900_000})"
        )
    conn.close()
    db_path.chmod(0o600)
    store = await Store.open(db_path, clock=lambda: T0 / 1000)
    try:
        old = await store.get_approval("acme", "apr_old")
        assert old is not None and old.decision_proof is None and old.status == "pending"
        assert await store.last_approval_event("acme") == 0  # history before the log is not invented
        await make_action(store, action_id="new", status="pending_approval", approval_id="apr_new")
        await approval(store, "apr_new", action_id="new")
        assert await decide(store, "acme", "apr_old", "denied", "no", "human:x", T0 + 1)
        await make_action(store, tenant="globex", action_id="g", status="pending_approval", approval_id="apr_g")
        await approval(store, "apr_g", tenant="globex", action_id="g")
        events = await store.list_approval_events("acme", 0, 10)
        assert [(e.seq, e.approval_id, e.status) for e in events] == [
            (1, "apr_new", "pending"),
            (2, "apr_old", "denied"),
        ]
        assert [(e.seq, e.approval_id) for e in await store.list_approval_events("globex", 0, 10)] == [(1, "apr_g")]
        assert await store.list_approval_events("acme", 1, 10) == events[1:]
    finally:
        await store.close()


async def test_every_approval_change_is_logged_per_tenant_in_order_on_both_engines(store: Store):
    """The approval event log (migration 4) on SQLite and PostgreSQL: creation, decision with its
    proof, withdrawal and expiry each append one row, per tenant from 1, in the writing transaction."""
    await approval(store, "apr_a", action_id="act_a")
    await approval(store, "apr_b", action_id="act_b")
    await approval(store, "apr_c", action_id="act_c", expires_at=T0 + 10)
    await approval(store, "apr_g", tenant="globex", action_id="act_g")
    decided, _ = await store.decide_and_start(
        "acme", "apr_a", "approved", "ok", "human:x", T0 + 1, start_if=lambda approval, action: False, proof='{"p":1}'
    )
    assert decided is not None and decided.decision_proof == '{"p":1}'
    assert await store.cancel_pending("acme", "act_b", '{"status":"cancelled"}') is not None
    assert [a.approval_id for a in await store.expire_approvals(T0 + 10)] == ["apr_c"]
    events = await store.list_approval_events("acme", 0, 100)
    assert [(e.seq, e.approval_id, e.status) for e in events] == [
        (1, "apr_a", "pending"),
        (2, "apr_b", "pending"),
        (3, "apr_c", "pending"),
        (4, "apr_a", "approved"),
        (5, "apr_b", "withdrawn"),
        (6, "apr_c", "expired"),
    ]
    assert await store.last_approval_event("acme") == 6 and await store.last_approval_event("globex") == 1
    assert [e.seq for e in await store.list_approval_events("acme", 4, 1)] == [5]
    assert not await decide(store, "acme", "apr_a", "denied", "again", "human:y", T0 + 2)  # nothing logged
    assert await store.last_approval_event("acme") == 6


async def test_an_action_keeps_the_trace_context_it_was_created_in(store: Store):
    """Migration 6: ``actions.trace_parent``, read back with the record (docs/observing.md "Observing actions")."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _, record = await make_action(store, trace_parent=traceparent)
    assert record.trace_parent == traceparent
    again = await store.get_action("acme", "act_1")
    assert again is not None and again.trace_parent == traceparent
    _, other = await make_action(store, action_id="act_2")
    assert other.trace_parent is None
