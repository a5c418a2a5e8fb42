"""``aip-crewai host --config host.toml``: the host process entry point.

Exit codes (docs/reference/cli.md "Exit codes"): 0 after a clean shutdown (SIGTERM/SIGINT),
2 for a configuration or store-location error or a bind that cannot listen
(a taken port; one line on stderr naming the key, no traceback), 1 when
serving fails, 130 on a second SIGINT during shutdown (no drain).

Shutdown: the first SIGTERM/SIGINT ends open tenant streams and answers
blocking calls at once (``host.stopping``), gives other connections
:data:`CONNECTION_GRACE_S`, then drains in-flight dispatches (up to
``http.lifespan.DRAIN_S``).

Source: ARCHITECTURE.md §11 (operator interface), §1 (the host never imports CrewAI).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from .. import tracing
from ..exit_codes import Exit
from ..plumbing.log import configure_logging
from ..plumbing.storage import release_lock
from . import tracing as host_tracing
from .config import HostConfigError, load_settings
from .settings import Settings
from .store.engines.postgres import PostgresHostLock
from .store.store import (
    InsecureStorePath,
    StoreError,
    StoreLocked,
    UnusableStore,
    check_location,
    check_store_file,
    lock_store,
)

log = structlog.get_logger(__name__)

#: Seconds hypercorn gives open connections at shutdown (streams end at once; this bounds the rest).
CONNECTION_GRACE_S = 5.0
#: Exit status of a second SIGINT during shutdown (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = Exit.INTERRUPTED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aip-crewai host", description="Run the AIP host for CrewAI crews.")
    parser.add_argument(
        "--config", required=True, help="path of host.toml (relative paths inside resolve against its directory)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "console"],
        help="json lines, console, or auto (json unless stderr is a terminal)",
    )
    return parser


def load(config: str) -> Settings:
    """Load settings and pre-check the store location (both exit 2 in :func:`main`).

    Raises:
        HostConfigError: the configuration is unusable.
        InsecureStorePath: the store location is unsafe.
        UnusableStore: the store file is not SQLite, is damaged, or is another application's.
    """
    settings = load_settings(config)
    if isinstance(settings.store_path, Path):  # a PostgreSQL store is checked when it is opened
        check_location(settings.store_path)
        check_store_file(settings.store_path)
    return settings


def own_store(settings: Settings) -> tuple[Callable[[], None], PostgresHostLock | None]:
    """Own the store for this process; returns ``(release, host_lock)``. A SQLite store: an exclusive
    lock on ``<store>.lock`` (:func:`~aip_crewai.host.store.store.lock_store`; ``host_lock`` None); a PostgreSQL
    store, shared by several hosts: a session advisory lock on this host's id
    (:class:`~aip_crewai.host.store.engines.postgres.PostgresHostLock`, re-checked by :func:`guard_host_lock`).
    Either lives as long as the process. Raises StoreLocked, InsecureStorePath or UnusableStore (all exit 2)."""
    if isinstance(settings.store_path, Path):
        fd = lock_store(settings.store_path)
        return (lambda: release_lock(fd)), None
    assert settings.host_id is not None
    lock = PostgresHostLock(settings.store_path, settings.host_id, settings.store_timeouts)
    return lock.close, lock


async def guard_host_lock(lock: PostgresHostLock, interval_s: float, lost: Callable[[], None]) -> None:
    """Every ``interval_s`` seconds, check this host still holds its host id on the PostgreSQL store
    (:meth:`PostgresHostLock.verify`, on a thread); when another process took the id (after a database
    restart dropped the lock), log ``host_id_taken`` and call ``lost`` once (the host stops). Runs until
    cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        held = await asyncio.to_thread(lock.verify)
        if held is False:
            log.error(
                "host_id_taken",
                host_id=lock.host_id,
                reason="the database dropped this host's id lock and another process took the id",
            )
            lost()
            return


class _LibraryLog(logging.Handler):
    """Forwards a library's stdlib log records (warnings and worse) to structlog: one line each, in the
    process's format (JSON lines by default), its first line only (psycopg's connection errors span two)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage().splitlines()
        except Exception:  # a malformed record must not break logging
            text = [str(record.msg)]
        structlog.get_logger(record.name).log(
            record.levelno, "library_log", library=record.name, message=(text[0] if text else "")[:500]
        )


def route_library_logs(name: str) -> None:
    """Send logger ``name``'s records at WARNING and above through structlog instead of Python's
    last-resort handler (plain multi-line text on stderr): the psycopg pool's reconnection messages."""
    library = logging.getLogger(name)
    library.handlers = [_LibraryLog(logging.WARNING)]
    library.propagate = False


