"""The approval console: static HTML/JS/CSS shipped in the package, served at ``/console/``.

Three fixed files (``console_static/``: ``index.html``, ``console.js``,
``console.css``), read once from the package, no build step. ``[host]
console = false`` turns the routes into 404s. The page works over the
host's own AIP routes with the signed-in principal's credential; it decides
and enforces nothing (docs/approvals.md "Approval console").

Headers: a Content-Security-Policy allowing only this origin (no inline
script or style, no framing), ``X-Content-Type-Options: nosniff``,
``Referrer-Policy: no-referrer`` and ``Cache-Control: no-cache``.

Source: docs/approvals.md "Approval console"; ARCHITECTURE.md §6.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ...contracts.errors import RouteNotFound
from .state import host_state

#: file name -> media type of the files the console serves (nothing else is served).
FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def _file(name: str) -> bytes:
    return (resources.files(__package__) / "console_static" / name).read_bytes()


def _enabled(request: Request) -> None:
    if not host_state(request).settings.console:
        raise RouteNotFound("the approval console is disabled on this host ([host] console = false)")


async def console_redirect(request: Request) -> Response:
    """``GET /console``: to ``/console/`` (relative links resolve under it)."""
    _enabled(request)
    return RedirectResponse("/console/", status_code=308)


async def console_file(request: Request) -> Response:
    """``GET /console/`` and ``GET /console/{file}``: one of :data:`FILES`, else 404."""
    _enabled(request)
    name = request.path_params.get("name") or "index.html"
    if name not in FILES:
        raise RouteNotFound("no such console file")
    return Response(_file(name), media_type=FILES[name], headers=HEADERS)


def routes() -> list[BaseRoute]:
    """The console routes, mounted by the host app."""
    return [
        Route("/console", console_redirect, methods=["GET"]),
        Route("/console/", console_file, methods=["GET"]),
        Route("/console/{name:str}", console_file, methods=["GET"]),
    ]
