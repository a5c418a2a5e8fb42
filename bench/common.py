"""Shared helpers of the benchmarks: statistics, result rows, markdown, and
real processes (sidecar, host, a bare Starlette server) on loopback.

Every process binds an ephemeral port (``port 0``) and the real port is read
back from its stderr, so there is no free-port race. :class:`Stack` owns the
processes and a private temporary directory; leaving it (also on an error)
stops every process it started (SIGTERM, then SIGKILL after a bound) and
removes the directory.

Durations are seconds everywhere; rows render milliseconds or rates.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx2
import structlog

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
SIDECAR_TOKEN = "bench-sidecar-token-7d21"
TENANT = "bench"
TOKENS = {"bench-app": "tok-bench-app-1", "bench-approver": "tok-bench-approver-1"}
ROLES = {"bench-app": "invoker", "bench-approver": "approver"}
REGISTRY = "bench.crews:CREWS"
HOST_OPERATIONS = ["run", "status", "events", "cancel"]
#: Sidecar arguments for a fresh worker process per job, measured beside the default (which runs up to 100 jobs of
#: one tenant's crew in one worker), and how the rows name that setting.
FRESH_WORKERS = ("--worker-jobs", "1")
FRESH = " ".join(FRESH_WORKERS)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
AIP_CONTENT_TYPE = "application/aip+json"


# --- statistics ------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linear interpolation between ranks."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Stats:
    """p50 and p99 of samples (durations, seconds; p99 is the slow tail)."""

    n: int
    p50: float
    p99: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        return cls(len(samples), percentile(samples, 50), percentile(samples, 99))


# --- sampling ----------------------------------------------------------------------

Timed = Callable[[], Awaitable[float]]


async def interleave(
    paths: dict[str, Timed],
    *,
    rounds: int,
    warmup: int,
    budget_s: float,
    before: Callable[[], Awaitable[object]] | None = None,
) -> dict[str, list[float]]:
    """Run every path once per round, rotating the order each round, so drift
    (caches, CPU frequency, journal growth) hits all paths alike.

    Each path returns its own measured duration (seconds), so preparation
    (building an envelope) stays outside the timing. ``before``, when given, is
    awaited before each measured sample, untimed (:func:`settle`: the previous
    sample's background work, such as a replacement worker's boot, done). Stops
    after ``rounds`` or when ``budget_s`` has passed (at least 20 rounds once warm).
    """
    names = list(paths)
    for _ in range(warmup):
        for name in names:
            await paths[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    end = time.monotonic() + budget_s
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            if before is not None:
                await before()
            samples[name].append(await paths[name]())
        if i >= 20 and time.monotonic() > end:
            break
    return samples


def quiet_logs() -> None:
    """Drop our modules' structlog output below warnings (in-process benchmarks)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# --- result rows and sections ------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.2f} ms"


def _rate(per_second: float, unit: str) -> str:
    if per_second >= 10_000:
        return f"{per_second / 1000:,.0f}k {unit}/s"
    return f"{per_second:,.0f} {unit}/s"


@dataclass(frozen=True)
class Row:
    """One side-by-side comparison, judged on p50 (p99 shown for the tail)."""

    metric: str
    ours: str
    baseline: str
    ratio_p50: str
    ratio_p99: str
    target: str
    met: bool | None  # None: reported, no target

    @property
    def verdict(self) -> str:
        return "—" if self.met is None else ("met" if self.met else "MISSED")


def latency_row(metric: str, ours: Stats, baseline: Stats, *, max_ratio: float | None) -> Row:
    """Ratio of durations ours / baseline (lower is better)."""
    r50, r99 = ours.p50 / baseline.p50, ours.p99 / baseline.p99
    return Row(
        metric,
        f"{_ms(ours.p50)} / {_ms(ours.p99)}",
        f"{_ms(baseline.p50)} / {_ms(baseline.p99)}",
        f"{r50:.2f}×",
        f"{r99:.2f}×",
        "—" if max_ratio is None else f"≤ {max_ratio:g}× at p50",
        None if max_ratio is None else r50 <= max_ratio,
    )


