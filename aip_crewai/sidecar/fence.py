"""The journal's process and permission fence (files only, no SQL).

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

import fcntl
import os
import stat
from pathlib import Path

from aip_crewai.sidecar.errors import JournalInsecure, JournalLocked


def check_parent(directory: Path) -> None:
    """Raise JournalInsecure unless ``directory`` exists and only its owner can write it."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        raise JournalInsecure(f"the journal directory {directory} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise JournalInsecure(f"the journal directory {directory} is not a directory")
    if info.st_mode & 0o022:
        raise JournalInsecure(
            f"the journal directory {directory} is group- or world-writable "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); use a directory only its owner can write"
        )


def check_private_file(path: Path) -> None:
    """Raise JournalInsecure if ``path`` exists and is a symlink, not a regular
    file, or has any group/other permission bit (0600 required)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise JournalInsecure(f"the journal file {path} is a symlink; use a regular file")
    if not stat.S_ISREG(info.st_mode):
        raise JournalInsecure(f"the journal file {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise JournalInsecure(f"the journal file {path} has mode {mode:04o}; it must be 0600 (chmod 600 {path})")


def create_private_file(path: Path) -> None:
    """Create ``path`` with mode 0600 if absent (never following a symlink)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)


def acquire_lock(journal: Path) -> int:
    """Lock ``<journal>.lock`` exclusively; return the open descriptor.

    Raises:
        JournalLocked: another process holds it.
        JournalInsecure: the lock file breaks :func:`check_private_file`.
    """
    lock_path = Path(f"{journal}.lock")
    check_private_file(lock_path)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalLocked(
            f"the journal {journal} is already owned by another active sidecar (lock {lock_path} is held)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_lock(fd: int) -> None:
    """Unlock and close a descriptor from :func:`acquire_lock`."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
