"""The user's guide holds together (README.md and docs/): every relative link resolves to a file and, with a
``#fragment``, to a heading or ``<a id>`` of it; every ``docs/… "Section"`` citation in code, tests and docs
names a page holding that section; and the configuration reference documents exactly the settings the code
reads: the host's TOML tables (``aip_crewai/host/config.py``'s msgspec tables, ``[[webhooks]]``, ``[pricing]``)
and the sidecar's flags (``aip_crewai/sidecar/options.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from aip_crewai.host import config as host_config
from aip_crewai.host.webhooks import config as webhook_config
from aip_crewai.sidecar.options import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
CONFIGURATION = ROOT / "docs" / "reference" / "configuration.md"
#: Pages another branch is writing at the same time: a link to one is checked once it exists.
WRITTEN_ELSEWHERE: set[Path] = set()

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (a link or heading in a code sample is not one)."""
    return _FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """The fragments a page answers: GitHub's slug of each heading (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces to ``-``, ``-1``, ``-2`` … on repeats) and every ``<a id="…">``."""
    text = _prose(page.read_text())
    found: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """Every link and image target of a page's prose."""
    return [a or b for a, b in _LINK.findall(_prose(page.read_text()))]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto: … : not ours to check offline
            path_part, _, fragment = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not resolved.exists():
                if resolved not in WRITTEN_ELSEWHERE:
                    broken.append(f"{where}: no such file")
            elif fragment and (resolved.suffix != ".md" or fragment not in anchors(resolved)):
                broken.append(f"{where}: no such anchor")
    assert broken == []


def test_the_link_checker_sees_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `title`, here\n\n[ok](#a-title-here) [bad](#nope) [gone](missing.md)\n")
    assert anchors(page) == {"a-title-here"}
    assert links(page) == ["#a-title-here", "#nope", "missing.md"]


_CITATION = re.compile(r"\b((?:README|docs/[\w/.-]+)\.md)(?:'s)?[,:]? \(?\"([^\"]+)\"")


#: The project's own folders (no process is started to ask git: this test belongs to the fast tier).
_PROJECT_DIRS = ("aip_crewai", "tests", "examples", "bench", "host", "sidecar", "docs", "contracts", ".ci")


def _project_files() -> list[Path]:
    """The files of the project's own folders and its top level, caches and vendored files left out."""
    found = [p for p in ROOT.iterdir() if p.is_file()]
    for folder in _PROJECT_DIRS:
        found += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and "vendor" not in p.parts
        ]
    return sorted(found)


def test_every_cited_section_is_on_its_page():
    """``docs/security.md "Security"`` (docstrings and comments name where their rule is written): the page
    exists and holds the quoted words (a heading, or the bold lead of a paragraph)."""
    dangling = []
    for path in _project_files():
        name = str(path.relative_to(ROOT))
        if path.suffix not in {".py", ".md", ".toml", ".js", ".example", ".env", ".service"} or not path.is_file():
            continue
        text = re.sub(r"\s*\n\s*(?:#:?|//)?\s*", " ", path.read_text())  # citations wrapped over comment lines
        for page, section in _CITATION.findall(text):
            target = ROOT / page
            if target in WRITTEN_ELSEWHERE and not target.exists():
                continue
            if not target.is_file() or section not in re.sub(r"\s+", " ", target.read_text()):
                dangling.append(f'{name}: {page} "{section}"')
    assert dangling == [], "\n".join(dangling)


# --- the configuration reference against the code ---------------------------------------------------------


def _fields(struct: Any) -> set[str]:
    return {field.encode_name for field in msgspec.structs.fields(struct)}


#: ``[pricing]`` is read by hand (aip_crewai/host/ledger/usage.py ``parse_pricing``): its tables' keys.
PRICING_KEYS = {"pricing": {"currency"}, "pricing.models.*": {"prompt", "completion", "cached_prompt", "currency"}}


def host_shape() -> dict[str, set[str]]:
    """Table (``tenants.*`` for a named one) -> the keys the host reads in it."""
    return {
        "host": _fields(host_config._HostTable),
        "sidecar": _fields(host_config._SidecarTable),
        "sidecars": _fields(host_config._SidecarsEntry),
        "crews": _fields(host_config._CrewsTable),
        "tenants.*": _fields(host_config._TenantTable),
        "principals": _fields(host_config._PrincipalTable),
        "webhooks": _fields(webhook_config._WebhookTable),
        **PRICING_KEYS,
    }


def documented_host_keys() -> dict[str, set[str]]:
    """The reference's TOML samples, commented-out lines included: table -> keys. A named table
    (``[tenants.acme]``, ``[pricing.models."gpt-4o-mini"]``) counts as ``tenants.*``; the free-form
    ``[pricing.crews]`` (crew id -> model) is skipped."""
    found: dict[str, set[str]] = {}
    for block in re.findall(r"^```toml\n(.*?)^```", CONFIGURATION.read_text(), re.MULTILINE | re.DOTALL):
        table = ""
        for line in block.splitlines():
            line = re.sub(r"^# (?=\[|[a-z0-9_]+ = )", "", line.strip())
            header = re.match(r"^\[\[?([^\]]+)\]\]?", line)
            if header:
                parts = header.group(1).split(".")
                table = {"tenants": "tenants.*", "pricing": "pricing" if len(parts) == 1 else ".".join(parts[:2])}.get(
                    parts[0], header.group(1)
                )
                if table == "pricing.models":
                    table = "pricing.models.*"
                found.setdefault(table, set())
                continue
            key = re.match(r"^([a-z0-9_]+) = ", line)
            if key and table != "pricing.crews":
                found.setdefault(table, set()).add(key.group(1))
    found.pop("pricing.crews", None)
    return found


def test_every_host_key_is_documented_and_every_documented_one_exists():
    shape, documented = host_shape(), documented_host_keys()
    missing = sorted(f"{t}.{k}" for t, keys in shape.items() for k in keys - documented.get(t, set()))
    unknown = sorted(f"{t}.{k}" for t, keys in documented.items() for k in keys - shape.get(t, set()))
    assert (missing, unknown) == ([], [])


def test_every_sidecar_flag_is_documented_and_every_documented_one_exists():
    flags = {
        option for action in build_parser()._actions for option in action.option_strings if option.startswith("--")
    } - {"--help"}
    documented = set(re.findall(r"^\| `(--[a-z-]+)` \|", CONFIGURATION.read_text(), re.MULTILINE))
    assert (sorted(flags - documented), sorted(documented - flags)) == ([], [])
