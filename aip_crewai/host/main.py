"""``aip-crewai host --config host.toml``: the host process entry point.

Exit codes (README "Exit codes"): 0 after a clean shutdown (SIGTERM/SIGINT),
2 for a configuration or store-location error or a bind that cannot listen
(a taken port; one line on stderr naming the key, no traceback), 1 when
serving fails, 130 on a second SIGINT during shutdown (no drain).

Shutdown: the first SIGTERM/SIGINT ends open tenant streams and answers
blocking calls at once (``host.stopping``), gives other connections
:data:`CONNECTION_GRACE_S`, then drains in-flight dispatches (up to
``actions.DRAIN_S``).

Source: ARCHITECTURE.md §11 (operator interface), §1 (the host never imports CrewAI).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from ..log import configure_logging
from ..storage import release_lock
from .config import ConfigError, Settings, load_settings
from .store_schema import lock_postgres_store
from .store import (
    InsecureStorePath,
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
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aip-crewai host", description="Run the AIP host for CrewAI crews.")
    parser.add_argument("--config", required=True, help="path of host.toml (relative paths inside resolve against its directory)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                        help="json lines, console, or auto (json unless stderr is a terminal)")
    return parser


def load(config: str) -> Settings:
    """Load settings and pre-check the store location (both exit 2 in :func:`main`).

    Raises:
        ConfigError: the configuration is unusable.
        InsecureStorePath: the store location is unsafe.
        UnusableStore: the store file is not SQLite, is damaged, or is another application's.
    """
    settings = load_settings(config)
    if isinstance(settings.store_path, Path):  # a PostgreSQL store is checked when it is opened
        check_location(settings.store_path)
        check_store_file(settings.store_path)
    return settings


def own_store(settings: Settings) -> Callable[[], None]:
    """Own the store for this process; returns the release. A SQLite store: an exclusive lock on
    ``<store>.lock`` (:func:`~aip_crewai.host.store.lock_store`); a PostgreSQL store, shared by
    several hosts: a session advisory lock on this host's id
    (:func:`~aip_crewai.host.store_schema.lock_postgres_store`). Either lives as long as the process. Raises StoreLocked, InsecureStorePath or UnusableStore (all exit 2)."""
    if isinstance(settings.store_path, Path):
        fd = lock_store(settings.store_path)
        return lambda: release_lock(fd)
    conn = lock_postgres_store(settings.store_path, settings.host_id)
    return conn.close


def listen(bind: str) -> socket.socket:
    """Bind and listen on ``host:port`` (``[v6]:port`` too) before serving, so
    a taken port is one clear error instead of a failure after start-up.

    Raises: OSError (address in use, permission, unknown host)."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(port)), family=family, backlog=1024)


async def serve(settings: Settings, sock: socket.socket) -> None:
    """Serve the app with hypercorn on the bound ``sock`` until SIGTERM or SIGINT."""
    from hypercorn.asyncio import serve as hypercorn_serve

    from ..serving import hypercorn_config, hypercorn_logger
    from .app import create_app

    config = hypercorn_config([f"fd://{sock.fileno()}"],  # timeouts, header bound, no h2c (README "Security")
                              errorlog=hypercorn_logger(), graceful_timeout=CONNECTION_GRACE_S)
    app = create_app(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            if signum == signal.SIGINT:  # a second Ctrl-C: no drain
                log.warning("host_exit_now", signal=signal.Signals(signum).name)
                sys.stderr.flush()
                os._exit(EXIT_INTERRUPTED)
            return
        log.info("host_stopping", signal=signal.Signals(signum).name)
        app.state.stopping.set()  # open streams end, blocking calls answer (host.stopping)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the host. Returns the process exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(json=None if args.log_format == "auto" else args.log_format == "json", level=args.log_level)
    try:
        settings = load(args.config)
        release = own_store(settings)
    except (ConfigError, InsecureStorePath, UnusableStore, StoreLocked) as exc:
        print(f"aip-crewai host: configuration error: {exc.message}", file=sys.stderr)
        return 2
    try:
        return _run(settings)
    finally:
        release()


def _run(settings: Settings) -> int:
    try:
        sock = listen(settings.bind)
    except (OSError, ValueError) as exc:
        print(f"aip-crewai host: configuration error: [host] bind: cannot listen on {settings.bind}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings, sock))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the process boundary: log once, exit non-zero
        log.exception("host_failed", error=type(exc).__name__)
        return 1
    return 0
