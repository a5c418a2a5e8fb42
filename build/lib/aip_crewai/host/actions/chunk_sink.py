"""Group commit of a dispatch's AIP stream chunks into the host store
(used by the action service's dispatch and by restart recovery).

Source: ARCHITECTURE.md §5 (chunk events commit in groups), §10 (appends batch).
"""

from __future__ import annotations

import asyncio

import msgspec

from ...contracts.aip import StreamChunk
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
    a write go into the next one, so batches grow with the rate. The stream is
    only held back (awaiting the writer) past :attr:`MAX_QUEUED` chunks.

    Chunk writes are not fsynced: like the sidecar's chunk checkpoints they
    become durable with the action's result commit (see :mod:`.store`).
    """

    MAX_QUEUED = 4096

    def __init__(self, store: Store, live: LiveAction) -> None:
        self.store = store
        self.live = live
        self._queued: list[StreamChunk] = []
        self._writer: asyncio.Task[None] | None = None

    async def add(self, chunks: list[StreamChunk]) -> None:
        """Queue ``chunks`` (in stream order); raises a previous write's error."""
        self._queued.extend(chunks)
        if self._writer is None or self._writer.done():
            if self._writer is not None:
                self._writer.result()
            self._writer = asyncio.get_running_loop().create_task(self._write())
        if len(self._queued) >= self.MAX_QUEUED:
            await asyncio.shield(self._writer)

    async def drain(self) -> None:
        """Wait until every queued chunk is stored; raises a write error."""
        if self._writer is not None:
            await asyncio.shield(self._writer)

    def discard(self) -> None:
        """Drop queued chunks and stop the writer (a batch already handed to the store may still land)."""
        self._queued.clear()
        if self._writer is not None:
            if self._writer.done() and not self._writer.cancelled():
                self._writer.exception()  # retrieved: the dispatch is being cancelled anyway
            self._writer.cancel()

    async def _write(self) -> None:
        job = self.live.job
        while self._queued:
            batch, self._queued = self._queued, []
            await self.store.append_chunks(
                job.tenant,
                job.action_id,
                [(c.sequence, _encode.encode(c).decode()) for c in batch],
                dispatch=job.dispatch.state,
                durable=False,
            )
            self.live.notify()
