"""An in-process SSE client for endless streams: httpx's ASGITransport buffers a
whole response, so a stream that never ends (``/aip/v1/approvals/events``) is
driven here at the ASGI level, its body frames decoded as they are sent."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

from aip_crewai.sse import SSEDecoder, SSEEvent

#: Longest a test waits for the next frame, seconds (a deadline, not a sleep).
FRAME_DEADLINE_S = 10.0


class Stream:
    """One request to the app (GET, or ``method`` with ``body``), its response streamed; ``close()`` disconnects."""

    def __init__(self, app: Any, target: str, headers: dict[str, str], method: str = "GET", body: bytes = b"") -> None:
        parts = urlsplit(target)
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": parts.path,
            "raw_path": parts.path.encode(),
            "query_string": parts.query.encode(),
            "root_path": "",
            "client": ("127.0.0.1", 50000),
            "server": ("host.test", 80),
            "headers": [(b"host", b"host.test"), *((k.lower().encode(), v.encode()) for k, v in headers.items())],
        }
        self.app = app
        self.request_body = body
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.gone = asyncio.Event()
        self.decoder = SSEDecoder()
        self.pending: list[SSEEvent] = []
        self.comments = 0
        self.status = 0
        self.body = b""
        self.ended = False
        self._sent_request = False
        self.task: asyncio.Task[None] | None = None

    async def _receive(self) -> dict[str, Any]:
        if not self._sent_request:
            self._sent_request = True
            return {"type": "http.request", "body": self.request_body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        await self.messages.put(message)

    async def open(self) -> Stream:
        self.task = asyncio.create_task(self.app(self.scope, self._receive, self._send))
        start = await asyncio.wait_for(self.messages.get(), FRAME_DEADLINE_S)
        self.status = start["status"]
        if self.status != 200:
            while True:
                message = await asyncio.wait_for(self.messages.get(), FRAME_DEADLINE_S)
                self.body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        return self

    async def _more(self) -> bytes:
        message = await asyncio.wait_for(self.messages.get(), FRAME_DEADLINE_S)
        if not message.get("more_body", False):
            self.ended = True
        return message.get("body", b"")

    async def next_event(self) -> SSEEvent:
        """The next dispatched event (keep-alive comments are counted in ``comments``)."""
        while not self.pending:
            if self.ended:
                raise EOFError("the stream ended")
            piece = await self._more()
            self.comments += piece.count(b"\n:") + (1 if piece.startswith(b":") else 0)
            self.pending.extend(self.decoder.feed(piece))
        return self.pending.pop(0)

    async def next_comment(self) -> None:
        """Wait for the next comment line (a keep-alive)."""
        seen = self.comments
        while self.comments == seen:
            piece = await self._more()
            self.comments += piece.count(b"\n:") + (1 if piece.startswith(b":") else 0)
            self.pending.extend(self.decoder.feed(piece))

    async def close(self) -> None:
        self.gone.set()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def open_stream(
    app: Any, target: str, headers: dict[str, str] | None = None, *, method: str = "GET", body: bytes = b""
) -> Stream:
    return await Stream(app, target, {"Accept": "text/event-stream", **(headers or {})}, method, body).open()
