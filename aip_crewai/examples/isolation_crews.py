"""Offline crews for process isolation tests and benches (registry ``aip_crewai.examples.isolation_crews:CREWS``).

Built from :mod:`aip_crewai.examples.testing` (offline LLM, ``build_crew``). The tools
write marker files into the directory named by ``AIP_CREWAI_TEST_MARKER_DIR``
(nothing when unset), one per job, named after the percent-encoded job id,
so another process (a test) can follow what a tool did and in which process.

| crew id | shape | what its tool does |
|---|---|---|
| ``echo`` | ``aip_crewai.examples.testing.echo`` | — (a fast run: 2 model calls) |
| ``blocking_tool`` | 1 agent with ``block_then_write`` | writes ``<job>.started`` (its pid), blocks ``AIP_CREWAI_TEST_BLOCK_SECONDS`` (default 5) in ``time.sleep`` (a synchronous call a cooperative cancel cannot stop; not while the marker directory holds a file ``no-block``), then writes ``<job>.after`` (the side effect a hard cancel must prevent) |
| ``blocking_trainable`` | ``blocking_tool`` with the options ``train`` and ``test`` need (``aip_crewai.examples.maintenance_crews``) | as ``blocking_tool`` |
| ``exits`` | 1 agent with ``exit_process`` | ``os._exit(7)``: the process running the job ends |
| ``probe`` | 1 agent with ``probe_process`` | writes ``<job>.probe`` (JSON: what it found of earlier jobs in its process: ``env``, ``cwd``, ``stdout``, ``bus_handlers``, ``seen``), and the rows of CrewAI's shared replay table, then leaves its own traces (environment variable, ``os.environ`` rebound to a plain dict, working directory, ``sys.stdout`` and ``sys.stdin``, an event-bus handler, a module global); its ``before_kickoff`` callback writes ``<job>.process`` (umask, SIGINT's disposition, whether the process leads its own group), then sets the umask to 0, SIGINT to Python's default handler and makes the process a group leader |
| ``probe_other`` | ``probe`` under another id | as ``probe`` (another crew for warm-worker tests) |
| ``environment`` | ``echo`` with an ``after_kickoff`` callback | its output's ``raw`` is the process environment as JSON (``environ``: ``os.environ``; ``proc_environ``: ``/proc/self/environ``) |
| ``reach`` | ``echo`` with a ``before_kickoff`` callback | writes ``<job>.pid`` (its pid), then reads the file named by the input ``path`` (an open refused fails the job ``PermissionError``); the output then says ``opened`` |
| ``hog`` | ``echo`` with a ``before_kickoff`` callback | writes ``<job>.pid`` (its pid), then keeps :data:`HOG_BYTES` more bytes in a module global (a crew that grows its process by that much per job) |
| ``flaky_build`` | ``echo``, from a factory that writes ``<job>.pid`` (its pid) and raises while the marker directory holds a file ``fail-build`` (the job fails ``CrewBuildFailed``) | — |
| ``memory_stall`` | ``echo``-like, crew ``memory=`` a :class:`SlowDrainMemory` | — (CrewAI's ``akickoff`` waits for memory saves synchronously on its event loop, crewAI PR#6497; each wait here takes ``AIP_CREWAI_TEST_DRAIN_SECONDS``, default 2) |
| ``lingering`` | 1 agent with ``linger`` | writes ``<job>.pid``; a job whose id ends in ``-wait`` asks for the stray chunk and waits (at most 30 s) until it was emitted; any other starts a thread in its job's context (as ``asyncio.to_thread`` does) that outlives the job: once a later job of its process asks, it emits a model chunk :data:`STRAY_CHUNK`, then writes ``stray-sent`` |

Source: ARCHITECTURE.md §5 (isolation); docs/security.md "Process isolation".
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

from crewai import Crew
from crewai.events.event_bus import crewai_event_bus
from crewai.events.types.llm_events import LLMCallStartedEvent, LLMStreamChunkEvent
from crewai.memory.unified_memory import Memory
from crewai.rag.embeddings.factory import build_embedder
from crewai.tools import tool

from aip_crewai.examples.maintenance_crews import TRAINING_FEEDBACK, offline_eval_llm, with_options
from aip_crewai.examples.offline_llm import OfflineLLM, offline_embedder
from aip_crewai.examples.testing import TWO_TASKS, build_crew, echo
from aip_crewai.sidecar.operations._common import current_job

#: Directory of the marker files (unset: no files).
MARKER_DIR_ENV = "AIP_CREWAI_TEST_MARKER_DIR"
#: Seconds ``block_then_write`` blocks (default 5).
BLOCK_SECONDS_ENV = "AIP_CREWAI_TEST_BLOCK_SECONDS"
#: Seconds each memory drain of ``memory_stall`` takes (default 2).
DRAIN_SECONDS_ENV = "AIP_CREWAI_TEST_DRAIN_SECONDS"
#: A file of this name in the marker directory makes ``block_then_write`` skip its block.
NO_BLOCK_FILE = "no-block"
#: Environment variable the probe sets (a later job in the same process would see it).
PROBE_ENV = "AIP_CREWAI_TEST_PROBE_TRACE"
#: What the probe writes to ``sys.stderr`` and warns with (a secret a crew might quote): never in a log.
PROBE_SECRET = "sk-live-PROBE-STDERR-4242"

#: The model chunk ``lingering``'s thread emits after its job ended (in no job's events).
STRAY_CHUNK = "stray chunk of an ended job"

#: What ``hog`` keeps per job, bytes: more than a warm worker may grow (``worker.WARM_GROWTH_LIMIT_BYTES``, 64 MiB).
HOG_BYTES = 72 * 1024 * 1024

_SEEN: list[str] = []
#: ``lingering``: a later job asked for the stray chunk; the stray chunk was emitted (one worker's jobs share them).
_STRAY_WANTED = threading.Event()
_STRAY_SENT = threading.Event()
_HOARD: list[bytes] = []
_HANDLERS: list[Any] = []


def marker(job_id: str, suffix: str) -> Path | None:
    """The marker file ``<dir>/<percent-encoded job id>.<suffix>``, or None without a marker dir."""
    directory = os.environ.get(MARKER_DIR_ENV)
    return Path(directory) / f"{quote(job_id, safe='')}.{suffix}" if directory else None


def _job_id() -> str:
    job = current_job()
    return job.action_id if job is not None else "-"


def _write(path: Path | None, text: str) -> None:
    if path is not None:
        path.write_text(text, encoding="utf-8")


@tool("block_then_write")
def block_then_write(text: str) -> str:
    """Block in a synchronous call, then leave a side effect (a file)."""
    job = _job_id()
    _write(marker(job, "started"), str(os.getpid()))
    directory = os.environ.get(MARKER_DIR_ENV)
    if not (directory and (Path(directory) / NO_BLOCK_FILE).exists()):
        time.sleep(float(os.environ.get(BLOCK_SECONDS_ENV) or 5))
    _write(marker(job, "after"), str(os.getpid()))
    return f"blocked and wrote for {len(str(text).split())} words"


@tool("linger")
def linger(text: str) -> str:
    """Leave a thread in this job's context behind (``lingering``), or wait for such a thread's chunk."""
    _write(marker(_job_id(), "pid"), str(os.getpid()))
    if _job_id().endswith("-wait"):
        _STRAY_WANTED.set()
        _STRAY_SENT.wait(30)  # a crew's own bounded wait: set by the earlier job's thread in this worker
        return "waited"
    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(_emit_stray,), daemon=True).start()
    return "left a thread"


def _emit_stray() -> None:
    """Once a later job of this process asked for it, emit :data:`STRAY_CHUNK` in the context this thread was
    started in, then write ``stray-sent`` in the marker directory."""
    if not _STRAY_WANTED.wait(60):
        return
    crewai_event_bus.emit(None, LLMStreamChunkEvent(chunk=STRAY_CHUNK, call_id="stray", task_id="stray"))
    _write(Path(os.environ[MARKER_DIR_ENV]) / "stray-sent" if os.environ.get(MARKER_DIR_ENV) else None, "1")
    _STRAY_SENT.set()


@tool("exit_process")
def exit_process(text: str) -> str:
    """End the process running the job at once (as a native crash would)."""
    _write(marker(_job_id(), "started"), str(os.getpid()))
    os._exit(7)


@tool("probe_process")
def probe_process(text: str) -> str:
    """Report the traces earlier jobs left in this process, then leave this job's own."""
    job = _job_id()
    found = {
        "pid": os.getpid(),
        "nice": os.nice(0),  # the niceness of the thread running the tool
        "env": os.environ.get(PROBE_ENV),
        "cwd": os.getcwd(),
        "stdout": type(sys.stdout).__name__,
        "stderr": type(sys.stderr).__name__,
        "stdin": type(sys.stdin).__name__,
        "environ": type(os.environ).__name__,
        "bus_handlers": len(_HANDLERS),
        "seen": list(_SEEN),
        # rows in CrewAI's shared replay table: jobs keep task outputs in a store of their own, never there
        "replay_rows": _replay_rows(),
    }
    _write(marker(job, "probe"), json.dumps(found))
    os.environ[PROBE_ENV] = job
    os.environ = dict(os.environ)  # type: ignore[assignment]  # noqa: B003 - a job that rebinds the mapping itself
    os.chdir(tempfile.gettempdir())
    sys.stdout = io.StringIO()
    sys.stdin = io.StringIO()
    print(f"probe {job}")
    sys.stderr.write(f"probe says api_key={PROBE_SECRET}\n")  # what a crew's own code may write
    warnings.warn(f"deprecated call with key {PROBE_SECRET}", UserWarning, stacklevel=1)

    def handler(_source: Any, _event: Any) -> None:
        _SEEN.append(f"event-after:{job}")

    crewai_event_bus.on(LLMCallStartedEvent)(handler)
    _HANDLERS.append(handler)
    _SEEN.append(job)
    return "probed"


