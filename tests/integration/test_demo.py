"""`make run`'s flow runs non-interactively and exits 0 (issue: the main job end to end)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_flow(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "aip_crewai.examples.demo", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        stdin=subprocess.DEVNULL,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for expected in [
        "-> pending_approval",
        "nothing was sent to the sidecar",
        "-> approved by human:acme-approver",
        "chunks streamed",
        "returns the stored result: completed",
        "status: completed",
        "match: Refund policy",
        "host stopped (exit status 0)",
        "sidecar stopped (exit status 0)",
    ]:
        assert expected in out, expected
    assert "Traceback" not in out
    # readable: wrapped lines, one block per speaker, the knowledge excerpt ends at a sentence
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 100, out
    for header in ["   [task]", "   [Support triage analyst]", "   [Resolution writer]"]:
        assert header in out.splitlines(), header
    match = out[out.index("match: Refund policy") :].split("\n\n")[0]
    assert match.rstrip().endswith("."), match
