"""``aip-crewai journal import``: a reference sidecar's JSON journal into a SQLite journal (
docs/operating.md "Migrating from the reference sidecar")."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from aip_crewai import cli
from aip_crewai.sidecar.errors import JournalForeign
from aip_crewai.sidecar.journal.crash_fence import RESTARTED_RUNNING
from aip_crewai.sidecar.journal.store import Journal

pytestmark = pytest.mark.timeout(60)


def _events(*names_and_data: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"event": name, "sequence": n, "data": data} for n, (name, data) in enumerate(names_and_data)]


OUTPUT = {"raw": "done", "token_usage": {}, "tasks_output": [{"task_id": "task-1", "raw": "t"}]}
REFERENCE_RUNS: list[dict[str, Any]] = [
    {
        "action_id": "acme:a-done",
        "crew_id": "echo",
        "operation": "run",
        "input_hash": "h1",
        "status": "completed",
        "events": _events(
            ("started", {"status": "running", "operation": "run"}),
            ("chunk", {"content": "hel", "channel": "llm"}),
            ("completed", OUTPUT),
        ),
        "output": OUTPUT,
    },
    {
        "action_id": "acme:a-failed",
        "crew_id": "echo",
        "operation": "run",
        "input_hash": "h2",
        "status": "failed",
        "events": _events(
            ("started", {"status": "running", "operation": "run"}),
            ("failed", {"status": "failed", "error_type": "ValueError", "message": "m", "uncertain_outcome": True}),
        ),
        "output": None,
    },
    {
        "action_id": "acme:a-cancelled",
        "crew_id": "echo",
        "operation": "batch_run",
        "input_hash": "h3",
        "status": "cancelled",
        "events": _events(("started", {}), ("cancelled", {"status": "cancelled"})),
        "output": None,
    },
    {
        "action_id": "acme:a-running",
        "crew_id": "echo",
        "operation": "run",
        "input_hash": "h4",
        "status": "running",
        "events": _events(
            ("started", {"status": "running", "operation": "run"}), ("chunk", {"content": "half", "channel": "llm"})
        ),
        "output": None,
    },
]


def _write_reference(directory: Path, runs: list[dict[str, Any]] = REFERENCE_RUNS) -> Path:
    path = directory / "runs.json"
    path.write_text(json.dumps(runs, separators=(",", ":"), sort_keys=True))
    path.chmod(0o600)
    return path


def _dump(journal: Path) -> tuple[list[Any], list[Any], list[Any]]:
    with sqlite3.connect(f"file:{journal}?mode=ro", uri=True) as conn:
        return (
            conn.execute("SELECT * FROM jobs ORDER BY action_id").fetchall(),
            conn.execute("SELECT * FROM events ORDER BY action_id, sequence").fetchall(),
            conn.execute("SELECT * FROM task_runs ORDER BY action_id, task_id").fetchall(),
        )


def _import(source: Path, target: Path, capsys) -> tuple[int, Any]:
    code = cli.main(["journal", "import", str(source), "--journal", str(target), "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory


def test_finished_jobs_keep_their_events_and_a_running_job_fails_uncertain(workdir, capsys):
    source = _write_reference(workdir)
    target = workdir / "journal.db"
    code, report = _import(source, target, capsys)
    assert code == 0 and report == {"journal": str(target), "imported": 4, "already_present": 0, "conflicts": []}
    asyncio.run(_check_imported(target))
    assert not Path(f"{source}.lock").exists()
    assert json.loads(source.read_text()) == REFERENCE_RUNS  # the source is only read


async def _check_imported(target: Path) -> None:
    journal = await Journal.open_readonly(target)
    try:
        done = await journal.get("acme:a-done")
        assert done is not None and done.status.value == "completed"
        assert done.output is not None and json.loads(done.output) == OUTPUT
        events = await journal.read_events("acme:a-done", 0)
        assert [(e.sequence, e.event) for e in events] == [(0, "started"), (1, "chunk"), (2, "completed")]
        assert json.loads(events[1].data) == {"content": "hel", "channel": "llm"}
        failed = await journal.get("acme:a-failed")
        assert failed is not None and failed.status.value == "failed"
        assert failed.error is not None and json.loads(failed.error)["message"] == "m"
        cancelled = await journal.get("acme:a-cancelled")
        assert cancelled is not None and cancelled.status.value == "cancelled" and cancelled.event_count == 2
        running = await journal.get("acme:a-running")
        assert running is not None and running.status.value == "failed" and running.event_count == 3
        last = (await journal.read_events("acme:a-running", 0))[-1]
        assert last.event == "failed" and json.loads(last.data) == {
            "status": "failed",
            "error_type": "SidecarRestarted",
            "message": RESTARTED_RUNNING,
            "uncertain_outcome": True,
        }
        assert await journal.find_task_run("echo", "task-1", "acme") is not None  # replay finds imported runs
        assert done.request_hash == "h1"
    finally:
        await journal.close()


def test_importing_twice_changes_nothing(workdir, capsys):
    source = _write_reference(workdir)
    target = workdir / "journal.db"
    assert _import(source, target, capsys)[0] == 0
    before = _dump(target)
    code, report = _import(source, target, capsys)
    assert code == 0 and report["imported"] == 0 and report["already_present"] == 4
    assert _dump(target) == before


def test_a_conflicting_action_id_is_reported_and_left_alone(workdir, capsys):
    target = workdir / "journal.db"
    assert _import(_write_reference(workdir), target, capsys)[0] == 0
    before = _dump(target)
    changed = [dict(run, input_hash="other") if run["action_id"] == "acme:a-done" else run for run in REFERENCE_RUNS]
    code, report = _import(_write_reference(workdir, changed), target, capsys)
    assert code == 1 and report["conflicts"] == ["acme:a-done"] and report["already_present"] == 3
    assert _dump(target) == before


@pytest.mark.parametrize(
    "runs, says",
    [
        ({"not": "a list"}, "not a reference sidecar journal"),
        ([{**REFERENCE_RUNS[0], "status": "paused"}], "unknown status"),
        ([{**REFERENCE_RUNS[0], "operation": "deploy"}], "unknown operation"),
        ([{**REFERENCE_RUNS[0], "events": _events(("completed", {}), ("chunk", {}))}], "terminal but not the last"),
        ([{**REFERENCE_RUNS[0], "events": [{"event": "started", "sequence": 3, "data": {}}]}], "sequences must be"),
        ([REFERENCE_RUNS[0], REFERENCE_RUNS[0]], "action id twice"),
    ],
)
def test_an_unusable_reference_journal_writes_nothing(workdir, capsys, runs, says):
    source = workdir / "runs.json"
    source.write_text(json.dumps(runs))
    target = workdir / "journal.db"
    assert cli.main(["journal", "import", str(source), "--journal", str(target)]) == 2
    assert says in capsys.readouterr().err
    assert not target.exists() and not Path(f"{target}.lock").exists() and not Path(f"{source}.lock").exists()


def test_a_reference_sidecar_still_running_on_the_file_is_refused(workdir, capsys):
    source = _write_reference(workdir)
    lock = Path(f"{source}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running reference holds it
        assert cli.main(["journal", "import", str(source)]) == 2
        assert "in use" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert not (workdir / "runs.db").exists()
    assert cli.main(["journal", "import", str(source)]) == 0  # its lock released: the default target runs.db
    assert (workdir / "runs.db").exists()


async def test_the_sidecar_points_at_the_import_and_leaves_no_lock_beside_a_reference_journal(workdir):
    source = _write_reference(workdir)
    with pytest.raises(JournalForeign, match="aip-crewai journal import"):
        await Journal.open(source)
    assert not Path(f"{source}.lock").exists()
    assert json.loads(source.read_text()) == REFERENCE_RUNS


# --- a hostile file: the sidecar's own bounds, per run (docs/operating.md "Migrating from the reference sidecar") ---


def _run_with(action_id: str = "acme:big", *, events: int = 2, data: Any = None, output: Any = None) -> dict[str, Any]:
    """A completed run of ``events`` events (started, chunks, completed), chunk data ``data``."""
    chunks = [("chunk", data if data is not None else {"content": "x"}) for _ in range(events - 2)]
    final = output if output is not None else {"raw": "r"}
    return {
        "action_id": action_id,
        "crew_id": "echo",
        "operation": "run",
        "input_hash": "h",
        "status": "completed",
        "events": _events(("started", {}), *chunks, ("completed", final)),
        "output": final,
    }


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def _refused(workdir: Path, capsys, runs: Any, *flags: str) -> str:
    """Import ``runs`` (plus one good run first): exit 2, one line on stderr, nothing written; returns it."""
    source = workdir / "runs.json"
    source.write_text(runs if isinstance(runs, str) else json.dumps([REFERENCE_RUNS[0], *runs]))
    target = workdir / "journal.db"
    assert cli.main(["journal", "import", str(source), "--journal", str(target), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not target.exists()
    return err


def _imports(workdir: Path, capsys, runs: list[dict[str, Any]], *flags: str) -> None:
    source = workdir / "runs.json"
    source.write_text(json.dumps(runs))
    target = workdir / f"journal-{len(list(workdir.iterdir()))}.db"
    assert cli.main(["journal", "import", str(source), "--journal", str(target), *flags]) == 0, capsys.readouterr()


def test_events_per_run_are_bounded_like_the_sidecar_s_at_the_edge(workdir, capsys):
    _imports(workdir, capsys, [_run_with(events=1000)])
    err = _refused(workdir, capsys, [_run_with("acme:\x1b[31mred", events=1001)])
    assert "run 'acme:\\x1b[31mred'" in err and "1000" in err and "--max-events-per-run" in err
    _imports(workdir, capsys, [_run_with(events=1001)], "--max-events-per-run", "1001")
    err = _refused(workdir, capsys, [_run_with(events=5001)], "--max-events-per-run", "5000")
    assert "5000" in err


def test_event_bytes_and_the_output_are_bounded_like_the_sidecar_s(workdir, capsys):
    overhead = len(b'{"event":"chunk","sequence":1,"data":{"content":""}}')
    _imports(workdir, capsys, [_run_with(events=3, data={"content": "x" * (262_144 - overhead)})])
    err = _refused(workdir, capsys, [_run_with(events=3, data={"content": "x" * (262_145 - overhead)})])
    assert "event 1 is 262145 bytes; at most 262144 (--max-event-bytes)" in err
    big = {"raw": "x" * (4 * 1024 * 1024)}
    err = _refused(workdir, capsys, [_run_with(output=big)], "--max-event-bytes", "4194304")
    assert "run 'acme:big'" in err and "4194304" in err


def test_json_nesting_is_bounded_like_every_json_the_sidecar_reads(workdir, capsys):
    """The input depth bound (64 levels) on event data and output; a file nested past the decoder's
    bound is one line, exit 2, never a RecursionError traceback."""
    _imports(workdir, capsys, [_run_with(events=3, data=_nested(64))])
    err = _refused(workdir, capsys, [_run_with(events=3, data=_nested(65))])
    assert "event 1 nests deeper than 64 levels" in err
    err = _refused(workdir, capsys, [dict(_run_with(), output={"raw": "r", "deep": _nested(64)})])
    assert "output nests deeper than 64 levels" in err
    deep = '{"a":' * 100_000 + "{}" + "}" * 100_000
    run = json.dumps(_run_with(events=3)).replace('{"content": "x"}', deep)
    err = _refused(workdir, capsys, f"[{run}]")
    assert "nests JSON deeper than the decoder allows" in err


def test_imported_jobs_are_marked_in_the_journal_and_conflicting_ids_are_printed_escaped(workdir, capsys):
    target = workdir / "journal.db"
    runs = [_run_with("acme:\x1b]0;owned\x07")]
    _write_reference(workdir, runs)
    assert cli.main(["journal", "import", str(workdir / "runs.json"), "--journal", str(target)]) == 0
    with sqlite3.connect(f"file:{target}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT action_id, imported FROM jobs").fetchall() == [("acme:\x1b]0;owned\x07", 1)]
    capsys.readouterr()
    _write_reference(workdir, [dict(runs[0], input_hash="other")])
    assert cli.main(["journal", "import", str(workdir / "runs.json"), "--journal", str(target)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "'acme:\\x1b]0;owned\\x07'" in err
