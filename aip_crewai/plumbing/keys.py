"""Secrets on disk: bearer tokens and Ed25519 key pairs, written 0600.

Source: developers' guide ("Secrets come from files with 0600 permissions").
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from .files import NotRegularFile, open_regular, read_fd

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

# cryptography is imported by the two functions that use keys, not here: a sidecar reads only its token
# through this module, and the library costs about 8 MiB of resident memory in a process that needs none of it.

MAX_SECRET_FILE_BYTES = 16384


class SecretFileError(ValueError):
    """A secret file is missing, not a regular file, a symlink, too open, another user's or of a bad size."""


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 (refuses to overwrite) and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def read_private(path: Path, *, what: str = "secret file") -> bytes:
    """Read a secret file: a regular file opened without following symlinks,
    no group/other permission bits (0600 or 0400), owned by the process's
    effective user or root (a process running as root used to take a 0600
    file of any user, who could have put their own secret there), 1..16384
    bytes; one trailing newline (LF or CRLF) is stripped.

    Raises:
        SecretFileError: naming the file and the broken rule, never the content.

    Source: ARCHITECTURE.md §4 (token file rules); developers' guide (secrets); docs/security.md
    "Security" (opened without blocking: a FIFO is refused).
    """
    try:
        fd = open_regular(path, follow_symlinks=False)  # non-blocking: a FIFO is refused, never waited on
    except FileNotFoundError:
        raise SecretFileError(f"{what} {path} does not exist") from None
    except NotRegularFile:
        raise SecretFileError(f"{what} {path} is not a regular file") from None
    except OSError as exc:
        if os.path.islink(path):
            raise SecretFileError(f"{what} {path} is a symlink; use a regular file") from None
        raise SecretFileError(f"cannot open {what} {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise SecretFileError(f"{what} {path} has mode {mode:04o}; it must be 0600 (no group/other access)")
        if info.st_uid not in (os.geteuid(), 0):
            raise SecretFileError(
                f"{what} {path} belongs to uid {info.st_uid}; it must belong to the user running this process "
                f"(uid {os.geteuid()}) or to root (its owner could change the secret)"
            )
        if not 1 <= info.st_size <= MAX_SECRET_FILE_BYTES:
            raise SecretFileError(f"{what} {path} must hold 1..{MAX_SECRET_FILE_BYTES} bytes, has {info.st_size}")
        data = read_fd(fd, MAX_SECRET_FILE_BYTES)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretFileError(f"{what} {path} must hold 1..{MAX_SECRET_FILE_BYTES} bytes")
    if data.endswith(b"\n"):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    if not data:
        raise SecretFileError(f"{what} {path} holds an empty token")
    return data


def read_token(path: Path, *, what: str = "token file") -> str:
    """A bearer token from a secret file (:func:`read_private` rules); the
    token is one run of visible ASCII characters (it travels in an HTTP header).

    Raises: SecretFileError.
    """
    data = read_private(path, what=what)
    if not all(0x21 <= byte <= 0x7E for byte in data):
        raise SecretFileError(f"{what} {path} must hold one token of visible ASCII characters, without whitespace")
    return data.decode("ascii")


def generate_token(path: Path) -> str:
    """Write a new random bearer token to ``path`` (0600); return its SHA-256 hex."""
    token = secrets.token_urlsafe(32)
    write_private(path, token.encode() + b"\n")
    return hashlib.sha256(token.encode()).hexdigest()


def generate_ed25519(path: Path) -> str:
    """Write a new Ed25519 private key (PKCS#8 PEM) to ``path`` (0600); return
    the base64 raw 32-byte public key for the host config."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_ed25519(path: Path) -> Ed25519PrivateKey:
    """Load a private key written by :func:`generate_ed25519` (0600 enforced).

    Raises:
        SecretFileError: the file breaks a rule of :func:`read_private`, is not an unencrypted PEM private
            key, or holds another kind of key (the message names the file, never its content).
    """
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = read_private(path, what="signing key") + b"\n"
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:  # cryptography's answer to an encrypted key loaded without a password
        raise SecretFileError(f"signing key {path}: encrypted; give an unencrypted PEM key (0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise SecretFileError(f"signing key {path}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SecretFileError(f"signing key {path}: not an Ed25519 key")
    return key
