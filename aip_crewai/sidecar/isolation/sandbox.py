"""The worker sandbox: what a job's worker may not open, and how each worker confines itself.

Two protections, each used when this machine offers it (docs/security.md "Security", worker sandbox):

- **User drop** (the sidecar runs as root and ``--worker-user`` names an unprivileged user): each
  worker (and the start-up registry check) becomes that user right after its fork, before the
  registry is imported. The sidecar hands it CrewAI's storage, the tenant namespaces and the
  training directory (:func:`hand_over`); its token file, journal and replay inputs stay root's 0600
  files.
- **Landlock** (Linux >= 5.13, unprivileged): two layers of rules (:mod:`.landlock`).
  *Layer 1*, at boot: everything the worker's user may open except the **protected paths** (the
  token file, the journal and its ``-wal``/``-shm``/``-journal``/``.lock``, the replay inputs, the
  ``/proc`` entries of the sidecar and the fork server).
  *Layer 2*, at the job's start: everything except the namespaces and the training directory,
  with the job's own namespace directory and its tenant's training directory granted again. A
  rule grants a hierarchy, so "everything except P" is built as the complement of P: every entry
  of each directory on the way from ``/`` to P that is neither P nor on the way to it
  (:func:`complement`). An entry created later in such a directory is not granted. The directories
  on the way (:func:`spines`) may be listed (names only), so a module beside the journal imports.

Without either (not root and no Landlock), the sidecar logs one warning and reports what is missing
in ``/health`` (``worker_sandbox``) and ``aip-crewai doctor``; ``--isolation inprocess`` cannot
sandbox at all (crews run in the sidecar process).

Source: docs/security.md "Security" (worker sandbox); ARCHITECTURE.md §5 (isolation).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import PurePosixPath

import msgspec

from aip_crewai.sidecar.isolation import landlock

#: Names, beside the journal, of the files SQLite and the sidecar's lock keep next to it.
JOURNAL_SIBLINGS = ("-wal", "-shm", "-journal", ".lock")
#: The state directory's entries a worker may use (CrewAI's storage, the tenant namespaces).
STORAGE_NAME, NAMESPACES_NAME = "crewai", "namespaces"
#: The state directory's entry holding every retained run's inputs (``jobs/replay_inputs.py``).
REPLAY_INPUTS_NAME = "replay-inputs"
#: ``HOME`` of a worker that dropped to ``--worker-user``, under CrewAI's storage.
HOME_NAME = "home"
#: ``TMPDIR`` of a job, under its namespace directory; before the job: under CrewAI's storage.
TMP_NAME = "tmp"

#: What each missing protection is called in ``/health``, ``doctor`` and the start-up warning.
MISSING_USER = "worker_user"
MISSING_LANDLOCK = "landlock"
MISSING_PROCESS = "process_isolation"


class SandboxPlan(msgspec.Struct, frozen=True):
    """What every worker does to itself, sent in its ``Boot`` (absolute, resolved paths).

    Attributes:
        landlock_abi: the kernel's Landlock ABI; 0: no Landlock layer.
        uid, gid, user, home: the worker user (``--worker-user``), or None: the worker keeps the sidecar's.
        protected: paths no worker may open (layer 1): token file, journal and its siblings, replay
            inputs, the sidecar's ``/proc/<pid>``.
        state_dir: the sidecar state directory.
        training_dir: ``--training-dir``, or None.
    """

    landlock_abi: int
    uid: int | None
    gid: int | None
    user: str | None
    home: str | None
    protected: list[str]
    state_dir: str
    training_dir: str | None

    @property
    def storage_dir(self) -> str:
        """CrewAI's storage directory (``crewai_env.crewai_storage_dir``), shared by every job."""
        return os.path.join(self.state_dir, STORAGE_NAME)

    @property
    def namespaces_dir(self) -> str:
        """The directory of the per-(tenant, crew) namespace directories (memory, a job's tmp)."""
        return os.path.join(self.state_dir, NAMESPACES_NAME)

    @property
    def regranted(self) -> list[str]:
        """Layer 1's grants inside the protected state directory: storage, namespaces, training."""
        return [self.storage_dir, self.namespaces_dir, *([self.training_dir] if self.training_dir else [])]


