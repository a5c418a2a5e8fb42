"""aip_crewai/plumbing/files.py: regular files only, opened without blocking, read within a bound."""

from __future__ import annotations

import os

import pytest

from aip_crewai.plumbing.files import FileTooLarge, NotRegularFile, read_regular


def test_a_fifo_a_directory_and_an_oversized_file_are_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open() would never return
    with pytest.raises(NotRegularFile):
        read_regular(tmp_path / "fifo", 100)
    with pytest.raises(NotRegularFile):
        read_regular(tmp_path, 100)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(FileTooLarge):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(OSError):
        read_regular(tmp_path / "link", 200, follow_symlinks=False)
