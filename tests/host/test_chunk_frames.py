"""The host's stored-chunk SSE frames (``host/http/routes.py`` ``ChunkFrames``): the byte template equals encoding
the decoded chunk inside an ``Envelope`` (replay speed without a second dialect)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.contracts.aip import AIP_VERSION, Body, Envelope, JsonPart, StreamChunk, StreamChunkKind, TextPart
from aip_crewai.host.http import routes as routes_actions
from aip_crewai.host.http.routes import ChunkFrames
from aip_crewai.host.store.store import ChunkRecord
from aip_crewai.sse import SSEDecoder, encode_event

FIXED = "0123456789abcdef01234567"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
parts = st.none() | st.builds(TextPart, text=st.text(max_size=40)) | st.builds(JsonPart, data=json_values)
chunks = st.builds(
    StreamChunk,
    action_id=st.from_regex(r"act_[A-Za-z0-9_-]{1,20}", fullmatch=True),
    sequence=st.integers(0, 10**6),
    kind=st.sampled_from(["data", "tool", "progress", "done", "error"]),
    data=json_values,
    part=parts,
)


@pytest.fixture(autouse=True)
def fixed_message_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routes_actions.secrets, "token_hex", lambda n: FIXED * (n // 12))


@given(chunk=chunks, sent_at=st.sampled_from(["2026-12-01T06:00:00.000Z", "2026-12-01T06:00:00.123Z"]))
def test_a_frame_equals_the_encoded_envelope_of_the_decoded_chunk(chunk: StreamChunk, sent_at: str) -> None:
    stored = msgspec.json.encode(chunk).decode()
    frame = ChunkFrames(chunk.action_id, sent_at).frame(ChunkRecord(chunk.sequence, stored))
    reference = Envelope(
        aip_version=AIP_VERSION,
        message_type="aip.core.v1.stream_chunk",
        message_id="msg_" + FIXED,
        sent_at=sent_at,
        body=Body(stream_chunk=chunk),
        correlation_id=chunk.action_id,
    )
    name = "done" if chunk.kind == "done" else "chunk"
    assert frame == encode_event(msgspec.json.encode(reference).decode(), event=name, id=f"sse_{1 + chunk.sequence}")


def test_a_stored_row_with_a_line_end_still_makes_one_well_formed_frame() -> None:
    stored = '{"action_id":"act_1",\n"sequence":4,"kind":"data","data":{"content":"a\\nb"}}'
    frame = ChunkFrames("act_1", "2026-12-01T06:00:00.000Z").frame(ChunkRecord(4, stored))
    events = SSEDecoder().feed(frame)
    assert [(e.id, e.event) for e in events] == [("sse_5", "chunk")]
    assert json.loads(events[0].data)["body"]["stream_chunk"] == json.loads(stored)


def test_a_page_is_its_frames_in_order_and_fresh_message_ids_are_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routes_actions.secrets, "token_hex", lambda n: ("a" * 24 + "b" * 24)[: 2 * n])
    kinds: list[StreamChunkKind] = ["data", "done"]
    rows = [
        ChunkRecord(i, msgspec.json.encode(StreamChunk(action_id="act_1", sequence=i, kind=k)).decode())
        for i, k in enumerate(kinds)
    ]
    events = SSEDecoder().feed(ChunkFrames("act_1", "2026-12-01T06:00:00.000Z").page(rows))
    assert [(e.id, e.event) for e in events] == [("sse_1", "chunk"), ("sse_2", "done")]
    assert [json.loads(e.data)["message_id"] for e in events] == ["msg_" + "a" * 24, "msg_" + "b" * 24]


@given(st.lists(chunks, min_size=1, max_size=6), st.lists(st.integers(0, 5), max_size=2))
def test_a_page_equals_its_frames_one_by_one_with_raw_line_ends_anywhere(page_chunks, spoiled) -> None:
    """The page's one-template path and its frame-by-frame fallback (a stored row with a line end) agree with
    the frame of each chunk alone, in order."""
    rows = [ChunkRecord(i, msgspec.json.encode(chunk).decode()) for i, chunk in enumerate(page_chunks)]
    for index in spoiled:
        if index < len(rows):
            rows[index] = ChunkRecord(index, rows[index].chunk_json.replace(",", ",\n", 1))
    frames = ChunkFrames("act_%1", "2026-12-01T06:00:00.000Z")
    assert frames.page(rows) == b"".join(frames.frame(row) for row in rows)
