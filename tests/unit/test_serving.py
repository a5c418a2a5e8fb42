"""aip_crewai/plumbing/serving.py: the hypercorn configuration of both processes (docs/security.md "Security")."""

from __future__ import annotations

import asyncio
import socket

import pytest
from kits.poll import until_async

from aip_crewai.plumbing.serving import hypercorn_config


async def _app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.timeout(30)
async def test_connections_beyond_the_bound_are_closed_unread():
    """Issue 16 item 3: open connections are bounded; one more is closed before anything is read."""
    from hypercorn.asyncio import serve

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = hypercorn_config([f"fd://{sock.detach()}"], errorlog=None, max_connections=2)  # hypercorn owns it
    stop = asyncio.Event()
    server = asyncio.create_task(serve(_app, config, shutdown_trigger=stop.wait))
    try:
        held = []
        for _ in range(2):  # two idle connections hold the bound
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            held.append((reader, writer))
        await until_async(
            lambda: getattr(config, "aip_open_connections", 0) >= 2, interval=0.01, what="two connections counted"
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:  # closed without an answer (a reset, when the request was still unread)
            assert await asyncio.wait_for(reader.read(), 10) == b""
        except ConnectionResetError:
            pass
        writer.close()
        held[0][1].write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the held ones are served
        assert (await asyncio.wait_for(held[0][0].readuntil(b"ok"), 10)).startswith(b"HTTP/1.1 200")
        for _, w in held:
            w.close()
    finally:
        stop.set()
        await asyncio.wait_for(server, 15)
