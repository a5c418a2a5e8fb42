"""The bare baseline servers: Starlette on Hypercorn, nothing of ours.

``python -m bench.bare BODY_FILE`` serves ``GET /jobs/{action_id}`` with the
bytes of ``BODY_FILE`` (the sidecar's job view, captured by the benchmark) as
``application/json``: no middleware, no authentication, no storage; the single
hop a request through our processes is compared with.

``python -m bench.bare --proxy JOB_URL TOKEN_FILE`` is the bare proxy: each
``POST /aip/v1/messages`` reads and decodes its JSON body, asks ``JOB_URL``
(a sidecar's ``GET /jobs/{id}``, with the bearer in ``TOKEN_FILE``) through
one aiohttp session set up as the host's pool of sidecar reads, decodes the
job view and answers ``{"status": "completed", "output": <view>}``. It is the
floor of any gateway built from our parts (two Hypercorn servers, one aiohttp
client, one JSON decode and encode each way) with nothing of a governed read:
no authentication, fence, record or AIP envelope.

Both bind 127.0.0.1 port 0; Hypercorn logs ``Running on
http://127.0.0.1:<port>`` on stderr. ``GET /jobs/ready`` answers at once on both.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import msgspec
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def create_app(body: bytes) -> Starlette:
    async def job(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return Starlette(routes=[Route("/jobs/{action_id}", job, methods=["GET"])])


def create_proxy(job_url: str, token: str) -> Starlette:
    """The bare proxy's app (the module's docstring); its session opens on the first request."""
    sessions: list[aiohttp.ClientSession] = []
    headers = {"Authorization": f"Bearer {token}"}

    async def ready(request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def message(request: Request) -> Response:
        msgspec.json.decode(await request.body())
        if not sessions:  # as the host's reads: getaddrinfo, no cookies, no Accept headers, no second try
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=aiohttp.ThreadedResolver()),
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("Accept", "Accept-Encoding"),
            )
            session._retry_connection = False
            sessions.append(session)
        async with sessions[0].get(job_url, headers=headers, allow_redirects=False) as answer:
            view = msgspec.json.decode(await answer.read())
        body = msgspec.json.encode({"status": "completed", "output": view})
        return Response(body, media_type="application/json")

    return Starlette(
        routes=[Route("/jobs/ready", ready, methods=["GET"]), Route("/aip/v1/messages", message, methods=["POST"])]
    )


async def main(argv: list[str]) -> None:
    if argv[0] == "--proxy":
        app = create_proxy(argv[1], Path(argv[2]).read_text().strip())
    else:
        app = create_app(Path(argv[0]).read_bytes())
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = "-"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
