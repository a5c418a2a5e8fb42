"""Sans-IO server-sent-events codec: bytes in, events out; events in, bytes out.

The decoder implements the WHATWG HTML "event stream interpretation"
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation)
on bytes fed in arbitrary chunks; the encoder writes frames the decoder (or
any conforming client) reads back. No sockets, clocks, logging or other I/O.

Frame size (bytes): the lines since the last blank line, each counted with
one byte for its terminator (CR, LF or CRLF), plus the blank line ending the
frame; the leading BOM is not counted. A comment line is checked against the
bound but not added to the frame (nothing of it is kept, so keep-alives
between events never accumulate). With LF line ends ``len(encode_event(...))``
is exactly the size of its frame.

Source: ARCHITECTURE.md §11 (SSE codec API), §8 (a frame over 1 MiB fails the
stream), §4 (frame layout, keep-alive comments); WHATWG HTML as above.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import msgspec

__all__ = [
    "SSEDecoder",
    "SSEEvent",
    "SSEFrameTooLarge",
    "encode_comment",
    "encode_event",
    "encode_retry",
    "encode_page",
    "page_template",
]

_BOM = b"\xef\xbb\xbf"
_LINE_END = re.compile(r"\r\n|\r|\n")  # encoder side: the decoder's line ends
#: The frame :func:`encode_event` and :func:`page_template` write for one-line data (an optional ``id``
#: without NUL, an ``event``, one ``data`` line, the blank line), after CR handling: the decoder takes a
#: run of these at a frame's start in one regex match each, with the same outcome as its line loop.
_CANONICAL_FRAME = re.compile(rb"(?:id: ([^\n\x00]*)\n)?event: ([^\n]*)\ndata: ([^\n]*)\n\n")


class SSEEvent(msgspec.Struct, frozen=True):
    """One dispatched event (a frozen ``msgspec.Struct``: built in C, about 0.5 µs less per event than a
    frozen dataclass).

    Attributes:
        event: the event type; ``"message"`` when the frame set none (or "").
        data: the ``data`` lines of the frame joined with LF ("" is possible).
        id: the last event id in force at dispatch (persists across frames);
            None before any ``id`` field, "" after an ``id`` with no value.
        retry: reconnection time in milliseconds set by this frame, else None.
    """

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry: int | None = None


class SSEFrameTooLarge(ValueError):
    """One frame exceeded ``max_frame_bytes``; ``limit_bytes`` is that bound (bytes).
    Source: ARCHITECTURE.md §11 and §8 ("frame over 1 MiB")."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"SSE frame exceeds {limit_bytes} bytes")


