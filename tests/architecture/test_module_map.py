"""The house rules, checked on the source (docs/ARCHITECTURE.md §2): the module map names every module
and nothing else, no folder holds more than 12 modules, no module exceeds 600 lines, host and sidecar
never import each other, every ``§N`` cited in code and docs is a section of ARCHITECTURE.md, and no
comment cites an issue number instead of stating its rule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "aip_crewai"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
#: At most this many modules directly in one folder, its ``__init__.py`` included (STYLE "Folders and gates").
MAX_MODULES_PER_FOLDER = 12
#: No module is longer than this, lines.
MAX_MODULE_LINES = 600
#: Where a ``§N`` may be cited.
CITING = [
    *PACKAGE.rglob("*.py"),
    *(ROOT / "tests").rglob("*.py"),
    *(ROOT / "bench").glob("*.py"),
    ROOT / "README.md",
    *(ROOT / "docs").glob("*.md"),
]


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def listed(path: Path) -> bool:
    """Whether the map must name ``path``: every module, and an ``__init__.py`` that holds code."""
    return path.name != "__init__.py" or bool(ast.parse(path.read_text()).body)


def module_map() -> dict[str, set[str]]:
    """§2's table: folder (relative to the repository, ending in ``/``) -> the ``*.py`` names its row cites."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## §2 ") : text.index("\n## §3 ")]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = line.split(" | ")
        folder = re.fullmatch(r"\| `(aip_crewai/[a-z_/]*)`", cells[0].strip())
        if folder is not None:
            rows[folder.group(1)] = set(re.findall(r"`([a-z_0-9]+\.py)`", " | ".join(cells[1:])))
    return rows


def test_the_module_map_names_every_module_and_nothing_else():
    rows = module_map()
    missing, folders = [], set()
    for path in modules():
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        folders.add(folder)
        if listed(path) and path.name not in rows.get(folder, set()):
            missing.append(path.relative_to(ROOT).as_posix())
    stale = [
        f"{folder}{name}"
        for folder, names in rows.items()
        for name in sorted(names)
        if not (ROOT / folder / name).is_file()
    ]
    assert missing == [], f"modules missing from docs/ARCHITECTURE.md §2: {missing}"
    assert stale == [], f"§2 names modules that do not exist: {stale}"
    assert sorted(set(rows) - folders) == [], "§2 has a row for a folder without modules"


def test_no_folder_holds_more_than_twelve_modules():
    counts: dict[Path, int] = {}
    for path in modules():
        counts[path.parent] = counts.get(path.parent, 0) + 1
    crowded = {folder.relative_to(ROOT).as_posix(): n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


def test_no_module_exceeds_six_hundred_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def _imported(path: Path) -> set[str]:
    """The absolute names of every module ``path`` imports (function bodies and TYPE_CHECKING included)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = list(package[: len(package) - (node.level - 1)]) if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_host_and_sidecar_never_import_each_other():
    crossings = []
    for path in modules():
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for own, other in (("aip_crewai.host", "aip_crewai.sidecar"), ("aip_crewai.sidecar", "aip_crewai.host")):
            if name.startswith(own + "."):
                crossings += [
                    f"{name} -> {target}"
                    for target in sorted(_imported(path))
                    if target == other or target.startswith(other + ".")
                ]
    assert crossings == []


def test_every_cited_section_exists():
    sections = set(re.findall(r"^## §(\d+) ", ARCHITECTURE.read_text(), re.MULTILINE))
    dangling = sorted(
        {
            f"{path.relative_to(ROOT).as_posix()}: §{number}"
            for path in CITING
            for number in re.findall(r"§(\d+)", path.read_text())
            if number not in sections
        }
    )
    assert dangling == []


def test_no_comment_cites_an_issue_number():
    """A comment or docstring states its rule (or names the README or ARCHITECTURE section holding it),
    never an issue: the issue tracker is not part of the repository."""
    citing = [
        f"{path.relative_to(ROOT).as_posix()}:{number}"
        for path in (*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissues? \d+\b", line)
    ]
    assert citing == []