class SandboxReport(msgspec.Struct, frozen=True):
    """The worker sandbox as ``/health`` (``worker_sandbox``) and ``doctor`` report it.

    Attributes:
        mode: ``user+landlock``, ``user``, ``landlock``, ``none`` or ``inprocess``.
        worker_user: the user workers run as (``--worker-user``), or None.
        landlock_abi: the kernel's Landlock ABI (0: none).
        missing: the protections not in force (:data:`MISSING_USER`, :data:`MISSING_LANDLOCK`,
            :data:`MISSING_PROCESS`).
    """

    mode: str
    worker_user: str | None
    landlock_abi: int
    missing: list[str]


def plan(
    *,
    state_dir: str,
    journal: str | None,
    token_file: str | None,
    training_dir: str | None,
    user: tuple[str, int, int, str] | None,
    landlock_abi: int,
    sidecar_pid: int,
) -> SandboxPlan:
    """The plan every worker follows (pure but for resolving paths).

    Args:
        state_dir, journal, token_file, training_dir: the sidecar's paths (any form; resolved here).
        user: ``(name, uid, gid, home)`` of ``--worker-user``, or None.
        landlock_abi: :func:`landlock.abi_version`.
        sidecar_pid: the sidecar's process id (its ``/proc`` entry is protected).

    Raises:
        ValueError: a protected path lies inside a directory workers are granted (the message names both).
    """
    state = os.path.realpath(state_dir)
    # the sidecar's /proc entry: its first environment (an inline token) and its open files
    protected = [os.path.join(state, REPLAY_INPUTS_NAME), f"/proc/{sidecar_pid}"]
    if token_file:
        protected.append(os.path.realpath(token_file))
    if journal:
        real = os.path.realpath(journal)
        protected += [real, *(real + suffix for suffix in JOURNAL_SIBLINGS)]
    result = SandboxPlan(
        landlock_abi=landlock_abi,
        uid=user[1] if user else None,
        gid=user[2] if user else None,
        user=user[0] if user else None,
        home=user[3] if user else None,
        protected=sorted(set(protected)),
        state_dir=state,
        training_dir=os.path.realpath(training_dir) if training_dir else None,
    )
    for granted in result.regranted:
        for path in result.protected:
            if _within(path, granted):
                raise ValueError(f"{path} lies inside {granted}, which crew workers may open; move it")
    return result


def report(*, isolation: str, sandbox: SandboxPlan | None, euid: int) -> SandboxReport:
    """What is in force and what is missing (``/health`` ``worker_sandbox``, ``doctor``).

    Root without ``--worker-user`` misses :data:`MISSING_USER` (workers run as root); any user
    without Landlock misses :data:`MISSING_LANDLOCK`; ``inprocess`` misses everything.
    """
    if isolation != "process":
        return SandboxReport("inprocess", None, 0, [MISSING_PROCESS, MISSING_USER, MISSING_LANDLOCK])
    user = sandbox.user if sandbox is not None else None
    abi = sandbox.landlock_abi if sandbox is not None else 0
    missing = []
    if user is None and euid == 0:
        missing.append(MISSING_USER)
    if abi < 1:
        missing.append(MISSING_LANDLOCK)
    parts = [name for name, on in (("user", user is not None), ("landlock", abi > 0)) if on]
    return SandboxReport("+".join(parts) or "none", user, abi, missing)


def describe_missing(found: SandboxReport) -> str:
    """One sentence naming the missing protections (the start-up warning and ``doctor``)."""
    why = {
        MISSING_PROCESS: "--isolation inprocess runs crews in the sidecar process, which no sandbox can separate "
        "from its token and journal",
        MISSING_USER: "workers run as root (set --worker-user to an unprivileged user)",
        MISSING_LANDLOCK: "this kernel offers no Landlock (Linux >= 5.13), so workers are not confined to "
        "their tenant's files",
    }
    return "; ".join(why[name] for name in found.missing)


# ------------------------------------------------------------------------------------------ pure rules


def ancestors(path: str) -> list[str]:
    """The strict ancestors of an absolute ``path``, from ``/`` down (``/a/b`` -> ``["/", "/a"]``)."""
    parents = list(PurePosixPath(path).parents)
    return [str(p) for p in reversed(parents)]


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


#: ``children(directory)`` -> ``[(name, kind)]`` with kind ``dir``, ``file`` or ``link``.
Children = Callable[[str], Iterable[tuple[str, str]]]


def spines(protected: Iterable[str]) -> set[str]:
    """The directories on the way from ``/`` to each ``protected`` path (absolute, normalized), none of
    them protected or under a protected path. Pure."""
    denied = set(protected)
    spine = {a for p in denied for a in ancestors(p)} - denied
    return {s for s in spine if not any(_within(s, p) for p in denied)}


