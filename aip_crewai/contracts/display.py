"""Faithful display of untrusted text: the code points a person would misread (pure).

An approver decides on the exact bytes of an input, but reads a rendering of
them. Some code points change what a rendering says without being seen:

| kind | code points | why |
|---|---|---|
| ``bidi_control`` | U+202A..U+202E, U+2066..U+2069, U+200E, U+200F, U+061C | reorder the text around them: ``9876-5432`` after U+202E reads ``2345-6789`` |
| ``invisible`` | general category ``Cf`` (zero-width space U+200B, joiners, U+FEFF, soft hyphen, tag characters), and the blank-looking letters and selectors of :data:`BLANK_LOOKING` | take no room: ``ad\\u200bmin`` reads ``admin`` |
| ``control`` | general category ``Cc`` except TAB, LF and CR, and lone surrogates (``Cs``) (which every JSON view already shows as ``\\t``, ``\\n``, ``\\r``) | may move the cursor or be dropped by a terminal |
| ``space`` | general category ``Zs`` other than U+0020, and ``Zl``/``Zp`` (U+2028, U+2029) | look like a plain space or a line end |
| ``compatibility`` | a letter or digit whose NFKC form is other ASCII (fullwidth ``Ａ``, mathematical ``𝐚``, ligatures) | look like the ASCII they stand for |
| ``mixed_script`` | a letter of a word that mixes Latin, Greek, Cyrillic, Armenian, Cherokee, Coptic or Lisu letters, the word's minority script | ``pаypal`` with a Cyrillic ``а`` reads ``paypal`` |

:func:`findings` lists them per JSON path of a decoded JSON value (object
keys included); :func:`escape` writes a string with each of them as a
``\\u202e``-style marker (a surrogate pair such as ``\\ud835\\udc1a`` above
U+FFFF), which is exactly the JSON escape of that code point, so an escaped rendering is still valid JSON
text; :func:`dumps` renders a whole value that way. A literal backslash in the
input stays distinguishable: JSON writes it ``\\\\``.

Source: docs/approvals.md "The approval flow" (faithful display).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from typing import Any, Literal

import msgspec

FindingKind = Literal["bidi_control", "invisible", "control", "space", "compatibility", "mixed_script"]

#: The bidirectional formatting controls (Unicode UAX #9): embeddings, overrides, isolates and marks.
BIDI_CONTROLS = frozenset([*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C])
#: Code points outside ``Cf`` that render as nothing or as blank: the combining grapheme joiner,
#: Hangul fillers, Khmer inherent vowels, Mongolian selectors, the braille blank and variation selectors.
BLANK_LOOKING = frozenset(
    [
        0x034F,
        0x115F,
        0x1160,
        0x17B4,
        0x17B5,
        *range(0x180B, 0x1810),
        0x2800,
        0x3164,
        0xFFA0,
        *range(0xFE00, 0xFE10),
        *range(0xE0100, 0xE01F0),
    ]
)
#: Scripts whose letters are mistaken for one another; a word mixing two of them is flagged.
CONFUSABLE_SCRIPTS = frozenset(["LATIN", "GREEK", "CYRILLIC", "ARMENIAN", "CHEROKEE", "COPTIC", "LISU"])
#: Control characters every JSON rendering already escapes visibly (``\\t``, ``\\n``, ``\\r``).
_JSON_VISIBLE = frozenset([0x09, 0x0A, 0x0D])
#: Most findings reported per value; past it :func:`findings` stops (the view says it was cut).
MAX_FINDINGS = 1000
#: The kinds that show nothing a person could read (:func:`says_something`).
_UNSEEN = frozenset(["bidi_control", "invisible", "control", "space"])
#: A word: a run of letters, marks and digits (``\\w`` without ``_``).
_WORD = re.compile(r"[^\W_]+")


class Finding(msgspec.Struct, frozen=True):
    """One code point a person would misread.

    Attributes:
        path: JSON path of the string (``$``, ``$.note``, ``$.items[2]``,
            ``$["a b"]``: :func:`child_path`).
        index: offset of the code point in that string, in code points (not
            UTF-16 units or bytes).
        code_point: ``U+XXXX`` (four to six hex digits, upper case).
        kind: see the module table.
        key: True when the string is the object key at ``path``, not its value.
    """

    path: str
    index: int
    code_point: str
    kind: FindingKind
    key: bool = False


def classify(char: str) -> FindingKind | None:
    """The kind of one code point on its own (every kind but ``mixed_script``), or None. Pure.

    Raises: TypeError (not a single character).
    """
    cp = ord(char)
    if cp in BIDI_CONTROLS:
        return "bidi_control"
    if cp < 0x80:
        return "control" if (cp < 0x20 or cp == 0x7F) and cp not in _JSON_VISIBLE else None
    category = unicodedata.category(char)
    if category == "Cf" or cp in BLANK_LOOKING:
        return "invisible"
    if category in ("Cc", "Cs"):  # Cs: a lone surrogate (JSON may carry one), shown as nothing or a box
        return "control"
    if category in ("Zs", "Zl", "Zp"):
        return "space"
    if category[0] in "LN":
        folded = unicodedata.normalize("NFKC", char)
        if folded != char and folded.isascii() and folded.isprintable():
            return "compatibility"
    return None


def says_something(text: str) -> bool:
    """Whether ``text`` holds a code point a person can see: one that is not white space (``str.isspace``) and not
    a ``bidi_control``, ``invisible``, ``control`` or ``space`` code point (:func:`classify`). Pure.

    ``"  "``, ``"\\n"``, ``"\\u200b"`` and ``"\\u00a0"`` say nothing; a decision's reason must say something
    (docs/approvals.md "The approval flow").
    """
    return any(not char.isspace() and classify(char) not in _UNSEEN for char in text)


def script_of(char: str) -> str | None:
    """The confusable script of a letter (:data:`CONFUSABLE_SCRIPTS`), from its Unicode name; None otherwise. Pure."""
    if not char.isalpha():
        return None
    if char.isascii():
        return "LATIN"
    name = unicodedata.name(char, "")
    first = name.split(" ", 1)[0]
    return first if first in CONFUSABLE_SCRIPTS else None


def _mixed(text: str) -> Iterator[int]:
    """Offsets of the minority-script letters of every word mixing confusable scripts (ties: Latin stays)."""
    if text.isascii():
        return
    for match in _WORD.finditer(text):
        word = match.group()
        if word.isascii():
            continue
        scripts = [script_of(c) for c in word]
        counts: dict[str, int] = {}
        for s in scripts:
            if s is not None:
                counts[s] = counts.get(s, 0) + 1
        if len(counts) < 2:
            continue
        keep = max(counts, key=lambda s: (counts[s], s == "LATIN"))
        for offset, s in enumerate(scripts):
            if s is not None and s != keep:
                yield match.start() + offset


def string_findings(text: str, path: str = "$", *, key: bool = False) -> list[Finding]:
    """The findings of one string, in offset order (one per code point). Pure."""
    found: dict[int, FindingKind] = {}
    if not text.isascii() or not text.isprintable():
        for i, char in enumerate(text):
            kind = classify(char)
            if kind is not None:
                found[i] = kind
        for i in _mixed(text):
            found.setdefault(i, "mixed_script")
    return [Finding(path, i, f"U+{ord(text[i]):04X}", found[i], key) for i in sorted(found)]


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def child_path(path: str, step: str | int) -> str:
    """The JSON path of a child: ``[i]`` for an array index, ``.name`` for a key that
    is an ASCII identifier, else ``[<key as JSON text>]`` (``json.dumps`` with
    ``ensure_ascii=False``, as JavaScript's ``JSON.stringify`` writes it). Pure."""
    if isinstance(step, int):
        return f"{path}[{step}]"
    if _IDENTIFIER.fullmatch(step):
        return f"{path}.{step}"
    return f"{path}[{json.dumps(step, ensure_ascii=False)}]"


def findings(value: Any, *, limit: int = MAX_FINDINGS) -> list[Finding]:
    """Every finding of a decoded JSON value (strings, object keys), depth first in document order. Pure.

    Args:
        value: a decoded JSON value (dict, list, str, numbers, bool, None).
        limit: at most this many findings are returned.
    """
    out: list[Finding] = []
    stack: list[tuple[str, Any, str | None]] = [("$", value, None)]
    while stack and len(out) < limit:
        path, node, key = stack.pop()
        if key is not None:
            out.extend(string_findings(key, path, key=True))
        if isinstance(node, str):
            out.extend(string_findings(node, path))
        elif isinstance(node, dict):
            stack.extend(reversed([(child_path(path, str(k)), v, str(k)) for k, v in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([(child_path(path, i), v, None) for i, v in enumerate(node)]))
    return out[:limit]


def marker(char: str) -> str:
    """The visible marker of one code point, its JSON escape: ``\\u202e``; above U+FFFF the
    UTF-16 surrogate pair ``\\udb40\\udc41``, as JSON writes it. Pure."""
    cp = ord(char)
    if cp <= 0xFFFF:
        return f"\\u{cp:04x}"
    cp -= 0x10000
    return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"


def escape(text: str, flagged: Any = None) -> str:
    """``text`` with each flagged code point written as its :func:`marker`. Pure.

    Args:
        text: any string.
        flagged: offsets to escape (a container of ints); None: this string's own :func:`string_findings`.
    """
    if flagged is None:
        flagged = {f.index for f in string_findings(text)}
    if not flagged:
        return text
    return "".join(marker(c) if i in flagged else c for i, c in enumerate(text))


def json_string(text: str) -> str:
    """``text`` as a JSON string literal for a person: non-ASCII kept, every finding written as its
    JSON escape (:func:`marker`), so the literal still decodes to ``text``. Pure."""
    flagged = {f.index for f in string_findings(text)}
    if not flagged:
        return json.dumps(text, ensure_ascii=False)
    parts = (marker(c) if i in flagged else json.dumps(c, ensure_ascii=False)[1:-1] for i, c in enumerate(text))
    return '"' + "".join(parts) + '"'


def dumps(value: Any, *, indent: int | None = 2) -> str:
    """A decoded JSON value as JSON text for a person (``json.dumps`` layout, ``ensure_ascii=False``),
    every string and key through :func:`json_string`: the text parses back to ``value``. Pure."""

    def enc(node: Any, level: int) -> str:
        if isinstance(node, str):
            return json_string(node)
        if isinstance(node, (dict, list)) and node:
            pad = "" if indent is None else "\n" + " " * (indent * (level + 1))
            end = "" if indent is None else "\n" + " " * (indent * level)
            if isinstance(node, dict):
                items = [
                    f"{json_string(str(k))}:{'' if indent is None else ' '}{enc(v, level + 1)}" for k, v in node.items()
                ]
                return "{" + ",".join(pad + item for item in items) + end + "}"
            return "[" + ",".join(pad + enc(v, level + 1) for v in node) + end + "]"
        return json.dumps(node, ensure_ascii=False, default=str)

    return enc(value, 0)


#: Findings a :func:`banner` names one by one; the rest are counted.
BANNER_NAMED = 5


def banner(found: list[Finding]) -> str | None:
    """One warning line for a person about ``found`` (None when empty), naming the first
    :data:`BANNER_NAMED` as ``<path>[<offset>] U+XXXX <kind>`` (paths escaped too). Pure."""
    if not found:
        return None
    named = ", ".join(
        f"{escape(f.path)}{' (key)' if f.key else ''}[{f.index}] {f.code_point} {f.kind}" for f in found[:BANNER_NAMED]
    )
    more = f" and {len(found) - BANNER_NAMED} more" if len(found) > BANNER_NAMED else ""
    return (
        f"warning: {len(found)} character(s) below would read differently from what they are (direction "
        f"controls, invisible, control or look-alike characters); each is shown as its \\u escape: {named}{more}"
    )
