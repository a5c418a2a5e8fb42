"""The host store's data model and on-disk rules (no SQL is executed here):
forward-only migrations, row types, action states and transitions, the
timestamp representation (integers, ms since the Unix epoch, UTC; rendered as
RFC 3339 only at the edges), the file-location rules and the opaque cursor.

Every table's primary key starts with ``tenant``. Migrations are numbered by
their position in :data:`MIGRATIONS` and tracked with ``PRAGMA user_version``;
never edit a shipped migration, append a new one.

Source: DESIGN.md §7, STYLE.md (Storage).
"""

from __future__ import annotations

import base64
import enum
import os
import re
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from ..contracts.errors import AipError, Category

_MIGRATION_1 = """
CREATE TABLE actions (
    tenant          TEXT NOT NULL,
    action_id       TEXT NOT NULL,
    capability_id   TEXT NOT NULL,
    crew_id         TEXT NOT NULL,
    operation       TEXT NOT NULL,
    input_json      TEXT NOT NULL,
    input_hash      TEXT NOT NULL,
    principal_id    TEXT NOT NULL,
    idempotency_key TEXT,
    status          TEXT NOT NULL CHECK (status IN ('pending_approval', 'running', 'completed', 'failed', 'cancelled')),
    dispatch        TEXT NOT NULL CHECK (dispatch IN ('not_sent', 'sent', 'acknowledged')),
    result_json     TEXT,
    error_json      TEXT,
    approval_id     TEXT,
    timeout_ms      INTEGER,
    chunk_count     INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (tenant, action_id)
) WITHOUT ROWID;
CREATE INDEX actions_live ON actions (status, created_at) WHERE status IN ('pending_approval', 'running');

CREATE TABLE chunks (
    tenant     TEXT NOT NULL,
    action_id  TEXT NOT NULL,
    sequence   INTEGER NOT NULL CHECK (sequence >= 0),
    chunk_json TEXT NOT NULL,
    PRIMARY KEY (tenant, action_id, sequence),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;

CREATE TABLE idempotency (
    tenant        TEXT NOT NULL,
    key           TEXT NOT NULL,
    capability_id TEXT NOT NULL,
    action_id     TEXT NOT NULL,
    input_hash    TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL,
    PRIMARY KEY (tenant, key)
) WITHOUT ROWID;

CREATE TABLE approvals (
    tenant              TEXT NOT NULL,
    approval_id         TEXT NOT NULL,
    action_id           TEXT NOT NULL,
    capability_id       TEXT NOT NULL,
    policy_hash         TEXT NOT NULL,
    requested_by        TEXT NOT NULL,
    input_snapshot_json TEXT NOT NULL,
    status              TEXT NOT NULL CHECK (status IN ('pending', 'approved', 'denied', 'expired')),
    decision_reason     TEXT,
    decided_by          TEXT,
    decided_at          INTEGER,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, approval_id),
    FOREIGN KEY (tenant, action_id) REFERENCES actions (tenant, action_id)
) WITHOUT ROWID;
CREATE INDEX approvals_by_created ON approvals (tenant, created_at, approval_id);
CREATE INDEX approvals_by_action ON approvals (tenant, action_id);
CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE status = 'pending';

CREATE TABLE message_ids (
    tenant     TEXT NOT NULL,
    message_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, message_id)
) WITHOUT ROWID;
CREATE INDEX message_ids_expiry ON message_ids (expires_at);
"""

#: Forward-only migrations; migration N (1-based) brings ``user_version`` to N.
MIGRATIONS: tuple[str, ...] = (_MIGRATION_1,)


class ActionState(str, enum.Enum):
    """Host action states (``ActionStatusName`` of contracts/aip.py)."""

    PENDING_APPROVAL = "pending_approval"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


_S = ActionState
#: Allowed transitions (self-transitions of live states update fields only).
TRANSITIONS: dict[ActionState, frozenset[ActionState]] = {
    _S.PENDING_APPROVAL: frozenset({_S.PENDING_APPROVAL, _S.RUNNING, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.COMPLETED, _S.FAILED, _S.CANCELLED}),
    _S.COMPLETED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}
DISPATCH_RANK = {"not_sent": 0, "sent": 1, "acknowledged": 2}
APPROVAL_DECISIONS = ("approved", "denied")
_RFC3339_RE = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})[Tt ](?P<time>\d{2}:\d{2}:\d{2})(?:\.(?P<fraction>\d{1,9}))?"
    r"(?P<offset>[Zz]|[+-]\d{2}:\d{2})\Z", re.ASCII)


# --- timestamps ----------------------------------------------------------------


