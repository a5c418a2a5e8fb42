"""Sidecar settings: flags, their environment variables, defaults, validation.

:func:`load_settings` is the only place in the sidecar that reads the process
environment. Every setting of ARCHITECTURE.md §11 is a flag that also reads the
peer's environment variable; a flag given on the command line wins over the
environment, and an empty environment variable counts as unset. An invalid
value raises :class:`ConfigError` naming the setting; the entry point prints
it on stderr and exits with status 2.

Additions of ours (same rules, ``AIP_CREWAI_`` prefix): ``--sse-keepalive-
seconds``, ``--shutdown-grace-seconds``, ``--max-journal-bytes``,
``--isolation``, ``--cancel-grace-seconds``, ``--idle-workers``, ``--log-level``, ``--log-format``. The two safety valves
``--allow-unauthenticated`` and ``--allow-ephemeral`` (also
``AIP_CREWAI_ALLOW_UNAUTHENTICATED`` / ``AIP_CREWAI_ALLOW_EPHEMERAL`` =
``1|true|yes|on``, or ``0|false|no|off``) work on loopback binds only.

The reference sidecar's environment is accepted as it is (docs/operating.md "Migrating
from the reference sidecar"): an inline ``AIP_CREWAI_BEARER_TOKEN`` (a warning
says a token file is safer), ``AIP_CREWAI_MAX_STATE_BYTES`` (the journal size
bound, as ``--max-journal-bytes``), a training directory or a journal
directory that does not exist yet (created 0700, with missing parents), and ``--max-event-bytes`` up to 4 MiB. Problems an
operator should hear about but that do not stop start-up are returned in
:attr:`Settings.warnings` (logged by the entry point; never a secret).

The table of flags, their variables, parsers and defaults, and the argument parser, are in
:mod:`.options`; this module validates their combination.

Source: ARCHITECTURE.md §11 (operator interface), §4 (token file), §5 (limits).
"""

from __future__ import annotations

import argparse
import os
import pwd
import stat
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aip_crewai.contracts.operations import INSPECTION_OPERATIONS
from aip_crewai.plumbing.loopback import is_loopback

from ..plumbing.keys import MAX_SECRET_FILE_BYTES, SecretFileError, read_token
from .isolation.sandbox import SandboxPlan
from .options import (
    DEFAULT_IDLE_WORKERS_CAP,
    DEFAULT_PRELOAD_MODULES,
    OPTIONS,
    VALVE_ENV,
    build_parser,
    int_in,
    option_name,
)

#: The host's SSE frame bound, bytes (ARCHITECTURE.md §7): larger events are refused by the host.
HOST_FRAME_BYTES = 1_048_576
#: The reference's ``AIP_CREWAI_MAX_STATE_BYTES`` range, bytes; it sets ``--max-journal-bytes``.
STATE_BYTES_ENV = "AIP_CREWAI_MAX_STATE_BYTES"
#: The reference's inline token (a token file is safer: it is not in the process environment).
INLINE_TOKEN_ENV = "AIP_CREWAI_BEARER_TOKEN"
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """An invalid setting. ``setting`` names the flag (and its variable)."""

    def __init__(self, setting: str, problem: str) -> None:
        self.setting = setting
        self.problem = problem
        super().__init__(f"{setting}: {problem}")


#: Settings of the job worker processes only: with ``--isolation inprocess`` a given one is ignored (a start-up
#: warning names it).
PROCESS_ONLY = (
    "cancel_grace_seconds",
    "idle_workers",
    "idle_shrink_seconds",
    "worker_nice",
    "worker_jobs",
    "preload_modules",
)


