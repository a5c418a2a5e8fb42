"""Storage faults of the sidecar journal (ARCHITECTURE.md §4 "journal write failure 507 (nothing
half-admitted)", §5 journal rules and crash fence).

In-process (the sidecar app over a fake executor, its journal's SQLite
connection made to fail on chosen writes, as a full disk does):

- :func:`admission_write_failure`: the admission insert fails: 507, no row,
  nothing executed, nothing counted;
- :func:`terminal_write_failure`: a job's terminal commit fails: the caller
  gets 507, the sidecar reports ``degraded`` and refuses new jobs (507,
  nothing executed) instead of running work it cannot record; once the disk
  takes writes again the kept outcome is recorded (one terminal event) and
  admissions resume;
- :func:`streamed_terminal_write_failure`: the same for a streamed job: its stream ends without a terminal
  event and a resume is 503 "try later" until the outcome is recorded.

Real processes:

- :func:`file_size_limit`: ``RLIMIT_FSIZE`` makes real writes fail (EFBIG, like
  a full disk) under a real sidecar; after a kill -9 and a restart without the
  limit every job has exactly one terminal event and nothing refused ever ran;
- :func:`journal_size_bound`: ``--max-journal-bytes`` answers 507 and admits nothing;
- :func:`journal_refusals`: a corrupt, truncated, foreign (another
  application's SQLite), non-SQLite or newer journal refuses start-up: exit 2,
  one clear line, no traceback.

Functions return ``[(check, ok, detail)]`` like :mod:`securitykit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx2
from chaoslib import uid
from kits.poll import Deadline, until_async
from relkit import TERMINAL, Processes, calls_by_action, sidecar_events

Result = tuple[str, bool, str]
Predicate = Callable[[str, Any], bool]


def _check(results: list[Result], name: str, ok: bool, detail: Any = "") -> None:
    results.append((name, bool(ok), "" if ok else str(detail)[:300]))


class FailingConnection:
    """Wraps the journal's sqlite3 connection (used on the journal's worker thread); statements
    matching ``fail`` raise ``sqlite3.OperationalError("database or disk is full")`` while ``fail`` is set."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.fail: Predicate | None = None
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    @property
    def in_transaction(self) -> bool:
        return bool(self._conn.in_transaction)

    def _maybe_fail(self, sql: str, params: Any) -> None:
        if self.fail is not None and self.fail(sql.strip(), params):
            self.failures += 1
            raise sqlite3.OperationalError("database or disk is full")

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._maybe_fail(sql, params)
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> Any:
        self._maybe_fail(sql, rows)
        return self._conn.executemany(sql, rows)


def any_write(sql: str, _params: Any) -> bool:
    return sql.upper().startswith(("INSERT", "UPDATE", "DELETE"))


def terminal_write(sql: str, params: Any) -> bool:
    """The terminal transition of :meth:`Journal.transition` (status to completed/failed/cancelled)."""
    return sql.startswith("UPDATE jobs SET status = ?") and bool(params) and params[0] in TERMINAL


@asynccontextmanager
async def sidecar_app(root: Path) -> AsyncIterator[tuple[httpx2.AsyncClient, FailingConnection, Any, Any]]:
    """``(client, failing connection, fake executor, app)``: the sidecar in-process on a journal in ``root``."""
    from kits.sidecar_fakes import FAKE_CREWS, TOKEN, FakeExecutor, make_settings

    from aip_crewai.sidecar.http.app import create_app
    from aip_crewai.sidecar.journal.store import Journal

    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    settings = make_settings(root)
    journal = await Journal.open(settings.journal)  # type: ignore[arg-type]
    failing = FailingConnection(journal._conn)
    journal._conn = failing  # type: ignore[assignment]
    fake = FakeExecutor()
    app = create_app(replace(settings), crews=FAKE_CREWS, executor=fake, journal=journal)
    async with app.router.lifespan_context(app):
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://sidecar", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as client:
            yield client, failing, fake, app


def _job(action_id: str, crew: str = "echo") -> dict[str, Any]:
    return {"crew_id": crew, "action_id": action_id, "operation": "run", "input": {}}