def _replay_rows() -> int:
    """Rows of CrewAI's shared ``latest_kickoff_task_outputs`` table in its storage dir (0 without the file)."""
    path = Path(os.environ.get("CREWAI_STORAGE_DIR") or ".") / "latest_kickoff_task_outputs.db"
    if not path.exists():
        return 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        try:
            return int(db.execute("SELECT COUNT(*) FROM latest_kickoff_task_outputs").fetchone()[0])
        except sqlite3.OperationalError:  # no table yet
            return 0


def _environment() -> str:
    """This process's environment as JSON: ``os.environ`` and the first one (``/proc/self/environ``)."""
    try:
        with open(f"/proc/{os.getpid()}/environ", "rb") as fh:
            initial: list[str] | None = fh.read().decode("utf-8", "replace").split("\0")
    except PermissionError:  # a worker that dropped to --worker-user is not dumpable: root owns its /proc files
        initial = None
    return json.dumps({"environ": dict(os.environ), "proc_environ": initial})


def _with_environment(output: Any) -> Any:
    """``after_kickoff`` callback: the crew's output becomes the process environment."""
    output.raw = _environment()
    return output


def environment() -> Crew:
    """``echo`` whose output is its process's environment (what a crew could leak of it)."""
    crew = echo()
    crew.after_kickoff_callbacks.append(_with_environment)
    return crew


