"""The store's one write that settles a result from the sidecar's journal (``Store.update_action`` with
``chunks=``), on both engines: the chunks the action lacks are appended in the SAME transaction as the
result that replaces the stored one, keyed by sequence (a stored chunk is never duplicated nor changed),
although the action is ended; a write that loses (another correction won, or this host lost its lease)
appends nothing. ARCHITECTURE.md §9 "Final results", §10 (dispatch leases).

Run on PostgreSQL too: the ``location`` fixture is parametrized (``sqlite``, ``postgresql``); the
PostgreSQL half skips with one line without a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aip_crewai.host.store.store import LeaseLost, Store

T0 = 1_790_000_000_000  # ms
PROVISIONAL = '{"action_id":"a1","status":"failed","error":{"code":"connector.crewai.cancelled_unconfirmed"}}'
CORRECTED = '{"action_id":"a1","status":"completed","output":{"raw":"x"}}'


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """A SQLite file, or a fresh database on the session's throwaway PostgreSQL server."""
    if request.param == "sqlite":
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        return state / "host.db"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(location: Path | str):
    opened = await Store.open(location, clock=lambda: T0 / 1000)
    yield opened
    await opened.close()


def chunk(sequence: int, text: str) -> tuple[int, str]:
    return sequence, json.dumps({"sequence": sequence, "text": text})


async def ended(store: Store, action_id: str = "a1", stored: int = 2) -> None:
    """A run that stored ``stored`` chunks and then a provisional failure."""
    await store.create_action(
        "acme", action_id, "cap:crewai:alpha", "alpha", "run", "{}", "h", "svc:acme", f"k-{action_id}", "running"
    )
    if stored:
        assert await store.append_chunks("acme", action_id, [chunk(s, "live") for s in range(stored)]) == stored
    failed = await store.update_action(
        "acme", action_id, from_statuses=["running"], status="failed", result_json=PROVISIONAL
    )
    assert failed is not None and failed.chunk_count == stored


async def correct(store: Store, chunks: list[tuple[int, str]], *, replacing: str = PROVISIONAL):
    return await store.update_action(
        "acme",
        "a1",
        from_statuses=["failed"],
        status="completed",
        result_json=CORRECTED,
        replacing=replacing,
        chunks=chunks,
    )


async def test_an_ended_action_takes_no_plain_append_but_its_correction_backfills_the_missing_chunks(store):
    await ended(store, stored=2)
    assert await store.append_chunks("acme", "a1", [chunk(2, "late")]) == 0  # no chunk follows a result
    corrected = await correct(store, [chunk(s, "journal") for s in range(6)])
    assert corrected is not None and (corrected.status, corrected.chunk_count) == ("completed", 6)
    assert corrected.result_json == CORRECTED
    rows = await store.list_chunks("acme", "a1")
    assert [r.sequence for r in rows] == list(range(6))
    texts = [json.loads(r.chunk_json)["text"] for r in rows]
    assert texts == ["live", "live", "journal", "journal", "journal", "journal"]  # stored ones kept as they were
    again = await store.get_action("acme", "a1")
    assert again is not None and again.chunk_count == 6


async def test_an_action_that_stored_no_chunk_gets_all_of_them(store):
    """The cross-host cancel race: failed (cancelled_unconfirmed) with 0 chunks, then corrected."""
    await ended(store, stored=0)
    corrected = await correct(store, [chunk(s, "journal") for s in range(4)])
    assert corrected is not None and corrected.chunk_count == 4
    assert [r.sequence for r in await store.list_chunks("acme", "a1")] == [0, 1, 2, 3]


async def test_a_correction_that_loses_writes_no_chunk(store):
    await ended(store, stored=1)
    assert await correct(store, [chunk(s, "journal") for s in range(5)], replacing="not what is stored") is None
    record = await store.get_action("acme", "a1")
    assert record is not None and (record.status, record.chunk_count) == ("failed", 1)
    assert [r.sequence for r in await store.list_chunks("acme", "a1")] == [0]


async def test_a_backfill_of_chunks_already_stored_adds_nothing(store):
    await ended(store, stored=3)
    corrected = await correct(store, [chunk(s, "journal") for s in range(3)])
    assert corrected is not None and corrected.chunk_count == 3


async def test_a_result_settled_with_chunks_by_a_host_that_lost_its_lease_writes_nothing(location):
    """The write is fenced by the lease token like every other write of a leased action: another host took
    the lease (raised its epoch) meanwhile, so neither the result nor a chunk is written."""
    holder = await Store.open(location, owner="host-a", lease_ms=30_000)
    try:
        await holder.create_action(
            "acme", "a1", "cap:crewai:alpha", "alpha", "run", "{}", "h", "svc:acme", "k-a1", "running"
        )
        assert holder.lease_token("acme", "a1") == 1
        await holder._change(  # host-b took the lease over (the database's clock passed host-a's)
            "UPDATE actions SET lease_owner = 'host-b', lease_epoch = lease_epoch + 1 WHERE action_id = 'a1'"
        )
        with pytest.raises(LeaseLost):
            await holder.update_action(
                "acme",
                "a1",
                from_statuses=["running"],
                status="completed",
                result_json=CORRECTED,
                chunks=[chunk(s, "journal") for s in range(3)],
            )
        record = await holder.get_action("acme", "a1")
        assert record is not None and (record.status, record.chunk_count) == ("running", 0)
        assert await holder.list_chunks("acme", "a1") == []
    finally:
        await holder.close()


async def test_a_result_settled_with_chunks_by_the_lease_holder_is_written_whole(location):
    holder = await Store.open(location, owner="host-a", lease_ms=30_000)
    try:
        await holder.create_action(
            "acme", "a1", "cap:crewai:alpha", "alpha", "run", "{}", "h", "svc:acme", "k-a1", "running"
        )
        await holder.append_chunks("acme", "a1", [chunk(0, "live")])
        done = await holder.update_action(
            "acme",
            "a1",
            from_statuses=["running"],
            status="completed",
            result_json=CORRECTED,
            chunks=[chunk(s, "journal") for s in range(3)],
        )
        assert done is not None and (done.status, done.chunk_count) == ("completed", 3)
        assert holder.lease_token("acme", "a1") is None  # ended: no lease kept
    finally:
        await holder.close()
