"""Faithful display (aip_crewai/contracts/display.py): every code point a person would misread is found,
with its JSON path, offset, code point and kind, and written as its JSON escape; nothing else is."""

from __future__ import annotations

import json
import sys
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.contracts import display
from aip_crewai.contracts.display import Finding

SPOOF = "refund 10 EUR to account \u202e9876-5432\u202c then close"


def kinds(text: str) -> list[tuple[int, str, str]]:
    return [(f.index, f.code_point, f.kind) for f in display.string_findings(text)]


@pytest.mark.parametrize(
    ("char", "kind"),
    [
        *[(chr(cp), "bidi_control") for cp in [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x61C]],
        ("\u200b", "invisible"),  # zero-width space
        ("\u200d", "invisible"),  # zero-width joiner
        ("\ufeff", "invisible"),  # BOM / zero-width no-break space
        ("\u00ad", "invisible"),  # soft hyphen
        ("\U000e0041", "invisible"),  # tag letter A
        ("\u3164", "invisible"),  # Hangul filler (a letter that draws nothing)
        ("\ufe0f", "invisible"),  # variation selector
        ("\u2800", "invisible"),  # braille blank
        ("\x00", "control"),
        ("\x1b", "control"),
        ("\x7f", "control"),
        ("\x85", "control"),
        ("\u00a0", "space"),
        ("\u2007", "space"),
        ("\u3000", "space"),
        ("\u2028", "space"),
        ("\u2029", "space"),
        ("\uff21", "compatibility"),  # fullwidth A
        ("\U0001d41a", "compatibility"),  # mathematical bold a
        ("\ufb01", "compatibility"),  # fi ligature
    ],
)
def test_each_kind_of_misread_code_point_is_found(char: str, kind: str) -> None:
    assert kinds(f"a{char}b") == [(1, f"U+{ord(char):04X}", kind)]
    assert display.classify(char) == kind


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii, with punctuation!",
        "tab\tnew\nline\rreturn",
        "日本語のテキストとカタカナ",
        "Ελληνικά",
        "русский текст",
        "עברית",
        "العربية",
        "emoji 🎉 ok",
        "café naïve",
        "iPhone手机",
        "x²"[:1],
    ],
)
def test_ordinary_text_has_no_findings(text: str) -> None:
    assert display.string_findings(text) == []


def test_tab_newline_and_return_are_not_findings_because_json_escapes_them() -> None:
    assert display.classify("\t") is display.classify("\n") is display.classify("\r") is None
    assert display.dumps("a\tb\nc") == '"a\\tb\\nc"'


@pytest.mark.parametrize(
    ("word", "flagged"),
    [
        ("p\u0430ypal", [1]),  # Cyrillic a in a Latin word
        ("\u0430dmin", [0]),
        ("\u0440\u0430\u0443\u0440al", [4, 5]),  # mostly Cyrillic: the Latin minority is flagged
        ("ab\u03bfcd", [2]),  # Greek omicron
        ("\u0430b", [0]),  # a tie keeps Latin
        ("PAY\ua4d1AL", [3]),  # a Lisu letter (looks like a Latin capital P) in a Latin word
    ],
)
def test_a_word_mixing_confusable_scripts_flags_its_minority_letters(word: str, flagged: list[int]) -> None:
    found = display.string_findings(f"see {word} now")
    assert [(f.index - 4, f.kind) for f in found] == [(i, "mixed_script") for i in flagged]


def test_the_spoofed_account_and_admin_are_found_and_escaped() -> None:
    assert kinds(SPOOF) == [(25, "U+202E", "bidi_control"), (35, "U+202C", "bidi_control")]
    assert display.escape(SPOOF) == "refund 10 EUR to account \\u202e9876-5432\\u202c then close"
    assert display.escape("ad\u200bmin") == "ad\\u200bmin"
    assert display.escape("\U000e0041") == "\\udb40\\udc41"


def test_findings_walk_keys_and_values_in_document_order_with_their_paths() -> None:
    value = {"note": SPOOF, "users": ["ok", "ad\u200bmin"], "p\u0430y": {"a b": "\u00a0"}, "n": 1, "z": None}
    assert display.findings(value) == [
        Finding("$.note", 25, "U+202E", "bidi_control"),
        Finding("$.note", 35, "U+202C", "bidi_control"),
        Finding("$.users[1]", 2, "U+200B", "invisible"),
        Finding('$["p\u0430y"]', 1, "U+0430", "mixed_script", key=True),
        Finding('$["p\u0430y"]["a b"]', 0, "U+00A0", "space"),
    ]
    assert display.findings(SPOOF) == [
        Finding("$", 25, "U+202E", "bidi_control"),
        Finding("$", 35, "U+202C", "bidi_control"),
    ]


