"""Process environment for CrewAI: offline, prompt-free, storage under the state dir.

CrewAI reads several settings at *import* time (Chroma's default path, the
Redis lock URL, telemetry switches), so :func:`prepare_crewai_environment` must
run before the first ``import crewai`` anywhere in the process; then
:func:`import_crewai` pays the import cost (about 4-5 s, about 150 MiB) once,
before the sidecar reports ready.

What is set, and why (measured against crewai 1.15.5 sources):

- ``CREWAI_DISABLE_TELEMETRY=true``, ``CREWAI_DISABLE_TRACKING=true``,
  ``OTEL_SDK_DISABLED=true``: CrewAI's OpenTelemetry exporter stays off (no
  network, no signal handlers of its own).
- ``CREWAI_TRACING_ENABLED=false``: no trace batches to the CrewAI backend.
- ``CREWAI_DISABLE_VERSION_CHECK=true``: verbose crews would otherwise ask
  PyPI whether a newer CrewAI exists.
- ``ANONYMIZED_TELEMETRY=False``: Chroma's own telemetry switch (CrewAI already
  passes ``anonymized_telemetry=False``; this covers other Chroma clients).
- ``CREWAI_STORAGE_DIR=<state_dir>/crewai`` (absolute, mode 0700; the tenant
  namespaces are beside it, :func:`namespaces_dir`): CrewAI
  feeds it to ``appdirs.user_data_dir(appname)``; an absolute appname makes
  ``os.path.join`` drop the XDG base, so replay outputs, Chroma knowledge files
  and ``.crewai_user.json`` land there.
- ``.crewai_user.json`` is seeded with ``first_execution_done=true`` and
  ``trace_consent=false`` when absent: otherwise the first kickoff collects a
  "first-time" trace and, on a terminal, prompts on stdin for 20 s and may
  upload it.
- ``OPENBLAS_NUM_THREADS=1`` (unless set): ``import crewai`` imports numpy,
  whose OpenBLAS starts a native worker thread per core at import; the worker
  fork server must fork from a process with one thread
  (``fork_server.start_forkserver``), and a crew gateway has no use for parallel
  BLAS. An operator who sets it above 1 gets a sidecar that refuses to start
  its workers (``worker_fork_server_threaded``).
- ``REDIS_URL`` is removed: ``crewai_core.lock_store`` would otherwise take its
  file locks through that Redis server.

CrewAI prints rich panels to stdout. That is allowed (our logs and protocol go
to stderr and HTTP), but a missing stdout would turn every print into an
exception inside a job, so a ``None`` stdout is pointed at ``os.devnull``.
Whoever starts the sidecar with ``stdout=PIPE`` must drain the pipe.

CrewAI also logs through stdlib ``logging``, quoting provider exception text
(``crewai.flow.runtime`` logs "Error executing listener call_llm_and_parse:
<provider message>" at ERROR), which can hold secrets. The ``crewai`` and
``crewai_core`` logger trees are therefore muted (no propagation, a
``NullHandler``). A few CrewAI modules log on the *root* logger (e.g. knowledge
search errors); the sidecar's logging configuration should not print foreign
root records verbatim.

Source: ARCHITECTURE.md §5 (storage under the state directory, telemetry disabled),
ARCHITECTURE.md §5 (Environment).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import structlog

from aip_crewai.plumbing.log import pin_log_stream

_ENV_DEFAULTS: dict[str, str] = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
    "ANONYMIZED_TELEMETRY": "False",
}
_USER_DATA_FILE = ".crewai_user.json"
_MUTED_LOGGERS = ("crewai", "crewai_core")
_imported = False


def crewai_storage_dir(state_dir: Path) -> Path:
    """Return the absolute CrewAI storage directory for a sidecar state dir.

    Args:
        state_dir: the sidecar state directory (may be relative).

    Returns:
        ``<state_dir>/crewai`` as an absolute path.
    """
    return (Path(state_dir).expanduser().resolve()) / "crewai"


def namespaces_dir(state_dir: Path) -> Path:
    """The directory of the per-(tenant, crew) namespace directories: ``<state_dir>/namespaces``
    (``operations/knowledge_query.namespace_storage_dir``). Until this version it was
    ``<state_dir>/crewai/namespaces``; :func:`prepare_crewai_environment` moves it once."""
    return Path(state_dir).expanduser().resolve() / "namespaces"


def prepare_crewai_environment(state_dir: Path) -> None:
    """Set CrewAI's environment before it is imported.

    Idempotent for the same ``state_dir``. The variables are forced (not
    defaulted): an operator's ``CREWAI_TRACING_ENABLED=true`` would break the
    no-network guarantee.

    Args:
        state_dir: the sidecar state directory; CrewAI storage goes to
            ``<state_dir>/crewai`` (created with mode 0700).

    Raises:
        RuntimeError: crewai was already imported with a different storage
            dir (its import-time paths would silently point elsewhere).
        OSError: the storage directory cannot be created.

    Source: ARCHITECTURE.md §5; ARCHITECTURE.md §5 (Environment).
    """
    storage = crewai_storage_dir(state_dir)
    current = os.environ.get("CREWAI_STORAGE_DIR")
    if "crewai" in sys.modules and current != str(storage):
        raise RuntimeError(
            "crewai was imported before prepare_crewai_environment(); "
            f"its storage dir is {current!r}, expected {str(storage)!r}"
        )
    storage.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(storage, 0o700)
    earlier, namespaces = storage / "namespaces", namespaces_dir(state_dir)
    if earlier.is_dir() and not namespaces.exists():  # tenant memories of an earlier version move along
        os.rename(earlier, namespaces)
    for name, value in _ENV_DEFAULTS.items():
        os.environ[name] = value
    os.environ["CREWAI_STORAGE_DIR"] = str(storage)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.pop("REDIS_URL", None)
    _seed_user_data(storage / _USER_DATA_FILE)
    _ensure_stdout()
    _mute_crewai_loggers()


def import_crewai() -> None:
    """Import crewai (and the operations package) once, eagerly.

    Call after :func:`prepare_crewai_environment` and before reporting ready,
    so the first job does not pay the import cost. Also registers the global
    cooperative-cancel ``before_llm_call`` hook and makes every crew keep its
    task outputs (which quote the kickoff inputs) in a job-private in-memory
    store instead of CrewAI's shared ``latest_kickoff_task_outputs.db``
    (``operations._task_outputs``).

    Raises:
        RuntimeError: :func:`prepare_crewai_environment` was not called.
    """
    global _imported
    if _imported:
        return
    if not os.environ.get("CREWAI_STORAGE_DIR"):
        raise RuntimeError("call prepare_crewai_environment() before import_crewai()")
    import crewai  # noqa: F401  (the import is the point)

    from aip_crewai.sidecar.operations import _common, _task_outputs

    _common.install_cancel_hook()
    _task_outputs.install()
    _imported = True


def _seed_user_data(path: Path) -> None:
    """Mark the first execution done with tracing declined, if not yet recorded."""
    if path.exists():
        return
    data = {"first_execution_done": True, "trace_consent": False}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh)


def _mute_crewai_loggers() -> None:
    """Keep CrewAI's stdlib log records (which quote provider errors) out of our logs."""
    for name in _MUTED_LOGGERS:
        logger = logging.getLogger(name)
        logger.propagate = False
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())


