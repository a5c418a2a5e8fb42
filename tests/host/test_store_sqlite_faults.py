"""Faults of the SQLite host store's file: a write the file cannot take (no space left, an I/O error, a
read-only file, a write lock held outside) is a typed 503 ``store.unavailable``, never an internal error;
``/ready`` says the store is unwritable until a write commits again; and the run whose result could not
be written ends correctly once the file takes writes again.

The full disk is SQLite's own ``SQLITE_FULL``, made without filling a disk: ``PRAGMA max_page_count`` at
the file's current size makes every write that needs a new page fail exactly as a full disk does. The
read-only file is ``PRAGMA query_only`` (``SQLITE_READONLY``).

docs/operating.md "Faults of a SQLite store".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx2
import pytest
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, HealthSidecar, action_env, bearer, running
from kits.poll import until_async
from structlog.testing import capture_logs

from aip_crewai.host.actions import recovery
from aip_crewai.host.http.state import host_state
from aip_crewai.host.store import store as store_module
from aip_crewai.host.store.engines import sqlite as engine
from aip_crewai.host.store.store import Store, StoreUnavailable
from aip_crewai.plumbing.storage import hop

T0 = 1_790_000_000_000
#: An input larger than a page (4 KiB): its row needs new (overflow) pages, so a full file refuses it.
BIG = "x" * 16_384


async def _pragma(store: Store, pragma: str) -> list[tuple[object, ...]]:
    """Run ``PRAGMA <pragma>`` on the store's own connection (on its worker thread)."""
    conn = store._db.conn  # type: ignore[attr-defined]
    return await hop(store._worker, lambda: conn.execute(f"PRAGMA {pragma}").fetchall())


async def _fill(store: Store) -> None:
    """The file is full from now on: no write may add a page (SQLITE_FULL, as on a full disk)."""
    ((pages,),) = await _pragma(store, "page_count")
    await _pragma(store, f"max_page_count = {pages}")


async def _free(store: Store) -> None:
    """Space is freed: writes may grow the file again."""
    await _pragma(store, "max_page_count = 1073741823")


async def _create(store: Store, action_id: str, text: str = BIG) -> object:
    return await store.create_action(
        "acme", action_id, "cap:crewai:alpha", "alpha", "run", json.dumps({"t": text}), "h", "p", None, "running"
    )


@pytest.fixture
async def store(tmp_path: Path):
    tmp_path.chmod(0o700)
    opened = await Store.open(tmp_path / "host.db", clock=lambda: T0 / 1000)
    try:
        yield opened
    finally:
        await opened.close()


async def test_a_full_file_fails_writes_typed_and_reads_go_on(store: Store) -> None:
    await _create(store, "act_before")
    await _fill(store)
    with capture_logs() as logs:
        with pytest.raises(StoreUnavailable) as raised:
            await _create(store, "act_full")
    assert raised.value.code == "store.unavailable" and raised.value.status == 503
    assert raised.value.retryable and raised.value.retry_after_ms == 1000
    cause = raised.value.__cause__
    assert isinstance(cause, engine.StoreFileUnwritable) and "database or disk is full (SQLITE_FULL)" in str(cause)
    assert [(e["event"], e["error"]) for e in logs] == [("store_unavailable", "StoreFileUnwritable")]
    assert (await store.get_action("acme", "act_before")) is not None  # reads go on
    assert await store.get_action("acme", "act_full") is None  # nothing of the refused write stayed
    with pytest.raises(sqlite3.OperationalError, match="no such table"):  # a bug in the SQL stays a bug (500)
        await store._fetch("SELECT 1 FROM no_such_table")


async def test_the_store_is_unwritable_until_a_write_commits_again(store: Store) -> None:
    assert await store.probe()
    await _fill(store)
    with pytest.raises(StoreUnavailable):
        await _create(store, "act_full")
    assert not await store.probe()
    assert (await store.get_action("acme", "act_full")) is None and not await store.probe()  # a read: no proof
    await _free(store)
    assert not await store.probe()  # not known before a write is tried ...
    await _create(store, "act_after")
    assert await store.probe()  # ... and the first that commits clears it


async def test_the_mark_of_a_failed_write_lapses_after_its_window(store: Store) -> None:
    store._db.unwritable_s = 0.0  # type: ignore[attr-defined]
    await _fill(store)
    with pytest.raises(StoreUnavailable):
        await _create(store, "act_full")
    assert await store.probe()  # no tenant and no dispatch writes: /ready does not stay unready forever


async def test_a_read_only_file_is_unavailable_not_an_internal_error(store: Store) -> None:
    await _pragma(store, "query_only = 1")
    with pytest.raises(StoreUnavailable) as raised:
        await _create(store, "act_ro", "small")
    assert "(SQLITE_READONLY)" in str(raised.value.__cause__)
    assert not await store.probe()
    await _pragma(store, "query_only = 0")
    await _create(store, "act_rw", "small")
    assert await store.probe()