@dataclass(frozen=True)
class Settings:
    """Validated sidecar settings (immutable; passed explicitly, never global).

    Attributes (units in the names or noted):
        registry: ``module:attribute`` of the crew registry.
        host, port: listen address; port 0 asks the OS for a free port.
        journal: SQLite journal path; None until an ephemeral one is made.
        state_dir: CrewAI storage lives under it (default: the journal's dir).
        token: bearer token (never printed: ``repr=False``); None only with
            ``allow_unauthenticated``.
        allowed_operations: startable operations this sidecar admits.
        max_concurrency: jobs executing at once (the semaphore).
        max_retained_runs: non-archived jobs in the journal; admission 507 at it.
        max_events_per_run: events of one job, terminal included.
        max_event_bytes: encoded size bound of one event, bytes.
        stream_checkpoint_events: chunk events committed per journal write.
        training_dir: where ``train`` writes artifacts (required with train).
        max_journal_bytes: bound on used journal pages plus the -wal file, bytes; admission 507 past it.
        body_budget_bytes: without a token, request bodies being read at once, in total, bytes (503 past it).
        sse_keepalive_seconds: interval of ``: keep-alive`` comments.
        shutdown_grace_seconds: how long in-flight jobs may finish at shutdown.
        isolation: ``process`` (each job in a worker process of its own, :mod:`.isolation.pool`)
            or ``inprocess`` (jobs run in the sidecar process: debugging).
        idle_workers: with ``process``, job workers kept booted ahead of need (at most
            ``max_concurrency``; None: ``max_concurrency``, at most :data:`~.options.DEFAULT_IDLE_WORKERS_CAP`).
        idle_shrink_seconds: with ``process``, seconds without a job starting or ending after which at most one idle worker
            is kept and warm workers are retired (0: never; ARCHITECTURE.md §5).
        worker_nice: with ``process``, what every job worker adds to the sidecar's niceness (0..19): jobs
            yield the CPU to the sidecar's event loop under contention (ARCHITECTURE.md §5).
        worker_jobs: with ``process``, jobs one worker runs at most, all of one tenant's one crew (default 100:
            warm workers; 1: a fresh process per job; ARCHITECTURE.md §5 "warm workers").
        preload_modules: with ``process``, modules the worker fork server imports besides CrewAI and the
            operations (``fork_server.start_forkserver``; ARCHITECTURE.md §5).
        cancel_grace_seconds: with ``process``, how long a cancelled job may take to
            stop cooperatively before its worker is killed.
        worker_user: ``(name, uid, gid, home)`` of ``--worker-user``: job workers drop to it (root only).
        worker_sandbox: the workers' sandbox, set at start-up by the entry point (``isolation/sandbox.py``).
        ephemeral: the journal is a temporary file made at start-up because
            none was configured (health then says ``durable_journal: false``).
        notify_socket: systemd ``NOTIFY_SOCKET`` (from the environment only).
        warnings: ``(event, message)`` pairs for the start-up log (no secrets).
    """

    registry: str
    host: str = "127.0.0.1"
    port: int = 8090
    journal: Path | None = None
    state_dir: Path | None = None
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    allow_unauthenticated: bool = False
    allow_ephemeral: bool = False
    allowed_operations: tuple[str, ...] = ("run",)
    max_concurrency: int = 4
    max_retained_runs: int = 2000
    max_events_per_run: int = 1000
    max_event_bytes: int = 262_144
    stream_checkpoint_events: int = 128
    training_dir: Path | None = None
    max_journal_bytes: int = 1_073_741_824
    body_budget_bytes: int = 64 * 1024 * 1024
    sse_keepalive_seconds: float = 15.0
    shutdown_grace_seconds: float = 20.0
    isolation: str = "process"
    cancel_grace_seconds: float = 1.0
    idle_workers: int | None = None
    idle_shrink_seconds: float = 30.0
    worker_nice: int = 10
    worker_jobs: int = 100
    preload_modules: tuple[str, ...] = DEFAULT_PRELOAD_MODULES
    worker_user: tuple[str, int, int, str] | None = None
    worker_sandbox: SandboxPlan | None = None
    log_level: str = "info"
    log_format: str = "auto"
    notify_socket: str | None = None
    ephemeral: bool = False
    warnings: tuple[tuple[str, str], ...] = ()

    @property
    def operations(self) -> list[str]:
        """Operations named by ``/health``: allowed ∪ status, events, cancel (sorted)."""
        return sorted(set(self.allowed_operations) | INSPECTION_OPERATIONS)


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> Settings:
    """Parse flags and environment into validated :class:`Settings`.

    Args:
        argv: the arguments after ``sidecar``.
        environ: the process environment (only this function reads it).

    Returns:
        Settings, with ``token`` read from the token file.

    Raises:
        ConfigError: a missing or invalid setting (the message names it).
        SystemExit: argparse usage errors (status 2) and ``--help`` (status 0).

    Source: ARCHITECTURE.md §11, §4 (token file), §5.
    """
    args = build_parser().parse_args(list(argv))
    values: dict[str, Any] = {}
    given: set[str] = set()
    for opt in OPTIONS:
        raw = getattr(args, opt.dest)
        source = raw if raw is not None else (environ.get(opt.env) or None if opt.env else None)
        if source is None:
            values[opt.dest] = opt.default
            continue
        given.add(opt.dest)
        try:
            values[opt.dest] = opt.parse(source)
        except ValueError as exc:
            raise ConfigError(option_name(opt), f"{exc} (got {source!r})") from None
    by_dest = {opt.dest: opt for opt in OPTIONS}
    warnings: list[tuple[str, str]] = []
    if values["registry"] is None:
        raise ConfigError(option_name(by_dest["registry"]), "is required (module:attribute)")
    values["max_journal_bytes"] = _journal_bytes(args, environ, values["max_journal_bytes"])
    if values["max_event_bytes"] > HOST_FRAME_BYTES:
        warnings.append(
            (
                "max_event_bytes_above_host_frame",
                f"--max-event-bytes is {values['max_event_bytes']}: the aip-crewai host refuses events "
                f"over {HOST_FRAME_BYTES} bytes (its SSE frame bound)",
            )
        )
    loopback = is_loopback(values["host"])
    allow_unauth = bool(args.allow_unauthenticated) or _switch(environ, VALVE_ENV["allow_unauthenticated"])
    allow_ephemeral = bool(args.allow_ephemeral) or _switch(environ, VALVE_ENV["allow_ephemeral"])
    if allow_unauth and not loopback:
        raise ConfigError("--allow-unauthenticated", f"only allowed with a loopback --host, not {values['host']!r}")
    if allow_ephemeral and not loopback:
        raise ConfigError("--allow-ephemeral", f"only allowed with a loopback --host, not {values['host']!r}")

    journal: Path | None = values["journal"]
    if journal is None and not allow_ephemeral:
        raise ConfigError(option_name(by_dest["journal"]), "is required (or --allow-ephemeral on a loopback --host)")
    if journal is not None:
        journal = journal.absolute()
        # A missing directory is created 0700 with its missing parents, as the reference sidecar does (a
        # drop-in switch needs no change); the journal's own checks then refuse a directory others can write.
        if _make_private_dirs(option_name(by_dest["journal"]), journal.parent):
            warnings.append(("journal_dir_created", f"created the journal directory {journal.parent} (mode 0700)"))
    state_dir: Path | None = values["state_dir"]
    if state_dir is not None:
        state_dir = _check_private_dir(option_name(by_dest["state_dir"]), state_dir.absolute())
    elif journal is not None:
        state_dir = journal.parent

    token: str | None = None
    token_file: Path | None = values["token_file"]
    inline = environ.get(INLINE_TOKEN_ENV) or None
    if token_file is not None and inline is not None:
        raise ConfigError(
            INLINE_TOKEN_ENV, f"and {option_name(by_dest['token_file'])} are mutually exclusive; keep the token file"
        )
    if token_file is not None:
        token = read_token_file(token_file, setting=option_name(by_dest["token_file"]))
    elif inline is not None:
        token = inline_token(inline)
        warnings.append(
            (
                "bearer_token_inline",
                f"the bearer token comes from {INLINE_TOKEN_ENV}; a 0600 token file "
                f"({option_name(by_dest['token_file'])}) is safer: the environment is readable by more "
                "processes and tools than the file",
            )
        )
    elif not allow_unauth:
        raise ConfigError(
            option_name(by_dest["token_file"]),
            f"is required (or {INLINE_TOKEN_ENV}, or --allow-unauthenticated on a loopback --host)",
        )

    training_dir: Path | None = values["training_dir"]
    if training_dir is not None:
        setting = option_name(by_dest["training_dir"])
        training_dir = training_dir.absolute()
        _check_training_dir_apart(setting, training_dir, journal, state_dir)
        if _make_private_dirs(setting, training_dir):
            warnings.append(("training_dir_created", f"created the training directory {training_dir} (mode 0700)"))
        training_dir = _check_private_dir(setting, training_dir)
    elif "train" in values["allowed_operations"]:
        raise ConfigError(option_name(by_dest["training_dir"]), "is required when train is an allowed operation")

    ignored = [option_name(by_dest[dest]) for dest in PROCESS_ONLY if dest in given]
    if values["isolation"] == "inprocess" and ignored:
        warnings.append(
            (
                "process_options_ignored",
                f"{', '.join(ignored)} apply to job worker processes (--isolation process); "
                "--isolation inprocess runs every job in the sidecar process and ignores them",
            )
        )
    worker_user = _worker_user(option_name(by_dest["worker_user"]), values["worker_user"], values["isolation"])
    idle_workers: int = (
        min(values["max_concurrency"], DEFAULT_IDLE_WORKERS_CAP)
        if values["idle_workers"] is None
        else values["idle_workers"]
    )
    if idle_workers > values["max_concurrency"]:
        raise ConfigError(
            option_name(by_dest["idle_workers"]),
            f"must be at most --max-concurrency ({values['max_concurrency']}), not {idle_workers}",
        )

    return Settings(
        registry=values["registry"],
        host=values["host"],
        port=values["port"],
        journal=journal,
        state_dir=state_dir,
        token=token,
        token_file=token_file,
        allow_unauthenticated=allow_unauth,
        allow_ephemeral=allow_ephemeral,
        allowed_operations=values["allowed_operations"],
        max_concurrency=values["max_concurrency"],
        max_retained_runs=values["max_retained_runs"],
        max_events_per_run=values["max_events_per_run"],
        max_event_bytes=values["max_event_bytes"],
        stream_checkpoint_events=values["stream_checkpoint_events"],
        training_dir=training_dir,
        max_journal_bytes=values["max_journal_bytes"],
        body_budget_bytes=values["body_budget_bytes"],
        sse_keepalive_seconds=values["sse_keepalive_seconds"],
        shutdown_grace_seconds=values["shutdown_grace_seconds"],
        isolation=values["isolation"],
        cancel_grace_seconds=values["cancel_grace_seconds"],
        idle_workers=idle_workers,
        idle_shrink_seconds=values["idle_shrink_seconds"],
        worker_nice=values["worker_nice"],
        worker_jobs=values["worker_jobs"],
        preload_modules=values["preload_modules"],
        worker_user=worker_user,
        log_level=values["log_level"],
        log_format=values["log_format"],
        notify_socket=environ.get("NOTIFY_SOCKET") or None,
        warnings=tuple(warnings),
    )


