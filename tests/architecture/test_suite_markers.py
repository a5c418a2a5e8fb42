"""The markers CI's second passes select by (Makefile ``test-postgresql``, ``test-inprocess``): a test file
that starts a host process carries ``host_processes``, so the PostgreSQL pass cannot miss it, and no
file carries it without starting one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SUITES = sorted(
    [*TESTS.glob("integration/test_*.py"), *TESTS.glob("reliability/test_*.py"), *TESTS.glob("realcrews/test_*.py")]
)
#: How the suites start a host: ``kits.host.start_host``/``write_config``, ``relkit.Processes.host``/
#: ``launch_host``, the reliability ``shared_pair`` fixture (sidecar and host processes) and the real-crew suite's
#: ``deployment`` fixture / ``start_deployment`` (``tests/realcrews/realkit.py``).
HOST_STARTERS = re.compile(
    r"\bstart_host\(|\bwrite_config\(|\bprocs\.(?:launch_)?host\(|\bstart_deployment\("
    r"|def test_\w+\([^)]*\b(?:shared_pair|deployment)\b"
)


@pytest.mark.parametrize("path", SUITES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_file_that_starts_a_host_is_marked_host_processes(path: Path) -> None:
    source = path.read_text()
    assert bool(HOST_STARTERS.search(source)) == ("pytest.mark.host_processes" in source), (
        f"{path.name}: starts a host: {bool(HOST_STARTERS.search(source))}; marked host_processes: "
        f"{'pytest.mark.host_processes' in source}"
    )


def test_the_markers_select_files() -> None:
    marked = [p.name for p in SUITES if "pytest.mark.host_processes" in p.read_text()]
    jobs = [p.name for p in SUITES if "pytest.mark.sidecar_jobs" in p.read_text()]
    assert "test_multi_host.py" in marked and "test_rel_outage.py" in marked
    assert "test_sidecar_contract.py" not in marked and "test_sidecar_contract.py" in jobs
