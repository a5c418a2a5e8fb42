"""The markers CI's second passes select by (Makefile ``test-postgresql``, ``test-inprocess``): a test file
that starts a host process carries ``host_processes``, so the PostgreSQL pass cannot miss it, and no
file carries it without starting one."""

from __future__ import annotations

import re
import subprocess
import sys
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


@pytest.mark.processes
def test_the_installed_pytest_xdist_groups_tests_by_their_xdist_group(tmp_path: Path) -> None:
    """``make test`` keeps each module's shared sidecar on one worker with ``--dist loadgroup``
    (tests/conftest.py). Some pytest releases silently break that grouping (pytest 9.2 with pytest-xdist
    3.8 ignores the group's node id suffix: github.com/pytest-dev/pytest-xdist/issues/1386), and then every
    module-scoped sidecar starts once per worker and the suite takes about twice as long without a failure:
    this run shows it."""
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.xdist_group('shared')\n@pytest.mark.parametrize('i', range(3))\n"
        "def test_grouped(i):\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r"\[(gw\d)\].*PASSED (\S+)", result.stdout)
    assert len(ran) == 3 and all(nodeid.endswith("@shared") for _, nodeid in ran), (
        f"pytest {pytest.__version__}: tests of one xdist_group were not grouped:\n{result.stdout}"
    )
    assert len({worker for worker, _ in ran}) == 1, result.stdout