def _worker_user(setting: str, name: str | None, isolation: str) -> tuple[str, int, int, str] | None:
    """``--worker-user``: an existing user other than root, for a sidecar started as root with process isolation.

    Returns:
        ``(name, uid, gid, home)``, or None when not set.

    Raises:
        ConfigError: unknown user, root, ``--isolation inprocess``, or a sidecar not running as root
            (only root can switch users).

    Source: docs/security.md "Security" (worker sandbox).
    """
    if name is None:
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isascii() and name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise ConfigError(setting, f"no such user {name!r}") from None
    if entry.pw_uid == 0:
        raise ConfigError(setting, "must be an unprivileged user, not root")
    if isolation != "process":
        raise ConfigError(setting, "needs --isolation process (jobs run in worker processes)")
    if os.geteuid() != 0:
        raise ConfigError(setting, "needs a sidecar started as root (only root can switch to another user)")
    return entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir


def scrub_environment(environ: MutableMapping[str, str]) -> bool:
    """Remove the inline bearer token (``AIP_CREWAI_BEARER_TOKEN``) from ``environ`` (the process's:
    ``os.environ`` also unsets it), so no fork server, worker or subprocess inherits it. True when it was set.

    Call once the settings are loaded, before anything starts a process.

    Source: docs/security.md "Security" (worker sandbox), "Migrating from the reference sidecar".
    """
    return environ.pop(INLINE_TOKEN_ENV, None) is not None


