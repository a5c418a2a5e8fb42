"""The pipe protocol between the sidecar and its job worker processes (pure data, no I/O).

One job per worker process, or up to ``--worker-jobs`` jobs of one tenant's
one crew, one after the other (ARCHITECTURE.md §5 "Isolation"). Frames travel
over one ``socketpair`` per worker: a 4-byte big-endian length, then a
msgspec MessagePack message of the tagged union below. Every frame is
bounded (:func:`frame_bound`); a peer that sends a larger or undecodable
frame is treated as broken (the sidecar kills that worker and fails its job).

| direction | message | when |
|---|---|---|
| worker → sidecar | :class:`Ready` | booted: CrewAI and the registry are loaded |
| sidecar → worker | :class:`Start` | the job this worker runs now |
| worker → sidecar | :class:`Started` | it took the job: sent before anything of the job runs |
| worker → sidecar | :class:`Chunk` | one ``ctx.emit_chunk`` payload (at most ``max_events - 1`` per job) |
| worker → sidecar | :class:`FindTaskRun` | ``ctx.find_task_run(task_id)`` (replay) |
| sidecar → worker | :class:`TaskRun` | its answer |
| sidecar → worker | :class:`Cancel` | the job was cancelled (cooperative stop; a kill follows after the grace) |
| worker → sidecar | :class:`Done` / :class:`Failed` | the job's end; the worker exits after it unless ``last`` is false (it then waits for its next ``Start``) |
| registry check → sidecar | :class:`Described` | the one answer of the start-up registry check process (no job) |

Source: ARCHITECTURE.md §5 (isolation, per-job bounds).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.sidecar.isolation.sandbox import SandboxPlan

#: Frame header: payload length, bytes, unsigned big-endian.
HEADER = struct.Struct("!I")
#: Fixed part of the frame bound, bytes: a ``Done`` (output up to ``MAX_OUTPUT_BYTES``, then the
#: kept inputs, at most the 1 MiB job input, and fingerprints) or a ``TaskRun`` answer (a retained output and inputs).
BASE_FRAME_BYTES = 2 * MAX_OUTPUT_BYTES + 4 * 1_048_576


def frame_bound(max_event_bytes: int) -> int:
    """The largest frame either side accepts, bytes.

    Args:
        max_event_bytes: ``--max-event-bytes``; a chunk's content is cut to
            ``max_event_bytes + 1`` characters by the worker (at most 6 bytes
            each once escaped), labels to 256 characters.

    Returns:
        ``BASE_FRAME_BYTES + 6 * (max_event_bytes + 1024)``.
    """
    return BASE_FRAME_BYTES + 6 * (max_event_bytes + 1024)


class Boot(msgspec.Struct, frozen=True):
    """What a worker needs before its job: the registry and how to log.

    Attributes:
        registry: ``module:attribute`` (``--registry``).
        state_dir: the sidecar state directory (CrewAI storage under it).
        log_json: JSON log lines (else the console renderer).
        log_level: ``debug``/``info``/``warning``/``error``.
        sandbox: what the worker does to itself after its fork (``isolation/sandbox.py``); None: nothing.
        trace_protocol, trace_content: the operator's tracing settings, read before CrewAI's environment
            forced ``OTEL_SDK_DISABLED`` (``aip_crewai/tracing.py``); None: no tracing.
        nice: added to the niceness the worker inherits, first thing at its boot (``--worker-nice``).
        jobs: jobs the worker runs at most, one after the other, all of its first job's tenant and crew
            (``--worker-jobs``, default 100; 1: a fresh process per job).
    """

    registry: str
    state_dir: str
    log_json: bool
    log_level: str
    sandbox: SandboxPlan | None = None
    #: the sidecar's tracing (docs/observing.md "Observing actions"): the OTLP protocol (None: off), content capture
    trace_protocol: str | None = None
    trace_content: bool = False
    nice: int = 0
    jobs: int = 1


class Start(msgspec.Struct, frozen=True, tag="start"):
    """The job a worker runs (its :class:`~aip_crewai.sidecar.jobs.context.JobContext` fields)."""

    action_id: str
    crew_id: str
    operation: str
    tenant: str
    input: dict[str, Any]
    state_dir: str
    training_dir: str | None
    max_events: int
    max_event_bytes: int
    #: the W3C ``traceparent`` of the job's span: the worker's CrewAI spans continue it (None: not traced)
    traceparent: str | None = None


class Started(msgspec.Struct, frozen=True, tag="started"):
    """The worker took its :class:`Start`; nothing of the job ran before this frame. A worker that dies
    before sending it did nothing of the job (the sidecar may give the job to another worker)."""


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Stop cooperatively: set the job's cancel flag (and cancel ``run``/``batch_run``'s task)."""


