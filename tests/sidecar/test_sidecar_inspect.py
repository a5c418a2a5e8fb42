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
