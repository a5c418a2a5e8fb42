"""`make run`'s flow runs non-interactively and exits 0 (issue: the main job end to end); with ``--webhooks``
(``make run WEBHOOKS=1``) the example receiver verifies each event of the flow (docs/webhooks.md "The demo")."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo(run: Path, *options: str) -> str:
    """Run the demo in ``run`` with ``options``; asserts it exits 0 and returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "aip_crewai.examples.demo", "--run-dir", str(run), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_flow(tmp_path):
    out = _demo(tmp_path / "run")
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


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_flow_with_webhooks_shows_verified_deliveries(tmp_path):
    run = tmp_path / "run"
    out = _demo(run, "--webhooks")
    assert "Traceback" not in out
    # each event where the flow makes it, verified by the receiver process with standardwebhooks
    flat = " ".join(out.split())  # the receiver's lines are wrapped
    requested = re.search(r"webhook receiver: approval\.requested approval=(apr_\S+) action=(act_\S+) verified", flat)
    assert requested, out
    assert flat.index("-> pending_approval") < requested.start() < flat.index("== 4.")
    approval, action = requested[1], requested[2]
    assert f"webhook receiver: approval.decided approval={approval} action={action} status=approved verified" in flat
    assert f"webhook receiver: action.completed action={action} status=completed verified" in flat
    assert "rejected" not in out and "webhook receiver stopped (exit status 0)" in out
    assert (run / "secrets" / "webhook.whsec").stat().st_mode & 0o777 == 0o600
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 100, out
