"""Tests for aip_crewai.sse: the sans-IO SSE codec (ARCHITECTURE.md §11, WHATWG HTML
"event stream interpretation").

Every table case runs whole, one byte at a time and followed by an extra frame;
property tests check encode/decode round trips, chunking invariance and a
naive reference decoder written straight from the WHATWG steps.
"""

from __future__ import annotations

import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aip_crewai.sse import (
    SSEDecoder,
    SSEEvent,
    SSEFrameTooLarge,
    encode_comment,
    encode_event,
    encode_page,
    encode_retry,
    page_template,
)

BOM = b"\xef\xbb\xbf"


def E(data: str, event: str = "message", id: str | None = None, retry: int | None = None) -> SSEEvent:
    return SSEEvent(event, data, id, retry)


def decode(chunks: list[bytes], max_frame_bytes: int = 1048576) -> list[SSEEvent]:
    dec = SSEDecoder(max_frame_bytes)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += dec.feed(chunk)
    return events + dec.close()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


# (name, input bytes, expected events, input ends at a frame boundary)
CASES: list[tuple[str, bytes, list[SSEEvent], bool]] = [
    ("lf", b"data: a\n\n", [E("a")], True),
    ("cr", b"data: a\r\r", [E("a")], True),
    ("crlf", b"data: a\r\n\r\n", [E("a")], True),
    ("mixed_line_ends", b"data: a\rdata: b\ndata: c\r\n\r\n", [E("a\nb\nc")], True),
    ("crlf_then_lf", b"data: a\r\n\n", [E("a")], True),
    ("cr_then_crlf", b"data: a\r\r\n", [E("a")], True),
    ("lf_cr_is_two_line_ends", b"data: a\n\rdata: b\n\n", [E("a"), E("b")], True),
    ("bom_stripped", BOM + b"data: a\n\n", [E("a")], True),
    ("bom_then_crlf", BOM + b"\r\ndata: a\r\n\r\n", [E("a")], True),
    ("second_bom_kept", BOM + BOM + b"data: a\n\ndata: b\n\n", [E("b")], True),
    ("bom_on_later_line_kept", b"data: a\n\n" + BOM + b"data: b\n\n", [E("a")], True),
    ("partial_bom_kept", b"\xef\xbbdata: a\n\n", [], True),
    ("comments", b": hello\ndata: a\n:\n:data: x\n\n", [E("a")], True),
    ("comment_only_frame", b": keep-alive\n\n", [], True),
    ("field_without_colon", b"data\n\n", [E("")], True),
    ("fields_without_colon", b"data\ndata\nevent\n\n", [E("\n")], True),
    ("one_leading_space_removed", b"data:  two\n\n", [E(" two")], True),
    ("no_space", b"data:x\n\n", [E("x")], True),
    ("tab_not_removed", b"data:\tx\n\n", [E("\tx")], True),
    ("colon_in_value", b"data: a: b\n\n", [E("a: b")], True),
    ("space_in_field_name", b"data : x\n\n", [], True),
    ("multi_line_data", b"data: a\ndata: b\ndata: c\n\n", [E("a\nb\nc")], True),
    ("trailing_empty_data_line", b"data: a\ndata:\n\n", [E("a\n")], True),
    ("last_id_persists", b"id: 1\ndata: a\n\ndata: b\n\n", [E("a", id="1"), E("b", id="1")], True),
    ("id_with_nul_ignored", b"id: 1\n\nid: 2\x00x\ndata: a\n\n", [E("a", id="1")], True),
    ("id_from_frame_without_data", b"id: 7\n\ndata: a\n\n", [E("a", id="7")], True),
    ("id_from_unterminated_frame_kept", b"id: 7\ndata: a\n\n", [E("a", id="7")], True),
    ("empty_id_resets", b"id: 1\ndata: a\n\nid\ndata: b\n\n", [E("a", id="1"), E("b", id="")], True),
    ("id_last_one_wins", b"id: 1\nid: 2\ndata: a\n\n", [E("a", id="2")], True),
    ("retry_digits", b"retry: 1500\ndata: a\n\ndata: b\n\n", [E("a", retry=1500), E("b")], True),
    ("retry_leading_zeros", b"retry: 007\ndata: a\n\n", [E("a", retry=7)], True),
    ("retry_zero", b"retry: 0\ndata: a\n\n", [E("a", retry=0)], True),
    ("retry_plus_rejected", b"retry: +5\ndata: a\n\n", [E("a")], True),
    ("retry_underscore_rejected", b"retry: 1_000\ndata: a\n\n", [E("a")], True),
    ("retry_fullwidth_rejected", "retry: ５\ndata: a\n\n".encode(), [E("a")], True),
    ("retry_arabic_indic_rejected", "retry: ٣\ndata: a\n\n".encode(), [E("a")], True),
    ("retry_empty_rejected", b"retry:\ndata: a\n\n", [E("a")], True),
    ("retry_space_rejected", b"retry:  5\ndata: a\n\n", [E("a")], True),
    ("retry_trailing_space_rejected", b"retry: 5 \ndata: a\n\n", [E("a")], True),
    ("retry_negative_rejected", b"retry: -1\ndata: a\n\n", [E("a")], True),
    ("retry_invalid_keeps_earlier", b"retry: 5\nretry: x\ndata: a\n\n", [E("a", retry=5)], True),
    ("retry_without_data_not_carried", b"retry: 5\n\ndata: a\n\n", [E("a")], True),
    ("empty_data_dispatches", b"data:\n\n", [E("")], True),
    ("space_only_data_dispatches", b"data: \n\n", [E("")], True),
    ("no_data_no_dispatch", b"event: x\n\n", [], True),
    ("event_reset_after_no_data_frame", b"event: x\n\ndata: a\n\n", [E("a")], True),
    ("event_reset_after_dispatch", b"event: x\ndata: a\n\ndata: b\n\n", [E("a", "x"), E("b")], True),
    ("unterminated_discarded", b"data: a\n\ndata: b\n", [E("a")], False),
    ("unterminated_line_discarded", b"data: a\n\ndata: b", [E("a")], False),
    ("unterminated_cr_discarded", b"data: a\r\rdata: b\r", [E("a")], False),
    (
        "unicode_separators_kept",
        "data: a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\n\n".encode(),
        [E("a\u2028b\u2029c\x85d\x0be\x0cf\x1cg")],
        True,
    ),
    ("nul_in_data_kept", b"data: a\x00b\n\n", [E("a\x00b")], True),
    ("invalid_utf8_replaced", b"data: a\xffb\n\n", [E("a\ufffdb")], True),
    ("truncated_utf8_before_lf", b"data: \xe2\x82\n\n", [E("\ufffd")], True),
    ("invalid_utf8_in_event_and_id", b"event: \xc3\nid: \xfe\ndata: a\n\n", [E("a", "\ufffd", "\ufffd")], True),
    ("utf8_multibyte", "event: ünï\ndata: 日本 🎉\n\n".encode(), [E("日本 🎉", "ünï")], True),
    ("unknown_field_ignored", b"foo: bar\ndata: a\n\n", [E("a")], True),
    ("field_names_case_sensitive", b"Data: x\nEVENT: y\n\n", [], True),
    ("event_default_message", b"data: a\n\n", [E("a")], True),
    ("event_empty_is_message", b"event:\ndata: a\n\n", [E("a")], True),
    ("event_named", b"event: update\ndata: a\n\n", [E("a", "update")], True),
    ("blank_lines_only", b"\n\r\n\r\n", [], True),
    ("empty_stream", b"", [], True),
]
TAIL = b"id: z\ndata: tail\n\n"


