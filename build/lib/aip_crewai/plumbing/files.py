"""Reading configuration and secret files safely (shared by both processes and the CLI).

A path that names a FIFO, a device or a socket must not hang start-up in
``open()`` (a FIFO without a writer blocks a plain ``open``): files are opened
with ``O_NONBLOCK`` and refused unless ``fstat`` says regular file, before any
byte is read. Reads are bounded.

Source: docs/security.md "Security" (configuration, token and key files).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegularFile(ValueError):
    """The path names something other than a regular file (FIFO, device, socket, directory)."""

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        super().__init__(f"{path} is not a regular file")


class FileTooLarge(ValueError):
    """The file holds more than the bound the caller allows."""

    def __init__(self, path: Path | str, limit_bytes: int) -> None:
        self.path, self.limit_bytes = str(path), limit_bytes
        super().__init__(f"{path} exceeds {limit_bytes} bytes")


def open_regular(path: Path | str, *, follow_symlinks: bool = True) -> int:
    """Open ``path`` read-only without blocking and return the descriptor when it is a regular file.

    Args:
        path: the file.
        follow_symlinks: False adds ``O_NOFOLLOW`` (a symlink fails with ``OSError`` ``ELOOP``).

    Returns:
        An open file descriptor (the caller closes it).

    Raises:
        OSError: the path cannot be opened (missing, permission, a symlink when not followed).
        NotRegularFile: it is a FIFO, device, socket or directory (the descriptor is closed).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: Largest single read, bytes: a file is read in pieces, so memory follows its size, never the bound.
READ_PIECE_BYTES = 1024 * 1024


def read_fd(fd: int, max_bytes: int) -> bytes:
    """Read at most ``max_bytes + 1`` bytes from ``fd`` (so a caller can tell "over the bound"), in pieces of
    at most :data:`READ_PIECE_BYTES` (a 1 KiB file under a 4 GiB bound never asks for 4 GiB at once)."""
    chunks: list[bytes] = []
    size = 0
    while size <= max_bytes:
        piece = os.read(fd, min(READ_PIECE_BYTES, max_bytes + 1 - size))
        if not piece:
            break
        chunks.append(piece)
        size += len(piece)
    return b"".join(chunks)


def read_regular(path: Path | str, max_bytes: int, *, follow_symlinks: bool = True) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` bytes.

    Raises:
        OSError: the path cannot be opened or read.
        NotRegularFile: not a regular file (never blocks on a FIFO).
        FileTooLarge: more than ``max_bytes`` bytes.
    """
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        data = read_fd(fd, max_bytes)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileTooLarge(path, max_bytes)
    return data
