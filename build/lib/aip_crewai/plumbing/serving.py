"""How both processes serve HTTP: one hypercorn configuration and its bounds.

| bound | value | enforced by |
|---|---|---|
| request head (and an idle keep-alive connection) | :data:`HEADER_TIMEOUT_S` | hypercorn ``keep_alive_timeout``: the timer runs from the connection's start, or the end of the previous response, until a whole request head has arrived |
| request head size | :data:`MAX_HEADER_BYTES` | a head still incomplete past it: hypercorn ``h11_max_incomplete_size`` (431); a whole head (as :func:`~aip_crewai.plumbing.asgi.head_size` counts it): :class:`~aip_crewai.plumbing.asgi.BoundedHead` (431) |
| pause between two body chunks | :data:`BODY_IDLE_TIMEOUT_S` | :class:`~aip_crewai.plumbing.asgi.BodyDeadline` (408) |
| whole request body | :data:`BODY_TOTAL_TIMEOUT_S` | :class:`~aip_crewai.plumbing.asgi.BodyDeadline` (408) |
| requests in flight (SSE streams included) | :data:`MAX_IN_FLIGHT` | :class:`~aip_crewai.plumbing.asgi.InFlightLimit` (503) |
| open TCP connections | :data:`MAX_CONNECTIONS` | :func:`bound_connections`: one more is closed at once, unread |
| HTTP/2 streams per connection | :data:`H2_MAX_CONCURRENT_STREAMS` | hypercorn (HTTP/2 is only reachable through TLS, which neither process terminates) |

Cleartext HTTP/2 (h2c: ``Upgrade: h2c`` or the prior-knowledge preface) is
not served: :func:`refuse_cleartext_h2` makes hypercorn answer such requests
as HTTP/1.1 (the upgrade is ignored, as RFC 9110 §7.8 allows) and treat the
bare preface as the malformed HTTP/1.1 request it is. Hypercorn's own
``read_timeout`` is left unset: it would also close a connection whose client
is quietly receiving a long SSE stream.

Source: docs/security.md "Security" (timeouts, connections, h2c).
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

#: Longest wait for a whole request head, and for the next request on an idle connection, seconds.
HEADER_TIMEOUT_S = 5.0
#: Bound of a request line plus headers, bytes.
MAX_HEADER_BYTES = 16 * 1024
#: Longest pause between two chunks of a request body, seconds.
BODY_IDLE_TIMEOUT_S = 10.0
#: Longest time for a whole request body, seconds.
BODY_TOTAL_TIMEOUT_S = 60.0
#: Requests one process handles at once (SSE streams included).
MAX_IN_FLIGHT = 4096
#: Concurrent streams of one HTTP/2 connection.
H2_MAX_CONCURRENT_STREAMS = 16
#: Open TCP connections one process serves at once (busy ones: at most MAX_IN_FLIGHT; the rest idle or
#: sending a head, which HEADER_TIMEOUT_S ends).
MAX_CONNECTIONS = 8192


def refuse_cleartext_h2() -> None:
    """Make hypercorn serve cleartext connections as HTTP/1.1 only (no h2c upgrade, no prior knowledge).

    Hypercorn has no setting for this: its HTTP/1.1 protocol switches to HTTP/2
    from ``_check_protocol``, which is replaced here by a no-op (idempotent).

    Raises:
        RuntimeError: the installed hypercorn no longer has that hook (a newer
            version): start-up stops rather than serving h2c unknowingly.
    """
    from hypercorn.protocol import h11 as hypercorn_h11

    protocol = getattr(hypercorn_h11, "H11Protocol", None)
    if protocol is None or not hasattr(protocol, "_check_protocol"):
        raise RuntimeError("this hypercorn version has no H11Protocol._check_protocol; cannot refuse h2c")

    async def http11_only(self: Any, event: Any) -> None:
        del self, event

    protocol._check_protocol = http11_only


def bound_connections() -> None:
    """Make hypercorn's asyncio server close, at once and unread, a connection
    beyond ``config.aip_max_connections`` open ones (no attribute: unbounded).

    Hypercorn has no setting for this: its accept callback runs the module
    global ``hypercorn.asyncio.run.TCPServer``, replaced here by a subclass
    that counts open connections per ``Config`` (idempotent).

    Raises:
        RuntimeError: the installed hypercorn no longer has that hook.
    """
    from hypercorn.asyncio import run as hypercorn_run

    base = getattr(hypercorn_run, "TCPServer", None)
    if base is None or not hasattr(base, "run"):
        raise RuntimeError("this hypercorn version has no asyncio.run.TCPServer; cannot bound connections")
    if getattr(base, "aip_bounded", False):
        return

    class BoundedTCPServer(base):  # type: ignore[misc, valid-type]
        aip_bounded = True

        async def run(self) -> None:
            config = self.config
            limit = getattr(config, "aip_max_connections", None)
            open_now = getattr(config, "aip_open_connections", 0)
            if limit is not None and open_now >= limit:
                self.writer.close()  # over the bound: closed before a byte is read
                return
            config.aip_open_connections = open_now + 1
            try:
                await super().run()
            finally:
                config.aip_open_connections -= 1

    setattr(hypercorn_run, "TCPServer", BoundedTCPServer)  # noqa: B010 (mypy: a class attribute of another module)


class _StructlogHandler(logging.Handler):
    """Forward hypercorn's stdlib log records to structlog (one JSON line on stderr, like ours)."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger("hypercorn").log(
            record.levelno, "hypercorn_log", message=record.getMessage(), exc_info=record.exc_info
        )


def hypercorn_logger() -> logging.Logger:
    """The logger both processes give hypercorn as its error log: its lines become structlog events."""
    logger = logging.getLogger("aip_crewai.hypercorn")
    if not logger.handlers:
        logger.addHandler(_StructlogHandler())
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logger


#: Paths of probes (readiness, liveness, scraping): their request lines are logged at debug, not info.
PROBE_PATHS = frozenset({"/ready", "/health", "/metrics"})


def hypercorn_config(
    bind: list[str],
    *,
    errorlog: logging.Logger | str | None = "-",
    graceful_timeout: float | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> Any:
    """The hypercorn ``Config`` of both processes, with the bounds of the module table.

    Args:
        bind: hypercorn bind strings (``fd://<n>``).
        errorlog: hypercorn's error logger.
        graceful_timeout: seconds open connections get at shutdown (None: hypercorn's default).
        max_connections: open TCP connections served at once (:func:`bound_connections`).
    """
    from hypercorn.config import Config

    refuse_cleartext_h2()
    bound_connections()
    config = Config()
    setattr(config, "aip_max_connections", max_connections)  # noqa: B010 (our own key on hypercorn's Config)
    config.bind = bind
    config.accesslog = None  # the apps log one summary line per request
    config.errorlog = errorlog
    config.keep_alive_timeout = HEADER_TIMEOUT_S
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.h2_max_concurrent_streams = H2_MAX_CONCURRENT_STREAMS
    config.read_timeout = None
    if graceful_timeout is not None:
        config.graceful_timeout = graceful_timeout
    return config
