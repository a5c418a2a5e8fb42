"""The normalizer turns sidecar SSE into AIP chunks and rejects every malformed stream (ARCHITECTURE.md §8)."""

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.errors import ConnectorInvalidStream, ConnectorResponseTooLarge
from aip_crewai.host.actions.normalize import StreamNormalizer, result_from_terminal
from aip_crewai.sse import encode_event

RUN = ops.get("run")


def frame(event, sequence, data, *, with_id=True):
    body = json.dumps({"event": event, "sequence": sequence, "data": data}, separators=(",", ":"))
    return encode_event(body, event=event, id=str(sequence) if with_id else None)


def good_stream():
    return b"".join(
        [
            frame("started", 0, {"status": "running", "operation": "run"}),
            frame("chunk", 1, {"content": "Hel", "channel": "llm"}),
            frame("chunk", 2, {"content": "search()", "channel": "tools"}),
            frame("chunk", 3, {"content": "x", "channel": "other"}),
            frame("completed", 4, {"raw": "Hello"}),
        ]
    )


def normalize(body, chunk_size=None, **kwargs):
    n = StreamNormalizer("act_1", RUN, **kwargs)
    chunks = []
    step = chunk_size or max(1, len(body))
    for i in range(0, len(body), step):
        chunks.extend(n.feed(body[i : i + step]))
    return chunks, n.close()


def test_kinds_parts_and_sequences():
    chunks, terminal = normalize(good_stream())
    assert [c.kind for c in chunks] == ["progress", "data", "tool", "progress", "done"]
    assert [c.sequence for c in chunks] == [0, 1, 2, 3, 4]
    assert chunks[1].part.text == "Hel"
    assert terminal.event == "completed"
    result = result_from_terminal("act_1", RUN, terminal)
    assert result.status == "completed" and result.output == {"raw": "Hello"}


def test_peer_stream_without_ids_and_crlf_is_accepted():
    body = frame("started", 0, {}, with_id=False).replace(b"\n", b"\r\n") + frame("completed", 1, {}, with_id=False)
    chunks, _ = normalize(body, chunk_size=1)
    assert [c.kind for c in chunks] == ["progress", "done"]


@given(st.integers(min_value=1, max_value=64))
def test_any_chunking_gives_the_same_chunks(size):
    assert normalize(good_stream(), chunk_size=size)[0] == normalize(good_stream())[0]


def test_failed_event_maps_to_execution_failed_with_details():
    body = frame("started", 0, {}) + frame(
        "failed",
        1,
        {"status": "failed", "error_type": "RuntimeError", "message": "crew failed", "uncertain_outcome": True},
    )
    chunks, terminal = normalize(body)
    assert chunks[-1].kind == "error"
    result = result_from_terminal("act_1", RUN, terminal)
    assert result.status == "failed"
    assert result.error.code == "connector.crewai.execution_failed"
    assert result.error.details["uncertain_outcome"] is True
    assert result.error.details["operation"] == "run"
    assert result.error.details["event"]["error_type"] == "RuntimeError"
    assert result.error.message == "the crew failed (RuntimeError): crew failed"
    assert result.error.retryable is False


def test_cancelled_maps_to_cancelled():
    _, terminal = normalize(frame("started", 0, {}) + frame("cancelled", 1, {"status": "cancelled"}))
    result = result_from_terminal("a", RUN, terminal)
    assert result.status == "cancelled" and result.output["remote_stop_confirmed"] is True


def test_resume_from_cursor():
    body = frame("chunk", 7, {"content": "a", "channel": "llm"}) + frame("completed", 8, {})
    chunks, _ = normalize(body, start_sequence=7, first_chunk_sequence=3)
    assert [c.sequence for c in chunks] == [3, 4]


