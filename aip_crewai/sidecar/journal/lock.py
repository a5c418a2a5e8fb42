"""The journal's process lock and file permission checks (files only, no SQL).

- :func:`acquire_lock`: an exclusive non-blocking ``flock`` on
  ``<journal>.lock``; a second sidecar on the same journal is refused
  ("already owned by another active sidecar"). The kernel drops the lock when
  the process dies, so a ``kill -9`` never leaves a stale lock.
- :func:`check_parent`: the directory must not be group/world-writable
  (another user could swap the files).
- :func:`check_private_file` / :func:`create_private_file`: regular
  non-symlink files without group/other permission bits (0600).

Source: ARCHITECTURE.md §5 (Journal).
"""

from __future__ import annotations

from pathlib import Path

from aip_crewai.plumbing.storage import acquire_lock as storage_lock
from aip_crewai.plumbing.storage import create_private_file as create_file
from aip_crewai.plumbing.storage import directory_problem, private_file_problem, release_lock
from aip_crewai.sidecar.errors import JournalError, JournalInsecure, JournalLocked

__all__ = ["check_parent", "check_private_file", "create_private_file", "acquire_lock", "release_lock"]


def check_parent(directory: Path) -> None:
    """Raise JournalInsecure unless ``directory`` exists and only its owner can write it."""
    problem = directory_problem(directory, "the journal directory")
    if problem is not None:
        raise JournalInsecure(problem)


def check_private_file(path: Path) -> None:
    """Raise JournalInsecure if ``path`` exists and is a symlink, not a regular
    file, or has any permission bit beyond 0600."""
    problem = private_file_problem(path, "the journal file")
    if problem is not None:
        raise JournalInsecure(problem)


def create_private_file(path: Path) -> None:
    """Create ``path`` with mode 0600 if absent (:func:`aip_crewai.plumbing.storage.create_private_file`).

    Raises:
        JournalError: it cannot be created ("cannot create <path>: Read-only file system").
    """
    create_file(path, JournalError)


def acquire_lock(journal: Path) -> int:
    """Lock ``<journal>.lock`` exclusively; return the open descriptor (:func:`aip_crewai.plumbing.storage.acquire_lock`).

    Raises:
        JournalLocked: another process holds it.
        JournalInsecure: the lock file is a symlink, not a regular file, or not private.
        JournalError: the lock file cannot be created, opened or locked (a read-only file
            system, no permission): one line naming the file and the reason, exit 2 at start-up.
    """
    return storage_lock(
        journal,
        insecure=JournalInsecure,
        unusable=JournalError,
        held=lambda lock_path: JournalLocked(
            f"the journal {journal} is already owned by another active sidecar (lock {lock_path} is held)"
        ),
    )