@pytest.mark.parametrize(("name", "raw", "expected", "_"), CASES, ids=[c[0] for c in CASES])
def test_case_whole(name: str, raw: bytes, expected: list[SSEEvent], _: bool) -> None:
    assert decode([raw]) == expected


@pytest.mark.parametrize(("name", "raw", "expected", "_"), CASES, ids=[c[0] for c in CASES])
def test_case_byte_at_a_time(name: str, raw: bytes, expected: list[SSEEvent], _: bool) -> None:
    assert decode(bytewise(raw)) == expected


BOUNDARY_CASES = [c[:3] for c in CASES if c[3]]


@pytest.mark.parametrize(("name", "raw", "expected"), BOUNDARY_CASES, ids=[c[0] for c in BOUNDARY_CASES])
def test_case_followed_by_a_frame(name: str, raw: bytes, expected: list[SSEEvent]) -> None:
    """A frame after a case that ends at a frame boundary decodes on its own, in any feeding."""
    want = [*expected, E("tail", id="z")]
    assert decode([raw + TAIL]) == want
    assert decode(bytewise(raw + TAIL)) == want
    assert decode([raw, TAIL]) == want


def test_crlf_split_across_feeds_dispatches_at_the_cr() -> None:
    """A CR ending a chunk ends the line at once; an LF opening the next chunk is swallowed."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\r") == [E("a")]
    assert dec.feed(b"\n") == []
    assert dec.feed(b"") == []
    assert dec.feed(b"\ndata: b\n\n") == [E("b")]  # this LF is a line end again
    assert dec.feed(b"data: c\r") == []
    assert dec.feed(b"") == []  # an empty chunk keeps the pending CR state
    assert dec.feed(b"\n\n") == [E("c")]
    assert dec.close() == []


def test_bom_split_across_feeds() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"\xef") == []
    assert dec.feed(b"") == []
    assert dec.feed(b"\xbb") == []
    assert dec.feed(b"\xbfdata: a\n\n") == [E("a")]


def test_close_discards_pending_bom_prefix() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"\xef\xbb") == []
    assert dec.close() == []


# --- frame bound -------------------------------------------------------------


def frame_of_size(n: int) -> bytes:
    frame = encode_event("x" * (n - len(encode_event(""))))
    assert len(frame) == n
    return frame


@pytest.mark.parametrize("limit", [9, 100, 4096])
def test_frame_of_exactly_the_limit_is_accepted(limit: int) -> None:
    frame = frame_of_size(limit)
    want = [E("x" * (limit - 8))]
    assert decode([frame], limit) == want
    assert decode(bytewise(frame), limit) == want
    assert decode([frame.replace(b"\n", b"\r\n")], limit) == want  # CRLF counts as one byte
    assert decode([frame * 3], limit) == want * 3  # the count restarts after each blank line


def canonical_frame_of_size(n: int, sequence: int = 7) -> bytes:
    """The frame the sidecar writes (``id``, ``event``, one data line: the decoder's regex path), ``n`` bytes."""
    frame = encode_event(
        "x" * (n - len(encode_event("", event="chunk", id=str(sequence)))), event="chunk", id=str(sequence)
    )
    assert len(frame) == n
    return frame


@pytest.mark.parametrize("limit", [30, 100, 4096])
def test_a_run_of_sidecar_frames_is_bounded_at_the_limit_and_one_byte_over(limit: int) -> None:
    """The decoder reads a run of sidecar frames (``id``, ``event``, one data line) without its line loop:
    the same events, and the same bound, as every other frame."""
    page = canonical_frame_of_size(limit, 1) + canonical_frame_of_size(limit, 2)
    data = "x" * (limit - len(encode_event("", event="chunk", id="1")))
    want = [E(data, "chunk", "1"), E(data, "chunk", "2")]
    assert decode([page], limit) == want == reference_decode(page)
    assert decode(bytewise(page), limit) == want
    over = canonical_frame_of_size(limit, 3) + canonical_frame_of_size(limit + 1, 4)
    dec = SSEDecoder(limit)
    with pytest.raises(SSEFrameTooLarge):
        dec.feed(over)
    assert decode([over[:limit]], limit) == [E(data, "chunk", "3")]


def test_a_run_of_sidecar_frames_keeps_the_state_of_the_stream_around_it() -> None:
    """A run read by the regex path sits between frames the line loop reads: the last event id carries
    across both ways, and a frame that is not of the sidecar's shape (a second data line, a retry, a
    comment, an id with NUL) ends the run where it starts."""
    stream = (
        b"retry: 5\ndata: a\n\n"
        + encode_event("b", event="chunk", id="1")
        + b": keep-alive\n"
        + encode_event("c", event="chunk", id="2")
        + b"event: chunk\ndata: d\n\n"
        + b"id: 3\nevent: chunk\ndata: e1\ndata: e2\n\n"
        + b"id: \x00\nevent: chunk\ndata: f\n\n"
        + encode_event("g", event="", id="4")
        + b"event: chunk\ndata: h"
    )
    want = [
        SSEEvent("message", "a", None, 5),
        E("b", "chunk", "1"),
        E("c", "chunk", "2"),
        E("d", "chunk", "2"),
        E("e1\ne2", "chunk", "3"),
        E("f", "chunk", "3"),
        E("g", "message", "4"),
    ]
    assert reference_decode(stream) == want
    assert decode([stream]) == want
    assert decode(bytewise(stream)) == want
    assert decode([stream[:40], stream[40:97], stream[97:]]) == want
    assert decode(frame_by_frame(stream)) == want


def frame_by_frame(raw: bytes) -> list[bytes]:
    """``raw`` cut after every blank line (``\\n\\n``): each piece starts where a frame may, as the sidecar's
    pages arrive (the decoder's regex path is tried at the start of a piece)."""
    pieces = raw.split(b"\n\n")
    return [piece + b"\n\n" for piece in pieces[:-1]] + [pieces[-1]]


@pytest.mark.parametrize("limit", [9, 100, 4096])
def test_frame_one_byte_over_the_limit_raises(limit: int) -> None:
    frame = frame_of_size(limit + 1)
    with pytest.raises(SSEFrameTooLarge) as info:
        decode([frame], limit)
    assert info.value.limit_bytes == limit
    assert isinstance(info.value, ValueError)
    dec = SSEDecoder(limit)
    with pytest.raises(SSEFrameTooLarge):
        for byte in bytewise(frame):
            dec.feed(byte)
    assert byte == b"\n"  # only the final blank line pushed it over


def test_raises_without_any_newline() -> None:
    with pytest.raises(SSEFrameTooLarge):
        SSEDecoder().feed(b"x" * (1048576 + 1))
    dec = SSEDecoder(100)
    for _ in range(100):
        assert dec.feed(b"x") == []
    with pytest.raises(SSEFrameTooLarge):
        dec.feed(b"x")  # the 101st byte of a line that never ends


def test_raises_as_soon_as_the_pending_frame_exceeds() -> None:
    """Many complete lines with no blank line raise on the line that crosses the bound."""
    dec = SSEDecoder(1000)
    sent = 0
    with pytest.raises(SSEFrameTooLarge):
        while True:
            dec.feed(b"data: 0123456789\n")  # 17 bytes
            sent += 17
    assert sent == 17 * (1000 // 17)


def test_stays_failed_after_raising() -> None:
    dec = SSEDecoder(10)
    with pytest.raises(SSEFrameTooLarge):
        dec.feed(b"data: 0123456789\n\n")
    for call in (
        lambda: dec.feed(b""),
        lambda: dec.feed(b"\n\n"),
        lambda: dec.feed(b"data: a\n\n"),
        dec.close,
        dec.close,
    ):
        with pytest.raises(SSEFrameTooLarge):
            call()


def test_keep_alive_comments_between_frames_do_not_accumulate() -> None:
    dec = SSEDecoder(64)
    keep_alive = encode_comment("keep-alive")
    for _ in range(100):
        assert dec.feed(keep_alive) == []
    assert dec.feed(b"data: a\n\n") == [E("a")]


def test_one_comment_line_longer_than_the_limit_raises() -> None:
    with pytest.raises(SSEFrameTooLarge):
        decode([b":" + b"x" * 64 + b"\n"], 64)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10", None])
def test_max_frame_bytes_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError):
        SSEDecoder(bad)  # type: ignore[arg-type]


# --- decoder misc ------------------------------------------------------------


def test_close_is_idempotent_and_feed_after_close_is_an_error() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: b\n") == [E("a")]
    assert dec.close() == []
    assert dec.close() == []
    with pytest.raises(ValueError):
        dec.feed(b"\n")


def test_last_event_id_and_reconnection_time_properties() -> None:
    """retry applies at once even in a frame that dispatches nothing (WHATWG)."""
    dec = SSEDecoder()
    assert (dec.last_event_id, dec.reconnection_ms) == (None, None)
    assert dec.feed(b"id: 3\nretry: 2500\n\n") == []
    assert (dec.last_event_id, dec.reconnection_ms) == ("3", 2500)
    assert dec.feed(b"retry: x\ndata: a\n\n") == [E("a", id="3")]
    assert dec.reconnection_ms == 2500


def test_retry_with_huge_digit_string_does_not_raise() -> None:
    raw = b"retry: " + b"9" * 5000 + b"\ndata: a\n\n"
    [event] = decode([raw])
    assert event.data == "a"
    if getattr(sys, "get_int_max_str_digits", lambda: 0)():
        assert event.retry is None  # past int()'s digit limit the field is ignored


def test_feed_accepts_bytearray() -> None:
    assert decode([bytearray(b"data: a\n\n")]) == [E("a")]  # type: ignore[list-item]


# --- encoder -----------------------------------------------------------------


def test_encode_event_layout() -> None:
    assert encode_event("a") == b"data: a\n\n"
    assert encode_event("a", event="e", id="1") == b"id: 1\nevent: e\ndata: a\n\n"
    assert encode_event("") == b"data: \n\n"
    assert encode_event("ü", event="ë") == "event: ë\ndata: ü\n\n".encode()


def test_encode_splits_every_line_end_into_data_lines() -> None:
    """decode(encode(d)) == d with CRLF and CR normalized to LF (lines are joined with LF)."""
    frame = encode_event("a\r\nb\rc\nd\n")
    assert frame == b"data: a\ndata: b\ndata: c\ndata: d\ndata: \n\n"
    assert decode([frame]) == [E("a\nb\nc\nd\n")]


def test_data_cannot_inject_fields_or_frames() -> None:
    data = "x\n\nid: evil\nevent: boom\r\n\r\ndata: y"
    assert decode([encode_event(data, id="1")]) == [E(data.replace("\r\n", "\n"), id="1")]


def test_unicode_separators_stay_inside_one_data_line() -> None:
    data = "a\u2028b\u2029c\x85d\x0be\x0cf"
    assert encode_event(data) == f"data: {data}\n\n".encode()
    assert decode([encode_event(data)]) == [E(data)]


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "\n"])
def test_event_with_line_end_raises(bad: str) -> None:
    with pytest.raises(ValueError):
        encode_event("x", event=bad)


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\r\nb", "a\x00b"])
def test_id_with_line_end_or_nul_raises(bad: str) -> None:
    with pytest.raises(ValueError):
        encode_event("x", id=bad)


