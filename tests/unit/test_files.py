"""aip_crewai/plumbing/files.py: regular files only, opened without blocking, read within a bound; and the secret files
of aip_crewai/plumbing/keys.py built on it."""

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


def test_a_small_file_under_a_huge_bound_is_read_in_bounded_pieces(tmp_path, monkeypatch):
    """Regression (second review): ``journal import`` asked ``os.read`` for 4 GiB + 1 at once (a
    ``MemoryError`` under a memory limit) to read a 1 KB file; each read asks for at most 1 MiB."""
    import os

    from aip_crewai.plumbing import files

    path = tmp_path / "runs.json"
    path.write_bytes(b"x" * (3 * files.READ_PIECE_BYTES + 5))
    asked: list[int] = []
    real_read = os.read

    def recording_read(fd: int, size: int) -> bytes:
        asked.append(size)
        return real_read(fd, size)

    monkeypatch.setattr(files.os, "read", recording_read)
    assert len(files.read_regular(path, 4 * 1024**3)) == 3 * files.READ_PIECE_BYTES + 5
    assert asked and max(asked) == files.READ_PIECE_BYTES
    with pytest.raises(files.FileTooLarge):
        files.read_regular(path, 3 * files.READ_PIECE_BYTES + 4)
    assert len(files.read_regular(path, 3 * files.READ_PIECE_BYTES + 5)) == 3 * files.READ_PIECE_BYTES + 5


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_secret_file_of_another_user_is_refused_even_to_root(tmp_path):
    """aip_crewai/plumbing/keys.py: a 0600 token file owned by another (unprivileged) user is refused; root
    read it before, and that user could have written their own token there."""
    from aip_crewai.plumbing.keys import SecretFileError, read_token

    token = tmp_path / "sidecar.token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    assert read_token(token) == "s3cret-token"  # root's own
    os.chown(token, 65534, -1)
    with pytest.raises(SecretFileError, match="belongs to uid 65534") as refused:
        read_token(token)
    assert "s3cret" not in str(refused.value)
