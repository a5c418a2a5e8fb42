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

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

MAX_SECRET_FILE_BYTES = 16384


class SecretFileError(ValueError):
    """A secret file is missing, not a regular file, a symlink, too open or of a bad size."""


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 (refuses to overwrite) and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def read_private(path: Path, *, what: str = "secret file") -> bytes:
    """Read a secret: a regular non-symlink file, mode 0600 (no group/other
    bits), 1..16384 bytes; one trailing newline is stripped.

    Raises: SecretFileError naming the file and the broken rule (never the content).
    """
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise SecretFileError(f"{what} {path}: cannot be read ({exc.strerror})") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise SecretFileError(f"{what} {path}: must be a regular file, not a symlink")
    if info.st_mode & 0o077:
        raise SecretFileError(f"{what} {path}: mode {stat.S_IMODE(info.st_mode):04o} is too open; use 0600")
    if not 1 <= info.st_size <= MAX_SECRET_FILE_BYTES:
        raise SecretFileError(f"{what} {path}: must hold 1..{MAX_SECRET_FILE_BYTES} bytes")
    data = path.read_bytes()
    data = data[:-1] if data.endswith(b"\n") else data
    if not data:
        raise SecretFileError(f"{what} {path}: is empty")
    return data


def generate_token(path: Path) -> str:
    """Write a new random bearer token to ``path`` (0600); return its SHA-256 hex."""
    token = secrets.token_urlsafe(32)
    write_private(path, token.encode() + b"\n")
    return hashlib.sha256(token.encode()).hexdigest()


def generate_ed25519(path: Path) -> str:
    """Write a new Ed25519 private key (PKCS#8 PEM) to ``path`` (0600); return
    the base64 raw 32-byte public key for the host config."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_private(path, pem)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def load_ed25519(path: Path) -> Ed25519PrivateKey:
    """Load a private key written by :func:`generate_ed25519` (0600 enforced)."""
    key = serialization.load_pem_private_key(read_private(path, what="signing key") + b"\n", password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise SecretFileError(f"signing key {path}: not an Ed25519 key")
    return key