def test_encode_retry_sets_the_reconnection_time_and_dispatches_nothing() -> None:
    decoder = SSEDecoder()
    assert encode_retry(3000) == b"retry: 3000\n\n"
    assert decoder.feed(encode_retry(3000)) == [] and decoder.reconnection_ms == 3000
    assert decoder.feed(encode_event("x", event="e")) == [SSEEvent("e", "x", None, None)]
    assert encode_retry(0) == b"retry: 0\n\n"
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            encode_retry(bad)  # type: ignore[arg-type]


def test_encode_comment() -> None:
    assert encode_comment("keep-alive") == b": keep-alive\n"
    assert encode_comment("a\nb\r\nc\rd") == b": a\n: b\n: c\n: d\n"
    assert encode_comment("") == b":\n"
    assert encode_comment("a\n") == b": a\n:\n"
    stream = encode_comment("x\ndata: no") + b"data: a\n" + encode_comment("mid\nframe") + b"\n"
    assert decode([stream]) == [E("a")]


# --- properties --------------------------------------------------------------

SEPARATORS = "\r\n\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e\ufeff\x00: "
any_char = st.characters(blacklist_categories=["Cs"])
data_text = st.text(st.one_of(any_char, st.sampled_from(SEPARATORS)))
event_name = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n"), min_size=1)
event_id = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n\x00"))
frames = st.lists(st.tuples(data_text, st.none() | event_name, st.none() | event_id, st.none() | data_text), max_size=8)
PROP = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def split_at(data: bytes, points: list[int]) -> list[bytes]:
    cuts = sorted({p % (len(data) + 1) for p in points})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=False)]


