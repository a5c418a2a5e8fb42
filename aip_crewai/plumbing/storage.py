"""The storage plumbing both SQLite layers share (host store, sidecar journal).

Each process keeps its own schema and SQL in its storage module; what they
share is here: the worker start-up, the file and directory checks, and the
migration runner.


A connection is created, used and closed on one dedicated thread (sqlite3
objects must stay on the thread that made them); callers hop to it once per
storage method. :func:`start_worker` opens the connection on that thread and
is safe to cancel: when the caller gives up mid-open (task cancelled, or the
open failed), the worker shuts down and whatever the open produced is handed
to ``abandon`` on the worker after the open has finished, so no connection,
thread or lock outlives a failed or cancelled open.

Source: docs/ARCHITECTURE.md §10 (storage).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import sqlite3
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")


async def start_worker(
    open_: Callable[[], _T], *, name: str, abandon: Callable[[_T | None], None], threads: int = 1
) -> tuple[ThreadPoolExecutor, _T]:
    """Start an executor (one thread unless ``threads`` says more) and run ``open_()`` on it.

    Args:
        open_: opens (and prepares) the connection; runs on the worker.
        name: thread name prefix (visible in tracebacks and py-spy).
        threads: the executor's threads: 1 for a connection that one thread owns; more for a
            connection pool whose connections each method checks out (the PostgreSQL host store).
        abandon: cleanup when the caller does not get the result: called on the
            worker with what ``open_`` returned, or with None when it raised
            (it closed its own connection then); it may release locks.

    Returns:
        ``(worker, value)``: the worker that now owns the connection.

    Raises:
        Whatever ``open_`` raised, or CancelledError; nothing leaks either way.
    """
    worker = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
    opening = worker.submit(open_)
    try:
        return worker, await asyncio.wrap_future(opening)
    except BaseException:
        if opening.done() and not opening.cancelled() and opening.exception() is not None:
            abandon(None)  # the open failed and closed its own connection: release at once
        else:
            worker.submit(_abandon, opening, abandon)  # runs after open_ (it waits for its result)
        worker.shutdown(wait=False)
        raise


async def hop(worker: ThreadPoolExecutor, fn: Callable[..., _T], *args: object) -> _T:
    """Run ``fn(*args)`` on the database's worker thread: the one hop a storage method makes."""
    return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)


def _abandon(opening: Future[_T], abandon: Callable[[_T | None], None]) -> None:
    value = opening.result() if not opening.cancelled() and opening.exception() is None else None
    abandon(value)


# --- file and directory checks (both storage layers) -------------------------------


def directory_problem(directory: Path, what: str = "the directory") -> str | None:
    """Why ``directory`` cannot hold a database (missing, not a directory,
    group- or world-writable), or None when it can. Only ``stat``; ``what``
    names it in the message (e.g. "the journal directory")."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return f"{what} {directory} does not exist"
    if not stat.S_ISDIR(info.st_mode):
        return f"{what} {directory} is not a directory"
    if info.st_mode & 0o022:
        return (
            f"{what} {directory} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):04o}); "
            "use a directory only its owner can write"
        )
    return None


def private_file_problem(path: Path, what: str = "the file") -> str | None:
    """Why an existing ``path`` is not a private regular file (a symlink, a
    FIFO or anything but a regular file, or a permission bit beyond owner
    read/write, or another owner than this process's user), or None (also
    when it does not exist). Only ``lstat``: never opens it."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{what} {path} is a symlink; use a regular file"
    if not stat.S_ISREG(info.st_mode):
        return f"{what} {path} is not a regular file"
    if info.st_uid != os.geteuid():
        return f"{what} {path} is owned by uid {info.st_uid}, not by this process's user ({os.geteuid()})"
    mode = stat.S_IMODE(info.st_mode)
    if mode & ~0o600:
        return f"{what} {path} has mode {mode:04o}; it must be 0600 (chmod 600 {path})"
    return None


def database_files(path: Path) -> tuple[Path, Path, Path]:
    """A SQLite database and its WAL companions: ``path``, ``path-wal``, ``path-shm``."""
    return path, Path(f"{path}-wal"), Path(f"{path}-shm")


