"""A live follower takes the chunks this host's dispatch has just committed from memory (``CommittedTail``,
ARCHITECTURE.md §10 "Live followers"): only rows the store inserted in full are kept, never a gap, within
their bounds; and a follower served from the tail delivers what the store holds, in order, without reading it.
"""

import asyncio
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kits.hostapp import calls_of, open_action_service
from kits.poll import until_async

from aip_crewai.contracts import operations as ops
from aip_crewai.contracts.aip import StreamChunk
from aip_crewai.host.actions.chunk_sink import ChunkSink
from aip_crewai.host.actions.dispatch import Job
from aip_crewai.host.actions.live import CommittedTail, LiveAction, follow_page
from aip_crewai.host.http.routes import follow
from aip_crewai.host.store.records import ChunkRecord

pytestmark = pytest.mark.timeout(60)


def rows(first, last, text="c"):
    return [ChunkRecord(s, f"{text}{s}") for s in range(first, last + 1)]


def test_kept_batches_answer_a_follower_from_the_chunk_after_its_position():
    tail = CommittedTail()
    tail.keep(rows(0, 2))
    tail.keep(rows(3, 4))
    assert tail.after(-1, 10) == rows(0, 4)
    assert tail.after(1, 10) == rows(2, 4)
    assert tail.after(1, 2) == rows(2, 3)  # the follower's page bound
    assert tail.after(4, 10) == []  # nothing newer: the follower reads the store
    assert tail.after(7, 10) == []


def test_a_follower_behind_the_tail_reads_the_store():
    tail = CommittedTail()
    tail.keep(rows(5, 6))
    assert tail.after(3, 10) == []  # the chunk of sequence 4 is not kept
    assert tail.after(4, 10) == rows(5, 6)


def test_a_batch_that_does_not_continue_the_tail_replaces_it():
    tail = CommittedTail()
    tail.keep(rows(0, 2))
    tail.keep(rows(5, 6))  # a gap: sequences 3 and 4 are elsewhere (another writer's backfill)
    assert len(tail) == 2 and tail.after(1, 10) == [] and tail.after(4, 10) == rows(5, 6)
    tail.keep(rows(5, 5, text="other"))  # a repeat
    assert tail.after(4, 10) == rows(5, 5, text="other")


def test_a_batch_with_a_gap_inside_keeps_nothing():
    tail = CommittedTail()
    tail.keep(rows(0, 2))
    tail.keep([ChunkRecord(3, "c3"), ChunkRecord(5, "c5")])
    assert len(tail) == 0 and tail.after(-1, 10) == []


@pytest.mark.parametrize(("kept", "expected"), [(4, 4), (5, 4)])
def test_the_tail_keeps_at_most_max_chunks_dropping_the_oldest(kept, expected):
    tail = CommittedTail(max_chunks=4)
    for sequence in range(kept):
        tail.keep(rows(sequence, sequence))
    assert len(tail) == expected
    assert tail.after(kept - 1 - expected, 10) == rows(kept - expected, kept - 1)


@pytest.mark.parametrize(("max_chars", "expected"), [(8, 4), (7, 3)])
def test_the_tail_keeps_at_most_max_chars_of_chunk_text_dropping_the_oldest(max_chars, expected):
    tail = CommittedTail(max_chars=max_chars)
    tail.keep([ChunkRecord(s, "xx") for s in range(4)])  # 8 characters in all
    assert len(tail) == expected
    assert tail.after(3 - expected, 10) == [ChunkRecord(s, "xx") for s in range(4 - expected, 4)]


def test_a_chunk_larger_than_the_bound_is_not_kept():
    tail = CommittedTail(max_chars=8)
    tail.keep(rows(0, 0))
    tail.keep([ChunkRecord(1, "x" * 9)])
    assert len(tail) == 0 and tail.after(0, 10) == []


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("keep"), st.integers(0, 40), st.integers(1, 6)),
            st.tuples(st.just("forget"), st.just(0), st.just(0)),
        ),
        max_size=30,
    ),
    st.integers(1, 8),
    st.integers(4, 60),
)
def test_whatever_it_kept_the_tail_answers_only_stored_rows_in_order(ops_, max_chunks, max_chars):
    """Model: the store's rows. A batch is kept only when every row was new (inserted in full); a batch
    holding a stored sequence is what the sink reports as a partial insert (forget). Whatever happened,
    a follower at any position gets either nothing or the stored rows right after it, consecutive."""
    stored: dict[int, str] = {}
    tail = CommittedTail(max_chunks=max_chunks, max_chars=max_chars)
    for op, first, count in ops_:
        if op == "forget":
            tail.forget()
            continue
        batch = [ChunkRecord(s, f"t{s}-{len(stored)}") for s in range(first, first + count)]
        if any(r.sequence in stored for r in batch):
            for r in batch:
                stored.setdefault(r.sequence, r.chunk_json)
            tail.forget()
        else:
            stored.update((r.sequence, r.chunk_json) for r in batch)
            tail.keep(batch)
        assert len(tail) <= max_chunks
        for position in range(-1, 48):
            answer = tail.after(position, 5)
            assert len(answer) <= 5
            assert [r.sequence for r in answer] == list(range(position + 1, position + 1 + len(answer)))
            assert all(stored[r.sequence] == r.chunk_json for r in answer)


