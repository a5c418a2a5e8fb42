"""The sidecar's direct SSE frame equals the reference encoder's, and pages keep every event once (issue 22)."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.sidecar.app import sse_frame
from aip_crewai.sidecar.jobs import EventRow
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
        (str(n), "chunk", msgspec.json.decode(msgspec.json.encode(d))) for n, d in enumerate(datas)]