def shared_spines(sandbox: SandboxPlan, lookup: Callable[[str], os.stat_result] = os.stat) -> list[str]:
    """The directories on the way to the protected paths (``/proc`` aside) that every user may write (mode
    ``o+w``, as ``/tmp``): other processes make entries there, and an entry made after a worker booted is out
    of that worker's reach (:func:`complement` lists each directory at the boot), so whether a job may open a
    file made there depends on when its worker booted. Empty without Landlock. docs/security.md."""
    if sandbox.landlock_abi < 1:
        return []
    shared = []
    for directory in sorted(spines(p for p in sandbox.protected if not p.startswith("/proc/"))):
        try:
            if lookup(directory).st_mode & 0o002:
                shared.append(directory)
        except OSError:
            continue
    return shared


def complement(protected: Iterable[str], children: Children) -> list[tuple[str, bool]]:
    """The grants that open everything except ``protected`` (absolute, normalized paths).

    Each directory on the way from ``/`` to a protected path (its *spine*) is listed, and every entry
    that is neither protected nor on a spine is granted, as ``(path, is_dir)``. Symbolic links are
    never granted (their target is reached by its own path). Nothing under a protected path is
    granted; a spine directory itself is not granted (no new entry can be made in it).
    """
    denied = set(protected)
    spine = spines(denied)
    grants = []
    for directory in sorted(spine):
        for name, kind in children(directory):
            path = os.path.join(directory, name)
            if path in denied or path in spine or kind == "link":
                continue
            grants.append((path, kind == "dir"))
    return grants


def list_children(directory: str) -> list[tuple[str, str]]:
    """:data:`Children` of the real file system (an unreadable directory has none)."""
    out = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_symlink():
                    out.append((entry.name, "link"))
                else:
                    out.append((entry.name, "dir" if entry.is_dir(follow_symlinks=False) else "file"))
    except OSError:
        return []
    return out


def unreachable(path: str, uid: int, gid: int, lookup: Callable[[str], os.stat_result] = os.stat) -> str | None:
    """The first directory on the way to ``path`` (``path`` included) that user ``uid``/``gid`` may not
    search (no ``x`` bit for it), or None when every one is searchable."""
    for directory in [*ancestors(path), path]:
        try:
            st = lookup(directory)
        except FileNotFoundError:
            return None
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return directory
    return None


# ---------------------------------------------------------------------------- the sidecar's side


def hand_over(sandbox: SandboxPlan) -> None:
    """Give the worker user what workers write (sidecar, as root, before the fork server starts).

    CrewAI's storage, the namespaces and the training directory (created 0700 when missing) and all
    they hold become the worker user's; the state directory gains ``o+x`` (search only: its entries
    cannot be listed, and the journal stays root's 0600 file). Nothing is done without a worker user.

    Raises:
        PermissionError: a directory the worker user must reach (those above, Python's installation)
            cannot be searched by it (the message names it).
        OSError: a change failed.
    """
    if sandbox.uid is None or sandbox.gid is None:
        return
    uid, gid = sandbox.uid, sandbox.gid
    mode = os.stat(sandbox.state_dir).st_mode
    if not mode & stat.S_IXOTH:
        os.chmod(sandbox.state_dir, stat.S_IMODE(mode) | stat.S_IXOTH)
    for directory in sandbox.regranted:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for root, dirs, files in os.walk(directory):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                st = os.lstat(name)
                if (st.st_uid, st.st_gid) != (uid, gid):
                    os.lchown(name, uid, gid)
    for directory in [*sandbox.regranted, sys.base_prefix, sys.prefix]:  # Python too: workers import lazily
        blocked = unreachable(directory, uid, gid)
        if blocked is not None:
            raise PermissionError(
                f"the worker user {sandbox.user} cannot reach {directory}: {blocked} is not searchable by it "
                "(give it o+x, or move the directory)"
            )


# ---------------------------------------------------------------------------- the worker's side


