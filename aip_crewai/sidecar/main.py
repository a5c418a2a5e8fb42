"""``aip-crewai sidecar``: the process entry point (imperative shell).

Start-up order (nothing is served before the last step):

1. settings from flags and environment (:mod:`config`, token file type, mode
   and size included); an invalid setting prints one line on stderr and exits
   2 (no traceback);
2. logging to stderr (JSON unless stderr is a terminal);
3. a temporary journal directory when ``--allow-ephemeral`` and no journal;
4. the registry's module is located on the Python path without importing
   anything (``registry.locate_registry``) and the port is bound (not yet
   listening: connections are refused until ready); either failure is one
   line and exit 2 within a second or two, before the CrewAI import;
5. the journal: lock, permissions, integrity and schema checks, migrations,
   then the crash fence (exit 2 on refusal, e.g. "already owned by another
   active sidecar", a corrupt file or another application's database);
   ``journal_checked`` is logged;
6. CrewAI's environment (telemetry off, storage under the state dir), then
   ``crewai_importing``, ``import crewai`` (seconds to tens of seconds) and the
   crew registry with its preflight (exit 2 on a registry that fails to
   import or holds no crews); ``crewai_ready`` says the crews are built.
   With ``--isolation process`` (the default) both happen in the worker
   fork server and a registry check process forked from it, never in this
   process (one CrewAI import per sidecar, not two);
7. the socket listens, then hypercorn; once it accepts, ``sidecar_listening``
   is logged (with the real port, also for ``--port 0``) and systemd gets
   ``READY=1`` when ``NOTIFY_SOCKET`` is set.

Signals during start-up (steps 2 to 7, :class:`~aip_crewai.sidecar.starting.StartupSignals`): SIGTERM and
SIGINT stop it (the registry check process, the job workers and the fork server killed and reaped, the journal
closed), one line ``sidecar_stopped_starting`` is logged and the process exits 0, as after a stop once
running; SIGHUP does the same with exit 129 (128 + SIGHUP). SIGUSR1 logs ``sidecar_drain_asked_starting``:
once started, the sidecar stops without listening (``sidecar_drained``, READY=1 then STOPPING=1, exit 0),
as a drain with nothing admitted ends.

Drain on SIGUSR1: new jobs get 503 ``sidecar.draining`` (before admission: a host
places them elsewhere or retries them), admitted jobs run to their end, then the
shutdown below runs with nothing left to cancel and the process exits 0.

Shutdown on SIGTERM/SIGINT (and SIGHUP, a closed terminal: the same stop, exit 129): new admissions get 503, running jobs may finish
within ``--shutdown-grace-seconds``, the rest are cancelled with a terminal
event; then hypercorn stops accepting and closes connections, and the
lifespan kills the job worker processes left (``--isolation process``) and
closes the journal. With ``--isolation inprocess``, worker threads that
ignore cancellation cannot be stopped: if any is still busy, the process
exits without waiting for it (the journal is already closed). Nothing is
printed to stdout. A second SIGINT (Ctrl-C) during that shutdown stops at
once, as the host's does: the job workers and the fork server are killed, one
line ``sidecar_exit_now`` is logged and the process exits 130
(``Exit.INTERRUPTED``); the crash fence ends the jobs it left at the next
start. A second SIGTERM changes nothing.

Source: ARCHITECTURE.md §5, §11; ARCHITECTURE.md §2.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from aip_crewai import tracing
from aip_crewai.exit_codes import Exit
from aip_crewai.plumbing.log import configure_logging, log_stream
from aip_crewai.sidecar import tracing as sidecar_tracing
from aip_crewai.sidecar.config import ConfigError, Settings, load_settings, scrub_environment
from aip_crewai.sidecar.isolation.landlock import set_not_dumpable
from aip_crewai.sidecar.starting import StartupSignals, StartupStopped, extending_start_timeout, sd_notify

if TYPE_CHECKING:
    from aip_crewai.sidecar.http.app import CrewFacts
    from aip_crewai.sidecar.isolation.pool import WorkerPool
    from aip_crewai.sidecar.isolation.sandbox import SandboxPlan
    from aip_crewai.sidecar.journal.store import Journal

log = structlog.get_logger(__name__)

PROG = "aip-crewai sidecar"
WORKER_PREFIX = "aip-crewai-worker"
#: Seconds hypercorn waits for open connections once jobs are terminal.
CONNECTION_GRACE_SECONDS = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar until SIGTERM/SIGINT. Returns the exit status (0, 1 or 2; a second Ctrl-C during the
    shutdown exits 130 from its signal handler, :func:`_exit_now`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = load_settings(argv, os.environ)
        # Read before CrewAI's environment forces OTEL_SDK_DISABLED (docs/observing.md "Observing actions").
        sidecar_tracing.configure(tracing.trace_settings(os.environ))
    except ConfigError as exc:
        return _refuse(str(exc))
    except tracing.TracingConfigError as exc:
        return _refuse(str(exc))
    inline_token = scrub_environment(os.environ)  # before any process starts: none inherits the token
    configure_logging(
        json=None if settings.log_format == "auto" else settings.log_format == "json", level=settings.log_level
    )
    signals = StartupSignals()  # until the event loop's own handlers (_serve): start-up takes seconds to minutes
    signals.install()
    try:
        return _start(settings, inline_token, signals)
    except StartupStopped as stopped:  # _run's clean-up is done: the fork server and its children are gone
        log.warning(
            "sidecar_stopped_starting",
            signal=signal.Signals(stopped.signum).name,
            message="stopped during start-up, before serving anything",
        )
        return stopped.status
    except ImportError as exc:  # the sidecar's own stack (a crew registry's import is refused where it is loaded)
        name = exc.name or "a module"
        return _refuse(
            f"cannot import {name!r} ({type(exc).__name__}): a module or package {name.split('.')[0]!r} on "
            "PYTHONPATH or in the working directory may shadow the installed one"
        )


def _start(settings: Settings, inline_token: bool, signals: StartupSignals) -> int:
    """From logging set up to the exit status: the start-up, then serving (:func:`_run`)."""
    for event, message in settings.warnings:  # e.g. an inline token (never the token itself)
        log.warning(event, message=message)
    if inline_token:  # /proc/<pid>/environ keeps the process's first environment: root's alone from now on
        try:
            set_not_dumpable()
        except OSError as exc:
            log.warning("sidecar_dumpable", error_type=type(exc).__name__)
    temporary: str | None = None
    if settings.journal is None:
        temporary = tempfile.mkdtemp(prefix="aip-crewai-sidecar-")
        settings = replace(
            settings,
            journal=Path(temporary) / "journal.db",
            state_dir=settings.state_dir or Path(temporary),
            ephemeral=True,
        )
        log.warning("journal_ephemeral", journal=str(settings.journal))
    try:
        settings = replace(settings, worker_sandbox=_sandbox_plan(settings))
    except ValueError as exc:
        return _refuse(f"worker sandbox: {exc}")
    try:
        return _run(settings, signals)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)


def _sandbox_plan(settings: Settings) -> SandboxPlan | None:
    """The job workers' sandbox (``isolation/sandbox.py``), None with ``--isolation inprocess``; the
    start-up warning names what is missing. Raises ValueError: a protected path where workers may write."""
    from aip_crewai.sidecar.isolation import sandbox

    plan = None
    if settings.isolation == "process":
        plan = sandbox.plan(
            state_dir=str(settings.state_dir),
            journal=str(settings.journal) if settings.journal else None,
            token_file=str(settings.token_file) if settings.token_file else None,
            training_dir=str(settings.training_dir) if settings.training_dir else None,
            user=settings.worker_user,
            landlock_abi=sandbox.landlock_abi(),
            sidecar_pid=os.getpid(),
        )
    found = sandbox.report(isolation=settings.isolation, sandbox=plan, euid=os.geteuid())
    if found.missing:
        log.warning(
            "worker_sandbox_missing", mode=found.mode, missing=found.missing, message=sandbox.describe_missing(found)
        )
    else:
        log.info("worker_sandbox", mode=found.mode, landlock_abi=found.landlock_abi, worker_user=found.worker_user)
    if plan is not None and (shared := sandbox.shared_spines(plan)):
        log.warning(
            "worker_sandbox_shared_directory",
            directories=shared,
            message="an entry made in these directories after a job's worker booted is out of that job's reach "
            "(a file made in /tmp, say): keep the state directory and the token file out of them",
        )
    return plan


def _run(settings: Settings, signals: StartupSignals) -> int:
    from aip_crewai.sidecar.registry import RegistryError, locate_registry

    try:  # the checks that need no CrewAI come first: each refusal is one line within a second or two
        locate_registry(settings.registry)
    except RegistryError as exc:
        return _refuse(f"--registry (AIP_CREWAI_REGISTRY): {exc}")
    try:
        sock = _bind(settings.host, settings.port)  # bound now (nobody else takes the port), listening once ready
    except OSError as exc:
        return _refuse(f"--host/--port: cannot listen on {settings.host}:{settings.port}: {exc.strerror}")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = ThreadPoolExecutor(max_workers=max(8, 4 * settings.max_concurrency), thread_name_prefix=WORKER_PREFIX)
    loop.set_default_executor(pool)
    try:
        with extending_start_timeout(settings.notify_socket):
            journal = loop.run_until_complete(_open_journal(settings))
        if journal is not None:
            log.info("journal_checked", journal=str(settings.journal))
        status = 2 if journal is None else _load_and_serve(loop, settings, journal, sock, signals)
    finally:
        signals.settle()  # a refusal's or a stop's clean-up is never cut by a signal
        sock.close()  # a no-op once hypercorn owns its descriptor
        stuck = _close_loop(loop, pool)  # a start stopped by a signal: _serve's task closes the workers here
        if settings.isolation == "process":  # its workers are gone by now (closed, or never started)
            from aip_crewai.sidecar.isolation.fork_server import stop_forkserver

            stop_forkserver()
    if stuck:
        log.warning("worker_threads_abandoned", threads=stuck)
        log_stream().flush()
        os._exit(status)  # busy worker threads would block interpreter exit forever
    return status


async def _open_journal(settings: Settings) -> Journal | None:
    """Open, check and recover the journal; None (refusal printed) when it cannot be used."""
    from aip_crewai.sidecar.errors import JournalError
    from aip_crewai.sidecar.http.app import recover
    from aip_crewai.sidecar.journal.store import Journal

    if settings.journal is None:  # main() sets an ephemeral one; config requires it otherwise
        raise RuntimeError("settings.journal is not set")
    try:
        journal = await Journal.open(settings.journal)
    except JournalError as exc:
        _refuse(f"--journal (AIP_CREWAI_STATE_FILE): {exc.message}")
        return None
    try:
        await recover(journal)
    except JournalError as exc:  # e.g. a page the integrity check could not see fails the crash fence's write
        await journal.close()
        _refuse(
            f"--journal (AIP_CREWAI_STATE_FILE): the crash fence could not be recorded in {settings.journal} "
            f"({exc.message}); check the disk, or restore the journal from a backup"
        )
        return None
    except BaseException:
        await journal.close()
        raise
    return journal


def _load_and_serve(
    loop: asyncio.AbstractEventLoop, settings: Settings, journal: Journal, sock: socket.socket, signals: StartupSignals
) -> int:
    """Import CrewAI and the registry, then serve; the journal is closed on every path."""
    try:
        with extending_start_timeout(settings.notify_socket):
            loaded = _load_crews(settings)
    except BaseException:
        loop.run_until_complete(journal.close())
        raise
    if isinstance(loaded, int):  # refused
        loop.run_until_complete(journal.close())
        return loaded
    crews, executor, facts = loaded
    try:
        sidecar_tracing.install()  # this process's job spans; after the fork server and the registry check
    except tracing.TracingConfigError as exc:
        loop.run_until_complete(journal.close())
        return _refuse(str(exc))
    try:
        return loop.run_until_complete(_serve(settings, crews, executor, journal, facts, sock, signals))
    finally:
        sidecar_tracing.shutdown()


def _load_crews(settings: Settings) -> tuple[frozenset[str], object, CrewFacts] | int:
    """CrewAI's environment, ``import crewai`` and the registry; an exit status when refused.

    With ``--isolation process`` this process never imports CrewAI: the worker fork server does (once,
    for every worker), and the registry and the start-up preflight are checked in one process forked from
    it (``fork_server.describe_registry``), whose answer gives the crew ids and their facts; the executor is a
    :class:`~aip_crewai.sidecar.isolation.pool.WorkerPool` whose workers the app's lifespan boots before serving.
    With ``--isolation inprocess`` this process imports CrewAI and the registry itself.
    """
    from aip_crewai.sidecar.crewai_env import capture_crewai_prints, prepare_crewai_environment

    started = time.monotonic()
    capture_crewai_prints()
    try:
        prepare_crewai_environment(settings.state_dir)  # type: ignore[arg-type]
    except OSError as exc:  # a read-only or full file system: one line naming the setting, never a traceback
        where = exc.filename or settings.state_dir
        return _refuse(
            f"--state-dir (AIP_CREWAI_STATE_DIR): cannot prepare CrewAI's storage at {where}: {exc.strerror}"
        )
    log.info("crewai_importing", isolation=settings.isolation)
    loaded = _load_in_workers(settings) if settings.isolation == "process" else _load_here(settings)
    if isinstance(loaded, int):
        return loaded
    crews, _, facts = loaded
    log.info(
        "crewai_ready",
        crews=len(crews),
        unusable_crews=len(facts.problems),
        import_ms=int((time.monotonic() - started) * 1000),
        isolation=settings.isolation,
    )
    return loaded


def _load_here(settings: Settings) -> tuple[frozenset[str], object, CrewFacts] | int:
    """``import crewai`` and the registry in this process (``--isolation inprocess``)."""
    from aip_crewai.sidecar.crewai_env import import_crewai

    try:
        import_crewai()
    except Exception as exc:  # a broken install: say which, never a traceback of provider text
        return _import_failed(type(exc).__name__)
    from aip_crewai.sidecar.http.app import registry_executor
    from aip_crewai.sidecar.registry import RegistryError

    try:
        return registry_executor(settings.registry, preflight=True)
    except (RegistryError, ImportError) as exc:
        return _refuse(f"--registry (AIP_CREWAI_REGISTRY): {exc}")


def _load_in_workers(settings: Settings) -> tuple[frozenset[str], object, CrewFacts] | int:
    """The fork server, the registry check forked from it, and the worker pool (``--isolation process``)."""
    from aip_crewai.sidecar.http.app import CrewFacts
    from aip_crewai.sidecar.isolation.fork_server import (
        ForkServerThreaded,
        WorkerStartFailed,
        describe_registry,
        start_forkserver,
    )
    from aip_crewai.sidecar.isolation.pool import WorkerPool
    from aip_crewai.sidecar.isolation.sandbox import hand_over
    from aip_crewai.sidecar.isolation.wire import Boot

    if settings.worker_sandbox is not None:
        try:  # CrewAI's storage, the namespaces and the training directory become the worker user's
            hand_over(settings.worker_sandbox)
        except OSError as exc:
            return _refuse(f"--worker-user (AIP_CREWAI_WORKER_USER): {exc}")
    try:
        context = start_forkserver(settings.preload_modules)
    except OSError as exc:  # one line and exit 1, never a traceback (docs/reference/cli.md "Exit codes")
        log.error("fork_server_failed", error=str(exc))
        return _refuse(f"--isolation process: the worker fork server did not start ({exc})", status=1)
    json_logs = settings.log_format == "json" or (settings.log_format == "auto" and not sys.stderr.isatty())
    traced = sidecar_tracing.settings()
    boot = Boot(
        settings.registry,
        str(settings.state_dir),
        json_logs,
        settings.log_level,
        settings.worker_sandbox,
        traced.protocol if traced is not None else None,
        traced.capture_content if traced is not None else False,
        nice=settings.worker_nice,
        jobs=settings.worker_jobs,
    )
    try:
        described = describe_registry(context, boot)
    except ForkServerThreaded as exc:
        return _refuse(f"--isolation process: {exc}")
    except WorkerStartFailed as exc:
        log.error("registry_check_failed", error=str(exc))
        return _refuse(f"cannot check the crew registry: {exc}", status=1)
    for module, error_type in described.preload_skipped:
        log.warning("preload_module_skipped", module=module, error_type=error_type, setting="--preload-modules")
    if described.import_failed is not None:
        return _import_failed(described.import_failed)
    if described.refused is not None:
        return _refuse(f"--registry (AIP_CREWAI_REGISTRY): {described.refused}")
    executor = WorkerPool(
        boot,
        settings.max_concurrency,
        cancel_grace_seconds=settings.cancel_grace_seconds,
        max_events=settings.max_events_per_run,
        max_event_bytes=settings.max_event_bytes,
        context=context,
        idle=settings.idle_workers,
        shrink_after_s=settings.idle_shrink_seconds,
    )
    return frozenset(described.crews), executor, CrewFacts(described.problems, described.inputs)


def _import_failed(error_type: str) -> int:
    log.error("crewai_import_failed", error_type=error_type)
    return _refuse(f"cannot import CrewAI ({error_type})", status=1)


async def _serve(
    settings: Settings,
    crews: frozenset[str],
    executor: object,
    journal: Journal,
    crew_facts: CrewFacts,
    sock: socket.socket,
    signals: StartupSignals,
) -> int:
    from aip_crewai.sidecar.isolation.fork_server import ForkServerThreaded
    from aip_crewai.sidecar.isolation.pool import WorkerPool

    workers = executor if isinstance(executor, WorkerPool) else None
    try:
        # The serving stack, in the try: an ImportError (a file on PYTHONPATH shadowing a package it needs)
        # closes the workers and the journal, then is one line (main)
        from hypercorn.asyncio import serve

        from aip_crewai.plumbing.serving import hypercorn_config, hypercorn_logger
        from aip_crewai.sidecar.http.app import create_app

        if workers is not None:  # before listening: a refusal is one line (the lifespan's start is then a no-op)
            await workers.start()
        if signals.drain_asked:  # SIGUSR1 during start-up: a drain with nothing admitted ends in a stop
            return await _drained_starting(settings, workers, journal)
        fd, port = _listen(sock)
    except (OSError, ForkServerThreaded) as exc:
        if workers is not None:
            await workers.close()
        await journal.close()
        if isinstance(exc, ForkServerThreaded):
            return _refuse(f"--isolation process: {exc}")
        return _refuse(f"--host/--port: cannot listen on {settings.host}:{settings.port}: {exc.strerror}")
    except BaseException:
        if workers is not None:
            await workers.close()
        await journal.close()
        raise
    app = create_app(
        settings,
        crews=crews,
        executor=executor,  # type: ignore[arg-type]
        journal=journal,
        crew_facts=crew_facts,
        workers=workers,
    )
    # timeouts, header bound, no h2c (docs/security.md "Security")
    config = hypercorn_config([f"fd://{fd}"], errorlog=hypercorn_logger(), graceful_timeout=CONNECTION_GRACE_SECONDS)
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    hangup: list[bool] = []  # the stopping signal was SIGHUP: exit 129 (128 + SIGHUP), as its default gives

    def on_signal(signum: int) -> None:
        if stop.is_set() and signum == signal.SIGINT:  # a second Ctrl-C: no grace, no cancel
            _exit_now(settings, workers, signum)
        if not stop.is_set():
            hangup.append(signum == signal.SIGHUP)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: a closed terminal, the same stop
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGUSR1, drain.set)
    if signals.drain_asked:  # it came after the check above, before this handler
        drain.set()

    async def shutdown_trigger() -> None:
        # hypercorn starts this once its servers accept connections
        log.info(
            "sidecar_listening",
            host=settings.host,
            port=port,
            journal=str(settings.journal),
            durable_journal=not settings.ephemeral,
            authenticated=settings.token is not None,
        )
        sd_notify(settings.notify_socket, "READY=1")
        await _until_stopped_or_drained(stop, drain, getattr(app.state, "runtime", None))
        log.info("sidecar_stopping", grace_seconds=settings.shutdown_grace_seconds)
        sd_notify(settings.notify_socket, "STOPPING=1")
        if workers is not None:
            workers.stop_replacing()  # the fork server may already have had a SIGTERM of its own
        runtime = getattr(app.state, "runtime", None)
        if runtime is not None:
            await runtime.shutdown(settings.shutdown_grace_seconds)

    await serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
    log.info("sidecar_stopped")
    return Exit.HANGUP if hangup[:1] == [True] else 0


async def _drained_starting(settings: Settings, workers: WorkerPool | None, journal: Journal) -> int:
    """A drain asked during start-up (SIGUSR1), once started: stop without listening (nothing was admitted), as
    a drain ends; READY=1 then STOPPING=1 tell systemd the start was clean (docs/operating.md "Draining a
    sidecar"). Exit status 0."""
    if workers is not None:
        await workers.close()
    await journal.close()
    sd_notify(settings.notify_socket, "READY=1")
    sd_notify(settings.notify_socket, "STOPPING=1")
    log.info("sidecar_drained", message="a drain asked during start-up: stopped without listening (nothing admitted)")
    return 0


def _exit_now(settings: Settings, workers: WorkerPool | None, signum: int) -> NoReturn:
    """A second Ctrl-C during the shutdown: kill the job workers and the fork server, log one line, exit
    :attr:`Exit.INTERRUPTED` (130) without waiting for the jobs or closing the journal (its commits are
    durable; the crash fence ends the jobs left running at the next start, ARCHITECTURE.md §5)."""
    if workers is not None:  # first: the stop never depends on the log sink
        workers.kill_all_now()
    if settings.isolation == "process":
        from aip_crewai.sidecar.isolation.fork_server import stop_forkserver

        stop_forkserver()
    log.warning(
        "sidecar_exit_now",
        signal=signal.Signals(signum).name,
        message="a second Ctrl-C: stopped without waiting for the running jobs (the next start's crash fence "
        "ends them)",
    )
    if settings.ephemeral and settings.journal is not None:  # main()'s temporary directory
        shutil.rmtree(settings.journal.parent, ignore_errors=True)
    log_stream().flush()
    os._exit(Exit.INTERRUPTED)


async def _until_stopped_or_drained(stop: asyncio.Event, drain: asyncio.Event, runtime: Any) -> None:
    """Return on SIGTERM/SIGINT (``stop``), or once a drain asked by SIGUSR1 (``drain``) has let every
    admitted job end (``Runtime.drain``; a SIGTERM meanwhile ends the wait at once). docs/operating.md "Draining a
    sidecar"."""
    stopped = asyncio.ensure_future(stop.wait())
    drain_asked = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait({stopped, drain_asked}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set() or runtime is None:
            return
        log.info("sidecar_draining", active_runs=runtime.health()["active_runs"])
        drained = asyncio.ensure_future(runtime.drain())
        await asyncio.wait({stopped, drained}, return_when=asyncio.FIRST_COMPLETED)
        if drained.done():
            log.info("sidecar_drained")
        else:
            drained.cancel()
    finally:
        for waiter in (stopped, drain_asked):
            waiter.cancel()


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not yet listening (connections are refused until :func:`_listen`).

    Raises:
        OSError: the address cannot be resolved or bound (in use, not local, no permission).
    """
    family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _listen(sock: socket.socket) -> tuple[int, int]:
    """Start listening on the bound ``sock``; return ``(detached fd, actual port)``."""
    sock.listen(1024)
    port: int = sock.getsockname()[1]
    return sock.detach(), port


def _close_loop(loop: asyncio.AbstractEventLoop, pool: ThreadPoolExecutor) -> list[str]:
    """Close the loop without waiting on busy worker threads; return their names."""
    try:
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=2.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        loop.close()
    deadline = time.monotonic() + 1.0
    workers = [t for t in threading.enumerate() if t.name.startswith(WORKER_PREFIX)]
    for thread in workers:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in workers if t.is_alive()]


def _refuse(message: str, *, status: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=log_stream())  # the real stderr, not crew code's filter
    return status
