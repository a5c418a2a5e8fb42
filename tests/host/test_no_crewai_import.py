"""The host never imports CrewAI (ARCHITECTURE.md §1): every module under aip_crewai/host,
found dynamically, imports in a fresh interpreter without pulling in crewai."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, pkgutil, sys
import aip_crewai.host as host
names = sorted(m.name for m in pkgutil.walk_packages(host.__path__, host.__name__ + "."))
for name in names:
    importlib.import_module(name)
import aip_crewai.cli
leaked = sorted(m for m in sys.modules if m == "crewai" or m.startswith("crewai."))
assert not leaked, leaked
assert "aip_crewai.host.main" in names and "aip_crewai.host.http.app" in names, names
print(len(names))
"""


@pytest.mark.processes
def test_no_host_module_imports_crewai():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) >= 9  # config, admission, auth, manifest, store, readiness, metrics, app, main
