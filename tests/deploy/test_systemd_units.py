"""The systemd units verify (when systemd-analyze exists) and carry the promised hardening."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = [ROOT / "host" / "aip-crewai-host.service", ROOT / "sidecar" / "aip-crewai-sidecar.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_has_notify_and_hardening(unit):
    text = unit.read_text()
    for line in [
        "Type=notify",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "Restart=on-failure",
        "StateDirectory=",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=",
    ]:
        assert line in text, f"{unit.name} lacks {line}"


@pytest.mark.processes
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(unit, tmp_path):
    # Point ExecStart at this venv's console script so verify can check it exists.
    script = Path(sys.executable).with_name("aip-crewai")
    if not script.exists():
        pytest.skip("console script not installed")
    copy = tmp_path / unit.name
    copy.write_text(unit.read_text().replace("/opt/aip-crewai/.venv/bin/aip-crewai", str(script)))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
