"""The bare baseline server: Starlette on Hypercorn, one handler answering fixed JSON.

``python -m bench.bare BODY_FILE`` serves ``GET /jobs/{action_id}`` with the
bytes of ``BODY_FILE`` (the sidecar's job view, captured by the benchmark) as
``application/json``, on 127.0.0.1 port 0. Hypercorn logs ``Running on
http://127.0.0.1:<port>`` on stderr. No middleware, no authentication, no
storage: the single hop a request through our processes is compared with.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

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


async def main(body_file: str) -> None:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = "-"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve(create_app(Path(body_file).read_bytes()), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
