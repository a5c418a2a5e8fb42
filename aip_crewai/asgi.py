"""ASGI plumbing shared by both processes (no I/O of its own).

:class:`CloseOnUnreadBody`: a response that starts before the request body
was read to its end (a 401 from authentication that never reads the body, a
413 on a declared length) gets ``Connection: close``. The server cannot reuse
such a connection (the unread body is still on it) and closes it after the
response; without the header a keep-alive client sends its next request on
the dying connection and gets "server disconnected without a response", a
transport error the host would have to count as an uncertain dispatch.

Source: RFC 9112 §9.6 (``close`` connection option).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


class CloseOnUnreadBody:
    """Pure ASGI middleware: ``Connection: close`` on responses to requests whose body was not fully read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        read = False

        async def receive_wrapper() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.disconnect" or (
                message["type"] == "http.request" and not message.get("more_body", False)
            ):
                read = True
            return message

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive_wrapper, send_wrapper)
