"""The shipped example configs fit together: every crew the host example admits is in the
sidecar example's registry, with operations the sidecar example allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
#: What the sidecar always serves besides --allowed-operations (ARCHITECTURE.md §3).
ALWAYS = {"status", "events", "cancel"}


def _env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


#: (host config, sidecar env file): the shipped deployment and the real-crew example deployment (whose env file
#: puts its crew module's directory on ``PYTHONPATH``, relative to the repository root).
DEPLOYMENTS = [
    (REPO / "host" / "host.example.toml", REPO / "sidecar" / "sidecar.env.example"),
    (REPO / "examples" / "realcrews" / "host.toml", REPO / "examples" / "realcrews" / "sidecar.env"),
]


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("host_toml", "env_file"), DEPLOYMENTS, ids=["shipped", "realcrews"])
def test_the_host_example_admits_only_crews_and_operations_the_sidecar_example_serves(
    host_toml: Path, env_file: Path
) -> None:
    host = tomllib.loads(host_toml.read_text())
    crews = json.loads((host_toml.parent / host["crews"]["file"]).read_text())
    sidecar = _env_file(env_file)
    module, attribute = sidecar["AIP_CREWAI_REGISTRY"].split(":")
    path = [str(REPO / entry) for entry in sidecar.get("PYTHONPATH", "").split(":") if entry]
    served = json.loads(
        subprocess.run(  # imports CrewAI: in a child process
            [
                sys.executable,
                "-c",
                f"import json, sys; sys.path[:0] = {path!r}; import {module} as m; "
                f"print(json.dumps(sorted(m.{attribute})))",
            ],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=100,
        ).stdout
    )
    allowed = set(sidecar["AIP_CREWAI_ALLOWED_OPERATIONS"].split(",")) | ALWAYS
    assert {crew["id"] for crew in crews} <= set(served)
    for crew in crews:
        assert set(crew.get("allowed_operations", ["run", "status", "events", "cancel"])) <= allowed, crew["id"]
    for tenant in host["tenants"].values():
        assert set(tenant["crews"]) <= {crew["id"] for crew in crews}


def test_the_distribution_ships_one_top_level_package() -> None:
    """The demo and test crews live in ``aip_crewai.examples``: nothing named ``examples`` is installed at the top
    level, where it would shadow or be shadowed by a user's own package. Checked as setuptools'
    package discovery sees the tree (top-level directories with an ``__init__.py`` matching ``include``), without
    importing setuptools (not in every venv)."""
    import fnmatch

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    top_level = {path.parent.name for path in REPO.glob("*/__init__.py")}
    shipped = {name for name in top_level if any(fnmatch.fnmatchcase(name, pattern) for pattern in find["include"])}
    assert shipped == {"aip_crewai"}
    assert (REPO / "aip_crewai" / "examples" / "__init__.py").is_file()
    # the top-level examples/ holds example deployments (configs + crew modules put on PYTHONPATH), no package
    assert not list(REPO.glob("examples/**/__init__.py"))