@PROP
@given(frames, st.booleans(), st.lists(st.integers(min_value=0)), st.data())
def test_round_trip_in_any_chunking(frames_, bom: bool, points: list[int], draw: st.DataObject) -> None:
    """Encoded frames (with comments between them) decode back in any chunking."""
    stream, want, last_id = BOM if bom else b"", [], None
    for data, event, id_, comment in frames_:
        if comment is not None:
            stream += encode_comment(comment)
        stream += encode_event(data, event=event, id=id_)
        last_id = id_ if id_ is not None else last_id
        want.append(E(re.sub(r"\r\n?", "\n", data), event or "message", last_id))
    assert decode([stream]) == want
    assert decode(split_at(stream, points)) == want
    assert decode(bytewise(stream)) == want


def reference_decode(raw: bytes) -> list[SSEEvent]:
    """Naive WHATWG event-stream interpretation on a complete stream (then EOF)."""
    text = (raw[3:] if raw.startswith(BOM) else raw).decode("utf-8", "replace")
    *lines, _unterminated = re.split(r"\r\n|\r|\n", text)
    events, data, event, last_id, retry = [], "", "", None, None
    for line in lines:
        if line == "":
            if data != "":
                events.append(SSEEvent(event or "message", data[:-1] if data.endswith("\n") else data, last_id, retry))
            data, event, retry = "", "", None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event = value
        elif name == "id" and "\x00" not in value:
            last_id = value
        elif name == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return events