class TaskRun(msgspec.Struct, frozen=True, tag="task_run"):
    """The answer to :class:`FindTaskRun` ``request``: the retained run, or None."""

    request: int
    run: dict[str, Any] | None


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The worker booted (process id ``pid``)."""

    pid: int


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """The worker will run no job: the fork server it was forked from had ``threads`` besides its main one
    (a lock one of them held stays held in the worker; ``fork_server.start_forkserver``)."""

    threads: list[str]


class Chunk(msgspec.Struct, frozen=True, tag="chunk"):
    """One chunk payload ``{"content", "channel", "task_id"?, "agent_role"?}``."""

    data: dict[str, Any]


class FindTaskRun(msgspec.Struct, frozen=True, tag="find_task_run"):
    """Ask the sidecar for the retained run holding ``task_id`` (answered by :class:`TaskRun`)."""

    request: int
    task_id: str


class Done(msgspec.Struct, frozen=True, tag="done"):
    """The job completed.

    Attributes:
        output: the operation output as compact JSON (at most ``MAX_OUTPUT_BYTES``).
        run_state: ``ctx.run_state`` as ``[[index or None, state], ...]``.
        dropped: chunks dropped at the per-job event bound.
        last: the worker exits after this frame; False: it waits for its next job (``Boot.jobs``).
    """

    output: bytes
    run_state: list[tuple[int | None, dict[str, Any]]]
    dropped: int = 0
    last: bool = True


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """The job ended without an output.

    Attributes:
        error_type: the exception class (or ``SafeJobError.error_type``).
        message: a publishable message (``SafeJobError`` only), else None.
        before_any_effect: ``SafeJobError.before_any_effect``.
        cancelled: the job stopped on its cancel (``JobCancelled`` or a cancelled task).
        stop_observed: ``ctx.stop_observed``.
        dropped: chunks dropped at the per-job event bound.
        uncertain: ``SafeJobError.uncertain`` (None: the runtime derives ``uncertain_outcome``).
        last: the worker exits after this frame; False: it waits for its next job (``Boot.jobs``).
    """

    error_type: str
    message: str | None = None
    before_any_effect: bool = False
    cancelled: bool = False
    stop_observed: bool = False
    dropped: int = 0
    uncertain: bool | None = None
    last: bool = True


class Described(msgspec.Struct, frozen=True, tag="described"):
    """The start-up registry check's answer (``worker.describe``): what the sidecar process would otherwise
    learn by importing CrewAI and the registry itself.

    Attributes:
        crews: the registry's crew ids, in its order.
        problems: the start-up preflight's ``{crew id: [code]}`` (``operations/startup/preflight.py``).
        inputs: the preflight's ``{crew id: {"placeholders": [name], "defaults": bool}}``.
        refused: why ``--registry`` cannot be loaded (a ``RegistryError`` or ``ImportError`` message), else None.
        import_failed: the exception class of a failed ``import crewai``, else None.
        preload_skipped: ``[module, exception class]`` of each ``--preload-modules`` module the fork server
            could not import (``operations/startup/preload.PRELOAD_SKIPPED``).
    """

    crews: list[str] = []
    problems: dict[str, list[str]] = {}
    inputs: dict[str, dict[str, Any]] = {}
    refused: str | None = None
    import_failed: str | None = None
    preload_skipped: list[list[str]] = []


ToWorker = Start | Cancel | TaskRun
FromWorker = Ready | Refused | Started | Chunk | FindTaskRun | Done | Failed | Described

_ENCODER = msgspec.msgpack.Encoder()
_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
_FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)
_BOOT = msgspec.msgpack.Decoder(Boot)


class FrameError(ValueError):
    """A frame over the bound, or one that does not decode to a message of its direction."""


def encode(message: ToWorker | FromWorker | Boot) -> bytes:
    """One whole frame (header and payload) for ``message``."""
    payload = _ENCODER.encode(message)
    return HEADER.pack(len(payload)) + payload


def payload_length(header: bytes, bound: int) -> int:
    """The payload length a 4-byte header announces.

    Raises:
        FrameError: it exceeds ``bound`` bytes.
    """
    (length,) = HEADER.unpack(header)
    if length > bound:
        raise FrameError(f"a frame of {length} bytes exceeds the bound of {bound} bytes")
    return int(length)


def decode_to_worker(payload: bytes) -> ToWorker:
    """Decode a sidecar → worker payload. Raises FrameError."""
    try:
        return _TO_WORKER.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"undecodable frame ({exc})") from None


def decode_from_worker(payload: bytes) -> FromWorker:
    """Decode a worker → sidecar payload. Raises FrameError."""
    try:
        return _FROM_WORKER.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"undecodable frame ({exc})") from None


def encode_boot(boot: Boot) -> bytes:
    """:class:`Boot` as bytes (passed as the worker process's argument)."""
    return _ENCODER.encode(boot)


def decode_boot(data: bytes) -> Boot:
    """The inverse of :func:`encode_boot`."""
    return _BOOT.decode(data)