async def admission_write_failure(root: Path) -> list[Result]:
    results: list[Result] = []
    async with sidecar_app(root) as (client, failing, fake, _):
        before = (await client.get("/health")).json()["retained_runs"]
        failing.fail = any_write
        for path in ("/jobs", "/jobs/stream"):
            action_id = uid("full")
            answer = await client.post(path, json=_job(action_id), headers={"Idempotency-Key": "k"})
            _check(results, f"{path} on a full disk is 507", answer.status_code == 507, answer.text)
            failing.fail = None
            seen = await client.get(f"/jobs/{action_id}")
            _check(results, f"{path}: nothing half-admitted", seen.status_code == 404, seen.text)
            failing.fail = any_write
        failing.fail = None
        health = (await client.get("/health")).json()
        _check(results, "nothing executed", fake.calls == [], fake.calls)
        # the failed writes are recent: degraded until an admission is written again
        _check(results, "nothing counted", health["retained_runs"] == before and health["status"] == "degraded", health)
        answer = await client.post("/jobs", json=_job(uid("after")), headers={"Idempotency-Key": "k"})
        _check(results, "admissions work once the disk does", answer.status_code == 200, answer.text)
        health = (await client.get("/health")).json()
        _check(results, "ready once an admission was written", health["status"] == "ready", health)
    return results


async def terminal_write_failure(root: Path) -> list[Result]:
    results: list[Result] = []
    async with sidecar_app(root) as (client, failing, fake, _):
        lost = uid("lost")
        failing.fail = terminal_write
        answer = await client.post("/jobs", json=_job(lost), headers={"Idempotency-Key": "k"})
        _check(results, "the blocking caller gets 507", answer.status_code == 507, answer.text)
        health = (await client.get("/health")).json()
        _check(results, "health says degraded (the host stops routing work)", health["status"] == "degraded", health)
        calls = len(fake.calls)
        refused = uid("refused")
        answer = await client.post("/jobs/stream", json=_job(refused), headers={"Idempotency-Key": "k"})
        _check(results, "a new job is refused while outcomes are unrecorded", answer.status_code == 507, answer.text)
        _check(results, "the refused job never ran", len(fake.calls) == calls, fake.calls[calls:])
        _check(results, "the refused job was not admitted", (await client.get(f"/jobs/{refused}")).status_code == 404)
        view = await client.get(f"/jobs/{lost}")
        _check(
            results,
            "the lost job's view is 'try later', not the journal's stale running row",
            view.status_code == 503 and view.json()["code"] == "sidecar.outcome_not_recorded",
            view.text,
        )
        failing.fail = None  # the disk takes writes again: the backlog retries with backoff

        async def recorded() -> bool:
            view = await client.get(f"/jobs/{lost}")
            return view.status_code == 200 and view.json()["status"] != "running"

        with contextlib.suppress(Deadline):  # what is recorded by then is checked below
            await until_async(recorded, timeout=10, interval=0.05, what="the lost job's outcome recorded")
        view = (await client.get(f"/jobs/{lost}")).json()
        events = (await client.get(f"/jobs/{lost}/events")).json()["events"]
        terminals = [e for e in events if e["event"] in TERMINAL]
        _check(
            results,
            "the kept outcome is recorded once",
            view["status"] == "completed"
            and len(terminals) == 1
            and events[-1] is terminals[0]
            and [e["sequence"] for e in events] == list(range(len(events))),
            (view, events),
        )
        health = (await client.get("/health")).json()
        _check(results, "health is ready again", health["status"] == "ready", health)
        answer = await client.post("/jobs", json=_job(uid("again")), headers={"Idempotency-Key": "k"})
        _check(results, "admissions resume", answer.status_code == 200, answer.text)
    return results


async def streamed_terminal_write_failure(root: Path) -> list[Result]:
    """A streamed job whose chunks went out live and whose terminal commit fails (a full disk): the stream
    ends without a terminal event instead of failing mid-response (its follower read past the journal's
    committed events: 416 raised inside the stream), a resume at the streamed cursor is 503 "try later"
    (it was 416, which made the host cancel a job that had completed), and once the disk takes writes the
    resume reads every event and the one terminal."""
    results: list[Result] = []
    async with sidecar_app(root) as (client, failing, _fake, _):
        action_id = uid("streamed")
        failing.fail = terminal_write
        body = {**_job(action_id), "input": {"chunks": 5}}
        async with client.stream("POST", "/jobs/stream", json=body, headers={"Idempotency-Key": "k"}) as answer:
            text = (await answer.aread()).decode()
        sent = [int(line[3:]) for line in text.splitlines() if line.startswith("id:")]
        _check(results, "the stream answered 200", answer.status_code == 200, text[:300])
        _check(results, "the chunks went out live", len(sent) >= 5, text[:500])
        _check(results, "no terminal event was streamed", "event: completed" not in text, text[-300:])
        cursor = max(sent, default=0) + 1
        for accept in ("application/json", "text/event-stream"):
            page = await client.get(f"/jobs/{action_id}/events", params={"cursor": cursor}, headers={"Accept": accept})
            _check(
                results,
                f"a resume ({accept}) is 503 outcome_not_recorded, not 416",
                page.status_code == 503 and "sidecar.outcome_not_recorded" in page.text,
                f"{page.status_code} {page.text[:300]}",
            )
        failing.fail = None

        async def resumed() -> bool:
            return (await client.get(f"/jobs/{action_id}/events", params={"cursor": cursor})).status_code == 200

        with contextlib.suppress(Deadline):
            await until_async(resumed, timeout=10, interval=0.05, what="the streamed job's outcome recorded")
        rest = (await client.get(f"/jobs/{action_id}/events", params={"cursor": cursor})).json()["events"]
        _check(
            results,
            "the resume then reads the terminal event",
            [e["event"] for e in rest] == ["completed"] and rest[0]["sequence"] == cursor,
            rest,
        )
    return results