MALFORMED = {
    "gap": frame("started", 0, {}) + frame("completed", 2, {}),
    "repeat": frame("started", 0, {}) + frame("started", 0, {}) + frame("completed", 1, {}),
    "reorder": frame("chunk", 1, {}) + frame("started", 0, {}),
    "starts_late": frame("started", 1, {}),
    "no_terminal": frame("started", 0, {}) + frame("chunk", 1, {"content": "x", "channel": "llm"}),
    "empty": b"",
    "after_terminal": frame("completed", 0, {}) + frame("chunk", 1, {}),
    "not_json": encode_event("not json", event="chunk"),
    "wrong_shape": encode_event(json.dumps({"event": "chunk"}), event="chunk"),
    "name_mismatch": encode_event(json.dumps({"event": "completed", "sequence": 0, "data": {}}), event="chunk"),
    "unterminated_frame": frame("started", 0, {}) + b'data: {"event":"completed","sequence":1,"data":{}}',
    "u2028_is_not_a_line_end": frame("started", 0, {}) + 'data: {"event":"completed",\u2028"sequence":1}\n\n'.encode(),
    "invalid_utf8": frame("started", 0, {}) + b'data: {"event":"completed","sequence":1,"data":{"x":"\xff"}\n\n',
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("chunk_size", [None, 1])
def test_malformed_streams_are_invalid_stream(name, chunk_size):
    with pytest.raises(ConnectorInvalidStream) as info:
        normalize(MALFORMED[name], chunk_size=chunk_size)
    assert info.value.code == "connector.crewai.invalid_stream"
    assert info.value.details["operation"] == "run"
    assert info.value.details["uncertain_outcome"] is True


def test_bom_at_start_is_accepted():
    chunks, _ = normalize(b"\xef\xbb\xbf" + good_stream(), chunk_size=1)
    assert len(chunks) == 5


def test_oversize_frame_edge():
    n = StreamNormalizer("a", RUN, max_frame_bytes=64)
    with pytest.raises(ConnectorInvalidStream):
        n.feed(b"data: " + b"x" * 100)


def test_event_count_limit_and_limit_plus_one():
    body = b"".join(frame("chunk", i, {}) for i in range(3)) + frame("completed", 3, {})
    normalize(body, max_events=4)
    with pytest.raises(ConnectorInvalidStream):
        normalize(body, max_events=3)


def test_response_bound_limit_and_limit_plus_one():
    body = good_stream()
    normalize(body, max_response_bytes=len(body))
    with pytest.raises(ConnectorResponseTooLarge) as info:
        normalize(body, max_response_bytes=len(body) - 1)
    assert info.value.code == "connector.crewai.response_too_large"


def test_read_only_operation_errors_are_not_uncertain():
    n = StreamNormalizer("a", ops.get("events"))
    with pytest.raises(ConnectorInvalidStream) as info:
        n.close()
    assert info.value.details["uncertain_outcome"] is False


@pytest.mark.parametrize(
    "data,kind",
    [
        ({"content": "a", "chunk_type": "text"}, "data"),
        ({"content": "a", "chunk_type": "TEXT"}, "data"),
        ({"content": "", "chunk_type": "tool_call", "tool_call": {"tool_name": "search"}}, "tool"),
        ({"content": "", "tool_call": {"tool_name": "search"}}, "tool"),
        ({"content": "a", "chunk_type": "other"}, "progress"),
        ({"content": "a", "channel": "llm", "chunk_type": "tool_call"}, "data"),  # ours: channel decides
    ],
)
def test_reference_sidecar_chunks_map_by_chunk_type_and_tool_call(data, kind):
    """Issue 17 item 8: a reference sidecar's chunks carry chunk_type/tool_call instead of channel."""
    from aip_crewai.contracts.sidecar import JobEvent
    from aip_crewai.host.actions.normalize import chunk_kind

    assert chunk_kind(JobEvent(event="chunk", sequence=1, data=data)) == kind


def _repeating_stream(bad_at: int) -> bytes:
    """Started, then data chunks 1..6, then completed at 7, with event ``bad_at`` sent with a repeated sequence."""
    events = [frame("started", 0, {"status": "running", "operation": "run"})]
    events += [frame("chunk", s, {"content": f"c{s}", "channel": "llm"}) for s in range(1, 7)]
    events.append(frame("completed", 7, {"raw": "done"}))
    events[bad_at] = frame("chunk", bad_at - 1, {"content": "again", "channel": "llm"})
    return b"".join(events)


@given(st.integers(min_value=1, max_value=6), st.integers(min_value=1, max_value=2048))
def test_an_invalid_event_keeps_every_chunk_before_it_and_fails_on_the_next_call(bad_at, size):
    """Every valid event before an invalid one becomes a chunk, however the body is split (an invalid event
    met after valid ones of the same piece fails the next call), and `expected` names the invalid one."""
    body = _repeating_stream(bad_at)
    n = StreamNormalizer("act_1", RUN)
    delivered = []
    with pytest.raises(ConnectorInvalidStream):
        for i in range(0, len(body), size):
            delivered.extend(n.feed(body[i : i + size]))
        n.close()
    assert [c.sequence for c in delivered] == list(range(bad_at))
    assert n.expected == bad_at
    resumed = n.resumed()
    assert resumed.expected == bad_at and resumed.next_chunk == bad_at


def test_a_deferred_failure_is_raised_by_close_and_stays():
    n = StreamNormalizer("act_1", RUN)
    chunks = n.feed(_repeating_stream(3))
    assert [c.sequence for c in chunks] == [0, 1, 2]
    for call in (n.close, lambda: n.feed(b"")):
        with pytest.raises(ConnectorInvalidStream, match="sequence 2 where 3 was expected"):
            call()


_DEEP_DECODES = pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="msgspec decodes 1,500 levels on Python 3.12+: a valid frame there"
)


@pytest.mark.parametrize("depth", [pytest.param(1_500, marks=_DEEP_DECODES), 100_000])
def test_a_frame_nested_past_the_decoders_bound_is_an_invalid_stream_not_an_internal_error(depth):
    """Regression (second review): a sidecar frame nested 1,500 deep failed the action with
    ``internal.error``; it is the stream error code, as any other undecodable frame."""
    deep = b'{"event":"chunk","sequence":1,"data":{"x":' + b"[" * depth + b"]" * depth + b"}}"
    body = frame("started", 0, {"status": "running"}) + b"event: chunk\nid: 1\ndata: " + deep + b"\n\n"
    n = StreamNormalizer("act_1", RUN, max_frame_bytes=4 * depth + 1024)
    assert [c.sequence for c in n.feed(body)] == [0]  # the valid event before it is delivered first
    with pytest.raises(ConnectorInvalidStream) as info:
        n.close()
    assert info.value.code == "connector.crewai.invalid_stream" and "nests too deeply" in info.value.message