def _switch(environ: Mapping[str, str], name: str) -> bool:
    """An on/off environment variable: ``1|true|yes|on`` or ``0|false|no|off`` (any case); unset or empty is off.

    Raises:
        ConfigError: any other value (a typo never silently turns a safety valve on or off).
    """
    text = (environ.get(name) or "").strip().lower()
    if not text or text in _FALSE:
        return False
    if text in _TRUE:
        return True
    raise ConfigError(name, f"must be 1, true, yes, on, 0, false, no or off (got {environ.get(name)!r})")


def _journal_bytes(args: argparse.Namespace, environ: Mapping[str, str], current: int) -> int:
    """``--max-journal-bytes``, or the reference's ``AIP_CREWAI_MAX_STATE_BYTES`` when that alone is given.

    The reference bounds its JSON state file; here the bound applies to the
    SQLite journal's used pages (admission 507 past it), the same promise.

    Raises:
        ConfigError: ``AIP_CREWAI_MAX_STATE_BYTES`` outside 1048576..4294967296,
            or given together with a different ``--max-journal-bytes``.
    """
    raw = environ.get(STATE_BYTES_ENV) or None
    if raw is None:
        return current
    try:
        state_bytes = int_in(1_048_576, 4_294_967_296)(raw)
    except ValueError as exc:
        raise ConfigError(f"{STATE_BYTES_ENV} (sets --max-journal-bytes)", f"{exc} (got {raw!r})") from None
    explicit = args.max_journal_bytes is not None or bool(environ.get("AIP_CREWAI_MAX_JOURNAL_BYTES"))
    if explicit and current != state_bytes:
        raise ConfigError(
            STATE_BYTES_ENV,
            f"is {state_bytes} but --max-journal-bytes (AIP_CREWAI_MAX_JOURNAL_BYTES) "
            f"is {current}; they are one bound, set one of them",
        )
    return state_bytes


