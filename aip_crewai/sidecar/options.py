"""The sidecar's command-line table: every flag, its environment variable, parser, default and help
(ARCHITECTURE.md §11), and the ``aip-crewai sidecar`` argument parser built from it.

Each parser takes the raw text (a flag's value, or its environment variable's) and returns the typed
value or raises ``ValueError`` with the problem; :func:`aip_crewai.sidecar.config.load_settings` turns
that into a :class:`~aip_crewai.sidecar.config.ConfigError` naming the setting (:func:`option_name`)
and validates the combination into :class:`~aip_crewai.sidecar.config.Settings`. This module reads no
environment and checks no file.

Source: ARCHITECTURE.md §11 (operator interface), §5 (limits).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aip_crewai.contracts.operations import INSPECTION_OPERATIONS, STARTABLE_OPERATIONS

#: Bounds of ``--max-event-bytes``, bytes (the reference sidecar's range).
MIN_EVENT_BYTES, MAX_EVENT_BYTES = 1024, 4_194_304
#: Idle workers booted when ``--idle-workers`` is unset: ``--max-concurrency``, at most this many (about 23 MiB
#: each: 1,024 of them took 12 GB and kept the sidecar from listening for over 40 s).
DEFAULT_IDLE_WORKERS_CAP = 16
#: Floor and default of ``--unauthenticated-body-budget-bytes``, bytes: one whole job body
#: (``jobs/admission.MAX_BODY_BYTES``), and 64 MiB (docs/security.md "Security").
MIN_BODY_BUDGET_BYTES, DEFAULT_BODY_BUDGET_BYTES = 8 * 1024 * 1024, 64 * 1024 * 1024
#: Bound on ``--preload-modules``: names, and characters per name.
MAX_PRELOAD_MODULES, MAX_MODULE_NAME_CHARS = 64, 200
#: What the fork server preloads besides CrewAI by default (``--preload-modules``): what CrewAI imports lazily on a
#: job's first use of its default provider (the OpenAI client's resources and transport) and of knowledge
#: (ChromaDB's telemetry client), installed with CrewAI and measured to start no thread (docs/operating.md).
DEFAULT_PRELOAD_MODULES = ("httpcore", "openai.resources", "posthog")
#: The environment variable that carries ``--preload-modules`` to the fork server (a comma list; internal: set by
#: ``fork_server.start_forkserver``, read by ``operations/startup/preload.py``).
PRELOAD_ENV = "_AIP_CREWAI_FORK_SERVER_PRELOAD"
#: Environment switches of the two safety valves, by flag.
VALVE_ENV = {
    "allow_unauthenticated": "AIP_CREWAI_ALLOW_UNAUTHENTICATED",
    "allow_ephemeral": "AIP_CREWAI_ALLOW_EPHEMERAL",
}


#: A decimal number as an option takes it: ASCII digits with at most one decimal point (``5``, ``0.25``, ``.5``).
#: Python's ``int()`` and ``float()`` also take ``1_0``, ``1e3``, ``+5``, `` 5 `` (blanks), ``inf`` and other
#: scripts' digits (``٥``); none of them is a value an operator means here.
DECIMAL_RE = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\Z")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """A parser of an integer ``low..high``: ASCII digits and nothing else (no sign, blank, ``_``, exponent).

    Raises (the parser):
        ValueError: anything else.
    """

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()):
            raise ValueError(f"must be an integer {low}..{high} (ASCII digits only)")
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be an integer {low}..{high}")
        return value

    return parse


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A parser of a number ``low..high``: :data:`DECIMAL_RE` (ASCII digits, at most one decimal point).

    Raises (the parser):
        ValueError: anything else.
    """

    def parse(text: str) -> float:
        if not DECIMAL_RE.match(text):
            raise ValueError(f"must be a number {low}..{high} (ASCII digits with at most one decimal point)")
        value = float(text)
        if not low <= value <= high:
            raise ValueError(f"must be a number {low}..{high}")
        return value

    return parse


def choice(*choices: str) -> Callable[[str], str]:
    """A parser of one of ``choices`` (any case; returned lower-case)."""

    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def text_value(text: str) -> str:
    """Non-empty text, stripped."""
    value = text.strip()
    if not value:
        raise ValueError("must not be empty")
    return value