def added_row(metric: str, ours: Stats, baseline: Stats, *, max_added_s: float | None) -> Row:
    """Difference of durations ours − baseline (p50 and p99), and their ratio (``max_added_s`` None: no target)."""
    added50, added99 = ours.p50 - baseline.p50, ours.p99 - baseline.p99
    return Row(
        metric,
        f"{_ms(ours.p50)} / {_ms(ours.p99)}",
        f"{_ms(baseline.p50)} / {_ms(baseline.p99)}",
        f"{ours.p50 / baseline.p50:.2f}× (+{added50 * 1000:.1f} ms)",
        f"{ours.p99 / baseline.p99:.2f}× (+{added99 * 1000:.1f} ms)",
        "—" if max_added_s is None else f"≤ +{max_added_s * 1000:g} ms at p50",
        None if max_added_s is None else added50 <= max_added_s,
    )


def rate_row(
    metric: str,
    unit: str,
    ours: Stats,
    baseline: Stats,
    *,
    units: float,
    min_ratio: float | None,
    min_rate: float | None = None,
) -> Row:
    """Throughput comparison. ``ours``/``baseline`` are durations of samples of
    ``units`` items each; rates are ``units / duration`` (p99 = the slow tail).
    Ratio ours / baseline (higher is better)."""
    o50, o99 = units / ours.p50, units / ours.p99
    b50, b99 = units / baseline.p50, units / baseline.p99
    targets, met = [], True
    if min_ratio is not None:
        targets.append(f"≥ {min_ratio:g}× at p50")
        met = met and o50 / b50 >= min_ratio
    if min_rate is not None:
        targets.append(f"≥ {_rate(min_rate, unit)}")
        met = met and o50 >= min_rate
    return Row(
        metric,
        f"{_rate(o50, unit)} / {_rate(o99, unit)}",
        f"{_rate(b50, unit)} / {_rate(b99, unit)}",
        f"{o50 / b50:.2f}×",
        f"{o99 / b99:.2f}×",
        ", ".join(targets) or "—",
        met if targets else None,
    )