TOKENS = [b"data:", b"data: ", b"id:", b"id: ", b"event:", b"retry:", b"\r", b"\n", b"\r\n", b":", b" ", b"\x00"]
TOKENS += [BOM, b"\xef", b"\xff", b"\xe2\x80\xa8", b"1", b"x", "５".encode()]
TOKENS += [b"event: ", b"\n\n", b"id: 1\nevent: e\ndata: x\n\n", b"event: \ndata: \n\n"]  # the decoder's fast frames
fuzz_bytes = st.lists(st.binary(max_size=6) | st.sampled_from(TOKENS), max_size=40).map(b"".join)


@PROP
@given(fuzz_bytes, st.lists(st.integers(min_value=0)))
def test_arbitrary_bytes_match_the_reference_in_any_chunking(raw: bytes, points: list[int]) -> None:
    want = reference_decode(raw)
    assert decode([raw]) == want
    assert decode(split_at(raw, points)) == want
    assert decode(bytewise(raw)) == want
    assert decode(frame_by_frame(raw)) == want


def bounded(chunks: list[bytes], limit: int) -> tuple[list[SSEEvent], bool]:
    dec, events = SSEDecoder(limit), []
    try:
        for chunk in chunks:
            events += dec.feed(chunk)
        events += dec.close()
    except SSEFrameTooLarge:
        return events, True
    return events, False