class SSEDecoder:
    """Incremental event-stream decoder (sans-IO, one instance per stream).

    Args:
        max_frame_bytes: bound on one frame, bytes (what counts: see the module
            docstring). Raises ValueError unless a positive int.

    Source: WHATWG HTML "event stream interpretation"; ARCHITECTURE.md §11.
    """

    def __init__(self, max_frame_bytes: int = 1048576) -> None:
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        self._limit = max_frame_bytes
        self._head: bytes | None = b""  # bytes seen while deciding on a BOM; None once decided
        self._partial = bytearray()  # current line, not yet terminated
        self._skip_lf = False  # the last chunk ended with CR: swallow one leading LF
        self._size = 0  # bytes of the current frame (complete non-comment lines)
        self._data: list[str] = []  # data buffer, kept as lines (joined at dispatch)
        self._event = ""  # event type buffer
        self._retry: int | None = None  # retry set by the current frame
        self._last_id: str | None = None  # last event ID buffer (persists)
        self._reconnection_ms: int | None = None
        self._failed = self._closed = False

    @property
    def last_event_id(self) -> str | None:
        """The last event ID buffer (None until an ``id`` field arrives)."""
        return self._last_id

    @property
    def reconnection_ms(self) -> int | None:
        """Latest valid ``retry``, milliseconds, also from frames that dispatch nothing."""
        return self._reconnection_ms

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Consume the next chunk of the stream.

        Args:
            data: bytes, any length; may end mid-line, mid-CRLF, mid-UTF-8 or mid-BOM.

        Returns:
            The events dispatched by this chunk, in stream order (often []).

        Raises:
            SSEFrameTooLarge: the current frame exceeds ``max_frame_bytes``
                (checked before an unterminated line is buffered), or any call
                after that: the decoder stays failed. Events dispatched earlier
                in the same chunk are then not returned.
            ValueError: called after ``close()``.
        """
        if self._failed:
            raise SSEFrameTooLarge(self._limit)
        if self._closed:
            raise ValueError("SSEDecoder.feed() called after close()")
        if self._head is not None:
            # WHATWG: the stream is decoded with "UTF-8 decode", which strips one
            # leading BOM. Wait until three bytes (or a mismatch) decide.
            head = self._head + bytes(data)
            if len(head) < 3 and _BOM.startswith(head):
                self._head = head
                return []
            self._head = None
            data = head[3:] if head.startswith(_BOM) else head
        if self._skip_lf and data:  # a CR ended the last chunk: an LF here completes that CRLF
            self._skip_lf = False
            data = data[1:] if data[:1] == b"\n" else data
        if b"\r" in data:
            # Line ends are CRLF, CR or LF ("end-of-line" in the stream grammar).
            # CR never occurs inside UTF-8 multibyte sequences, so splitting bytes
            # before decoding equals decoding first. _partial never holds a CR.
            self._skip_lf = data[-1:] == b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # Frame by frame: a run of the sidecar's frames by regex (_canonical_frames), any other frame (or the
        # rest of one begun in an earlier chunk) by the line loop, up to its blank line; the unterminated rest
        # by the line loop too. Equal to the line loop over the whole chunk (a property test checks it).
        events: list[SSEEvent] = []
        pos, end = 0, data.find(b"\n\n")
        while end >= 0:
            if not (self._size or self._data or self._event or self._retry is not None):  # at a frame's start
                if self._partial:  # the start of its first line came in the last chunk
                    data, pos = bytes(self._partial) + data[pos:], 0
                    self._partial = bytearray()
                pos = self._canonical_frames(data, pos, events)
                end = data.find(b"\n\n", pos)
                if end < 0:
                    break
            self._lines(data[pos : end + 2], events)
            pos = end + 2
            end = data.find(b"\n\n", pos)
        self._lines(data[pos:] if pos else data, events)
        return events

    def _lines(self, data: bytes, events: list[SSEEvent]) -> None:
        """The line loop: interpret ``data`` (CR-free) line by line after the pending partial line,
        appending dispatched events to ``events``; raises SSEFrameTooLarge past the bound."""
        lines = data.split(b"\n")
        tail = lines.pop()
        limit = self._limit
        if not lines:
            if self._size + len(self._partial) + len(tail) > limit:
                self._fail()
            self._partial += tail
            return
        if self._partial:
            lines[0] = bytes(self._partial) + lines[0]
            self._partial = bytearray()
        size, data_lines, event, retry, last_id = self._size, self._data, self._event, self._retry, self._last_id
        for line in lines:
            size += len(line) + 1
            if size > limit:
                self._fail()
            if not line:
                # "If the line is empty (a blank line): Dispatch the event."
                # Step 1: the last event ID string is the buffer (last_id persists).
                # Step 2: empty data buffer -> reset buffers, dispatch nothing.
                # Step 3: a trailing LF is removed (here: lines joined with LF).
                # Steps 4-5: type "message" unless the event type buffer is set.
                if data_lines:
                    events.append(SSEEvent(event or "message", "\n".join(data_lines), last_id, retry))
                    data_lines = []
                event, retry, size = "", None, 0
            elif line[0] == 0x3A:
                # "If the line starts with a U+003A COLON character: Ignore the line."
                size -= len(line) + 1  # kept nowhere, so not part of the frame
            else:
                # "If the line contains a U+003A COLON": field = before the first colon,
                # value = after it minus one leading U+0020 SPACE; "Otherwise" the whole
                # line is the field name and the value is "". Unknown fields are ignored.
                name, _, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if name == b"data":
                    data_lines.append(value.decode("utf-8", "replace"))
                elif name == b"event":
                    event = value.decode("utf-8", "replace")
                elif name == b"id":
                    if b"\x00" not in value:  # "If the field value does not contain U+0000 NULL"
                        last_id = value.decode("utf-8", "replace")
                elif name == b"retry" and value.isdigit():  # bytes.isdigit(): ASCII 0-9 only
                    try:
                        retry = self._reconnection_ms = int(value)
                    except ValueError:  # beyond sys.get_int_max_str_digits(): ignore
                        pass
        self._size, self._data, self._event, self._retry, self._last_id = size, data_lines, event, retry, last_id
        if size + len(tail) > limit:
            self._fail()
        self._partial += tail

    def _canonical_frames(self, data: bytes, start: int, events: list[SSEEvent]) -> int:
        """At a frame's start (no field of a frame read yet, no partial line): append the events of the run
        of :data:`_CANONICAL_FRAME` frames of ``data`` (CR-free) from index ``start`` to ``events``, each
        within the frame bound, and return the index after them (a frame over the bound is left to the
        line loop, which raises)."""
        limit, last_id = self._limit, self._last_id
        match = _CANONICAL_FRAME.match(data, start)
        while match is not None and match.end() - start <= limit:
            id_, event, value = match.groups()
            if id_ is not None:
                last_id = id_.decode("utf-8", "replace")
            events.append(
                SSEEvent(event.decode("utf-8", "replace") or "message", value.decode("utf-8", "replace"), last_id)
            )
            start = match.end()
            match = _CANONICAL_FRAME.match(data, start)
        self._last_id = last_id
        return start

    def close(self) -> list[SSEEvent]:
        """Signal end of stream; idempotent. Returns [] (symmetry with ``feed``).

        WHATWG: "Once the end of the file is reached, any pending data must be
        discarded": an unterminated frame (or final line) dispatches nothing.
        Raises SSEFrameTooLarge if the decoder failed earlier.
        """
        if self._failed:
            raise SSEFrameTooLarge(self._limit)
        self._closed, self._partial, self._data = True, bytearray(), []
        return []

    def _fail(self) -> None:
        self._failed, self._partial, self._data = True, bytearray(), []
        raise SSEFrameTooLarge(self._limit)


def encode_event(data: str, event: str | None = None, id: str | None = None) -> bytes:
    """Encode one event frame as UTF-8 bytes.

    Layout: ``id: <id>\\n`` (if given), ``event: <event>\\n`` (if given), one
    ``data: <line>\\n`` per line of ``data`` (split at CRLF, CR or LF, so data
    can never inject a field), then a blank line. Decoding the frame yields
    ``data`` with every CRLF/CR replaced by LF; "" encodes as one empty data
    line and decodes as "".

    Args:
        data: payload text, line ends allowed. event: type; None or "" means
            "message". id: event id (the client's last event id).

    Returns:
        The frame, bytes (UTF-8).

    Raises:
        ValueError: ``event`` holds CR or LF, or ``id`` holds CR, LF or NUL
            (not representable); UnicodeEncodeError on lone surrogates.

    Source: WHATWG HTML "event stream interpretation"; ARCHITECTURE.md §4, §11.
    """
    parts: list[str] = []
    if id is not None:
        if "\r" in id or "\n" in id or "\x00" in id:
            raise ValueError("SSE id must not contain CR, LF or NUL")
        parts.append(f"id: {id}\n")
    if event is not None:
        if "\r" in event or "\n" in event:
            raise ValueError("SSE event type must not contain CR or LF")
        parts.append(f"event: {event}\n")
    lines = _LINE_END.split(data) if "\r" in data or "\n" in data else (data,)
    parts.extend(f"data: {line}\n" for line in lines)
    parts.append("\n")
    return "".join(parts).encode("utf-8")


def encode_comment(text: str) -> bytes:
    """Encode a comment (e.g. a keep-alive) as UTF-8 bytes.

    Each line of ``text`` (split at CRLF, CR or LF; line ends allowed) becomes
    its own ``: <line>\\n`` line (an empty one ``:\\n``); no blank line follows.
    Returns the comment lines, bytes (UTF-8).

    Source: WHATWG HTML "event stream interpretation" (lines starting with a
    colon are ignored); ARCHITECTURE.md §4 (``: keep-alive`` every 15 s).
    """
    return "".join(f": {line}\n" if line else ":\n" for line in _LINE_END.split(text)).encode("utf-8")


def encode_retry(ms: int) -> bytes:
    """Encode a ``retry: <ms>`` line and a blank line: it sets the client's reconnection time
    (milliseconds) and dispatches nothing (its frame has no data).

    Raises:
        ValueError: ``ms`` not a non-negative int.

    Source: WHATWG HTML "event stream interpretation" (the ``retry`` field); docs/approvals.md "Approval events".
    """
    if isinstance(ms, bool) or not isinstance(ms, int) or ms < 0:
        raise ValueError(f"retry must be a non-negative int of milliseconds, got {ms!r}")
    return f"retry: {ms}\n\n".encode("ascii")


def page_template(data: bytes, *, id_prefix: bytes = b"") -> bytes:
    """The byte template of one frame for :func:`encode_page`: ``id: <id_prefix><int>``, ``event:
    <bytes>``, then ``data: `` + ``data`` (a ``%`` template of its own values, its literal ``%`` already
    written ``%%``) and the blank line. Values, in order: the id number (``%d``), the event name (bytes),
    then ``data``'s. Source: ARCHITECTURE.md §4 (frame layout).
    """
    return b"id: " + id_prefix.replace(b"%", b"%%") + b"%d\nevent: %s\ndata: " + data + b"\n\n"


def encode_page(template: bytes, values: Sequence[tuple[object, ...]], frame: Callable[[int], bytes]) -> bytes:
    """The frames of one page of events as one write: ``template % values[i]`` for every frame (one
    :func:`page_template` per page, no per-frame encoding), or, when the page holds any CR or more than
    a frame's four LFs per frame (a line end in some value), ``frame(i)`` for every frame (the caller's
    exact encoding, e.g. :func:`encode_event`).

    The fast page equals the concatenated :func:`encode_event` frames whenever it is taken (a property
    test checks it): with no line end in an id, an event name or the data, each frame is exactly those
    four lines. Returns bytes; raises what ``template %`` or ``frame`` raise.
    """
    page = b"".join([template % value for value in values])
    if page.count(b"\n") == 4 * len(values) and b"\r" not in page:
        return page
    return b"".join([frame(index) for index in range(len(values))])
