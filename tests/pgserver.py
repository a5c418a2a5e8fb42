"""A throwaway PostgreSQL server for tests: Debian's binaries, a cluster in a temporary directory, started as
the unprivileged ``postgres`` user (or the current user when that is not root) on a free loopback port, and
removed afterwards. No mock: the host store's PostgreSQL tests run against this.

``find_bin_dir()`` is None when PostgreSQL is not installed: the tests that need it skip with one line.
``AIP_CREWAI_PG_BIN`` names the directory of ``initdb``/``pg_ctl`` explicitly.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

SKIP_REASON = "PostgreSQL tests skipped: no initdb/pg_ctl found (apt-get install postgresql)"


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: ``$AIP_CREWAI_PG_BIN``, PATH, or Debian's layout."""
    explicit = os.environ.get("AIP_CREWAI_PG_BIN")
    candidates = [explicit] if explicit else []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """One running cluster. ``url(database)`` is its libpq URL; ``create_database(name)`` makes a fresh one."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="aip-crewai-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = "aip"
        self._as: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            account = pwd.getpwnam("postgres")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.user, "--no-sync", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w", "start")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bin_dir / tool), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def cluster_pids(server: PostgresServer) -> list[int]:
    """The postmaster of ``server`` and every process it started."""
    postmaster = int((server.data / "postmaster.pid").read_text().splitlines()[0])
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
    return [postmaster, *(int(pid) for pid in children)]


@contextmanager
def stopped(server: PostgresServer) -> Iterator[None]:
    """The whole cluster SIGSTOPped (TCP stays up, nothing answers), SIGCONTed afterwards."""
    pids = cluster_pids(server)
    try:
        for pid in pids:  # a backend listed a moment ago may have exited since; the rest is still stopped
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        yield
    finally:  # also after a failed SIGSTOP: a cluster left stopped would fail every later test on this server
        for pid in pids:  # the postmaster, resumed first, may reap a backend that exited while stopped
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