@PROP
@given(fuzz_bytes, st.lists(st.integers(min_value=0)), st.integers(min_value=1, max_value=40))
def test_bound_is_chunking_invariant_and_only_raises_too_large(raw: bytes, points: list[int], limit: int) -> None:
    """Any bytes, any chunking: only SSEFrameTooLarge escapes; whether it raises does not
    depend on chunking; events before the failure are a prefix of the unbounded result."""
    unbounded = decode([raw])
    whole, whole_raised = bounded([raw], limit)
    for chunks in (split_at(raw, points), bytewise(raw), frame_by_frame(raw)):
        events, raised = bounded(chunks, limit)
        assert raised == whole_raised
        assert events == (unbounded[: len(events)] if raised else whole)
    if not whole_raised:
        assert whole == unbounded


# --- the page encoder (one template per page, both processes) ----------------------------------------

_FRAME_VALUES = st.tuples(
    st.integers(min_value=0, max_value=2**63),
    st.text(st.characters(blacklist_characters="\r\n"), max_size=12),  # encode_event refuses CR/LF in a name
    st.text(max_size=40),  # any data: a line end sends the page to the frame-by-frame path
)


@PROP
@given(st.lists(_FRAME_VALUES, max_size=8), st.sampled_from([b"", b"sse_"]))
def test_a_page_equals_its_frames_encoded_one_by_one(frames, prefix):
    """encode_page of one page_template equals the concatenated encode_event frames, fast path or not."""
    template = page_template(b"%s", id_prefix=prefix)
    values = [(number, event.encode(), data.encode()) for number, event, data in frames]

    def one(index: int) -> bytes:
        number, event, data = frames[index]
        return encode_event(data, event=event, id=f"{prefix.decode()}{number}")

    assert encode_page(template, values, one) == b"".join(one(i) for i in range(len(frames)))


def test_a_page_template_keeps_a_literal_percent_of_its_prefix():
    assert encode_page(page_template(b"%s", id_prefix=b"a%d"), [(1, b"e", b"x")], lambda i: b"") == encode_event(
        "x", event="e", id="a%d1"
    )