def file_size_limit(procs: Processes, limit_bytes: int = 1_500_000, max_runs: int = 40) -> list[Result]:
    """Real write failures: a real sidecar whose files may not grow past ``limit_bytes`` runs chatty jobs."""
    results: list[Result] = []
    sidecar = procs.sidecar(fsize_limit=limit_bytes)
    ran: list[str] = []
    first_failure = None
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=60) as http:
        for _ in range(max_runs):
            action_id = uid("chatty")
            answer = http.post("/jobs", json=_job(action_id, "chatty"), headers={"Idempotency-Key": "k"})
            ran.append(action_id)
            if answer.status_code != 200:
                first_failure = answer
                break
        _check(
            results,
            "the journal fills up and the caller gets 507",
            first_failure is not None and first_failure.status_code == 507,
            first_failure.text if first_failure is not None else "no failure within the runs",
        )
        # Which write hit the limit decides the state: the last job's admission (refused whole, nothing to
        # keep: health may stay ready) or a later write of it (an outcome the journal could not take is kept
        # and retried: health is degraded). Either way the full journal refuses further admissions.
        # 503 outcome_not_recorded: admitted, its end kept in memory until the journal takes it.
        last_admitted = bool(ran) and http.get(f"/jobs/{ran[-1]}").status_code in (200, 503)
        health = http.get("/health").json()
        if last_admitted:
            _check(
                results,
                "an outcome the journal could not record degrades health",
                health["status"] == "degraded",
                health,
            )
        refused = [uid("refused") for _ in range(3)]
        for action_id in refused:
            answer = http.post("/jobs", json=_job(action_id), headers={"Idempotency-Key": "k"})
            _check(results, "admission is refused once the journal cannot grow", answer.status_code == 507, answer.text)
    sidecar.kill(signal.SIGKILL)
    restarted = procs.restart_sidecar(sidecar)
    calls = calls_by_action(procs.call_log)
    with httpx2.Client(base_url=restarted.base_url, headers=restarted.headers, timeout=30) as http:
        for action_id in refused:
            _check(results, "a refused job was never admitted", http.get(f"/jobs/{action_id}").status_code == 404)
            _check(results, "a refused job never ran", calls[action_id] == 0, calls[action_id])
        # The write that hits the limit may be the last job's admission (then it was refused whole) or one of
        # its later writes (then it was admitted and its outcome was lost): which one depends on where the
        # WAL file crosses the limit. Every earlier job was admitted.
        admitted = [a for a in ran if http.get(f"/jobs/{a}").status_code == 200]
    _check(
        results,
        "every job before the failing write was admitted",
        admitted[: len(ran) - 1] == ran[:-1],
        sorted(set(ran) - set(admitted)),
    )
    _check(results, "the restart keeps what was admitted", (bool(ran) and ran[-1] in admitted) == last_admitted)
    if ran and ran[-1] not in admitted:
        _check(results, "a job refused at admission never ran", calls[ran[-1]] == 0, calls[ran[-1]])
    for action_id in admitted:
        events = sidecar_events(restarted, action_id)
        terminals = [e for e in events if e["event"] in TERMINAL]
        ok = (
            len(terminals) == 1
            and events[-1] is terminals[0]
            and [e["sequence"] for e in events] == list(range(len(events)))
        )
        _check(results, "every admitted job has exactly one terminal event", ok, (action_id, events[-2:]))
    if ran and ran[-1] in admitted:
        # Its failing write was a later one: the start (then CrewAI never ran it: a certain failure) or a
        # checkpoint or the result (then it ran and its outcome was lost: uncertain), unless it completed.
        last = sidecar_events(restarted, ran[-1])[-1]
        never_ran = last["data"].get("uncertain_outcome") is False and calls[ran[-1]] == 0
        _check(
            results,
            "the job whose outcome was lost is failed as uncertain (certain if it never ran)",
            last["event"] == "completed" or last["data"].get("uncertain_outcome") is True or never_ran,
            (last, calls[ran[-1]]),
        )
    restarted.kill(signal.SIGTERM)
    return results