def _read_requested(inputs: dict[str, Any]) -> dict[str, Any]:
    """``before_kickoff`` callback: write ``<job>.pid`` (its pid), then read the file of the input ``path`` (an
    error fails the job)."""
    _write(marker(_job_id(), "pid"), str(os.getpid()))
    path = inputs.get("path")
    if path:
        with open(str(path), "rb") as fh:
            fh.read(1)
        inputs = {**inputs, "topic": "opened"}
    return inputs


def _hoard(inputs: dict[str, Any]) -> dict[str, Any]:
    """``before_kickoff`` callback: write ``<job>.pid``, then keep :data:`HOG_BYTES` written bytes for good."""
    _write(marker(_job_id(), "pid"), str(os.getpid()))
    _HOARD.append(b"\x01" * HOG_BYTES)  # written, so resident (a zeroed buffer may not be)
    return inputs


#: A file of this name in the marker directory makes the ``flaky_build`` factory raise.
FAIL_BUILD_FILE = "fail-build"


def flaky_build() -> Crew:
    """``echo``, or a factory failure while the marker directory holds :data:`FAIL_BUILD_FILE`."""
    _write(marker(_job_id(), "pid"), str(os.getpid()))
    directory = os.environ.get(MARKER_DIR_ENV)
    if directory and (Path(directory) / FAIL_BUILD_FILE).exists():
        raise RuntimeError("the factory broke off half-way")
    return echo()


def hog() -> Crew:
    """``echo`` that grows its process by :data:`HOG_BYTES` per job."""
    crew = echo()
    crew.before_kickoff_callbacks.append(_hoard)
    return crew


def reach() -> Crew:
    """``echo`` that first reads the file its input names (the worker sandbox's probe)."""
    crew = echo()
    crew.before_kickoff_callbacks.append(_read_requested)
    return crew


class SlowDrainMemory(Memory):
    """CrewAI memory whose wait for pending saves (``drain_writes``) takes a while."""

    def drain_writes(self) -> None:
        time.sleep(float(os.environ.get(DRAIN_SECONDS_ENV) or 2))
        super().drain_writes()


