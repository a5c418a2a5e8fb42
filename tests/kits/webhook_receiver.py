"""A webhook receiver on loopback (an asyncio HTTP/1.1 server, in-process or in a process of its own) and a
transport that fails the test on any connection beyond loopback (docs/webhooks.md tests).

``Receiver``: answers each POST with the next status of ``statuses`` (then 200), optionally after waiting
for ``release`` (a slow receiver); records ``(headers, body)`` of every request.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass, field

import httpx2
import pytest


@dataclass
class Receiver:
    statuses: list[int] = field(default_factory=list)
    release: asyncio.Event | None = None
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    port: int = 0
    _server: asyncio.base_events.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> Receiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening, end every open connection (a handler held by ``release`` or waiting for the next
        request of a kept-alive connection), then wait for the server: never a wait on a client (Python
        3.12.1+'s ``wait_closed`` waits for every connection to close)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.received.append((headers, body))
                if self.release is not None:
                    await self.release.wait()
                status = self.statuses.pop(0) if self.statuses else 200
                writer.write(f"HTTP/1.1 {status} X\r\ncontent-length: 2\r\n\r\nok".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # only stop() cancels a handler; ending quietly spares asyncio's callback a cancelled task
        finally:
            self._handlers.discard(task)
            writer.close()


class LoopbackOnly(httpx2.AsyncHTTPTransport):
    """An HTTP transport that fails the test before connecting anywhere but a loopback address."""

    def __init__(self) -> None:
        super().__init__()
        self.hosts: list[str] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        self.hosts.append(host)
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            pytest.fail(f"a webhook attempt tried to connect to {host}, beyond loopback")
        return await super().handle_async_request(request)