@dataclass
class Section:
    """The result of one benchmark: rows, free-form notes and its own runtime."""

    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # extra markdown lines (tables)
    seconds: float = 0.0

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", f"Runtime: {self.seconds:.1f} s.", ""]
        lines += table(
            ["metric", "ours p50 / p99", "baseline p50 / p99", "ratio p50", "ratio p99", "target", ""],
            [[r.metric, r.ours, r.baseline, r.ratio_p50, r.ratio_p99, r.target, r.verdict] for r in self.rows],
        )
        if self.extra:
            lines += ["", *self.extra]
        if self.notes:
            lines += ["", *[f"- {note}" for note in self.notes]]
        return "\n".join(lines) + "\n"

    def console(self) -> str:
        out = [f"== {self.title} ({self.seconds:.1f} s)"]
        for r in self.rows:
            out.append(
                f"  {r.metric}: ours {r.ours} | baseline {r.baseline} | ratio p50 {r.ratio_p50}, "
                f"p99 {r.ratio_p99} | target {r.target} [{r.verdict}]"
            )
        return "\n".join(out)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table as lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def machine_line() -> str:
    """One line describing where the numbers come from."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cores ({model})"
    )


# --- processes ---------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state, ``[1]`` the parent
    pid, ``[11:15]`` utime, stime, cutime, cstime in clock ticks); raises OSError when gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """User + system CPU time of ``pid`` from ``/proc/<pid>/stat``, seconds; 0.0 when gone.

    ``reaped``: also the CPU time of its children that exited and were waited for (``cutime`` +
    ``cstime``: theirs and, recursively, their own reaped children's)."""
    try:
        fields = _stat_fields(pid)
        ticks = int(fields[11]) + int(fields[12])
        if reaped:
            ticks += int(fields[13]) + int(fields[14])
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent pid (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(_stat_fields(int(stat.parent.name))[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, alive or zombie (from /proc), ``root`` first."""
    children = _children()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet waited for, or gone)."""
    try:
        return _stat_fields(pid)[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def sidecar_workers(sidecar: int) -> tuple[int | None, list[int]]:
    """(the worker fork server, the job workers alive: its children not yet exited) of a sidecar with
    ``--isolation process``; ``(None, [])`` without a fork server. Workers are forked from the fork server and
    inherit its command line, so they are told apart by parentage."""
    children = _children()
    server = next((pid for pid in children.get(sidecar, []) if "forkserver" in cmdline(pid)), None)
    if server is None:
        return None, []
    return server, sorted(pid for pid in children.get(server, []) if not is_zombie(pid))


def smaps_rollup(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in KiB (Rss, Pss, Private_Clean, Private_Dirty, ...); empty when gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces; empty when gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


#: A process tree is idle once its CPU did not grow for QUIET_S, polled every POLL_S, within SETTLE_S (s).
QUIET_S = 0.5
POLL_S = 0.05
SETTLE_S = 30.0
#: Between two latency samples (:func:`interleave`'s ``before``), the sidecars' trees are still this long (s):
#: the previous sample's replacement worker has booted (about 100 ms of CPU; on 2 cores it would slow the next).
SAMPLE_QUIET_S = 0.1


def uss_kib(pid: int) -> int:
    """Memory only ``pid`` maps (unique set size: private clean + dirty), KiB; 0 when gone."""
    rollup = smaps_rollup(pid)
    return rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)


def tree_cpu_seconds(root: int) -> float:
    """CPU time of ``root``'s process tree, seconds: user + system time of ``root`` and of every descendant,
    plus that of the children each of them reaped (a finished job worker's, in the fork server's)."""
    return sum(cpu_seconds(pid, reaped=True) for pid in process_tree(root))


def tree_pss_kib(root: int) -> int:
    """PSS of ``root`` and every descendant, summed, KiB."""
    return sum(smaps_rollup(pid).get("Pss", 0) for pid in process_tree(root))


async def settle(
    root: int, *, ready: Callable[[], bool] = lambda: True, quiet_s: float = QUIET_S, deadline_s: float = SETTLE_S
) -> float:
    """Wait until ``root``'s tree is idle: its CPU did not grow for ``quiet_s`` (:data:`QUIET_S`) and ``ready()`` holds.

    Returns:
        the tree's CPU time then, seconds (:func:`tree_cpu_seconds`).

    Raises:
        BenchError: not idle within ``deadline_s`` (:data:`SETTLE_S`).
    """
    end = time.monotonic() + deadline_s
    last, since = tree_cpu_seconds(root), time.monotonic()
    while True:
        await asyncio.sleep(POLL_S)
        now = tree_cpu_seconds(root)
        if abs(now - last) > 1e-6:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s and ready():
            return now
        if time.monotonic() > end:
            raise BenchError(f"process {root}'s tree was still busy (or not ready) after {deadline_s:g} s")


def pool_full(sidecar: int, size: int) -> Callable[[], bool]:
    """``() -> bool``: whether ``size`` job workers of ``sidecar`` are alive (its pool is booted)."""
    return lambda: len(sidecar_workers(sidecar)[1]) == size


@dataclass
class Process:
    """One child process on loopback."""

    name: str
    popen: subprocess.Popen[bytes]
    stderr_path: Path
    base_url: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_for_port(self, pattern: re.Pattern[str], deadline_s: float = START_TIMEOUT_S) -> int:
        """Poll stderr for ``pattern`` (group 1 = the port) until the deadline."""
        end = time.monotonic() + deadline_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.stderr_tail()}")
            match = pattern.search(self.stderr_path.read_text(errors="replace"))
            if match:
                return int(match.group(1))
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name} did not report its port in time:\n{self.stderr_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, wait up to STOP_TIMEOUT_S, then SIGKILL (only this child, by pid)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=STOP_TIMEOUT_S)


#: How the bench starts ``aip-crewai``: the console script beside this interpreter, as a systemd unit runs it
#: (docs/operating.md), or ``python -m aip_crewai.cli`` when it is not installed. The two differ in what a
#: sidecar's worker runs before its target (multiprocessing runs the main module again in each child).
COMMAND = (
    [str(Path(sys.executable).with_name("aip-crewai"))]
    if Path(sys.executable).with_name("aip-crewai").exists()
    else [sys.executable, "-m", "aip_crewai.cli"]
)


def child_env() -> dict[str, str]:
    """This environment without our settings variables, with the repository on PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AIP_CREWAI_") and k not in ("NOTIFY_SOCKET", "CREWAI_STORAGE_DIR")
    }
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


_HYPERCORN_PORT = re.compile(r"Running on https?://127\.0\.0\.1:(\d+)")


class Stack:
    """Processes and a private working directory; closed on exit whatever happens."""

    def __init__(self, name: str) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"aip-bench-{name}-"))
        self.workdir.chmod(0o700)
        self.processes: list[Process] = []

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for process in reversed(self.processes):
            try:
                process.stop()
            except Exception as error:  # keep stopping the others; say what failed
                print(f"bench: could not stop {process.name} (pid {process.pid}): {error}", file=sys.stderr)
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Process:
        stderr_path = self.workdir / f"{name}.stderr"
        with stderr_path.open("wb") as stderr:
            popen = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                # TMPDIR: the fork server's socket and CrewAI's lock files stay in the stack's directory
                env={**child_env(), "TMPDIR": str(self.workdir), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        process = Process(name, popen, stderr_path)
        self.processes.append(process)
        return process

    def start_sidecar(self, *args: str, name: str = "sidecar", env: dict[str, str] | None = None) -> Process:
        """``aip-crewai sidecar`` with the bench crews, a 0600 token, a journal here, port 0 (``env``: added
        to its environment)."""
        token_file = self.workdir / "sidecar.token"
        if not token_file.exists():
            token_file.write_text(SIDECAR_TOKEN + "\n")
            token_file.chmod(0o600)
        state = self.workdir / f"{name}-state"
        state.mkdir(mode=0o700, exist_ok=True)
        cmd = [
            *COMMAND,
            "sidecar",
            "--registry",
            REGISTRY,
            "--journal",
            str(state / "journal.db"),
            "--token-file",
            str(token_file),
            "--port",
            "0",
            "--shutdown-grace-seconds",
            "5",
            *args,
        ]
        process = self._spawn(name, cmd, env)
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.popen.poll() is not None:
                raise RuntimeError(f"sidecar exited with {process.popen.returncode}:\n{process.stderr_tail()}")
            for line in process.stderr_path.read_text(errors="replace").splitlines():
                if '"sidecar_listening"' in line:
                    process.base_url = f"http://127.0.0.1:{json.loads(line)['port']}"
            if process.base_url:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"sidecar did not listen in time:\n{process.stderr_tail()}")
            time.sleep(0.05)
        _wait_http(f"{process.base_url}/health", {"Authorization": f"Bearer {SIDECAR_TOKEN}"}, process)
        return process

    def start_host(
        self,
        sidecar: Process,
        crews: Sequence[str],
        *,
        name: str = "host",
        store: str = "host.db",
        host_keys: Sequence[str] = (),
    ) -> Process:
        """``aip-crewai host`` on port 0 in front of ``sidecar``; tenant ``bench`` sees ``crews``;
        ``store``: a SQLite file in its own directory, or a ``postgresql://`` URL (``host_id`` = ``name``);
        ``host_keys``: more ``[host]`` lines, e.g. ``"status_cache_entries = 0"``."""
        home = self.workdir / name
        home.mkdir(mode=0o700)
        (home / "sidecar.token").write_text(SIDECAR_TOKEN + "\n")
        (home / "sidecar.token").chmod(0o600)
        descriptors = [{"id": crew, "name": crew.title(), "allowed_operations": HOST_OPERATIONS} for crew in crews]
        (home / "crews.json").write_text(json.dumps(descriptors))
        lines = [
            "[host]",
            'bind = "127.0.0.1:0"',
            f"store = {json.dumps(store)}",
            f'host_id = "{name}"',
            *host_keys,
            "",
            "[sidecar]",
            f'url = "{sidecar.base_url}"',
            'token_file = "sidecar.token"',
            "",
            "[crews]",
            'file = "crews.json"',
            "",
            f"[tenants.{TENANT}]",
            f"crews = {json.dumps(list(crews))}",
            "",
        ]
        for principal, token in TOKENS.items():
            lines += [
                "[[principals]]",
                f'id = "{principal}"',
                f'tenant = "{TENANT}"',
                f'roles = ["{ROLES[principal]}"]',
                f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
                "",
            ]
        (home / "host.toml").write_text("\n".join(lines))
        process = self._spawn(name, [*COMMAND, "host", "--config", str(home / "host.toml")])
        process.base_url = f"http://127.0.0.1:{process.wait_for_port(_HYPERCORN_PORT)}"
        _wait_http(f"{process.base_url}/ready", {}, process)
        return process

    def start_module(self, name: str, module: str, *args: str) -> Process:
        """``python -m module args`` in the working directory, stdin and stdout closed, stderr kept (no wait)."""
        return self._spawn(name, [sys.executable, "-m", module, *args])

    def start_bare(self, body: bytes, *, name: str = "bare") -> Process:
        """The bare Starlette-on-Hypercorn server of :mod:`bench.bare` answering ``body``."""
        body_file = self.workdir / f"{name}.json"
        body_file.write_bytes(body)
        process = self._spawn(name, [sys.executable, "-m", "bench.bare", str(body_file)])
        process.base_url = f"http://127.0.0.1:{process.wait_for_port(_HYPERCORN_PORT)}"
        _wait_http(f"{process.base_url}/jobs/ready", {}, process)
        return process

    def start_proxy(self, sidecar: Process, job_path: str, *, name: str = "proxy") -> Process:
        """The bare proxy of :mod:`bench.bare`: each ``POST /aip/v1/messages`` answers ``sidecar``'s
        ``GET job_path`` (started after :meth:`start_sidecar`, whose token file it reads)."""
        job_url = f"{sidecar.base_url}{job_path}"
        process = self._spawn(
            name, [sys.executable, "-m", "bench.bare", "--proxy", job_url, str(self.workdir / "sidecar.token")]
        )
        process.base_url = f"http://127.0.0.1:{process.wait_for_port(_HYPERCORN_PORT)}"
        _wait_http(f"{process.base_url}/jobs/ready", {}, process)
        return process


def _wait_http(url: str, headers: dict[str, str], process: Process) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.stderr_tail()}")
        try:
            if httpx2.get(url, headers=headers, timeout=5).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{process.name}: {url} never answered 200:\n{process.stderr_tail()}")
        time.sleep(0.05)


class TreeSampler:
    """Samples the PSS of some processes' trees (:func:`tree_pss_kib`: a sidecar with its fork server and job
    workers) every ``interval_s`` in a thread of its own; keeps the peak. A sample reads ``smaps_rollup`` of every
    process of the trees, each a walk of its page tables (64 workers: about 100 ms of CPU): in the event loop it
    stalled the bench's own clients, so it runs beside them, and seldom."""

    def __init__(self, processes: Sequence[Process], interval_s: float = 2.0) -> None:
        self.processes = list(processes)
        self.interval_s = interval_s
        self.peak: dict[str, int] = {p.name: 0 for p in self.processes}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for process in self.processes:
            self.peak[process.name] = max(self.peak[process.name], tree_pss_kib(process.pid))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    async def __aenter__(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self._sample)  # one last sample


# --- talking to the host ----------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def envelope(capability_id: str, input: dict[str, Any], *, action_id: str, key: str | None = None) -> bytes:
    """An ``aip.core.v1.action`` envelope, encoded."""
    action: dict[str, Any] = {"id": action_id, "capability_id": capability_id, "input": input}
    if key is not None:
        action["idempotency_key"] = key
    sent_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return json.dumps(
        {
            "aip_version": "1.0",
            "message_type": "aip.core.v1.action",
            "message_id": new_id("msg"),
            "sent_at": sent_at,
            "body": {"action": action},
        }
    ).encode()


def async_client(base_url: str, token: str | None = None, *, connections: int = 16) -> httpx2.AsyncClient:
    """An httpx client for the benchmarks. Idle connections expire after 1 s, well
    before hypercorn's 5 s keep-alive timeout: with httpx's default (also 5 s)
    a request can race the server closing the connection and fail with ReadError.
    The 1 s is counted from when this process handled the end of the previous
    response, the server's 5 s from when it sent it: a client whose event loop
    lags by seconds (hundreds of runs at once on 2 loaded cores) can still send
    on a connection the server is closing (see :data:`STALE_CONNECTION`)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=1.0)
    return httpx2.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=httpx2.Timeout(300.0, connect=10.0)
    )


class BenchError(RuntimeError):
    """A benchmark request did not answer as the flow requires."""


#: What httpx raises for a request sent on a kept-alive connection the server closed as idle meanwhile
#: (hypercorn's ``keep_alive_timeout``, 5 s): the server's FIN had not reached this process when it wrote, so
#: the read finds EOF (RemoteProtocolError "Server disconnected without sending a response") or the server
#: kernel's reset (ReadError), or the write fails. The request never reached the application (the host logs
#: no ``request_finished`` for it), and every request :class:`Governed` resends is safe to send twice (an
#: envelope with its idempotency key; a decision, checked when the first one did land). Resent once, and
#: counted (:attr:`Governed.resent`) so a report shows how often it happened.
STALE_CONNECTION = (httpx2.ReadError, httpx2.WriteError, httpx2.RemoteProtocolError)


class Governed:
    """The tenant (``bench-app``) and approver (``bench-approver``) of one host."""

    def __init__(self, host: Process, *, connections: int = 16) -> None:
        self.app = async_client(host.base_url, TOKENS["bench-app"], connections=connections)
        self.approver = async_client(host.base_url, TOKENS["bench-approver"], connections=connections)
        #: Requests resent once after a :data:`STALE_CONNECTION` failure (what each failure was, by name).
        self.resent: list[str] = []

    async def _send(self, client: httpx2.AsyncClient, url: str, **kwargs: Any) -> tuple[httpx2.Response, bool]:
        """POST ``url``; resent once on a :data:`STALE_CONNECTION` failure. Returns (the response, resent)."""
        try:
            return await client.post(url, **kwargs), False
        except STALE_CONNECTION as error:
            self.resent.append(type(error).__name__)
        return await client.post(url, **kwargs), True

    async def aclose(self) -> None:
        await self.app.aclose()
        await self.approver.aclose()

    async def post(self, body: bytes) -> dict[str, Any]:
        """POST an envelope, JSON reply; the ``action_result`` body."""
        response, _ = await self._send(
            self.app, "/aip/v1/messages", content=body, headers={"Content-Type": AIP_CONTENT_TYPE}
        )
        if response.status_code not in (200, 202):
            raise BenchError(f"POST /aip/v1/messages answered {response.status_code}: {response.text[:300]}")
        result = response.json()["body"].get("action_result")
        if result is None:
            raise BenchError(f"no action_result in {response.text[:300]}")
        return result

    async def decide(self, approval_id: str) -> None:
        response, resent = await self._send(
            self.approver,
            f"/aip/v1/approvals/{approval_id}/decision",
            json={"decision": "approved", "reason": "benchmark"},
        )
        if resent and response.status_code == 409:  # the first one may have landed after all: it must say so
            view = await self.approver.get(f"/aip/v1/approvals/{approval_id}")
            if view.status_code == 200 and view.json().get("status") == "approved":
                return
        if response.status_code != 200:
            raise BenchError(f"decision answered {response.status_code}: {response.text[:300]}")

    async def submit(self, crew: str, input: dict[str, Any]) -> tuple[bytes, str]:
        """Submit a run; return (the envelope, the approval id) of the pending action."""
        body = envelope(f"cap:crewai:{crew}", input, action_id=new_id("act"), key=new_id("key"))
        result = await self.post(body)
        if result["status"] != "pending_approval":
            raise BenchError(f"expected pending_approval, got {result['status']}")
        return body, result["output"]["approval_id"]

    async def governed_run(self, crew: str, input: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """Submit, approve, fetch the result with the blocking re-call (same id and key).

        Returns (the result, seconds from sending the decision to holding the result).
        """
        body, approval_id = await self.submit(crew, input)
        started = time.perf_counter()
        await self.decide(approval_id)
        result = await self.post(body)
        elapsed = time.perf_counter() - started
        if result["status"] != "completed":
            raise BenchError(f"run ended {result['status']}: {json.dumps(result)[:300]}")
        return result, elapsed