def create_private_file(path: Path, unusable: Callable[[str], Exception] | None = None) -> None:
    """Create ``path`` with mode 0600 if absent, never through a symlink (whatever the umask).

    Raises:
        ``unusable(problem)``: the file cannot be created (a read-only file system, no
            permission); the problem names the file and the reason (:func:`os_problem`).
            Without ``unusable``, the ``OSError`` itself.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        if unusable is None:
            raise
        raise unusable(os_problem(f"cannot create {path}", exc)) from exc
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def integrity_problems(conn: sqlite3.Connection, limit: int = 5) -> list[str]:
    """SQLite's ``quick_check`` (reads every page once, writes nothing): the
    problems it reports (at most ``limit``), ``[]`` for a sound database."""
    try:
        return [
            str(row[0]) for row in conn.execute(f"PRAGMA quick_check({int(limit)})").fetchall() if str(row[0]) != "ok"
        ]
    except sqlite3.DatabaseError as exc:
        return [str(exc)]


# --- forward-only migrations ---------------------------------------------------------


def apply_migrations(
    conn: sqlite3.Connection,
    migrations: Sequence[str],
    *,
    too_new: Callable[[int, int], Exception],
    applied: Callable[[int], None] | None = None,
) -> int:
    """Apply the migrations ``conn`` lacks, in order, each in its own
    ``BEGIN IMMEDIATE`` transaction with its ``PRAGMA user_version`` bump
    (migration N brings the version to N).

    Args:
        conn: an autocommit connection (``isolation_level=None``), on its worker.
        migrations: the scripts, oldest first (statements separated by ``;``).
        too_new: the error to raise for a database newer than ``migrations``
            (called with its version and the newest known).
        applied: called with each version once it is committed (logging).

    Returns the resulting version. Raises ``too_new(...)``, or what SQLite
    raised (the failed migration is rolled back whole).
    """
    version = int((conn.execute("PRAGMA user_version").fetchone() or (0,))[0])
    if version > len(migrations):
        raise too_new(version, len(migrations))
    for number in range(version + 1, len(migrations) + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(migrations[number - 1]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {number}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if applied is not None:
            applied(number)
    return len(migrations)


def _statements(script: str) -> list[str]:
    """The statements of a migration script (no ``;`` inside string literals or triggers)."""
    return [s.strip() for s in script.split(";") if s.strip()]


# --- the one-process lock ---------------------------------------------------------------


def acquire_lock(
    path: Path,
    *,
    held: Callable[[Path], Exception],
    insecure: Callable[[str], Exception],
    unusable: Callable[[str], Exception] | None = None,
) -> int:
    """Lock ``<path>.lock`` exclusively (non-blocking); return the open descriptor.

    One process owns a database: a second sidecar on a journal, or a second
    host on a store, is refused before it touches the file.

    Raises:
        ``held(lock_path)``: another process holds the lock.
        ``insecure(problem)``: the lock file breaks :func:`private_file_problem`.
        ``unusable(problem)`` (``insecure`` when not given): the lock file cannot be
            created, opened or locked (a read-only file system, no permission, no
            locks on the file system); the problem names the file and the reason
            (see :func:`os_problem`), never a bare ``OSError``.

    Source: docs/reference/cli.md (exit codes: an unusable store or journal is one line, exit 2).
    """
    lock_path = Path(f"{path}.lock")
    problem = private_file_problem(lock_path, "the lock file")
    if problem is not None:
        raise insecure(problem)
    refuse = insecure if unusable is None else unusable
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise refuse(os_problem(f"cannot open the lock file {lock_path}", exc)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise held(lock_path) from None
    except OSError as exc:
        os.close(fd)
        raise refuse(os_problem(f"cannot lock {lock_path}", exc)) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def os_problem(what: str, exc: OSError) -> str:
    """``what`` and the reason of ``exc`` in one line (``cannot open … : Read-only file system``),
    with a hint where the reason has a usual cause (the directory is read-only or not this user's)."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        reason += " (the directory must be on a writable file system and writable by this process's user)"
    return f"{what}: {reason}"


def release_lock(fd: int) -> None:
    """Unlock and close a descriptor from :func:`acquire_lock`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
