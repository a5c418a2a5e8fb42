"""Group commit of a dispatch's AIP stream chunks into the host store
(used by the action service's dispatch and by restart recovery).

Source: ARCHITECTURE.md §5 (chunk events commit in groups), §10 (appends batch).
"""

from __future__ import annotations

import asyncio

import anyio
import msgspec

from ...contracts.aip import StreamChunk
from ..store.records import ChunkRecord
from ..store.store import Store
from .live import LiveAction

_encode = msgspec.json.Encoder()


class ChunkSink:
    """Stores a dispatch's chunks with group commit.

    The sidecar writes one SSE frame per event, so the stream yields about one
    event per read; a store transaction per read would cap a stream at a few
    thousand events per second. Chunks are queued instead and ONE writer task
    stores everything queued in one transaction (chunks, chunk count and the
    dispatch state together), then wakes the followers; events arriving during
    a write go into the next one, so batches grow with the rate. Two batches are
    at least :attr:`COMMIT_WINDOW_S` apart: a chunk arriving sooner after a commit
    waits for the rest of the window with those behind it, so a fast stream costs
    one store hop per window, not one per read (a store hop costs about 0.1 ms of
    CPU on the 2-core bench machine). A chunk after a quiet spell is written at once;
    :meth:`drain` (the stream ended) and a queue of :attr:`MAX_QUEUED` chunks write
    without waiting. The stream is only held back (awaiting the writer) past
    :attr:`MAX_QUEUED` chunks. A dispatch that holds its result takes the chunks not yet
    handed to the store (:meth:`rest`) and writes them in the result's own transaction
    (``ActionWriter.finish(chunks=)``): the stream's last batch costs no store hop of its own.

    Chunk writes are not fsynced: like the sidecar's chunk checkpoints they
    become durable with the action's result commit (see :mod:`.store`).

    A batch the store inserted in full is also kept in the live action's
    :class:`~.live.CommittedTail` before the followers are woken, so a live follower on this host
    takes it without reading it back; any other outcome empties the tail.

    A dispatch that took the action's lease hands the sink its fencing token (:meth:`hold`): every batch
    is fenced by that token for the sink's whole life, so a batch the writer task stores after this host
    forgot the token (a renewal that found the lease taken forgets it before it cancels the dispatch) is
    refused (``LeaseLost``) instead of written as by a host that never held the lease (ARCHITECTURE.md §10).
    """

    MAX_QUEUED = 4096
    #: Shortest time between two batch commits of one stream, seconds: what a live chunk in a burst may wait
    #: for its batch (ARCHITECTURE.md §10 "Live followers"). 20 ms: a tenant's live stream gets at most 50
    #: writes a second; a chatty run of 1,000 chunks costs the host about a fifth less CPU than at 5 ms.
    COMMIT_WINDOW_S = 0.02

    def __init__(self, store: Store, live: LiveAction, *, commit_window_s: float = COMMIT_WINDOW_S) -> None:
        self.store = store
        self.live = live
        self._queued: list[StreamChunk] = []
        self._writer: asyncio.Task[None] | None = None
        self._lease_token: int | None = None
        self._window_s = commit_window_s
        self._committed_at = float("-inf")  # the event loop's clock at the last batch's commit
        self._flush = asyncio.Event()  # set: the writer stops waiting for the window
        self._draining = False
        self._closing = False  # set by :meth:`rest`: the writer hands nothing more to the store

    def hold(self, lease_token: int | None) -> None:
        """Fence every later batch by ``lease_token`` (the dispatch's, from ``Store.lease_token`` right after
        ``Store.take_lease``; None: no lease, as on a store without a host id)."""
        self._lease_token = lease_token

    async def add(self, chunks: list[StreamChunk]) -> None:
        """Queue ``chunks`` (in stream order); raises a previous write's error."""
        self._queued.extend(chunks)
        if self._writer is None or self._writer.done():
            if self._writer is not None:
                self._writer.result()
            self._writer = asyncio.get_running_loop().create_task(self._write())
        if len(self._queued) >= self.MAX_QUEUED:
            self._flush.set()
            await asyncio.shield(self._writer)

    async def drain(self) -> None:
        """Wait until every queued chunk is stored, without waiting for the window; raises a write error."""
        self._draining = True
        self._flush.set()
        if self._writer is not None:
            await asyncio.shield(self._writer)

    async def rest(self) -> list[StreamChunk]:
        """Stop the writer and return the queued chunks it had not handed to the store (stream order, possibly
        none), once a batch already handed to it is stored: the caller writes them with the result, in one
        transaction. The sink takes no more chunks after this. Raises a previous write's error."""
        self._closing = True
        self._flush.set()
        if self._writer is not None:
            await asyncio.shield(self._writer)
        rest, self._queued = self._queued, []
        return rest

    def discard(self) -> None:
        """Drop queued chunks and stop the writer (a batch already handed to the store may still land)."""
        self._queued.clear()
        if self._writer is not None:
            if self._writer.done() and not self._writer.cancelled():
                self._writer.exception()  # retrieved: the dispatch is being cancelled anyway
            self._writer.cancel()

    async def _write(self) -> None:
        job = self.live.job
        loop = asyncio.get_running_loop()
        while self._queued and not self._closing:
            rest = self._committed_at + self._window_s - loop.time()
            if rest > 0 and not self._flush.is_set():
                with anyio.move_on_after(rest):
                    await self._flush.wait()
                if self._closing:  # the result's write takes the queue (:meth:`rest`)
                    return
            batch, self._queued = self._queued, []
            if not self._draining:
                self._flush.clear()  # a full queue's flush covers this batch only
            rows = [ChunkRecord(c.sequence, _encode.encode(c).decode()) for c in batch]
            inserted = await self.store.append_chunks(
                job.tenant,
                job.action_id,
                [(row.sequence, row.chunk_json) for row in rows],
                dispatch=job.dispatch.state,
                durable=False,
                lease_token=self._lease_token,
            )
            if inserted == len(rows):  # every row is the stored one: live followers here take them from memory
                self.live.committed.keep(rows)
            else:
                self.live.committed.forget()
            self._committed_at = loop.time()
            self.live.notify()