def blocking_tool() -> Crew:
    """One agent whose tool blocks, then writes a file."""
    return build_crew(
        OfflineLLM(model="offline-blocking", chunks_per_answer=2),
        ["Count the words of the topic {topic}."],
        tools=[block_then_write],
    )


def _spawn_child(inputs: dict[str, Any]) -> dict[str, Any]:
    """``before_kickoff`` callback: start a child process that outlives a finished worker unless something
    kills it, and write its pid to ``<job>.child``."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # noqa: S603 - a fixed command
    _write(marker(_job_id(), "child"), str(child.pid))
    return inputs


def spawner() -> Crew:
    """``blocking_tool`` whose job first starts a child process (:func:`_spawn_child`): what a hard cancel
    must take with the worker."""
    crew = blocking_tool()
    crew.before_kickoff_callbacks.append(_spawn_child)
    return crew


def lingering() -> Crew:
    """One agent whose tool leaves a thread that emits a chunk after its job ended (:func:`linger`)."""
    return build_crew(
        OfflineLLM(model="offline-lingering", chunks_per_answer=2),
        ["Count the words of the topic {topic}."],
        tools=[linger],
    )


def exits() -> Crew:
    """One agent whose tool ends the process."""
    return build_crew(
        OfflineLLM(model="offline-exits", chunks_per_answer=2),
        ["Count the words of the topic {topic}."],
        tools=[exit_process],
    )


def _handler_name(handler: Any) -> str:
    """``SIG_IGN``, ``SIG_DFL`` or a handler function's name."""
    return str(getattr(handler, "name", None) or getattr(handler, "__name__", repr(handler)))


def _unsettle(inputs: dict[str, Any]) -> dict[str, Any]:
    """``before_kickoff`` callback (on the worker's main thread): write ``<job>.process`` (JSON: the file-mode
    creation mask, SIGINT's and SIGPIPE's dispositions, whether the process leads its own group, the blocked
    signals, whether an alarm is pending, the recursion limit, the open-files limit, the time zone), then
    change all of them. A topic holding ``pending`` also leaves SIGUSR2 pending behind the blocked mask
    (unblocking it would end the worker: beyond repair)."""
    mask = os.umask(0)
    _write(
        marker(_job_id(), "process"),
        json.dumps(
            {
                "umask": oct(mask),
                "sigint": _handler_name(signal.getsignal(signal.SIGINT)),
                "sigpipe": _handler_name(signal.getsignal(signal.SIGPIPE)),
                "own_group": os.getpgrp() == os.getpid(),
                "blocked": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, ())),
                "alarm": signal.getitimer(signal.ITIMER_REAL)[0] > 0,
                "recursion": sys.getrecursionlimit(),
                "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                "zone": time.tzname[0],
            }
        ),
    )
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    signal.alarm(3600)
    sys.setrecursionlimit(777)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512) - 1, hard))
    os.environ["TZ"] = "JST-9"
    time.tzset()
    os.setpgid(0, 0)
    if "pending" in str(inputs.get("topic", "")):  # a signal left pending behind the mask: beyond repair
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)  # this thread's own: it stays pending here
    return inputs


def probe() -> Crew:
    """One agent whose tool reports and leaves process traces (and a callback that changes the process)."""
    crew = build_crew(
        OfflineLLM(model="offline-probe", chunks_per_answer=2),
        ["Probe the process for {topic}."],
        tools=[probe_process],
    )
    crew.before_kickoff_callbacks.append(_unsettle)
    return crew


def memory_stall() -> Crew:
    """One task on a crew whose memory drains slowly (the akickoff loop stall)."""
    base = build_crew(OfflineLLM(model="offline-memory-stall", chunks_per_answer=1), TWO_TASKS[:1])
    memory = SlowDrainMemory(
        embedder=build_embedder(offline_embedder()),
        llm=OfflineLLM(model="offline-memory-llm"),
        root_scope="/crew/memory-stall",
    )
    return Crew(
        agents=base.agents,
        tasks=base.tasks,
        memory=memory,
        tracing=False,
        verbose=False,
        before_kickoff_callbacks=base.before_kickoff_callbacks,
    )


CREWS: dict[str, Any] = {
    "echo": echo,
    "blocking_tool": blocking_tool,
    "blocking_trainable": with_options(blocking_tool, training_feedback=TRAINING_FEEDBACK, eval_llm=offline_eval_llm),
    "exits": exits,
    "probe": probe,
    "probe_other": probe,
    "memory_stall": memory_stall,
    "environment": environment,
    "reach": reach,
    "hog": hog,
    "flaky_build": flaky_build,
    "spawner": spawner,
    "lingering": lingering,
}
