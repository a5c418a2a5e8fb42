"""Sidecar SSE → AIP stream chunks, with strict bounds (sans-IO).

:class:`StreamNormalizer` is fed the sidecar's response body in arbitrary byte
chunks and returns AIP :class:`~aip_crewai.contracts.aip.StreamChunk` objects.
It enforces a strict event sequence (from 0, or from the cursor), the frame
bound (1 MiB), the event-count bound (100,000), the response bound (default
64 MiB) and exactly one terminal event, last. :func:`result_from_terminal`
maps the terminal event to an AIP ``ActionResult``.

Source: ARCHITECTURE.md §8 (normalization, errors), §4 (events).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ...contracts.aip import ActionResult, StreamChunk, TextPart, protocol_error
from ...contracts.errors import AipError, ConnectorExecutionFailed, ConnectorInvalidStream, ConnectorResponseTooLarge
from ...contracts.operations import OperationSpec
from ...contracts.sidecar import TERMINAL_EVENTS, JobEvent
from ...sse import SSEDecoder, SSEFrameTooLarge

MAX_FRAME_BYTES = 1_048_576
MAX_STREAM_EVENTS = 100_000
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_RESPONSE_BYTES = 256 * 1024 * 1024

#: sidecar chunk channel -> AIP chunk kind (ARCHITECTURE.md §8); other channels: progress.
CHANNEL_KINDS = {"tools": "tool", "llm": "data", "messages": "data"}
#: A reference sidecar's chunk carries CrewAI's ``chunk_type`` (``StreamChunkType``: ``text`` |
#: ``tool_call``) and a ``tool_call`` object instead of ``channel``: the same kinds.
CHUNK_TYPE_KINDS = {"text": "data", "tool_call": "tool"}
#: sidecar event -> AIP chunk kind for the non-chunk events (ARCHITECTURE.md §8).
EVENT_KINDS = {"started": "progress", "completed": "done", "cancelled": "done", "failed": "error"}

_event_decoder = msgspec.json.Decoder(JobEvent)


def chunk_kind(event: JobEvent) -> str:
    """AIP chunk kind of one sidecar event (ARCHITECTURE.md §8)."""
    if event.event == "chunk":
        if "channel" in event.data:
            return CHANNEL_KINDS.get(str(event.data["channel"]), "progress")
        if event.data.get("tool_call"):
            return "tool"
        return CHUNK_TYPE_KINDS.get(str(event.data.get("chunk_type", "")).lower(), "progress")
    return EVENT_KINDS.get(event.event, "progress")


def to_chunk(action_id: str, sequence: int, event: JobEvent) -> StreamChunk:
    """Normalize one sidecar event; ``sequence`` is the AIP chunk sequence.

    The chunk's ``data`` is the sidecar event's data; a ``content`` string
    becomes a text part.
    """
    content = event.data.get("content")
    part = TextPart(text=content) if isinstance(content, str) and content else None
    return StreamChunk(action_id=action_id, sequence=sequence, kind=chunk_kind(event), data=event.data, part=part)  # type: ignore[arg-type]


class StreamNormalizer:
    """Incremental, bounded normalizer of one sidecar event stream.

    Args:
        action_id: the AIP action id stamped on every chunk.
        spec: the operation's catalogue row (for error details).
        start_sequence: the sidecar sequence the stream must start at (0, or
            the cursor / Last-Event-ID + 1 when resuming).
        first_chunk_sequence: the AIP sequence of the first chunk produced.
        max_response_bytes: bound on the whole body, bytes (1..256 MiB).
        max_events: bound on events in this stream.
        max_frame_bytes: bound on one SSE frame, bytes.

    Raises (from feed/close): ConnectorInvalidStream (gap, reorder, repeat,
    oversize frame, too many events, bad JSON, events after the terminal one,
    no terminal event at close); ConnectorResponseTooLarge (body bound).
    """

    def __init__(
        self,
        action_id: str,
        spec: OperationSpec,
        *,
        start_sequence: int = 0,
        first_chunk_sequence: int = 0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_events: int = MAX_STREAM_EVENTS,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self.action_id = action_id
        self.spec = spec
        self.expected = start_sequence
        self.next_chunk = first_chunk_sequence
        self.max_response_bytes = max_response_bytes
        self.max_events = max_events
        self.received_bytes = 0
        self.events = 0
        self.terminal: JobEvent | None = None
        self._max_frame_bytes = max_frame_bytes
        self._decoder = SSEDecoder(max_frame_bytes=max_frame_bytes)
        #: An invalid event met after valid ones of the same piece: raised by the next feed or close, once
        #: the caller has stored the chunks before it (a resumed read starts after them).
        self._failure: ConnectorInvalidStream | None = None

    def resumed(self) -> StreamNormalizer:
        """A normalizer for the same job's events read again from the first
        one this one did not receive (after a silent stream): same action,
        bounds and counts so far; a partial frame is dropped (it is read again).
        Raises: ConnectorInvalidStream when the terminal event was already received."""
        if self.terminal is not None:
            raise self._invalid("stream resumed after its terminal event")
        other = StreamNormalizer(
            self.action_id,
            self.spec,
            start_sequence=self.expected,
            first_chunk_sequence=self.next_chunk,
            max_response_bytes=self.max_response_bytes,
            max_events=self.max_events,
            max_frame_bytes=self._max_frame_bytes,
        )
        other.received_bytes, other.events = self.received_bytes, self.events
        return other

    def _invalid(self, reason: str) -> ConnectorInvalidStream:
        return ConnectorInvalidStream(
            f"invalid sidecar event stream: {reason}",
            operation=self.spec.name,
            remote_status=200,
            uncertain_outcome=self.spec.mutation,
            read_only=self.spec.read_only,
            dispatch="acknowledged",
            details={"reason": reason},
        )

    def feed(self, data: bytes) -> list[StreamChunk]:
        """Consume body bytes; return the chunks they complete. When an invalid
        event follows valid ones in ``data``, the chunks before it are returned
        and the error is raised by the next call (``feed`` or ``close``), so no
        valid chunk is lost and :attr:`expected` names the first event not delivered."""
        if self._failure is not None:
            raise self._failure
        self.received_bytes += len(data)
        if self.received_bytes > self.max_response_bytes:
            raise ConnectorResponseTooLarge(
                f"sidecar response exceeded {self.max_response_bytes} bytes",
                operation=self.spec.name,
                remote_status=200,
                uncertain_outcome=self.spec.mutation,
                read_only=self.spec.read_only,
                dispatch="acknowledged",
                details={"limit_bytes": self.max_response_bytes},
            )
        try:
            frames = self._decoder.feed(data)
        except SSEFrameTooLarge as exc:
            raise self._invalid(f"frame over {exc.limit_bytes} bytes") from exc
        chunks: list[StreamChunk] = []
        for frame in frames:
            try:
                chunks.append(self._accept(frame.event, frame.data))
            except ConnectorInvalidStream as exc:
                if not chunks:
                    raise
                self._failure = exc
                break
        return chunks

    def _accept(self, sse_event: str, data: str) -> StreamChunk:
        if self.terminal is not None:
            raise self._invalid("event after the terminal event")
        self.events += 1
        if self.events > self.max_events:
            raise self._invalid(f"more than {self.max_events} events")
        try:
            event = _event_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # RecursionError: too deep
            raise self._invalid("event data is not a sidecar job event (or nests too deeply)") from exc
        if sse_event not in ("message", event.event):
            raise self._invalid("SSE event name differs from the job event")
        if event.sequence != self.expected:
            raise self._invalid(f"sequence {event.sequence} where {self.expected} was expected")
        self.expected += 1
        if event.event in TERMINAL_EVENTS:
            self.terminal = event
        chunk = to_chunk(self.action_id, self.next_chunk, event)
        self.next_chunk += 1
        return chunk

    def close(self) -> JobEvent:
        """End of body: return the terminal event, or raise ConnectorInvalidStream."""
        if self._failure is not None:
            raise self._failure
        try:
            self._decoder.close()
        except SSEFrameTooLarge as exc:
            raise self._invalid(f"frame over {exc.limit_bytes} bytes") from exc
        if self.terminal is None:
            raise self._invalid("the stream ended without a terminal event")
        return self.terminal


def failed_result(action_id: str, error: AipError) -> ActionResult:
    """A failed ActionResult carrying ``error`` (its details say how far the
    request got: ``dispatch``, ``uncertain_outcome``, for connector errors)."""
    return ActionResult(action_id=action_id, status="failed", error=protocol_error(error))


#: Longest sidecar failure message quoted in an AIP error message, characters.
MAX_FAILURE_MESSAGE_CHARS = 1024


def failure_message(data: dict[str, Any]) -> str | None:
    """``"the crew failed (ProviderUnreachable): the model provider could not be reached ..."`` from a
    sidecar ``failed`` event's ``error_type`` and ``message`` (the sidecar publishes only safe text there:
    its own typed messages, or a fixed one); None (the default message) when either is missing."""
    error_type, message = data.get("error_type"), data.get("message")
    if not isinstance(error_type, str) or not isinstance(message, str) or not error_type or not message:
        return None
    return f"the crew failed ({error_type[:128]}): {message[:MAX_FAILURE_MESSAGE_CHARS]}"


def result_from_terminal(action_id: str, spec: OperationSpec, event: JobEvent) -> ActionResult:
    """Map the sidecar's terminal event to the AIP result (ARCHITECTURE.md §8).

    completed → ``completed`` with the event data as output; cancelled →
    ``cancelled``; failed → ``failed`` with ``connector.crewai.execution_failed``
    whose message names the sidecar's error type and message
    (:func:`failure_message`) and whose details carry the event data.
    """
    if event.event == "completed":
        return ActionResult(action_id=action_id, status="completed", output=event.data)
    if event.event == "cancelled":
        output: dict[str, Any] = {"remote_stop_confirmed": True, **event.data}
        return ActionResult(action_id=action_id, status="cancelled", output=output)
    data = dict(event.data)
    error = ConnectorExecutionFailed(
        failure_message(data),
        operation=spec.name,
        remote_status=200,
        uncertain_outcome=bool(data.get("uncertain_outcome", spec.mutation)),
        read_only=spec.read_only,
        dispatch="acknowledged",
        details={"event": data},
    )
    return failed_result(action_id, error)