def inline_token(text: str) -> str:
    """Check an inline bearer token (``AIP_CREWAI_BEARER_TOKEN``): surrounding whitespace is
    stripped; then 1..16384 bytes of visible ASCII (it travels in an HTTP header), as a token file.

    Raises:
        ConfigError: naming the variable, never the token.

    Source: docs/operating.md "Migrating from the reference sidecar"; ARCHITECTURE.md §4 (bearer token).
    """
    token = text.strip()
    if not 1 <= len(token.encode("utf-8", "surrogateescape")) <= MAX_SECRET_FILE_BYTES:
        raise ConfigError(INLINE_TOKEN_ENV, f"must hold 1..{MAX_SECRET_FILE_BYTES} bytes")
    if not all(0x21 <= ord(char) <= 0x7E for char in token):
        raise ConfigError(INLINE_TOKEN_ENV, "must be one token of visible ASCII characters, without whitespace")
    return token


def _make_private_dirs(setting: str, path: Path) -> bool:
    """Create ``path`` and any missing parents, each mode 0700; True when something was created.

    Raises:
        ConfigError: a directory cannot be created (the message names it).
    """
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # the umask may have taken bits away; never added any
        except OSError as exc:
            raise ConfigError(setting, f"cannot create {directory}: {exc.strerror}") from None
    return bool(missing)


def _check_training_dir_apart(setting: str, training_dir: Path, journal: Path | None, state_dir: Path | None) -> None:
    """Refuse a training directory that is, or contains, the journal or the state directory.

    A train artifact is written by name into the training directory tree; if
    that tree held the journal, an ``artifact_name`` such as ``journal.db``
    could replace the live journal. Paths are compared resolved (symlinks
    followed).

    Raises:
        ConfigError: the training directory equals the state directory or the
            journal's directory, or is an ancestor of either.

    Source: docs/security.md ("Tenant-scoped crew state"); ARCHITECTURE.md §11 (``--training-dir``).
    """
    training = training_dir.resolve()
    for label, path in (("the journal", journal), ("the state directory", state_dir)):
        if path is None:
            continue
        target = path.resolve()
        if target == training or training in target.parents:
            raise ConfigError(setting, f"must not be, or contain, {label} ({path}); use a directory of its own")


def read_token_file(path: Path, *, setting: str = "--token-file") -> str:
    """Read and check the bearer token file.

    Rules: a regular file, not a symlink, no group/other permission bits
    (mode 0600 or stricter), 1..16384 bytes, UTF-8; one trailing newline (LF
    or CRLF) is stripped; the token must then be non-empty and hold no
    whitespace or control characters (it travels in an HTTP header).

    Raises:
        ConfigError: any rule broken (the message names ``setting``, never the token).

    Source: ARCHITECTURE.md §4.
    """
    try:
        return read_token(path)
    except SecretFileError as exc:
        raise ConfigError(setting, str(exc)) from None


def _check_private_dir(setting: str, path: Path) -> Path:
    """A directory that exists, is not a symlink and is not group/world-writable."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(setting, f"{path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(setting, f"{path} is a symlink; use the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(setting, f"{path} is not a directory")
    if info.st_mode & 0o022:
        raise ConfigError(setting, f"{path} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):04o})")
    return path