class Confinement:
    """A worker's sandbox: :meth:`enter_boot` right after the fork, :meth:`enter_job` at its job's start.

    Raises (both): OSError when the kernel refuses a step; the worker then runs nothing.
    """

    def __init__(self, sandbox: SandboxPlan | None) -> None:
        self.sandbox = sandbox
        self._job_layer: landlock.Ruleset | None = None

    def enter_boot(self) -> None:
        """Build both Landlock layers, drop to the worker user, then enforce layer 1; layer 2 (everything
        but the per-tenant directories, whose own two :meth:`enter_job` grants) waits for the job.

        The rules are built first, with the sidecar's rights: the worker user may not list the
        directories on the way to the protected paths (the state directory is search-only for it); layer
        1 lets a process that may list them do so (names only, :func:`spines`), never open what is protected.
        """
        sandbox = self.sandbox
        if sandbox is None:
            return
        for directory in sandbox.regranted:  # before the rules: no new entry can be made beside the journal
            os.makedirs(directory, mode=0o700, exist_ok=True)
        layer = job_layer = None
        try:
            if sandbox.landlock_abi >= 1:
                layer, job_layer = landlock.Ruleset(sandbox.landlock_abi), landlock.Ruleset(sandbox.landlock_abi)
                fork_server = f"/proc/{os.getppid()}"  # the worker's parent: the fork server
                _allow_all(layer, complement([*sandbox.protected, fork_server], list_children))
                # Listing the spine directories shows names, never contents: a registry module or a data
                # file beside the journal (the state directory, often the working directory) stays importable.
                _allow_all(layer, [(d, True) for d in spines([*sandbox.protected, fork_server])], landlock.READ_DIR)
                _allow_all(layer, [(path, True) for path in sandbox.regranted])
                per_tenant = [sandbox.namespaces_dir, *_training(sandbox)]
                _allow_all(job_layer, complement(per_tenant, list_children))
                _allow_all(job_layer, [(sandbox.storage_dir, True)])
            if sandbox.uid is not None and sandbox.gid is not None:
                _drop_to(sandbox)
            _set_tmp(os.path.join(sandbox.storage_dir, TMP_NAME))
            if layer is not None:
                layer.restrict_self()
        except BaseException:
            if job_layer is not None:
                job_layer.close()
            raise
        finally:
            if layer is not None:
                layer.close()
        self._job_layer = job_layer

    def enter_job(self, namespace_dir: str, tenant_training_dir: str | None) -> None:
        """Create the job's namespace directory (with its ``tmp``, the job's ``TMPDIR``) and its tenant's
        training directory, then enforce layer 2 granting only those two of the per-tenant directories."""
        if self.sandbox is None:
            return
        tmp = os.path.join(namespace_dir, TMP_NAME)
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        own = [namespace_dir]
        if tenant_training_dir is not None:
            os.makedirs(tenant_training_dir, mode=0o700, exist_ok=True)
            own.append(tenant_training_dir)
        _set_tmp(tmp)
        layer, self._job_layer = self._job_layer, None
        if layer is None:
            return
        try:
            _allow_all(layer, [(path, True) for path in own])
            layer.restrict_self()
        finally:
            layer.close()


def _drop_to(sandbox: SandboxPlan) -> None:
    """Become the worker user (every thread: glibc's setxid broadcast); ``HOME`` in CrewAI's storage (the
    user's own may not exist, and CrewAI keeps a key file under it).

    Raises:
        PermissionError: the switch did not take (a job never runs as root by mistake).
    """
    if sandbox.uid is None or sandbox.gid is None:
        return
    os.setgroups([])
    os.setgid(sandbox.gid)
    os.setuid(sandbox.uid)
    if os.getuid() != sandbox.uid or os.geteuid() != sandbox.uid:
        raise PermissionError("the worker could not drop to the worker user")
    home = os.path.join(sandbox.storage_dir, HOME_NAME)
    os.makedirs(home, mode=0o700, exist_ok=True)
    os.environ.update({"HOME": home, "USER": sandbox.user or "", "LOGNAME": sandbox.user or ""})


def _training(sandbox: SandboxPlan) -> list[str]:
    return [sandbox.training_dir] if sandbox.training_dir else []


def _allow_all(layer: landlock.Ruleset, grants: Iterable[tuple[str, bool]], rights: int | None = None) -> None:
    """Grant each ``(path, is_dir)`` every right (or only ``rights``); a path gone meanwhile is skipped."""
    for path, is_dir in grants:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):  # replaced by a link meanwhile: never granted
                continue
            layer.allow(fd, is_dir and stat.S_ISDIR(os.fstat(fd).st_mode), rights)
        finally:
            os.close(fd)


def _set_tmp(directory: str) -> None:
    """Make ``directory`` (created 0700) this process's ``TMPDIR`` and :mod:`tempfile`'s directory."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.environ["TMPDIR"] = directory
    tempfile.tempdir = directory


def landlock_abi() -> int:
    """The kernel's Landlock ABI (0: none), for :func:`plan`."""
    return landlock.abi_version() if sys.platform.startswith("linux") else 0
