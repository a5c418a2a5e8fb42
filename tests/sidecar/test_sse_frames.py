"""The sidecar's direct SSE frame equals the reference encoder's, and pages keep every event once."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from aip_crewai.sidecar.http.app import sse_frame, sse_frames
from aip_crewai.sidecar.jobs.model import EventRow
from aip_crewai.sse import SSEDecoder, encode_event

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=12,
)
events = st.sampled_from(["started", "chunk", "completed", "failed", "cancelled"]) | st.text(max_size=40)


@given(event=events, sequence=st.integers(min_value=0, max_value=2**53), data=json_values)
def test_a_frame_equals_encode_event_of_the_compact_json(event: str, sequence: int, data) -> None:
    row = EventRow(sequence, event, msgspec.json.encode(data))
    try:
        expected = encode_event(row.to_json().decode("utf-8"), event=event, id=str(sequence))
    except (ValueError, UnicodeEncodeError) as exc:  # an event name SSE cannot carry: refused alike
        try:
            sse_frame(row)
        except type(exc):
            return
        raise AssertionError("sse_frame accepted what encode_event refuses") from exc
    assert sse_frame(row) == expected


@given(st.lists(json_values, min_size=1, max_size=20))
def test_a_page_of_frames_decodes_to_its_events_in_order(datas) -> None:
    rows = [EventRow(n, "chunk", msgspec.json.encode(d)) for n, d in enumerate(datas)]
    decoder = SSEDecoder()
    decoded = decoder.feed(b"".join(map(sse_frame, rows)))
    assert [(e.id, e.event, msgspec.json.decode(e.data)["data"]) for e in decoded] == [
        (str(n), "chunk", msgspec.json.decode(msgspec.json.encode(d))) for n, d in enumerate(datas)
    ]


@given(st.lists(st.tuples(events, st.text(max_size=30)), max_size=12))
def test_a_page_equals_the_frames_of_its_rows_encoded_one_by_one(items) -> None:
    """Raw data bytes too (a CR or LF that compact JSON never holds, from an imported journal): those rows
    take encode_event's path, the others the direct one, and the page is their frames in order."""
    rows = [EventRow(n, event, text.encode("utf-8")) for n, (event, text) in enumerate(items)]
    try:
        expected = [encode_event(row.to_json().decode("utf-8"), event=row.event, id=str(row.sequence)) for row in rows]
    except (ValueError, UnicodeEncodeError):
        assume(False)
    assert sse_frames(rows) == b"".join(expected)  # names first seen here: frame by frame
    assert sse_frames(rows) == b"".join(expected)  # names known now: the whole page at once, or its fallback


@pytest.mark.parametrize("event", ["chunk", "x" * 32, "Chunk", "x" * 33, "a-b"])
def test_a_frame_of_an_event_name_at_the_direct_paths_edge_is_the_encoders(event: str) -> None:
    row = EventRow(7, event, b'{"n":1}')
    assert sse_frame(row) == encode_event(row.to_json().decode("utf-8"), event=event, id="7")


def test_a_page_with_a_raw_line_end_in_one_event_falls_back_for_that_event_only() -> None:
    rows = [
        EventRow(0, "chunk", b'{"n":0}'),
        EventRow(1, "chunk", b'"a\nb"'),
        EventRow(2, "chunk", b'"c\rd"'),
        EventRow(3, "completed", b"{}"),
    ]
    sse_frames(rows[:1] + rows[3:])  # both names known: the next call takes the page path first
    page = sse_frames(rows)
    assert page == b"".join(encode_event(r.to_json().decode(), event=r.event, id=str(r.sequence)) for r in rows)
    assert page.count(b"\n\n") == 4 and b'data: {"event":"chunk","sequence":1,"data":"a\ndata: b"}' in page
