"""The positions of an action's tenant stream: the SSE id of every frame, and where a resume with
``Last-Event-ID`` (or ``?cursor=``) starts. Pure: no I/O, no clock.

Positions, C the action's stored chunk count (docs/reference/http-api.md "Stream positions"):

- ``sse_0``: the ack; ``sse_<1+s>``: the stored chunk of sequence s (a chunk never changes);
- a **final** result (ARCHITECTURE.md §9 "Final results"): ``sse_<1+C>`` its ``aip_error`` frame when it
  carries an error, then its ``result`` frame at the next position;
- a **provisional** result: ``sse_<C>.1`` its ``aip_error`` frame, ``sse_<C>.2`` its ``result`` frame
  (``sse_<C>.1`` the result frame of one without an error): sub-positions after the last chunk the
  tenant was sent. A correction from the sidecar's journal backfills chunks at ``sse_<1+C>`` onwards in
  the result's own write; no chunk ever takes a sub-position, so an id never names two frames.

Positions are ordered as ``(n, sub)``: a stream's ids only grow, across a correction too (``sse_3``,
``sse_3.1``, ``sse_3.2``, then after the correction ``sse_4`` ...). A resume after a provisional
result's frame that is no longer the action's result (corrected, or marked final) starts at the first
chunk the tenant was not sent, then the current result; after one that is still the result, it goes on
after that frame, as after any other position.
"""

from __future__ import annotations

from typing import NamedTuple

from .store.records import InvalidCursor

__all__ = ["Position", "delivered", "ending", "ending_held", "parse", "sequence_held"]

#: Most decimal digits of a position's ``n`` (a stream holds far fewer frames: 100,000 events at most).
MAX_DIGITS = 9
#: Most frames that end a stream (``aip_error``, ``result``): the largest sub-position.
MAX_ENDING = 2
_PREFIX = "sse_"


class Position(NamedTuple):
    """One stream position: ``n`` (ack 0, chunk of sequence s at 1+s, a final result's frames after the
    chunks) and ``sub`` (0, or 1..2: the frames of a provisional result after position n). Ordered."""

    n: int
    sub: int = 0

    @property
    def id(self) -> str:
        """The SSE id: ``sse_<n>``, or ``sse_<n>.<sub>`` for a provisional result's frame."""
        return f"{_PREFIX}{self.n}" if self.sub == 0 else f"{_PREFIX}{self.n}.{self.sub}"


def parse(value: str) -> Position:
    """The position a ``Last-Event-ID`` header or a ``cursor`` query value names.

    Args:
        value: ``sse_<n>`` or ``sse_<n>.<k>`` (an id this host sent), or the same without ``sse_`` (a
            cursor); n at most :data:`MAX_DIGITS` ASCII digits, k 1..:data:`MAX_ENDING`.

    Raises:
        InvalidCursor: (400 ``request.invalid_cursor``) anything else.

    Source: docs/reference/http-api.md "Stream positions".
    """
    text = value[len(_PREFIX) :] if value.startswith(_PREFIX) else value
    whole, dot, sub = text.partition(".")
    if not _digits(whole) or (dot and not (len(sub) == 1 and sub.isdigit() and 1 <= int(sub) <= MAX_ENDING)):
        raise InvalidCursor("Last-Event-ID must be sse_<n> or sse_<n>.<k> (or cursor the same without sse_)")
    return Position(int(whole), int(sub) if dot else 0)


def _digits(text: str) -> bool:
    return 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit()


def ending(chunk_count: int, *, error: bool, final: bool) -> tuple[Position, ...]:
    """The positions of the frames that end an ended action's stream, in order: its ``aip_error`` frame
    (``error``: the result carries one), then its ``result`` frame. ``final``: the result is final
    (:func:`~.actions.recovery.is_final`); a provisional one's frames take sub-positions after chunk
    position ``chunk_count``."""
    count = 2 if error else 1
    if final:
        return tuple(Position(1 + chunk_count + i) for i in range(count))
    return tuple(Position(chunk_count, 1 + i) for i in range(count))


def sequence_held(at: Position | None) -> int:
    """The last chunk sequence a tenant resuming after ``at`` was sent (-1: none; ``at`` None: a stream
    from the start). Every chunk at a position up to ``at.n`` (the sequences below it), whatever ``at``
    names: a chunk, a final result's frame, or a provisional result's frame after ``at.n`` chunks."""
    return -1 if at is None else at.n - 1


def ending_held(at: Position | None, chunk_count: int, *, error: bool, final: bool) -> int:
    """How many of the ending frames (:func:`ending`) of the action's current result a tenant resuming
    after ``at`` already holds (0..2).

    - ``at`` None: none.
    - a plain position: the frames at or before it, counted at a final result's positions (a plain id
      past the chunks of a provisional result was sent before sub-positions existed).
    - a sub-position after ``at.n`` chunks: those up to it when the current result is still that
      provisional result (provisional, ``at.n == chunk_count``); none when it is no longer (corrected or
      marked final): the chunks after ``at.n`` and the current result follow; all when ``at.n`` is past
      the stored chunks (a position past the stream's end, as for a plain one).
    """
    if at is None:
        return 0
    frames = ending(chunk_count, error=error, final=True)
    if at.sub == 0:
        return sum(1 for p in frames if p <= at)
    if at.n > chunk_count:
        return len(frames)
    if not final and at.n == chunk_count:
        return min(at.sub, len(frames))
    return 0


def delivered(at: Position | None, chunk_count: int, *, error: bool, final: bool) -> bool:
    """Whether a tenant resuming after ``at`` holds the whole stream of an ended action: every chunk and
    every ending frame of its current result (the stream answers ``204 No Content`` then)."""
    if at is None or sequence_held(at) + 1 < chunk_count:
        return False
    return ending_held(at, chunk_count, error=error, final=final) >= (2 if error else 1)