def test_the_outage_codes_are_told_from_the_others() -> None:
    def error(code: int, message: str) -> sqlite3.Error:
        exc = sqlite3.OperationalError(message)
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
        return exc

    assert engine.unwritable_name(error(13, "database or disk is full")) == "SQLITE_FULL"
    # SQLITE_IOERR_WRITE, an extended code: its primary code counts
    assert engine.unwritable_name(error(778, "disk I/O error")) == "SQLITE_IOERR"
    assert engine.unwritable_name(error(1032, "attempt to write a readonly database")) == "SQLITE_READONLY"
    assert engine.unwritable_name(error(5, "database is locked")) == "SQLITE_BUSY"
    assert engine.unwritable_name(error(1, "no such table: x")) is None
    assert engine.unwritable_name(error(11, "database disk image is malformed")) is None  # corrupt: not transient
    assert engine.unwritable_name(sqlite3.OperationalError("disk I/O error")) == "SQLITE_IOERR"  # no code (Python 3.10)
    assert engine.unwritable_name(ValueError("database or disk is full")) is None


# --- the host over HTTP ------------------------------------------------------------------------------


async def _submit(
    client: httpx2.AsyncClient, action_id: str, text: str, cap: str = "cap:crewai:beta"
) -> httpx2.Response:
    env = action_env(f"msg_{action_id}_{time.monotonic_ns()}", action_id, cap, {"t": text}, f"key-{action_id}")
    return await client.post("/aip/v1/messages", json=env, headers=bearer("acme-invoker"))


async def test_over_http_a_full_file_gives_typed_503s_and_the_run_ends_once_space_is_freed(
    make_app, settings, monkeypatch
) -> None:
    monkeypatch.setattr(store_module, "PROBE_FRESH_S", 0.0)
    monkeypatch.setattr(recovery, "RECONCILE_S", 0.05)
    fake = FakeSidecar(SIDECAR_TOKEN)
    fake.health = HealthSidecar().health  # a whole /health: the host is ready but for its store
    started, filled = asyncio.Event(), asyncio.Event()

    async def sidecar(request: httpx2.Request) -> httpx2.Response:
        if request.url.path in ("/jobs", "/jobs/stream") and request.method == "POST":
            started.set()
            await filled.wait()  # the job runs once the disk is full: its result cannot be written
        return fake.handle(request)

    app = make_app(
        dataclasses.replace(settings, readiness_interval_s=0.05), sidecar_transport=httpx2.MockTransport(sidecar)
    )
    async with running(app) as client:
        store = host_state(app).store
        await until_async(lambda: _ready(client), what="the host to be ready")
        submitted = await _submit(client, "act_run", BIG)  # beta: pending approval
        assert submitted.status_code == 202, submitted.text
        approval_id = submitted.json()["body"]["action_result"]["output"]["approval_id"]
        decided = await client.post(
            f"/aip/v1/approvals/{approval_id}/decision",
            headers=bearer("acme-both"),  # not the requester
            json={"decision": "approved", "reason": "ok"},
        )
        assert decided.status_code == 200, decided.text
        await asyncio.wait_for(started.wait(), 60)
        await _fill(store)
        with capture_logs() as logs:
            refused = await _submit(client, "act_refused", BIG)
            assert refused.status_code == 503, refused.text
            assert refused.json()["body"]["error"]["error"]["code"] == "store.unavailable"
            assert refused.headers.get("retry-after") == "1"
            assert (await client.get("/ready")).status_code == 503
            filled.set()  # the run completes at the sidecar; its result (holding the big input) is refused

            def deferred_thrice() -> bool:
                return _deferred(logs) >= 3

            await until_async(deferred_thrice, what="the result write deferred, and retried")
            assert (await _status(client, "act_run")) == "running"
            assert (await client.get("/ready")).status_code == 503
            await _free(store)
            await until_async(
                lambda: _status(client, "act_run", "completed"), what="the run recorded once space is freed"
            )
        assert not [e for e in logs if e["log_level"] in ("error", "critical") or "exc_info" in e], logs
        assert fake.executions == 1
        assert (await client.get("/ready")).status_code == 200
        again = await _submit(client, "act_refused", BIG)  # the same idempotency key, retried: accepted now
        assert again.status_code == 202, again.text


def _deferred(logs: Sequence[Mapping[str, Any]]) -> int:
    """How many times a write of the run's result was put off (by its dispatch or a reconciliation)."""
    return sum(e["event"] in ("dispatch_deferred", "action_resume_deferred") for e in logs)


async def _ready(client: httpx2.AsyncClient) -> bool:
    return (await client.get("/ready")).status_code == 200


async def _status(client: httpx2.AsyncClient, action_id: str, wanted: str | None = None) -> str | bool:
    state = (await client.get(f"/aip/v1/actions/{action_id}", headers=bearer("acme-invoker"))).json()["state"]
    return state if wanted is None else state == wanted