# --- the sink keeps what it committed; a follower takes it without a store read ---------------------------


@pytest.fixture
async def env(tmp_path):
    service, _, http, _ = await open_action_service(tmp_path, {"acme": {"support": frozenset(ops.OPERATION_NAMES)}})
    yield service
    await http.aclose()
    await service.store.close()


def chunk(sequence):
    return StreamChunk(action_id="s1", sequence=sequence, kind="data", data={"content": str(sequence)})


async def live_sink(service):
    await service.store.create_action(
        "acme", "s1", "cap:crewai:support", "support", "run", "{}", "h", "p", "k", "running"
    )
    job = Job(tenant="acme", action_id="s1", crew_id="support", spec=ops.get("run"), input={}, idempotency_key="k")
    live = LiveAction(job=job)
    service.live.add(live)
    return live, ChunkSink(service.store, live)


def count_reads(service, monkeypatch):
    return calls_of(service.store, "follow_page", monkeypatch)


async def test_a_batch_inserted_in_full_is_kept_and_one_holding_a_stored_sequence_empties_the_tail(env):
    live, sink = await live_sink(env)
    await sink.add([chunk(0), chunk(1)])
    await sink.drain()
    assert live.committed.after(-1, 10) == await env.store.list_chunks("acme", "s1")
    await env.store.append_chunks("acme", "s1", [(2, '{"other":"writer"}')], durable=False)  # a backfill, say
    await sink.add([chunk(2), chunk(3)])  # sequence 2 is stored already: only 3 is inserted
    await sink.drain()
    assert len(live.committed) == 0
    assert [c.sequence for c in await env.store.list_chunks("acme", "s1")] == [0, 1, 2, 3]


async def test_follow_page_takes_a_running_actions_committed_chunks_from_its_dispatch(env, monkeypatch):
    live, sink = await live_sink(env)
    await sink.add([chunk(0), chunk(1), chunk(2)])
    await sink.drain()
    record = await env.store.get_action("acme", "s1")
    reads = count_reads(env, monkeypatch)
    chunks, stored = await follow_page(env.store, live, record, 0, 10)
    assert stored is record and reads == []
    assert chunks == (await env.store.list_chunks("acme", "s1"))[1:]
    assert await follow_page(env.store, live, record, 2, 10) == ([], record)  # nothing newer: the store
    assert len(reads) == 1
    await follow_page(env.store, None, record, 0, 10)  # no dispatch here
    await follow_page(env.store, live, dataclasses.replace(record, status="completed"), 0, 10)
    assert len(reads) == 3


async def test_a_live_tenant_stream_gets_each_committed_batch_in_order_without_reading_it_back(env, monkeypatch):
    live, sink = await live_sink(env)
    reads = count_reads(env, monkeypatch)
    record = await env.store.get_action("acme", "s1")
    frames = follow(env, record, None)
    await sink.add([chunk(0), chunk(1)])
    await sink.drain()
    first = await asyncio.wait_for(anext(frames), 10)  # the ack and the first batch, from the tail
    assert b"id: sse_0\n" in first and b"id: sse_1\n" in first and b"id: sse_2\n" in first
    assert reads == []
    waits = calls_of(live, "wait", monkeypatch)
    second = asyncio.ensure_future(anext(frames))
    await until_async(lambda: waits, what="the follower waiting for the dispatch's next commit")
    await sink.add([chunk(2), chunk(3), chunk(4)])
    await sink.drain()
    page = await asyncio.wait_for(second, 10)
    assert [line for line in page.split(b"\n") if line.startswith(b"id: ")] == [
        b"id: sse_3",
        b"id: sse_4",
        b"id: sse_5",
    ]
    assert reads == []  # woken by the commit, the follower took the batch from the tail
    await frames.aclose()
