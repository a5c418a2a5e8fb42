"""Logging setup shared by both processes (structlog).

``configure_logging(json=..., level=...)`` is called once, from an entry
point. Logs go to **stderr** (CrewAI prints to stdout). Event names are fixed
snake_case phrases; data goes in key-values with units. Never log secrets,
tokens, crew inputs or outputs: log sizes and hashes.

Source: ARCHITECTURE.md §2 (logging).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

#: The stream log lines go to whatever ``sys.stderr`` becomes (:func:`pin_log_stream`); None: ``sys.stderr``.
_PINNED: Any = None


def pin_log_stream(stream: Any) -> None:
    """Send this process's log lines to ``stream`` from now on, whatever ``sys.stderr`` becomes: the sidecar
    pins its stderr before it hands ``sys.stderr`` to crew code through a filter (docs/security.md)."""
    global _PINNED
    _PINNED = stream


def log_stream() -> Any:
    """Where this process's log lines (and its one-line refusals) go: the stream pinned with
    :func:`pin_log_stream`, else ``sys.stderr``. Flush this one before ``os._exit``."""
    return _PINNED or sys.stderr


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at each write (a test's capture, a replaced stream), not the one
    configured first: a logger cached before the stream changed never writes to a closed file. A stream
    pinned with :func:`pin_log_stream` is used instead.

    A line that cannot be written (``OSError``: the log pipe's reader went away, ``EPIPE``; a full or failed
    disk) is dropped: a dead log sink must not stop the process from answering requests or from stopping on
    SIGTERM (a host behind ``| head`` once ignored every signal). ``ValueError`` (a closed file) too."""

    def write(self, text: str) -> int:
        try:
            return int(log_stream().write(text))
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            log_stream().flush()
        except (OSError, ValueError):
            pass


def configure_logging(*, json: bool | None = None, level: str = "info", cache: bool = True) -> None:
    """Configure structlog once.

    Args:
        json: JSON lines (production) when True, the console renderer when
            False; None picks JSON unless stderr is a terminal.
        level: minimum level name (debug, info, warning, error).
        cache: cache each logger on first use (the long-running processes); a
            client command configures without, so a caller that configures
            logging again (an embedding program, a test) is obeyed.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per record, its newline included: a job's worker shares the sidecar's stderr, and a record
        # written in two pieces (print's text, then its newline) could be split by another process's record.
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=cache,
    )
