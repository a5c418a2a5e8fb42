"""The worker fork server, and what is forked from it at start-up (``--isolation process``).

- :func:`start_forkserver` starts multiprocessing's fork server (it preloads :data:`PRELOAD`: CrewAI and
  the operations, never the crew registry); every worker of :class:`~aip_crewai.sidecar.isolation.pool.WorkerPool`
  and the registry check fork from it.
- :func:`describe_registry` is the start-up registry check: one process forked from the fork server loads
  the registry and runs the preflight (``worker.describe``) and answers with a
  :class:`~aip_crewai.sidecar.isolation.wire.Described` frame.
- The start-up failures: :class:`WorkerStartFailed` (no worker or no check answer: exit 1) and
  :class:`ForkServerThreaded` (the fork server had threads: refused, exit 2); :func:`describe_exit`
  names a process's exit status in their messages (and in the pool's).

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
from collections.abc import Sequence
from multiprocessing.context import BaseContext
from typing import Any

from aip_crewai.sidecar.isolation.wire import (
    HEADER,
    Boot,
    Described,
    FrameError,
    FromWorker,
    Refused,
    decode_from_worker,
    encode_boot,
    frame_bound,
    payload_length,
)
from aip_crewai.sidecar.options import DEFAULT_PRELOAD_MODULES, PRELOAD_ENV

#: Modules the fork server imports before it forks any worker (``preload`` warms CrewAI up, then freezes what is loaded,
#: so everything before it in the list too; ``sidecar.tracing``, which every job's ``run_job`` imports, would cost each
#: fresh worker's first job about 2 ms; ``examples.offline_llm``, the demo and offline crews' model, about 20 ms of
#: each worker's boot). multiprocessing runs the sidecar's main module again in every child before its target:
#: ``aip_crewai.cli`` here means that run imports nothing (it used to import the command line, about 10 ms of CPU per
#: worker); ``__main__`` lets a Python with CPython gh-126631 fixed (3.13 and later) skip the run altogether when the
#: main is a script. ``--preload-modules`` are imported by ``preload`` itself, first (:func:`start_forkserver`).
PRELOAD = [
    "aip_crewai.sidecar.isolation.pool",
    "aip_crewai.sidecar.isolation.worker",
    "aip_crewai.sidecar.tracing",
    "aip_crewai.cli",
    "aip_crewai.examples.offline_llm",
    "aip_crewai.sidecar.operations.startup.preload",
    "__main__",
]
#: How long a worker may take to boot (s); the first ones wait for the fork server's CrewAI import.
BOOT_TIMEOUT_SECONDS = 300.0
#: How long a killed worker's exit is awaited (s).
REAP_SECONDS = 10.0


def start_forkserver(modules: Sequence[str] = DEFAULT_PRELOAD_MODULES) -> BaseContext:
    """Start the worker fork server now (it imports CrewAI in the background) and return its context.

    ``modules`` (``--preload-modules``, passed in ``options.PRELOAD_ENV``) are imported by the ``preload`` module
    before CrewAI, with the sidecar's rights: by default what CrewAI imports lazily on a job's first use of its
    default provider and of knowledge, about 390 ms of CPU (and up to 16 MiB of its own memory) that a fresh
    worker would otherwise spend on each job of a crew on an OpenAI-compatible model (docs/operating.md
    "Preloaded modules"). One whose import raises is skipped (``Described.preload_skipped`` names it); one
    that starts a thread makes every worker refuse to boot, as below.

    Call after ``crewai_env.prepare_crewai_environment`` and
    ``capture_crewai_prints``: the fork server inherits the environment and
    file descriptors 1 and 2 of this moment.

    The crew registry is *not* preloaded: a registry module may start threads
    at import (an SDK's metrics flusher, an exporter), and a process forked
    while another thread holds a lock inherits the lock held forever (a job that
    needs it hangs until its timeout). The fork server imports only CrewAI and our own
    modules and records any thread left besides its main one
    (``operations/startup/preload.FORK_SERVER_THREADS``); each worker imports the
    registry after the fork (its threads start in the worker, where they are
    safe) and refuses to boot if the fork server was not single-threaded.

    Source: ARCHITECTURE.md §5 (isolation).
    """
    context = multiprocessing.get_context("forkserver")
    os.environ[PRELOAD_ENV] = ",".join(modules)  # the fork server inherits this process's environment
    context.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return context


class WorkerStartFailed(RuntimeError):
    """The pool could not start its workers (the sidecar stops: exit 1)."""


class ForkServerThreaded(WorkerStartFailed):
    """The fork server had threads besides its main one: no worker may be forked from it (the sidecar
    refuses to start: one line, exit 2)."""

    def __init__(self, threads: list[str]) -> None:
        names = ", ".join(threads[:8]) + (f" and {len(threads) - 8} more" if len(threads) > 8 else "")
        super().__init__(
            f"the job worker fork server runs {len(threads)} thread(s) besides its main one ({names}); "
            "workers forked from it could inherit a lock held forever. Something it imports starts "
            "them: set OPENBLAS_NUM_THREADS=1 for numpy's, leave a module that starts one out of --preload-modules, "
            "or use --isolation inprocess"
        )
        self.threads = threads


def stop_forkserver() -> None:
    """Kill the worker fork server started by :func:`start_forkserver`, if any, and reap it; call once no
    worker is left. It would end by itself when this process exits, unless a thread it was left with (a
    preloaded module's, see :class:`ForkServerThreaded`) or an import still under way keeps it alive.
    It holds no state of its own: SIGKILL loses nothing."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # multiprocessing's one fork server (its pid and _stop: 3.7 to 3.13)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        server._stop()  # closes its descriptors, reaps it, removes its socket file
    except OSError:  # reaped or its socket removed already (a cleaned temporary directory): nothing left to do
        pass


def describe_registry(context: BaseContext, boot: Boot, *, timeout: float = BOOT_TIMEOUT_SECONDS) -> Described:
    """The start-up registry check, in a process forked from the fork server (``worker.describe``).

    Blocks until its answer (the fork server's CrewAI import included), at most ``timeout`` seconds; the
    process is then reaped (killed if it lingers). With process isolation this replaces the sidecar's own
    ``import crewai`` and registry load: the crew ids and the preflight's facts come from here.

    Returns:
        the :class:`~aip_crewai.sidecar.isolation.wire.Described` answer (``refused`` / ``import_failed`` set when refused).

    Raises:
        ForkServerThreaded: the fork server had threads besides its main one (the check refused to run).
        WorkerStartFailed: the fork server did not start the process (its ``OSError`` named), or no answer
            (the process died, timed out or sent a bad frame; the message names its exit status).
        BaseException: whatever interrupts the wait (the start-up's signal handler's ``StartupStopped``) goes
            on once the process is killed and reaped.

    Source: ARCHITECTURE.md §5 (isolation).
    """
    ours, theirs = socket.socketpair()
    process = context.Process(  # type: ignore[attr-defined]
        target=_describe_entry,
        args=(theirs, encode_boot(boot)),
        name="aip-crewai-registry-check",
        daemon=False,
    )
    try:
        process.start()
    except OSError as exc:  # the fork server cannot be reached (it died, or this user may not connect to it)
        ours.close()
        raise WorkerStartFailed(f"the fork server did not start the registry check process ({exc})") from None
    except EOFError:  # it ended before answering: during its own start-up, a module it imports ended it
        ours.close()
        raise WorkerStartFailed(
            "the worker fork server ended during its start-up (did a module of --preload-modules end the process?)"
        ) from None
    finally:
        theirs.close()
    answer: FromWorker | None = None
    try:
        ours.settimeout(timeout)
        header = _read_exactly(ours, HEADER.size)
        answer = decode_from_worker(_read_exactly(ours, payload_length(header, frame_bound(262_144))))
    except (OSError, EOFError, FrameError):
        answer = None
    except BaseException:  # a stop during start-up (``starting.StartupStopped``): kill it now, no answer awaited
        process.kill()
        raise
    finally:
        ours.close()
        process.join(REAP_SECONDS)
        if process.exitcode is None:
            process.kill()
            process.join(REAP_SECONDS)
    if isinstance(answer, Refused):
        raise ForkServerThreaded(answer.threads)
    if not isinstance(answer, Described):
        raise WorkerStartFailed(
            f"the registry check process ended without an answer ({describe_exit(process.exitcode)})"
        )
    return answer


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from a blocking socket. Raises EOFError at end of file, OSError (timeouts too)."""
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise EOFError
        data += piece
    return bytes(data)


def describe_exit(exitcode: int | None) -> str:
    """``signal SIGKILL``, ``exit status 3`` or ``exit status unknown`` for a process exit code."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def _describe_entry(sock: socket.socket, boot_data: bytes) -> None:
    """Process target of :func:`describe_registry` (imported by reference in the fork server's child)."""
    from aip_crewai.sidecar.isolation.worker import describe

    describe(sock, boot_data)