def test_findings_stop_at_the_limit_and_the_banner_counts_the_rest() -> None:
    many = ["\u200b" * 3] * 10
    assert len(display.findings(many, limit=7)) == 7
    found = display.findings(many)
    text = display.banner(found)
    assert text is not None and text.startswith("warning: 30 character(s)") and text.endswith("and 25 more")
    assert "$[0][0] U+200B invisible" in text and display.banner([]) is None


def test_child_paths_match_what_a_browser_writes() -> None:
    assert display.child_path("$", "name_1") == "$.name_1"
    assert display.child_path("$", 3) == "$[3]"
    assert display.child_path("$", "1x") == '$["1x"]'
    assert display.child_path("$", 'a"b\\c\n') == '$["a\\"b\\\\c\\n"]'
    assert display.child_path("$", "é") == '$["é"]'


def test_dumps_has_the_json_layout_and_escapes_only_findings() -> None:
    value = {"a": [1, {"b": None, "c": []}], "c": {}, "d": 'q"\\', "e": "café", "f": True, "g": 1.5}
    assert display.dumps(value) == json.dumps(value, indent=2, ensure_ascii=False)
    assert display.dumps(value, indent=None) == json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert (
        display.dumps({"x": SPOOF}, indent=None)
        == '{"x":"refund 10 EUR to account \\u202e9876-5432\\u202c then close"}'
    )


# --- properties ----------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@given(json_values)
def test_dumps_always_parses_back_to_the_same_value(value: object) -> None:
    assert json.loads(display.dumps(value)) == value
    assert json.loads(display.dumps(value, indent=None)) == value


@given(st.text())
def test_the_escaped_form_holds_no_misread_code_point_and_replaces_only_the_findings(text: str) -> None:
    escaped = display.escape(text)
    assert all(display.classify(c) is None for c in escaped)
    flagged = [text[f.index] for f in display.string_findings(text)]
    assert len(escaped) == len(text) + sum(len(display.marker(c)) - 1 for c in flagged)
    literal = display.json_string(text)
    assert json.loads(literal) == text and all(display.classify(c) is None for c in literal)


@given(st.text(), st.text(), st.sampled_from(sorted(display.BIDI_CONTROLS)))
def test_a_bidi_control_anywhere_is_always_found_at_its_offset(before: str, after: str, control: int) -> None:
    text = before + chr(control) + after
    found = {f.index: f for f in display.string_findings(text)}
    assert found[len(before)].kind == "bidi_control"
    assert found[len(before)].code_point == f"U+{control:04X}"


@given(st.text(alphabet=st.characters(codec="ascii", exclude_categories=["Cc"])))
def test_printable_ascii_never_has_findings(text: str) -> None:
    assert display.string_findings(text) == []
    assert display.escape(text) == text


@given(st.characters())
def test_classify_agrees_with_the_unicode_categories(char: str) -> None:
    kind = display.classify(char)
    category = unicodedata.category(char)
    if category == "Cf" or ord(char) in display.BIDI_CONTROLS:
        assert kind in ("bidi_control", "invisible")
    elif category in ("Zl", "Zp") or category == "Zs" and char != " ":
        assert kind == "space"
    elif category == "Cc" and char not in "\t\n\r":
        assert kind == "control"
    elif kind is not None:
        assert kind in ("invisible", "compatibility", "control")


def test_every_code_point_is_classified_without_error() -> None:
    """Exhaustive: the whole code space (the surrogates included) classifies, and the counts are stable
    properties of the tables (every Cf is found, nothing in plain letters of the common scripts is)."""
    counts: dict[str | None, int] = {}
    for cp in range(sys.maxunicode + 1):
        kind = display.classify(chr(cp))
        counts[kind] = counts.get(kind, 0) + 1
        if unicodedata.category(chr(cp)) == "Cf":
            assert kind in ("bidi_control", "invisible"), hex(cp)
    assert counts["bidi_control"] == len(display.BIDI_CONTROLS)
    for cp in [*range(0x41, 0x5B), *range(0x430, 0x450), *range(0x3B1, 0x3CA), *range(0x4E00, 0x4E10)]:
        assert display.classify(chr(cp)) is None


@pytest.mark.parametrize("text", ["", " ", "  ", "\n", "\t\r\n", "\u200b", "\u00a0", "\u202e\u202c", "\u3000\ufeff"])
def test_blank_and_invisible_text_says_nothing(text: str) -> None:
    assert not display.says_something(text)


@pytest.mark.parametrize("text", ["ok", " ok ", "\u200bok", "\u05d0", "1", "\uff41", "."])
def test_text_with_a_visible_code_point_says_something(text: str) -> None:
    assert display.says_something(text)


@given(st.text(), st.text(alphabet=" \n\t\u00a0\u200b\u202e\u2066\u3000\ufeff"))
def test_blank_and_invisible_padding_never_changes_whether_text_says_something(text: str, padding: str) -> None:
    assert display.says_something(padding + text + padding) is display.says_something(text)
    assert not display.says_something(padding)