def path_value(text: str) -> Path:
    """A path (``~`` expanded), not yet checked."""
    return Path(text_value(text)).expanduser()


def parse_operations(text: str) -> tuple[str, ...]:
    """A comma-separated list of operations: the startable ones named, in their canonical order
    (status/events/cancel are always served: accepted and dropped).

    Raises:
        ValueError: an unknown operation, or no startable one.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted({n for n in names if n not in STARTABLE_OPERATIONS and n not in INSPECTION_OPERATIONS})
    if unknown:
        raise ValueError(f"unknown operation(s) {', '.join(unknown)}; startable: {', '.join(STARTABLE_OPERATIONS)}")
    # status/events/cancel are always served; accept them (peer env files list them) and drop them.
    startable = tuple(n for n in STARTABLE_OPERATIONS if n in names)
    if not startable:
        raise ValueError(f"must name at least one startable operation ({', '.join(STARTABLE_OPERATIONS)})")
    return startable


def parse_modules(text: str) -> tuple[str, ...]:
    """A comma-separated list of dotted module names (Python identifiers joined by dots; blanks around a name
    are dropped), in order, repeats dropped; ``none`` (any case) alone is the empty list. At most
    :data:`MAX_PRELOAD_MODULES` names of at most :data:`MAX_MODULE_NAME_CHARS` characters.

    Raises:
        ValueError: no name at all, an empty or blank entry (``os,,sys``, a leading or trailing comma), a name
            that is not a dotted identifier or is too long, ``none`` beside a name, or too many names.
    """
    if not text.strip():
        raise ValueError("must not be empty (none: no module beyond CrewAI and the operations)")
    names = [part.strip() for part in text.split(",")]
    empty = [str(i) for i, name in enumerate(names, 1) if not name]
    if empty:
        raise ValueError(
            f"has an empty or blank entry ({'entries' if len(empty) > 1 else 'entry'} {', '.join(empty)} of "
            f"{len(names)}); give module names separated by single commas, none before the first or after the last"
        )
    if any(name.lower() == "none" for name in names):
        if len(names) > 1:
            raise ValueError("none stands alone (it means no module beyond CrewAI and the operations)")
        return ()
    for name in names:
        if len(name) > MAX_MODULE_NAME_CHARS:
            raise ValueError(f"a module name longer than {MAX_MODULE_NAME_CHARS} characters: {name[:40]!r}...")
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"not a module name: {name!r} (Python identifiers joined by dots)")
    unique = tuple(dict.fromkeys(names))
    if len(unique) > MAX_PRELOAD_MODULES:
        raise ValueError(f"at most {MAX_PRELOAD_MODULES} modules, not {len(unique)}")
    return unique


@dataclass(frozen=True)
class Option:
    """One valued setting: ``args.<dest>`` from ``flag``, else from ``env``, parsed by ``parse``; else ``default``."""

    dest: str
    flag: str
    env: str | None
    parse: Callable[[str], Any]
    default: Any
    help: str


#: Every valued setting: flag, environment variable, parser, default (ARCHITECTURE.md §11).
OPTIONS: tuple[Option, ...] = (
    Option(
        "registry", "--registry", "AIP_CREWAI_REGISTRY", text_value, None, "crew registry, module:attribute (required)"
    ),
    Option("host", "--host", "AIP_CREWAI_HOST", text_value, "127.0.0.1", "listen address"),
    Option("port", "--port", "AIP_CREWAI_PORT", int_in(0, 65535), 8090, "listen port (0: any free port)"),
    Option(
        "journal",
        "--journal",
        "AIP_CREWAI_STATE_FILE",
        path_value,
        None,
        "SQLite job journal (required unless --allow-ephemeral on loopback; a missing directory is created 0700)",
    ),
    Option(
        "state_dir",
        "--state-dir",
        "AIP_CREWAI_STATE_DIR",
        path_value,
        None,
        "state directory; CrewAI storage goes under it (default: the journal's directory)",
    ),
    Option(
        "token_file",
        "--token-file",
        "AIP_CREWAI_BEARER_TOKEN_FILE",
        path_value,
        None,
        "bearer token file: regular file, mode 0600, 1..16384 bytes "
        "(required unless --allow-unauthenticated on loopback)",
    ),
    Option(
        "allowed_operations",
        "--allowed-operations",
        "AIP_CREWAI_ALLOWED_OPERATIONS",
        parse_operations,
        ("run",),
        "comma list of startable operations (run, batch_run, replay, train, test, knowledge_query, "
        "memory_reset); status, events and cancel are always served",
    ),
    Option(
        "max_concurrency",
        "--max-concurrency",
        "AIP_CREWAI_MAX_CONCURRENCY",
        int_in(1, 1024),
        4,
        "jobs executing at once",
    ),
    Option(
        "max_retained_runs",
        "--max-retained-runs",
        "AIP_CREWAI_MAX_RETAINED_RUNS",
        int_in(1, 10_000_000),
        2000,
        "non-archived jobs kept; admission answers 507 at the limit",
    ),
    Option(
        "max_events_per_run",
        "--max-events-per-run",
        "AIP_CREWAI_MAX_EVENTS_PER_RUN",
        int_in(2, 100_000),
        1000,
        "events per job, the terminal one included",
    ),
    Option(
        "max_event_bytes",
        "--max-event-bytes",
        "AIP_CREWAI_MAX_EVENT_BYTES",
        int_in(MIN_EVENT_BYTES, MAX_EVENT_BYTES),
        262_144,
        "encoded size bound of one event, bytes, 1024..4194304 (above 1 MiB, the aip-crewai host's SSE frame "
        "bound, a warning at start: the host refuses larger events)",
    ),
    Option(
        "stream_checkpoint_events",
        "--stream-checkpoint-events",
        "AIP_CREWAI_STREAM_CHECKPOINT_EVENTS",
        int_in(1, 100_000),
        128,
        "chunk events committed per journal write",
    ),
    Option(
        "training_dir",
        "--training-dir",
        "AIP_CREWAI_TRAINING_DIR",
        path_value,
        None,
        "directory for train artifacts (required when train is allowed)",
    ),
    Option(
        "max_journal_bytes",
        "--max-journal-bytes",
        "AIP_CREWAI_MAX_JOURNAL_BYTES",
        int_in(1_048_576, 1 << 50),
        1_073_741_824,
        "journal size bound, bytes; admission answers 507 past it "
        "(the reference's AIP_CREWAI_MAX_STATE_BYTES, 1048576..4294967296, sets it too)",
    ),
    Option(
        "body_budget_bytes",
        "--unauthenticated-body-budget-bytes",
        "AIP_CREWAI_UNAUTHENTICATED_BODY_BUDGET_BYTES",
        int_in(MIN_BODY_BUDGET_BYTES, 1 << 40),
        DEFAULT_BODY_BUDGET_BYTES,
        "without a bearer token (--allow-unauthenticated): request bodies being read at once, in total, bytes; "
        "past it a body is 503 with Retry-After",
    ),
    Option(
        "sse_keepalive_seconds",
        "--sse-keepalive-seconds",
        "AIP_CREWAI_SSE_KEEPALIVE_SECONDS",
        float_in(0.01, 3600.0),
        15.0,
        "interval of SSE keep-alive comments, seconds",
    ),
    Option(
        "shutdown_grace_seconds",
        "--shutdown-grace-seconds",
        "AIP_CREWAI_SHUTDOWN_GRACE_SECONDS",
        float_in(0.0, 3600.0),
        20.0,
        "at SIGTERM/SIGINT, how long running jobs may finish before cancellation",
    ),
    Option(
        "isolation",
        "--isolation",
        "AIP_CREWAI_ISOLATION",
        choice("process", "inprocess"),
        "process",
        "where jobs run: process (each job in a worker process of its own: hard cancel, crash containment) or "
        "inprocess (in the sidecar process, for debugging)",
    ),
    Option(
        "cancel_grace_seconds",
        "--cancel-grace-seconds",
        "AIP_CREWAI_CANCEL_GRACE_SECONDS",
        float_in(0.0, 60.0),
        1.0,
        "with --isolation process: how long a cancelled job may take to stop "
        "before its worker process is killed, seconds",
    ),
    Option(
        "idle_workers",
        "--idle-workers",
        "AIP_CREWAI_IDLE_WORKERS",
        int_in(0, 1024),
        None,
        "with --isolation process: job workers kept booted ahead of need, 0..--max-concurrency (default: "
        f"--max-concurrency, at most {DEFAULT_IDLE_WORKERS_CAP}); each holds about 23 MiB of its own, and a job "
        "that finds none idle waits for one to boot (a fork, the registry import and a warm-up kickoff)",
    ),
    Option(
        "idle_shrink_seconds",
        "--idle-shrink-seconds",
        "AIP_CREWAI_IDLE_SHRINK_SECONDS",
        float_in(0.0, 86400.0),
        30.0,
        "with --isolation process: after this many seconds without a job starting or ending, idle workers beyond "
        "one (none with --idle-workers 0) exit and warm workers are retired, so an idle sidecar holds one worker; "
        "the next job's start boots the others back (0: keep --idle-workers booted always)",
    ),
    Option(
        "worker_nice",
        "--worker-nice",
        "AIP_CREWAI_WORKER_NICE",
        int_in(0, 19),
        10,
        "with --isolation process: added to the sidecar's own niceness in every job worker, 0..19; under CPU "
        "contention the sidecar's event loop (admissions, event streams, /health) and a host on the same "
        "machine run ahead of the jobs (0: the jobs compete at the sidecar's own priority)",
    ),
    Option(
        "worker_jobs",
        "--worker-jobs",
        "AIP_CREWAI_WORKER_JOBS",
        int_in(1, 100_000),
        100,
        "with --isolation process: jobs one worker process runs, one after the other, all of one tenant's one "
        "crew (above 1, a job that completed leaves its worker warm for that tenant's next job of that crew, "
        "which then skips the worker's boot; 1: a fresh process per job)",
    ),
    Option(
        "preload_modules",
        "--preload-modules",
        "AIP_CREWAI_PRELOAD_MODULES",
        parse_modules,
        DEFAULT_PRELOAD_MODULES,
        "with --isolation process: comma list of modules the worker fork server imports once, with the "
        "sidecar's rights, before it forks any worker, so that no job imports them on its time (none: only "
        "CrewAI and the operations); for what your crews' model providers import lazily. A module that starts "
        "a thread stops start-up; one whose import raises is skipped with a warning (preload_module_skipped)",
    ),
    Option(
        "worker_user",
        "--worker-user",
        "AIP_CREWAI_WORKER_USER",
        text_value,
        None,
        "with --isolation process and a sidecar started as root: the unprivileged user (name or uid) every "
        "job worker runs as (docs/security.md, worker sandbox)",
    ),
    Option(
        "log_level",
        "--log-level",
        "AIP_CREWAI_LOG_LEVEL",
        choice("debug", "info", "warning", "error"),
        "info",
        "log level (logs go to stderr)",
    ),
    Option(
        "log_format",
        "--log-format",
        "AIP_CREWAI_LOG_FORMAT",
        choice("auto", "json", "console"),
        "auto",
        "log format; auto: JSON unless stderr is a terminal",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``aip-crewai sidecar`` argument parser (``--help`` lists every setting)."""
    parser = argparse.ArgumentParser(
        prog="aip-crewai sidecar",
        description="Run the CrewAI sidecar: crew registry, SQLite job journal, sidecar HTTP contract. "
        "Every setting also reads its environment variable; a flag wins over the environment.",
    )
    for opt in OPTIONS:
        default = ",".join(opt.default) if isinstance(opt.default, tuple) else opt.default
        env = f" [env {opt.env}]" if opt.env else ""
        shown = f" (default: {default})" if default is not None else ""
        parser.add_argument(
            opt.flag, dest=opt.dest, metavar=opt.dest.upper(), default=None, help=f"{opt.help}{env}{shown}"
        )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help=f"serve without a bearer token; loopback --host only [env {VALVE_ENV['allow_unauthenticated']}=1|true]",
    )
    parser.add_argument(
        "--allow-ephemeral",
        action="store_true",
        help="use a temporary journal when --journal is unset; loopback --host only "
        f"(health then reports durable_journal=false) [env {VALVE_ENV['allow_ephemeral']}=1|true]",
    )
    return parser


def option_name(opt: Option) -> str:
    """How errors name a setting: its flag and, when it has one, its environment variable."""
    return f"{opt.flag} ({opt.env})" if opt.env else opt.flag
