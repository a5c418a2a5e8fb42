"""A small ctypes binding of Linux Landlock (unprivileged filesystem sandboxing) and two ``prctl`` calls.

Landlock (Linux >= 5.13) lets an unprivileged process restrict, for itself and every process it
forks afterwards, which file hierarchies it may open: a *ruleset* names the access rights it
handles; each *rule* grants some of them beneath one directory (or on one file); anything
handled and not granted is denied with ``EACCES``. A process may stack rulesets (each is a layer:
an access must pass every layer). Only the calling **thread** and threads and processes it starts
afterwards are restricted (until ABI 8's thread sync, which this module does not use).

Why our own binding: PyPI's Landlock packages (``landlock`` 1.0.0.dev5, ``landlockpy`` 0.2,
``py-landlock`` 0.1) are pre-releases; the three syscalls and two structs here are stable kernel ABI
(``include/uapi/linux/landlock.h``), and a worker's start path needs nothing more.

Every function raises ``OSError`` (errno set) on failure; :func:`abi_version` never raises.

Source: docs/security.md "Security" (worker sandbox); ARCHITECTURE.md §5 (isolation);
Documentation/userspace-api/landlock.rst of the Linux kernel.
"""

from __future__ import annotations

import ctypes
import os
import platform

#: Syscall numbers (the same on every architecture that has Landlock: the "generic" table).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38

# Filesystem access rights (landlock.h), with the ABI that introduced them.
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5
#: Scopes (ABI 6): no connecting to abstract unix sockets, no signals, outside the domain.
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

#: Rights that apply to a regular file (a rule on a file may grant only these).
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


def fs_rights(abi: int) -> int:
    """Every filesystem right the kernel of Landlock ABI ``abi`` handles (0 when ``abi`` < 1)."""
    if abi < 1:
        return 0
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


def scopes(abi: int) -> int:
    """The scopes of Landlock ABI ``abi`` (0 before ABI 6)."""
    return SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes' declaration
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in landlock.h: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]  # noqa: RUF012


_libc: ctypes.CDLL | None = None


def _syscall() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(result: int) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is unavailable (not Linux, too old, disabled
    at boot, or a seccomp filter refuses the call). Never raises."""
    if platform.system() != "Linux":
        return 0
    try:
        result = int(_syscall().syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(result, 0)


class Ruleset:
    """One Landlock ruleset under construction; :meth:`restrict_self` enforces it on the calling thread.

    Args:
        abi: the kernel's ABI (:func:`abi_version`), at least 1: the ruleset handles every filesystem
            right of it (:func:`fs_rights`) and, from ABI 6, the signal and abstract-socket scopes.

    Raises:
        OSError: the kernel refused the ruleset.
    """

    def __init__(self, abi: int) -> None:
        self.handled = fs_rights(abi)
        attr = _RulesetAttr(self.handled, 0, scopes(abi))
        self.fd: int | None = _check(
            int(_syscall().syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0))
        )

    def allow(self, fd: int, is_dir: bool, rights: int | None = None) -> None:
        """Grant every handled right (or only ``rights`` of them) beneath the open ``fd`` (an ``O_PATH``
        descriptor): on a directory, the whole hierarchy under it; on a file, the file rights only.

        Raises:
            OSError: the kernel refused the rule.
        """
        if self.fd is None:
            raise ValueError("the ruleset was closed")
        access = self.handled if rights is None else self.handled & rights
        if not is_dir:
            access &= FILE_RIGHTS
        attr = _PathBeneathAttr(access, fd)
        _check(int(_syscall().syscall(_SYS_ADD_RULE, self.fd, _RULE_PATH_BENEATH, ctypes.byref(attr), 0)))

    def restrict_self(self) -> None:
        """Enforce the ruleset on the calling thread and everything it starts (sets ``no_new_privs``
        first, which Landlock requires of a process without ``CAP_SYS_ADMIN``), then close it.

        Raises:
            OSError: the kernel refused.
        """
        if self.fd is None:
            raise ValueError("the ruleset was closed")
        set_no_new_privs()
        try:
            _check(int(_syscall().syscall(_SYS_RESTRICT_SELF, self.fd, 0)))
        finally:
            self.close()

    def close(self) -> None:
        """Close the ruleset's descriptor (idempotent)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def set_no_new_privs() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS, 1)``: no ``execve`` of this process or its children gains privileges
    (setuid binaries, file capabilities). Raises OSError."""
    _check(int(_syscall().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)))


def set_not_dumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: this process's ``/proc/<pid>`` files (``environ``, ``mem``, ``fd``)
    belong to root and no process of the same user may ptrace it; no core dumps. Raises OSError."""
    _check(int(_syscall().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)))