def listen(bind: str) -> socket.socket:
    """Bind and listen on ``host:port`` (``[v6]:port`` too) before serving, so
    a taken port is one clear error instead of a failure after start-up.

    Raises: OSError (address in use, permission, unknown host)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(port)), family=family, backlog=1024)


#: Exit status of a host that stopped because another process took its host id (systemd restarts it).
EXIT_HOST_ID_TAKEN = 1


async def serve(settings: Settings, sock: socket.socket, host_lock: PostgresHostLock | None = None) -> int:
    """Serve the app with hypercorn on the bound ``sock`` until SIGTERM or SIGINT (returns 0), or until
    another process takes this host's id on a PostgreSQL store (``host_lock`` re-checked every third of
    the lease; returns :data:`EXIT_HOST_ID_TAKEN`)."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.utils import LifespanFailureError

    from ..plumbing.serving import hypercorn_config, hypercorn_logger
    from .http.app import create_app
    from .http.state import host_setup, startup_error

    config = hypercorn_config(
        [f"fd://{sock.fileno()}"],  # timeouts, header bound, no h2c (docs/security.md "Security")
        errorlog=hypercorn_logger(),
        graceful_timeout=CONNECTION_GRACE_S,
    )
    app = create_app(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    hangup: list[bool] = []  # the stopping signal was SIGHUP: exit 129 (128 + SIGHUP), as its default gives

    def on_signal(signum: int) -> None:
        if stop.is_set():
            if signum == signal.SIGINT:  # a second Ctrl-C: no drain
                log.warning("host_exit_now", signal=signal.Signals(signum).name)
                sys.stderr.flush()
                os._exit(EXIT_INTERRUPTED)
            return
        hangup.append(signum == signal.SIGHUP)
        host_setup(app).stopping.set()  # open streams end, blocking calls answer (http.stopping)
        stop.set()  # before the log line: the stop never depends on the log sink
        log.info("host_stopping", signal=signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: a closed terminal, the same stop
        loop.add_signal_handler(signum, on_signal, signum)
    taken: list[bool] = []

    def lost() -> None:
        taken.append(True)
        host_setup(app).stopping.set()
        stop.set()

    guard = (
        None
        if host_lock is None
        else asyncio.ensure_future(guard_host_lock(host_lock, max(settings.lease_s / 3, 0.05), lost))
    )
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    except LifespanFailureError:
        error = startup_error(app)
        if isinstance(error, StoreError):  # the store could not be opened: one line, exit 2
            raise error from None
        raise
    finally:
        if guard is not None:
            guard.cancel()
    if taken:
        return EXIT_HOST_ID_TAKEN
    return Exit.HANGUP if hangup[:1] == [True] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the host. Returns the process exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(json=None if args.log_format == "auto" else args.log_format == "json", level=args.log_level)
    route_library_logs("psycopg")
    try:
        settings = load(args.config)
        traced = tracing.trace_settings()
        release, host_lock = own_store(settings)
    except (HostConfigError, InsecureStorePath, UnusableStore, StoreLocked) as exc:
        print(f"aip-crewai host: configuration error: {exc.message}", file=sys.stderr)
        return 2
    except tracing.TracingConfigError as exc:
        print(f"aip-crewai host: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        host_tracing.activate(None if traced is None else tracing.install(traced, "aip-crewai-host"))
        return _run(settings, host_lock)
    except tracing.TracingConfigError as exc:
        print(f"aip-crewai host: configuration error: {exc}", file=sys.stderr)
        return 2
    finally:
        installed = host_tracing.deactivate()
        if installed is not None:
            installed.shutdown()
        release()


def _run(settings: Settings, host_lock: PostgresHostLock | None = None) -> int:
    try:
        sock = listen(settings.bind)
    except (OSError, ValueError) as exc:
        print(
            f"aip-crewai host: configuration error: [host] bind: cannot listen on {settings.bind}: "
            f"{getattr(exc, 'strerror', None) or exc}",
            file=sys.stderr,
        )
        return 2
    try:
        return asyncio.run(serve(settings, sock, host_lock))
    except KeyboardInterrupt:
        return 0
    except StoreError as exc:  # raised while opening the store (e.g. a PostgreSQL pool not filled in time)
        print(f"aip-crewai host: store error: {exc.message}", file=sys.stderr)
        return 2
    except Exception as exc:  # the process boundary: log once, exit non-zero
        log.exception("host_failed", error=type(exc).__name__)
        return 1
