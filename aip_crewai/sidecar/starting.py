"""The sidecar's start-up, before it serves: systemd's start timeout kept ahead, and the signals that arrive meanwhile.

- :func:`extending_start_timeout` sends ``EXTEND_TIMEOUT_USEC`` while the journal is checked and CrewAI is
  imported; :func:`sd_notify` sends one systemd notification.
- :class:`StartupSignals` handles SIGTERM, SIGINT, SIGHUP and SIGUSR1 from the moment logging is set up
  until the event loop's own handlers replace them (``main._serve``): start-up takes seconds to minutes
  (the CrewAI import, the fork server, the registry check), and Python's defaults would end the process
  without a line and leave the fork server and the registry check running. SIGTERM, SIGINT and SIGHUP raise
  :class:`StartupStopped` in the main thread, wherever it waits; ``main`` unwinds (the registry check
  process killed, the journal closed, the fork server killed and reaped), logs ``sidecar_stopped_starting``
  and exits :meth:`StartupStopped.status`. SIGUSR1 (a drain) is remembered: once start-up is done, the
  sidecar stops without listening, as a drain with nothing admitted ends (:attr:`StartupSignals.drain_asked`).

Source: docs/operating.md ("Operating under systemd", "Draining a sidecar"); docs/reference/cli.md "Exit codes";
sd_notify(3) ``EXTEND_TIMEOUT_USEC``.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import structlog

log = structlog.get_logger(__name__)

#: While starting, the sidecar asks systemd for this much more time (s) ...
EXTEND_BY_SECONDS = 30.0
#: ... every this many seconds (s) ...
EXTEND_EVERY_SECONDS = 5.0
#: ... for at most this long in all (s): a start stuck for longer is left to ``TimeoutStartSec``.
MAX_EXTENDED_START_SECONDS = 900.0

#: The signals that stop a start-up (SIGHUP: a closed terminal, as its default would, but with a line and no orphans).
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StartupStopped(BaseException):
    """A stop signal arrived during start-up (raised by :class:`StartupSignals` in the main thread).

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` of a start-up step swallows it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        """The exit status: 0 for SIGTERM and SIGINT, as a stop once running (docs/reference/cli.md "Exit
        codes"); 129 (128 + SIGHUP) for SIGHUP, the status its default action gave."""
        return 128 + self.signum if self.signum == signal.SIGHUP else 0


class StartupSignals:
    """The start-up's signal handlers (:meth:`install`), from logging set up until the event loop's own.

    A stop signal raises :class:`StartupStopped` once; later ones, and any once :meth:`settle` was called
    (start-up over: its refusal or its clean-up is under way), are ignored, so the clean-up is never cut.
    """

    def __init__(self) -> None:
        self.drain_asked = False
        self._settled = False

    def install(self) -> None:
        """Install the handlers (main thread only: ``signal.signal`` raises ValueError elsewhere)."""
        for signum in STOPPING:
            signal.signal(signum, self._stop)
        signal.signal(signal.SIGUSR1, self._drain)

    def settle(self) -> None:
        """From now on the handlers do nothing (a refusal or the clean-up of a stop is under way)."""
        self._settled = True

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self._settled:
            return
        self._settled = True
        raise StartupStopped(signum)

    def _drain(self, signum: int, frame: FrameType | None) -> None:
        if self._settled or self.drain_asked:
            return
        self.drain_asked = True
        log.info(
            "sidecar_drain_asked_starting",
            message="SIGUSR1 during start-up: the sidecar stops once started, without listening (nothing admitted)",
        )


@contextmanager
def extending_start_timeout(address: str | None) -> Iterator[None]:
    """Keep systemd's start timeout ahead of a slow start (journal check, recovery, CrewAI import).

    While the block runs, a thread sends ``EXTEND_TIMEOUT_USEC=<EXTEND_BY_SECONDS in µs>`` at once
    and then every :data:`EXTEND_EVERY_SECONDS`, for at most :data:`MAX_EXTENDED_START_SECONDS`.
    Without ``NOTIFY_SOCKET`` it does nothing.

    Source: docs/operating.md ("Operating under systemd"); sd_notify(3) ``EXTEND_TIMEOUT_USEC``.
    """
    if not address:
        yield
        return
    stop = threading.Event()
    message = f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_SECONDS * 1_000_000)}"

    def beat() -> None:
        deadline = time.monotonic() + MAX_EXTENDED_START_SECONDS
        while time.monotonic() < deadline:
            sd_notify(address, message)
            if stop.wait(EXTEND_EVERY_SECONDS):
                return

    thread = threading.Thread(target=beat, name="aip-crewai-start-extender", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def sd_notify(address: str | None, message: str) -> None:
    """Send one systemd notification datagram (``READY=1``) when ``NOTIFY_SOCKET`` is set.

    Abstract sockets (``@name``) are supported. Failures are logged, never raised.
    """
    if not address:
        return
    target = "\0" + address[1:] if address.startswith("@") else address
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            sock.sendall(message.encode("ascii"))
    except OSError as exc:
        log.warning("sd_notify_failed", error_type=type(exc).__name__)
