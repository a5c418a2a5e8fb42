"""The positions of an action's tenant stream (``host/stream_positions.py``; docs/reference/http-api.md
"Stream positions"): the ids parsed at their edges, the ending frames' layout, and, over random streams
and split points, that a resume after any frame the tenant saw yields the rest of the stream exactly
once: the continuation itself while nothing changed, and every chunk the tenant lacks, then the final
result, once a provisional result was corrected with backfilled chunks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.host.store.records import InvalidCursor
from aip_crewai.host.stream_positions import (
    MAX_DIGITS,
    Position,
    delivered,
    ending,
    ending_held,
    parse,
    sequence_held,
)


@pytest.mark.parametrize(
    "value,position",
    [
        ("sse_0", Position(0)),
        ("sse_7", Position(7)),
        ("7", Position(7)),
        ("sse_" + "9" * MAX_DIGITS, Position(10**MAX_DIGITS - 1)),  # the bound
        ("sse_3.1", Position(3, 1)),
        ("sse_3.2", Position(3, 2)),
        ("0.2", Position(0, 2)),
    ],
)
def test_a_position_parses_and_its_id_round_trips(value, position):
    assert parse(value) == position
    assert parse(position.id) == position


@pytest.mark.parametrize(
    "value",
    [
        "sse_" + "9" * (MAX_DIGITS + 1),  # the bound + 1
        "",
        "sse_",
        "sse_x",
        "sse_-1",
        "-1",
        "sse_+1",
        "sse_1_0",
        "sse_\u00b2",  # a digit to str.isdigit, not to int()
        "sse_\u0663",  # an Arabic-Indic three
        "sse_3.",
        "sse_.1",
        "sse_3.0",
        "sse_3.3",  # past the two ending frames
        "sse_3.10",
        "sse_3.1.1",
        "apv_3",
        " sse_3",
    ],
)
def test_anything_else_is_an_invalid_cursor(value):
    with pytest.raises(InvalidCursor):
        parse(value)


def test_ending_frames_follow_the_chunks_of_a_final_result_and_sub_positions_of_a_provisional_one():
    assert ending(3, error=True, final=True) == (Position(4), Position(5))
    assert ending(3, error=False, final=True) == (Position(4),)
    assert ending(3, error=True, final=False) == (Position(3, 1), Position(3, 2))
    assert ending(0, error=False, final=False) == (Position(0, 1),)
    assert [p.id for p in ending(3, error=True, final=False)] == ["sse_3.1", "sse_3.2"]


def test_a_sub_position_of_a_result_no_longer_current_holds_only_its_chunks():
    at = Position(3, 2)  # the provisional result's frame after 3 chunks
    assert sequence_held(at) == 2
    assert ending_held(at, 3, error=True, final=False) == 2  # still the result: both frames held
    assert ending_held(at, 9, error=False, final=True) == 0  # corrected with 6 more chunks
    assert ending_held(at, 3, error=True, final=True) == 0  # made final with no chunk more
    assert ending_held(at, 2, error=True, final=True) == 2  # names more chunks than stored: past the end
    assert not delivered(at, 9, error=False, final=True)
    assert delivered(at, 3, error=True, final=False)


def test_a_plain_position_past_a_provisional_results_chunks_counts_at_the_final_layout():
    """An id a host sent before sub-positions existed (``sse_<C+1>``, ``sse_<C+2>``) keeps its meaning."""
    assert ending_held(Position(4), 3, error=True, final=False) == 1
    assert ending_held(Position(5), 3, error=True, final=False) == 2


# --- resumes over random streams and split points ---------------------------------------------------------


def frames_of(chunk_count: int, *, error: bool, final: bool) -> list[Position]:
    """Every frame of a stream from its start: the ack, the chunks, the ending frames."""
    return [Position(0), *(Position(1 + s) for s in range(chunk_count)), *ending(chunk_count, error=error, final=final)]


def served(after: Position, chunk_count: int, *, error: bool, final: bool) -> list[Position]:
    """What the host sends a tenant resuming after ``after`` on an ended action (as ``routes.follow`` does)."""
    chunks = [Position(1 + s) for s in range(sequence_held(after) + 1, chunk_count)]
    frames = ending(chunk_count, error=error, final=final)
    return [*chunks, *frames[ending_held(after, chunk_count, error=error, final=final) :]]


def chunks_in(frames: list[Position], chunk_count: int) -> list[int]:
    """The chunk sequences among ``frames`` (plain positions 1..chunk_count)."""
    return [p.n - 1 for p in frames if p.sub == 0 and 1 <= p.n <= chunk_count]


streams = st.integers(0, 40).flatmap(
    lambda stored: st.tuples(
        st.just(stored),
        st.integers(stored, stored + 40),  # chunk count after the correction: never fewer
        st.booleans(),  # the provisional result carries an error
        st.booleans(),  # the corrected result carries one
        st.integers(1, stored + 3),  # frames of the first stream the tenant saw
    )
)


@given(streams)
def test_a_resume_after_any_frame_of_a_provisional_stream_misses_and_repeats_nothing(stream):
    stored, corrected, provisional_error, final_error, cut = stream
    first = frames_of(stored, error=provisional_error, final=False)
    seen = first[: min(cut, len(first))]
    # nothing changed yet: the resume is the rest of the same stream
    rest = served(seen[-1], stored, error=provisional_error, final=False)
    assert seen + rest == first
    assert delivered(seen[-1], stored, error=provisional_error, final=False) == (rest == [])
    # corrected (backfilled chunks, a final result): every chunk once, in order, then the final result
    resumed = served(seen[-1], corrected, error=final_error, final=True)
    assert chunks_in(seen, stored) + chunks_in(resumed, corrected) == list(range(corrected))
    assert resumed[-1] == ending(corrected, error=final_error, final=True)[-1]
    assert seen + resumed == sorted(set(seen + resumed))  # ids grow, none named twice
    assert not delivered(seen[-1], corrected, error=final_error, final=True)


@given(st.integers(0, 60), st.booleans(), st.data())
def test_a_resume_of_a_final_stream_is_its_rest_as_before(chunk_count, error, data):
    """Chunk ids and a final result's ids: the resume after the k-th frame is the frames after it, and
    ``204`` (delivered) exactly after the last one."""
    whole = frames_of(chunk_count, error=error, final=True)
    assert [p.id for p in whole] == [f"sse_{n}" for n in range(len(whole))]  # the ids tenants rely on
    k = data.draw(st.integers(1, len(whole)))
    after = whole[k - 1]
    assert served(after, chunk_count, error=error, final=True) == whole[k:]
    assert delivered(after, chunk_count, error=error, final=True) == (k == len(whole))