def journal_size_bound(procs: Processes, max_runs: int = 40) -> list[Result]:
    results: list[Result] = []
    sidecar = procs.sidecar(args=["--max-journal-bytes", "1048576"])
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=60) as http:
        answer = None
        for _ in range(max_runs):
            action_id = uid("bound")
            answer = http.post("/jobs", json=_job(action_id, "chatty"), headers={"Idempotency-Key": "k"})
            if answer.status_code != 200:
                break
        _check(
            results,
            "past the journal bound admission is 507",
            answer is not None and answer.status_code == 507 and "size bound" in answer.text,
            answer.text if answer is not None else "",
        )
        _check(results, "the refused job was not admitted", http.get(f"/jobs/{action_id}").status_code == 404)
        _check(results, "the refused job never ran", calls_by_action(procs.call_log)[action_id] == 0)
        _check(results, "a full journal is not a failing one", http.get("/health").json()["status"] == "ready")
    sidecar.kill(signal.SIGTERM)
    return results


def journal_refusals(workdir: Path) -> list[Result]:
    """Start-up with unusable journals (before the CrewAI import, so each refusal takes well under a second)."""
    from kits.sidecar import ALLOWED, REGISTRY, TOKEN, child_env, sidecar_command

    results: list[Result] = []
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)
    token = workdir / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = child_env(workdir / "calls.log")

    def valid_journal(path: Path, jobs: int = 300) -> bytes:
        asyncio.run(_fill(path, jobs))
        return path.read_bytes()

    def corrupt(data: bytes) -> bytes:
        damaged = bytearray(data)
        for offset in range(8192, len(damaged) - 512, 4096):  # every page after the first two: bad cells
            damaged[offset + 100 : offset + 400] = os.urandom(300)
        return bytes(damaged)

    cases: dict[str, tuple[Callable[[Path], object], str]] = {
        "a corrupt journal": (lambda p: p.write_bytes(corrupt(valid_journal(p))), "is corrupt"),
        "a truncated journal": (lambda p: p.write_bytes(valid_journal(p)[:12288]), "corrupt"),
        "a non-SQLite file": (
            lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(4000)),
            "not a SQLite database",
        ),
        "another application's SQLite file": (_foreign_sqlite, "not an aip-crewai journal"),
        "another application's versioned file": (lambda p: _foreign_sqlite(p, version=2), "not an aip-crewai journal"),
        "a newer journal schema": (lambda p: _newer(p, valid_journal), "schema version"),
    }
    for name, (prepare, needle) in cases.items():
        d = workdir / name.replace(" ", "-").replace("'", "")
        d.mkdir(mode=0o700)
        journal = d / "journal.db"
        prepare(journal)
        for extra in (Path(f"{journal}-wal"), Path(f"{journal}-shm")):
            extra.unlink(missing_ok=True)
        journal.chmod(0o600)
        before = journal.read_bytes()
        argv = [
            *sidecar_command("--registry", REGISTRY),
            "--journal",
            str(journal),
            "--token-file",
            str(token),
            "--port",
            "0",
            "--allowed-operations",
            ALLOWED,
        ]
        done = subprocess.run(argv, capture_output=True, timeout=60, env=env, stdin=subprocess.DEVNULL, check=False)
        err = done.stderr.decode(errors="replace")
        ok = (
            done.returncode == 2
            and needle in err
            and "Traceback" not in err
            and done.stdout == b""
            and "--journal (AIP_CREWAI_STATE_FILE)" in err
        )
        _check(results, f"start-up refuses {name}", ok, f"exit {done.returncode}: {err[-400:]}")
        _check(results, f"start-up leaves {name} untouched", journal.read_bytes() == before)
    return results


async def _fill(path: Path, jobs: int) -> None:
    from aip_crewai.sidecar.jobs.model import EventRow, JobStatus, NewJob
    from aip_crewai.sidecar.journal.store import Journal

    journal = await Journal.open(path)
    try:
        for n in range(jobs):
            action_id = f"job-{n}"
            await journal.admit(
                NewJob(action_id, "echo", "run", "h" * 64, "k", None), max_retained_runs=10**6, max_bytes=10**12
            )
            await journal.transition(
                action_id, JobStatus.RUNNING, first_sequence=0, events=[EventRow(0, "started", b'{"status":"running"}')]
            )
        await journal._run(journal._conn.execute, "PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        await journal.close()


def _foreign_sqlite(path: Path, version: int = 0) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        db.execute("INSERT INTO notes (body) VALUES ('an operator''s data')")
        if version:
            db.execute(f"PRAGMA user_version = {version}")
    db.close()


def _newer(path: Path, make: Callable[[Path], bytes]) -> None:
    from aip_crewai.sidecar.journal.store import SCHEMA_VERSION

    make(path)
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
