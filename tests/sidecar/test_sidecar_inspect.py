"""`aip-crewai journal list|inspect` reads a journal without locking or writing it."""

import json
import subprocess
import sys

import pytest

from aip_crewai.sidecar.jobs.model import NewJob
from aip_crewai.sidecar.journal.store import Journal


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "journal", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.processes
async def test_list_and_inspect_beside_the_owning_process(tmp_path):
    tmp_path.chmod(0o700)
    path = tmp_path / "journal.db"
    journal = await Journal.open(path)  # holds the lock, like a running sidecar
    try:
        await journal.admit(
            NewJob("acme:a1", "echo", "run", "h" * 64, "k1", None), max_retained_runs=10, max_bytes=1 << 30
        )
        before = path.read_bytes()
        listed = cli("list", str(path), "--json")
        assert listed.returncode == 0, listed.stderr
        jobs = json.loads(listed.stdout)
        assert [(j["action_id"], j["status"], j["operation"]) for j in jobs] == [("acme:a1", "queued", "run")]
        shown = cli("inspect", str(path), "acme:a1", "--json")
        assert json.loads(shown.stdout)["events"] == []
        assert path.read_bytes() == before
        missing = cli("inspect", str(path), "nope")
        assert missing.returncode == 1 and "no job" in missing.stderr
        short = cli("inspect", str(path), "a1", "--json")  # without the tenant prefix
        assert short.returncode == 0 and json.loads(short.stdout)["action_id"] == "acme:a1"
        await journal.admit(
            NewJob("beta:a1", "echo", "run", "h" * 64, "k1", None), max_retained_runs=10, max_bytes=1 << 30
        )
        both = cli("inspect", str(path), "a1")
        assert both.returncode == 1 and "acme:a1, beta:a1" in both.stderr
    finally:
        await journal.close()


@pytest.mark.processes
def test_not_a_journal_is_a_clear_error(tmp_path):
    bogus = tmp_path / "x.db"
    bogus.write_text("hello")
    result = cli("list", str(bogus))
    assert result.returncode == 1 and "not an aip-crewai journal" in result.stderr
    assert "Traceback" not in result.stderr
    assert cli("list", str(tmp_path / "absent.db")).returncode == 1


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``aip-crewai journal ARGS`` in this process: (exit code, stdout, stderr)."""
    from aip_crewai import cli as cli_main

    capsys.readouterr()  # what came before (the journal's migration log lines)
    code = cli_main.main(["journal", *args])
    out, err = capsys.readouterr()
    return code, out, err


def write_journal(path, jobs: list[tuple[str, str]]) -> None:
    """A closed journal at ``path`` holding ``jobs`` (action id, crew id), each with a few events."""
    import asyncio

    from aip_crewai.sidecar.jobs.model import EventRow, JobStatus

    async def fill() -> None:
        journal = await Journal.open(path)
        try:
            for action_id, crew_id in jobs:
                await journal.admit(
                    NewJob(action_id, crew_id, "run", "h" * 64, "k", None), max_retained_runs=1000, max_bytes=1 << 30
                )
                events = [EventRow(n, "chunk", b'{"content":"' + b"x" * 200 + b'"}') for n in range(1, 4)]
                await journal.transition(
                    action_id, JobStatus.RUNNING, first_sequence=0, events=[EventRow(0, "started", b"{}"), *events]
                )
        finally:
            await journal.close()

    asyncio.run(fill())


def test_a_corrupt_journal_is_one_line_and_exit_1_for_list_and_inspect(tmp_path, capsys):
    """Regression: on a damaged journal (200 bytes overwritten at offset 8192) ``inspect`` printed a
    traceback (``database disk image is malformed``, exit 1) and ``list`` listed rows with exit 0 and no
    warning; both now refuse it in one line, the sidecar's start-up integrity check, exit 1."""
    tmp_path.chmod(0o700)
    path = tmp_path / "journal.db"
    write_journal(path, [(f"acme:a{n}", "echo") for n in range(60)])
    assert path.stat().st_size > 8192 + 200
    with open(path, "r+b") as fh:
        fh.seek(8192)
        fh.write(bytes(range(200)))
    for args in (("list", str(path)), ("inspect", str(path), "acme:a1"), ("list", str(path), "--json")):
        code, out, err = in_process(capsys, *args)
        assert (code, out) == (1, ""), (args, code, out, err)
        assert f"the journal {path} is corrupt (SQLite integrity check:" in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_read_that_fails_after_the_check_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    """A page damaged after the open's check (the file changed under the command) fails the read in one
    line, never a traceback."""
    import sqlite3

    tmp_path.chmod(0o700)
    path = tmp_path / "journal.db"
    write_journal(path, [("acme:a1", "echo")])

    async def malformed(self, *args, **kwargs):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(Journal, "read_events", malformed)
    code, out, err = in_process(capsys, "inspect", str(path), "acme:a1")
    assert (code, out) == (1, "")
    assert err == f"aip-crewai: cannot read the journal {path}: database disk image is malformed\n"


def test_list_prints_ids_escaped(tmp_path, capsys):
    """Regression: ``journal list`` printed an imported id's control sequences raw (a crafted file could set
    the terminal's title); ids are printed escaped as ``inspect`` and ``import`` print them."""
    tmp_path.chmod(0o700)
    path = tmp_path / "journal.db"
    write_journal(path, [("acme:\x1b[31mred", "echo"), ("acme:q9", "ec\x1b]0;pwned\x07ho"), ("beta:\u202eab", "e")])
    code, out, err = in_process(capsys, "list", str(path))
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "'acme:\\x1b[31mred'" in out and "'ec\\x1b]0;pwned\\x07ho'" in out and "'beta:\\u202eab'" in out
    assert " acme:q9\n" in out  # a printable id is printed as it is
    code, out, err = in_process(capsys, "inspect", str(path), "\u202eab")
    assert code == 0 and "\u202e" not in out


def test_several_tenants_of_an_action_id_are_named_escaped(tmp_path, capsys):
    tmp_path.chmod(0o700)
    path = tmp_path / "journal.db"
    write_journal(path, [("acme:\x1b[2Jx", "echo"), ("beta:\x1b[2Jx", "echo")])
    code, out, err = in_process(capsys, "inspect", str(path), "\x1b[2Jx")
    assert code == 1 and "\x1b" not in err
    assert "'acme:\\x1b[2Jx', 'beta:\\x1b[2Jx'" in err
