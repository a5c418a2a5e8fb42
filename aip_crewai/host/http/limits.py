"""Per-route request-body bounds of the host (applied by :class:`~aip_crewai.plumbing.asgi.BoundedBody`).

| route | bound |
|---|---|
| ``POST /aip/v1/messages`` | :data:`MAX_MESSAGE_BYTES` (2 MiB: the 1 MiB input plus envelope room) |
| ``POST /aip/v1/approvals/{id}/decision`` | :data:`MAX_DECISION_BYTES` (32 KiB) |
| any other route (none reads a body) | :data:`MAX_OTHER_BODY_BYTES` (16 KiB) |

A body over its bound is refused with 413 ``message.too_large`` before more
than the bound is read. Both routes that read a body take JSON (:data:`JSON_BODY`):
one declared as anything else, or not declared, is refused with 415
``message.unsupported_media_type`` before any of it is read.

Source: docs/security.md "Security" (request bodies); ARCHITECTURE.md §6 (routes).
"""

from __future__ import annotations

from starlette.types import Scope

from ...contracts.aip import CONTENT_TYPE
from ...contracts.errors import UnsupportedMediaType
from ...plumbing.asgi import MediaTypes

#: Bound on a message body, bytes: the 1 MiB input plus envelope room.
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
#: The media types of the host's request bodies: JSON, or AIP's own ``application/aip+json``.
JSON_BODY = MediaTypes(frozenset({"application/json", CONTENT_TYPE}), UnsupportedMediaType)
#: Bound of a decision body, bytes: ``reason`` is at most 2048 characters (12 KiB even as ``\\uXXXX`` escapes).
MAX_DECISION_BYTES = 32 * 1024
#: Bound of a body on any route that does not read one, bytes.
MAX_OTHER_BODY_BYTES = 16 * 1024


def body_limit(scope: Scope) -> int:
    """The body bound of a request, bytes, from its method and path (before routing)."""
    path: str = scope.get("path", "")
    if scope.get("method") == "POST":
        if path == "/aip/v1/messages":
            return MAX_MESSAGE_BYTES
        if path.startswith("/aip/v1/approvals/") and path.endswith("/decision"):
            return MAX_DECISION_BYTES
    return MAX_OTHER_BODY_BYTES