def ms_to_rfc3339(ms: int) -> str:
    """Render epoch milliseconds as RFC 3339 UTC, e.g. ``2026-11-29T10:00:00.123Z``."""
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def rfc3339_to_ms(text: str) -> int:
    """Parse an RFC 3339 timestamp (``Z`` or ``±hh:mm`` offset) to epoch ms.

    Raises:
        ValueError: not RFC 3339 (no offset, a date alone, out of range).
    """
    match = _RFC3339_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError("not an RFC 3339 timestamp")
    offset = "+00:00" if match["offset"] in ("Z", "z") else match["offset"]
    moment = datetime.fromisoformat(f"{match['date']}T{match['time']}{offset}")
    fraction = (match["fraction"] or "") + "000"
    return int(moment.timestamp()) * 1000 + int(fraction[:3])


# --- records -------------------------------------------------------------------


@dataclass(frozen=True)
class ActionRecord:
    """One row of ``actions``. ``*_json`` hold canonical JSON text; times are ms."""

    tenant: str
    action_id: str
    capability_id: str
    crew_id: str
    operation: str
    input_json: str
    input_hash: str
    principal_id: str
    idempotency_key: str | None
    status: str
    dispatch: str
    result_json: str | None
    error_json: str | None
    approval_id: str | None
    timeout_ms: int | None
    chunk_count: int
    created_at: int
    updated_at: int


@dataclass(frozen=True)
class IdempotencyRecord:
    """One idempotency reservation; ``created`` is True for the call that made it."""

    tenant: str
    key: str
    capability_id: str
    action_id: str
    input_hash: str
    created_at: int
    expires_at: int
    created: bool = False


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval. ``status`` is as stored; see :meth:`effective_status`."""

    tenant: str
    approval_id: str
    action_id: str
    capability_id: str
    policy_hash: str
    requested_by: str
    input_snapshot_json: str
    status: str
    decision_reason: str | None
    decided_by: str | None
    decided_at: int | None
    created_at: int
    expires_at: int

    def effective_status(self, now_ms: int) -> str:
        """``expired`` for a pending approval past ``expires_at`` (before the sweep ran)."""
        return "expired" if self.status == "pending" and now_ms >= self.expires_at else self.status


@dataclass(frozen=True)
class ChunkRecord:
    sequence: int
    chunk_json: str


@dataclass(frozen=True)
class ApprovalPage:
    """A page of approvals. Follow ``next_cursor`` until ``done`` is True
    (``next_cursor`` is None exactly when ``done``)."""

    items: list[ApprovalRecord]
    next_cursor: str | None
    done: bool


class StoreError(AipError):
    code = "store.unavailable"
    category = Category.TEMPORARY
    default_message = "the host store failed"


class InsecureStorePath(StoreError):
    code = "store.insecure_path"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store path is not safe"


class UnusableStore(StoreError):
    """The store file is not SQLite, is damaged, or is another application's database."""

    code = "store.unusable"
    category = Category.PERMANENT
    http_status = 500
    default_message = "the host store file cannot be used"


class MissingTarget(LookupError):
    """:meth:`Store.create_action` found no target action (the run a
    status/events/cancel action names); nothing was written. Internal: the
    action service answers ``action.not_found``."""


class InvalidCursor(AipError):
    code = "request.invalid_cursor"
    category = Category.PERMANENT
    default_message = "the cursor is not valid"


# --- file safety ---------------------------------------------------------------


def check_location(path: Path) -> None:
    """Refuse an unsafe store location (no I/O beyond ``stat``).

    Raises:
        InsecureStorePath: the directory is missing or group/world-writable;
            the file (or its ``-wal``/``-shm``) is a symlink, not a regular
            file, or has any permission bit beyond 0600.
    """
    parent = path.parent
    try:
        parent_mode = stat.S_IMODE(os.stat(parent).st_mode)
    except FileNotFoundError:
        raise InsecureStorePath(f"store directory {parent} does not exist") from None
    if parent_mode & 0o022:
        raise InsecureStorePath(f"store directory {parent} has mode {parent_mode:04o}; "
                                "it must not be group- or world-writable")
    for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
            raise InsecureStorePath(f"store file {candidate} must be a regular file, not a symlink")
        mode = stat.S_IMODE(info.st_mode)
        if mode & ~0o600:
            raise InsecureStorePath(f"store file {candidate} has mode {mode:04o}; it must be 0600 (chmod 600)")


def create_private_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def encode_cursor(created_at: int, approval_id: str) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode([created_at, approval_id])).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, approval_id = msgspec.json.decode(raw, type=tuple[int, str])
    except (ValueError, msgspec.DecodeError) as exc:
        raise InvalidCursor() from exc
    return created_at, approval_id
