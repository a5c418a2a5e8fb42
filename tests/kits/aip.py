"""AIP messages for the tests: the one ``envelope`` builder and the one ``sse_events`` reader.

``envelope(action(...))`` is an unsigned ``aip.core.v1.action`` envelope (docs/reference/http-api.md "AIP 1.0 conformance");
``sse_events(response or bytes)`` decodes a ``text/event-stream`` body with the package's own decoder
(:mod:`aip_crewai.sse`) into ``(event, id, parsed data)`` as the frames arrive.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import httpx2

from aip_crewai.client import now_rfc3339
from aip_crewai.sse import SSEDecoder

#: The message type of an action.
ACTION = "aip.core.v1.action"


def action(action_id: str, capability_id: str, input: Any, key: str | None = None, **fields: Any) -> dict[str, Any]:
    """The body ``{"action": {...}}`` of an action envelope (``key``: its ``idempotency_key``, omitted if None;
    ``fields``: more action fields as given)."""
    body: dict[str, Any] = {"id": action_id, "capability_id": capability_id, "input": input, **fields}
    if key is not None:
        body["idempotency_key"] = key
    return {"action": body}


def envelope(
    body: dict[str, Any],
    *,
    message_type: str = ACTION,
    message_id: str | None = None,
    sent_at: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An unsigned AIP 1.0 envelope of ``body`` (a dict): ``message_id`` by default ``msg_<16 hex>``, ``sent_at``
    (RFC 3339) by default now; ``extra`` adds or replaces top-level fields (``correlation_id``, ``security``)."""
    return {
        "aip_version": "1.0",
        "message_type": message_type,
        "message_id": message_id or f"msg_{os.urandom(8).hex()}",
        "sent_at": sent_at or now_rfc3339(),
        "body": body,
        **extra,
    }


def sse_events(source: bytes | httpx2.Response) -> Iterator[tuple[str, str | None, Any]]:
    """``(event, id, parsed data)`` of every frame of an SSE body: ``bytes``, or a response (streamed as it
    arrives, so a caller may stop early; a response already read is decoded from its content). A frame left
    unterminated at the end of the body dispatches nothing (WHATWG, :meth:`aip_crewai.sse.SSEDecoder.close`)."""
    pieces: Iterable[bytes] = [source] if isinstance(source, bytes) else source.iter_bytes()
    decoder = SSEDecoder()
    for piece in pieces:
        for frame in decoder.feed(piece):
            yield frame.event, frame.id, json.loads(frame.data)
    for frame in decoder.close():
        yield frame.event, frame.id, json.loads(frame.data)