def _ensure_stdout() -> None:
    """Give CrewAI a writable stdout when the process has none."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115


#: Longest printed line kept while waiting for its newline (chars); the rest is dropped.
MAX_PRINTED_LINE_CHARS = 8192
_ERROR_WORDS = re.compile(r"error|fail|exception|traceback", re.IGNORECASE)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_FRAME = re.compile(r"[\u2500-\u259f]+")
#: A printed error's label is kept only when it is plain words (no digits, keys or paths).
_PLAIN_LABEL = re.compile(r"^[A-Za-z][A-Za-z ,'()-]{0,79}$")
#: CrewAI's printed prefixes, e.g. ``[2026-12-01 04:14:29]`` and ``[ERROR]:``.
_TAGS = re.compile(r"^(\s*\[[^\]]{0,40}\]:?)+\s*")


class PrintedErrorLog(io.TextIOBase):
    """A ``sys.stdout`` for CrewAI: nothing reaches fd 1; printed errors become log events.

    Each complete printed line (ANSI colours and box-drawing frames removed)
    that names an error (``error``, ``failed``, ``exception``, ...) is logged
    once as ``crewai_printed_error`` at warning level with only its *label*:
    the text before the first ``:`` when that is plain words (e.g. "Failed
    to init knowledge"), else ``"withheld"``. The rest of the line (provider
    and embedder messages, which can quote keys) is never logged: the same
    rule as job errors, which publish their type and a fixed message.
    Other lines (panels, progress) are dropped. Thread-safe; a line longer
    than :data:`MAX_PRINTED_LINE_CHARS` is cut there.

    Source: docs/security.md ("Tenant-scoped crew state": knowledge; "Security": no
    secrets in logs).
    """

    def __init__(self, stream: str = "stdout") -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._pending = ""
        self._log = structlog.get_logger("aip_crewai.sidecar")
        self._fields = {} if stream == "stdout" else {"stream": stream}

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        """Take printed text; log the error lines it completes. Returns ``len(text)``."""
        with self._lock:
            lines = (self._pending + text).split("\n")
            self._pending = lines.pop()[:MAX_PRINTED_LINE_CHARS]
        for line in lines:
            self._consider(line[:MAX_PRINTED_LINE_CHARS])
        return len(text)

    def flush(self) -> None:
        """Nothing is buffered below a line; a partial line waits for its newline."""

    def _consider(self, line: str) -> None:
        plain = _FRAME.sub(" ", _ANSI.sub("", line)).strip()
        if not plain or not _ERROR_WORDS.search(plain):
            return
        self._log.warning("crewai_printed_error", label=printed_error_label(plain), **self._fields)


def printed_error_label(line: str) -> str:
    """The loggable label of a printed error line (see :class:`PrintedErrorLog`).

    Args:
        line: one printed line, colours and frames removed.

    Returns:
        After CrewAI's bracketed prefixes (``[<time>]``, ``[ERROR]:``), the
        text before the first ``:``, stripped, when it is 1 to 80 plain
        characters (letters, spaces, ``,'()-``); else ``"withheld"``.
    """
    line = _TAGS.sub("", line)
    label = line.split(":", 1)[0].strip() if ":" in line else ""
    return label if _PLAIN_LABEL.match(label) else "withheld"


class LibraryLog(logging.Handler):
    """The root logger's one handler in the sidecar and its workers: a library's stdlib record (warning and
    worse) becomes one ``library_log`` event with its logger's name and only the label of its first line
    (:func:`printed_error_label`), never its text.

    CrewAI's OpenAI provider logs ``OpenAI API call failed: <the provider's error>`` on the root logger, and a
    provider or gateway may quote the API key, the prompt or the input there; without a handler Python's
    ``logging.error`` would print it raw on stderr (``ERROR:root:...``, not a JSON line). Thread-safe.

    Source: docs/security.md ("Security": no secrets in logs); docs/operating.md (one JSON object per line).
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            first = str(record.getMessage()).split("\n", 1)[0]
        except Exception:  # a malformed record must not break logging
            first = ""
        structlog.get_logger("aip_crewai.sidecar").log(
            record.levelno, "library_log", library=record.name, label=printed_error_label(first)
        )


def log_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """``warnings.showwarning`` of the sidecar and its workers: one ``python_warning`` event naming the
    warning's category and where it was raised (file name and line), never its text (a crew's or a library's
    warning may quote a key or an input). Signature: :func:`warnings.showwarning`."""
    structlog.get_logger("aip_crewai.sidecar").warning(
        "python_warning", category=category.__name__, at=f"{os.path.basename(filename)}:{lineno}"
    )


def capture_crewai_prints() -> None:
    """Point fd 1 at ``/dev/null`` and ``sys.stdout`` at a :class:`PrintedErrorLog`, ``sys.stderr`` at another
    (its events say ``stream: stderr``; the process's log lines keep the real stderr), Python warnings at
    :func:`log_warning`, and give the root logger one :class:`LibraryLog` (warnings and worse) in place of any
    handler.

    Call before CrewAI is imported, in the sidecar process only (not in
    tests that share pytest's stdout). CrewAI prints panels and warnings,
    some quoting provider or embedder exceptions verbatim (e.g. ``Failed to
    init knowledge: <error>`` in ``crew.py::create_crew_knowledge``), which
    can hold secrets; the sidecar itself writes nothing to stdout (logs go
    to stderr), so fd 1 carries nothing at all. Native writes to fd 1 are
    discarded.

    Raises:
        OSError: ``/dev/null`` cannot be opened.
    """
    if sys.stdout is not None:
        sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
    finally:
        os.close(devnull)
    sys.stdout = PrintedErrorLog()
    # Crew code's own writes to sys.stderr and its warnings (a tool's sys.stderr.write, warnings.warn, a
    # library's UserWarning) may quote keys and inputs as well: the same filter, and each warning one labelled
    # event; the process's own log lines keep the real stderr (native writes to fd 2 still go there raw).
    pin_log_stream(sys.stderr)
    sys.stderr = PrintedErrorLog(stream="stderr")
    warnings.showwarning = log_warning
    root = logging.getLogger()
    root.handlers = [LibraryLog()]
    root.setLevel(logging.WARNING)
