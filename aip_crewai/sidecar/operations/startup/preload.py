"""Imported once by the worker fork server (``fork_server.start_forkserver``), before it forks any worker.

First the modules ``--preload-modules`` names (``options.PRELOAD_ENV``, set by
``fork_server.start_forkserver``; :func:`_import_extras`): a module whose import
raises anything, ``SystemExit`` included, is skipped and named in
:data:`PRELOAD_SKIPPED` (the start-up registry check reports it, the sidecar
logs ``preload_module_skipped``). Then CrewAI and every operation module, so a
job worker forked from the fork server starts with them in memory (pages shared with the fork server)
and never pays the CrewAI import. The fork server inherits the sidecar's
CrewAI environment (``crewai_env.prepare_crewai_environment`` ran first).

Then :func:`warm_up` runs one throwaway kickoff (a one-task crew on
:class:`_WarmUpLLM`, no tools, memory or knowledge; task outputs in the
in-memory store of ``_task_outputs``): CrewAI builds much lazily on a
process's first kickoff (pydantic schemas, Flow state classes), about 25 ms
that every worker would otherwise pay on its one job. Its event bus starts
threads on the first event; they are stopped again (:func:`_quiesce_event_bus`,
CrewAI 1.15 internals) so the fork server forks with one thread, and each
worker starts its own on its first event.

Last, ``gc.freeze()``: the objects loaded so far are never scanned by a
worker's garbage collector, which would otherwise write to (and so copy)
the pages it shares with the fork server.

Nothing here raises (an exception would stop the fork server): each worker
imports again at boot and reports its own failure; a failed warm-up only
costs the first-kickoff time.

Source: ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import warnings
from typing import Any

# A drain (SIGUSR1) is the sidecar process's; `systemctl kill` without --kill-whom=main reaches the fork
# server too, whose default action would end it (and so every worker start).
try:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
except ValueError:  # imported outside a main thread (a worker's own boot): nothing to protect there
    pass

# multiprocessing runs the sidecar's main module again in each worker before its target. Started as
# `python -m aip_crewai.cli`, that is runpy re-running a module the fork server imported already
# (fork_server.PRELOAD), which runpy warns about on stderr: expected here, and one such line per job.
warnings.filterwarnings("ignore", message=r"'aip_crewai\.cli' found in sys\.modules", category=RuntimeWarning)

#: ``(module, exception class)`` of each ``--preload-modules`` module whose import failed (and was skipped).
PRELOAD_SKIPPED: list[tuple[str, str]] = []


def _import_extras() -> None:
    """Import each module of ``options.PRELOAD_ENV``, in order; one that raises (``SystemExit`` and
    ``KeyboardInterrupt`` too: the fork server must live on) is recorded in :data:`PRELOAD_SKIPPED`."""
    import importlib
    import os

    from aip_crewai.sidecar.options import PRELOAD_ENV

    for name in filter(None, os.environ.get(PRELOAD_ENV, "").split(",")):
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - a job that needs it imports it again and fails there
            PRELOAD_SKIPPED.append((name, type(exc).__name__))


_import_extras()

try:
    import crewai  # noqa: F401  (the import is the point)

    from aip_crewai.sidecar.operations import (  # noqa: F401
        _common,
        _task_outputs,
        batch_run,
        knowledge_query,
        memory_reset,
        replay,
        run,
        test,
        train,
    )
    from aip_crewai.sidecar.operations.startup import preflight as _preflight  # noqa: F401
except Exception:  # noqa: BLE001, S110 - reported by the worker that imports it again
    _ready = False
else:
    _ready = True


def warm_up(*, in_worker: bool = False) -> bool:
    """One throwaway kickoff; in the fork server (not ``in_worker``) then the event bus back to no threads.
    True when it ran (and, in the fork server, one thread is left).

    A worker runs it too while it is idle (``worker._boot``): its first kickoff would otherwise copy
    the thousands of pages (about 20 MiB) it shares with the fork server that a kickoff writes to,
    about 20 ms, on the job's time.
    """
    from crewai import Agent, Crew, Task
    from crewai.crews.utils import enable_agent_streaming

    _task_outputs.install()
    agent = Agent(
        role="warm-up",
        goal="warm up",
        backstory="warm-up",
        llm=_WarmUpLLM(model="aip-crewai-warm-up"),
        allow_delegation=False,
        verbose=False,
        max_iter=1,
    )
    crew = Crew(
        agents=[agent],
        tasks=[Task(description="Say ok.", expected_output="ok", agent=agent)],
        verbose=False,
        tracing=False,
    )
    crew.stream = False
    enable_agent_streaming(crew.agents)
    asyncio.run(crew.akickoff(inputs={}))
    if in_worker:
        return True
    return _quiesce_event_bus()


def _quiesce_event_bus() -> bool:
    """Stop the threads CrewAI's event bus started (its loop thread and handler pool); it starts them
    again on its next event (``event_bus.py::_ensure_executor_initialized``). True when none is left."""
    import threading

    from crewai.events.event_bus import crewai_event_bus as bus

    bus.flush()
    with bus._instance_lock:
        if bus._executor_initialized:
            loop, thread = bus._loop, bus._loop_thread
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            bus._sync_executor.shutdown(wait=True)
            if not thread.is_alive():
                loop.close()
            bus._executor_initialized = False
    return threading.active_count() == 1


def _llm_class() -> Any:
    global _LLM_CALL
    from crewai.events.types.llm_events import LLMCallType
    from crewai.llms.base_llm import BaseLLM

    _LLM_CALL = LLMCallType.LLM_CALL

    class WarmUpLLM(BaseLLM):
        """Answers every call at once with a final answer (no network, no events of its own)."""

        def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            return self._answer(messages, kwargs)

        async def acall(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            return self._answer(messages, kwargs)

        def _answer(self, messages: Any, kwargs: dict[str, Any]) -> str:
            """Emit what a streaming provider emits (call started, one chunk, call completed)."""
            from crewai.llms.base_llm import llm_call_context

            answer = "Thought: done\nFinal Answer: ok"
            task, agent = kwargs.get("from_task"), kwargs.get("from_agent")
            with llm_call_context():
                self._emit_call_started_event(messages=messages, from_task=task, from_agent=agent)
                self._emit_stream_chunk_event(chunk=answer, from_task=task, from_agent=agent)
                self._track_token_usage_internal({"prompt_tokens": 1, "completion_tokens": 1})
                self._emit_call_completed_event(
                    response=answer, call_type=_LLM_CALL, from_task=task, from_agent=agent, messages=messages
                )
            return answer

        def supports_function_calling(self) -> bool:
            return False

        def supports_stop_words(self) -> bool:
            return False

        def get_context_window_size(self) -> int:
            return 8192

    return WarmUpLLM


_LLM_CALL: Any = None

if _ready:
    try:
        _WarmUpLLM = _llm_class()
        warmed = warm_up()
    except Exception:  # noqa: BLE001 - a worker then pays the first-kickoff time, nothing worse
        warmed = False
    # Everything allocated so far stays out of the collector's sight in the workers, so a
    # collection there does not write to (and copy) the pages they share with the fork server.
    gc.collect()
    gc.freeze()


def other_threads() -> list[str]:
    """Threads of this process besides the calling one: Python threads by name, plus
    ``native-thread-<n>`` for OS threads Python does not know (``/proc/self/task``, Linux)."""
    import os
    import threading

    names = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    try:
        native = len(os.listdir("/proc/self/task")) - 1 - len(names)
    except OSError:
        native = 0
    return names + [f"native-thread-{n}" for n in range(1, native + 1)]


#: The threads the fork server had besides its main one once it preloaded (``[]``: safe to fork); a worker
#: inherits this value and refuses to boot when it is not empty (``worker._boot``).
FORK_SERVER_THREADS: list[str] = other_threads()
