"""Helpers for the reliability suite and ``make chaos`` (no pytest needed).

Real processes on loopback, reusing the integration helpers
(``tests/kits/sidecar.py``, ``tests/kits/host.py``) with three
additions:

- :class:`Processes` starts sidecars and hosts in one private directory and
  captures stdout as well as stderr (CrewAI prints to stdout, and systemd
  keeps stdout in the system journal too, so secrets must be absent from
  both); a sidecar may get resource limits (``RLIMIT_FSIZE``: real write
  failures without root or mounts).
- The host configuration has tenant ``acme`` (crews echo, slow, failing,
  chatty, knowledge_a) and ``beta`` (echo, for its own jobs, and
  knowledge_b); bearer principals as in ``kits.host.TOKENS`` plus an
  Ed25519 invoker ``acme-signer`` (:data:`SIGNER`) for signed envelopes.
- :class:`AppThread` runs an app in-process on its own loop so synchronous
  code (hypothesis, the chaos runner) can call it with a deadline.
- :func:`calls_by_action` reads the offline LLM's call log (``<time> <pid>
  <model> <action id>``), so a test counts executions per action across
  processes and restarts.

Polling only (:func:`until`), never a sleep that waits for a result.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import httpx2
from kits.aip import action, envelope, sse_events
from kits.host import Host, free_port, launch_host, write_config
from kits.poll import Deadline, until
from kits.sidecar import TOKEN, Sidecar, launch, wait_ready

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: aip_crewai.examples.offline_llm.FAKE_SECRET (not imported: that imports CrewAI into this process).
FAKE_SECRET = "sk-test-SECRET-7f3a9c"
#: A distinctive marker put in crew inputs; it must never reach logs, error bodies or the journal.
MARKER = "zqx-INPUT-MARKER-5e1d"
ACME_CREWS = ["echo", "slow", "failing", "chatty", "knowledge_a"]
OPERATIONS = ["run", "status", "events", "cancel", "knowledge_query"]
TERMINAL = ("completed", "failed", "cancelled")

T = TypeVar("T")


# --------------------------------------------------------------- processes


#: Tenants of the real host: acme sees five crews, beta sees echo (its own jobs) and knowledge_b.
TENANTS = {"acme": ACME_CREWS, "beta": ["echo", "knowledge_b"]}
#: An Ed25519 principal (acme, invoker) for signed envelopes; its private key seed.
SIGNER, SIGNER_SEED = "acme-signer", b"\x07" * 32
#: An approver-only Ed25519 principal of acme and its private key seed.
APPROVER_SIGNER, APPROVER_SIGNER_SEED = "acme-approver-signer", b"\x08" * 32
#: A bearer principal of acme with the operator role (``/metrics``).
OPERATOR, OPERATOR_TOKEN = "acme-operator", "tok-acme-operator-1"


def signer_key(seed: bytes = SIGNER_SEED) -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(seed)


def write_host_config(
    workdir: Path,
    sidecar_url: str,
    port: int,
    *,
    sidecar_token: str = TOKEN,
    tenants: dict[str, list[str]] | None = None,
    max_response_bytes: int | None = None,
    host_options: dict[str, object] | None = None,
    store: str | None = None,
) -> Path:
    """host.toml for the reliability crews (ACME_CREWS, OPERATIONS, TENANTS) plus
    the Ed25519 :data:`SIGNER`; see ``kits.host.write_config`` (``store``: by default the suite's
    backend, ``storebackend.host_store``)."""
    import base64

    crews = [{"id": c, "name": c.title(), "allowed_operations": OPERATIONS} for c in ACME_CREWS]
    crews.append({"id": "knowledge_b", "name": "Knowledge B", "allowed_operations": ["knowledge_query"]})
    public = base64.b64encode(signer_key().public_key().public_bytes_raw()).decode()
    signer = {"id": SIGNER, "tenant": "acme", "role": "invoker", "ed25519_public_key": public}
    approver_public = base64.b64encode(signer_key(APPROVER_SIGNER_SEED).public_key().public_bytes_raw()).decode()
    approver_signer = {
        "id": APPROVER_SIGNER,
        "tenant": "acme",
        "role": "approver",
        "ed25519_public_key": approver_public,
    }
    operator = {
        "id": OPERATOR,
        "tenant": "acme",
        "role": "operator",
        "token_sha256": hashlib.sha256(OPERATOR_TOKEN.encode()).hexdigest(),
    }
    return write_config(
        workdir,
        sidecar_url,
        sidecar_token,
        port,
        crews=crews,
        tenants=tenants or TENANTS,
        max_response_bytes=max_response_bytes,
        extra_principals=[signer, approver_signer, operator],
        host_options=host_options,
        store=store,
    )


class Processes:
    """Starts sidecars and hosts under one private directory; :meth:`close` kills survivors."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        self.workdir = workdir
        self.sidecars: list[Sidecar] = []
        self.hosts: list[Host] = []
        self._count = 0
        self.call_log = workdir / "calls.log"

    def _tag(self) -> str:
        self._count += 1
        return str(self._count)

    def launch_sidecar(
        self,
        *,
        journal: Path | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        fsize_limit: int | None = None,
        token_file: Path | None = None,
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Start a sidecar (:func:`kits.sidecar.launch`, JSON logs, stdout captured) without waiting; returns
        (process, stderr path, stdout path)."""
        tag = self._tag()
        stderr_path, stdout_path = self.workdir / f"sidecar{tag}.err", self.workdir / f"sidecar{tag}.out"
        process = launch(
            self.workdir,
            journal=journal,
            args=["--log-format", "json", *(args or [])],
            env=env,
            stdout=stdout_path,
            stderr=stderr_path,
            token_file=token_file,
            fsize_limit=fsize_limit,
        )
        return process, stderr_path, stdout_path

    def sidecar(
        self,
        *,
        journal: Path | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        fsize_limit: int | None = None,
    ) -> Sidecar:
        """Start a sidecar and wait until ``/health`` answers."""
        journal = journal or self.workdir / "journal.db"
        process, stderr_path, stdout_path = self.launch_sidecar(
            journal=journal, args=args, env=env, fsize_limit=fsize_limit
        )
        sidecar = Sidecar(
            process, "", TOKEN, journal, self.workdir, self.call_log, stderr_path, list(args or []), stdout_path
        )
        self.sidecars.append(sidecar)
        sidecar.base_url = wait_ready(process, stderr_path)
        return sidecar

    def restart_sidecar(self, old: Sidecar, **kwargs: Any) -> Sidecar:
        """A new sidecar on the same journal (the old one must be gone)."""
        return self.sidecar(journal=old.journal, args=kwargs.pop("args", old.args), **kwargs)

    def launch_host(
        self, workdir: Path, argv_config: Path, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Start a host (:func:`kits.host.launch_host`, JSON logs, stdout captured) without waiting; returns
        (process, stderr path, stdout path)."""
        tag = self._tag()
        stderr_path, stdout_path = workdir / f"host{tag}.err", workdir / f"host{tag}.out"
        process = launch_host(argv_config, stderr_path, stdout=stdout_path, env=env, json_logs=True)
        return process, stderr_path, stdout_path

    def host(
        self,
        sidecar_url: str,
        *,
        name: str = "host",
        port: int | None = None,
        ready: bool = True,
        tenants: dict[str, list[str]] | None = None,
        max_response_bytes: int | None = None,
        env: dict[str, str] | None = None,
        host_options: dict[str, object] | None = None,
    ) -> Host:
        """Start (or restart: same ``name`` → same store and config) a host; wait for ``/ready``
        (``env``: extra environment variables of the process; ``host_options``: more ``[host]`` keys)."""
        workdir = self.workdir / name
        port = port or free_port()
        config = write_host_config(
            workdir,
            sidecar_url,
            port,
            tenants=tenants,
            max_response_bytes=max_response_bytes,
            host_options=host_options,
        )
        process, stderr_path, stdout_path = self.launch_host(workdir, config, env)
        host = Host(process, f"http://127.0.0.1:{port}", stderr_path, workdir, stdout_path)
        self.hosts.append(host)

        def is_ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"host exited {process.returncode}:\n{stderr_path.read_text(errors='replace')}")
            try:
                return httpx2.get(f"{host.base_url}/ready", timeout=5).status_code == 200
            except httpx2.TransportError:
                return False

        if ready:
            until(is_ready, timeout=60, interval=0.05, what="host /ready")
        return host

    def all_output(self) -> bytes:
        """Every process's captured stdout and stderr."""
        paths = [
            *self.workdir.glob("sidecar*.err"),
            *self.workdir.glob("sidecar*.out"),
            *self.workdir.glob("*/host*.err"),
            *self.workdir.glob("*/host*.out"),
        ]
        return b"".join(p.read_bytes() for p in paths)

    def close(self) -> None:
        for sidecar in self.sidecars:
            if sidecar.process.poll() is None:
                sidecar.kill(signal.SIGKILL)
        for host in self.hosts:
            if host.process.poll() is None:
                host.kill(signal.SIGKILL)


def served(host: Host, timeout: float = 60.0) -> Host:
    """Wait until the host answers ``/health`` (it is not ``/ready`` while its sidecar is down or unknown)."""

    def up() -> bool:
        if host.process.poll() is not None:
            raise AssertionError(f"host exited {host.process.returncode}: {host.output()[-2000:]!r}")
        try:
            return httpx2.get(f"{host.base_url}/health", timeout=5).status_code == 200
        except httpx2.TransportError:
            return False

    until(up, timeout=timeout, interval=0.05, what="host /health")
    return host


class LogsSince:
    """What processes append to their log files from now on (a shared process's output of one test)."""

    def __init__(self, *paths: Path | None) -> None:
        self.marks = {p: p.stat().st_size if p.exists() else 0 for p in paths if p is not None}

    def read(self) -> bytes:
        return b"".join(p.read_bytes()[mark:] for p, mark in self.marks.items() if p.exists())


# ------------------------------------------------------------------- reads


def calls_by_action(call_log: Path, pid: int | None = None, since: float | None = None) -> Counter[str]:
    """Model calls per sidecar action id (optionally of one process, or at or after unix time ``since``)
    from the offline LLM's call log. With process isolation the calls come from job worker processes:
    tell sidecars apart by time, not by the sidecar's pid."""
    counts: Counter[str] = Counter()
    if not call_log.exists():
        return counts
    for line in call_log.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and (pid is None or parts[1] == str(pid)) and (since is None or float(parts[0]) >= since):
            counts[unquote(parts[3])] += 1
    return counts


def sidecar_events(sidecar: Sidecar, job_id: str) -> list[dict[str, Any]]:
    """Every journaled event of a sidecar job (JSON pages)."""
    events: list[dict[str, Any]] = []
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=30) as http:
        while True:
            page = http.get(f"/jobs/{quote_id(job_id)}/events", params={"cursor": len(events)}).json()
            events += page["events"]
            if not page["events"] or events[-1]["event"] in TERMINAL:
                return events


def sidecar_view(sidecar: Sidecar, job_id: str) -> dict[str, Any]:
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=30) as http:
        return http.get(f"/jobs/{quote_id(job_id)}").json()


def quote_id(job_id: str) -> str:
    from urllib.parse import quote

    return quote(job_id, safe=":")


def post_action(
    http: httpx2.Client, capability_id: str, input: dict[str, Any], action_id: str, key: str | None = None
) -> httpx2.Response:
    return http.post(
        "/aip/v1/messages",
        json=envelope(action(action_id, capability_id, input, key)),
        headers={"Content-Type": "application/aip+json"},
    )


def approve(host: Host, response: httpx2.Response, decision: str = "approved") -> httpx2.Response:
    """Decide the approval of a ``pending_approval`` answer as ``acme-approver``."""
    approval_id = response.json()["body"]["action_result"]["output"]["approval_id"]
    with host.http("acme-approver") as approver:
        return approver.post(
            f"/aip/v1/approvals/{approval_id}/decision", json={"decision": decision, "reason": "reliability test"}
        )


def action_status(http: httpx2.Client, action_id: str) -> dict[str, Any]:
    return http.get(f"/aip/v1/actions/{action_id}").json()


def wait_action(
    http: httpx2.Client, action_id: str, statuses: tuple[str, ...] = TERMINAL, timeout: float = 60.0
) -> dict[str, Any]:
    def settled() -> dict[str, Any] | None:
        status = action_status(http, action_id)
        return status if status.get("state") in statuses else None

    return until(settled, timeout=timeout, interval=0.05, what=f"action {action_id} in {statuses}")


def chunk_count(http: httpx2.Client, action_id: str) -> int:
    """How many chunks the host stored for an action (paging ``/chunks``)."""
    count, cursor = 0, "0"
    while True:
        page = http.get(f"/aip/v1/actions/{action_id}/chunks", params={"cursor": cursor}).json()
        count += len(page["chunks"])
        if page.get("cursor") is None or not page["chunks"]:
            return count
        cursor = page["cursor"]


def host_history(http: httpx2.Client, action_id: str) -> list[str]:
    """Every SSE id of an action's full stored AIP stream (read from the start)."""
    with http.stream("GET", f"/aip/v1/actions/{action_id}/events", headers={"Accept": "text/event-stream"}) as resp:
        return [sse_id or "" for _, sse_id, _ in sse_events(resp)]


def scan(paths: list[Path], needles: list[bytes]) -> list[tuple[str, bytes]]:
    """``(file, needle)`` for every needle found in the bytes of every file (SQLite files and their -wal included)."""
    found = []
    for path in paths:
        for candidate in (path, Path(f"{path}-wal")):
            if candidate.exists():
                data = candidate.read_bytes()
                found += [(str(candidate), n) for n in needles if n in data]
    return found


@dataclass
class Tally:
    """Tried/passed counts per category for ``make chaos``."""

    rows: dict[str, list[int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def record(self, category: str, ok: bool, detail: str = "") -> None:
        row = self.rows.setdefault(category, [0, 0])
        row[0] += 1
        row[1] += int(ok)
        if not ok:
            self.failures.append(f"{category}: {detail}")


# ------------------------------------------------------- in-process host


def host_files(root: Path, *, max_response_bytes: int | None = None, sidecar_url: str | None = None) -> Path:
    """Write the ``tests/kits/hostapp.py`` configuration under ``root`` (crews alpha, beta, gamma;
    tenants acme, globex, closed); returns the host.toml path."""
    from kits import hostapp as hostkit

    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / "state").mkdir(mode=0o700, exist_ok=True)
    token = root / "sidecar.token"
    token.write_text(hostkit.SIDECAR_TOKEN + "\n")
    token.chmod(0o600)
    (root / "crews.json").write_text(json.dumps(hostkit.CREWS))
    config = root / "host.toml"
    doc = hostkit.base_document()
    if max_response_bytes is not None:
        doc["host"]["max_response_bytes"] = max_response_bytes
    if sidecar_url is not None:
        doc["sidecar"]["url"] = sidecar_url
    config.write_text(hostkit.render_toml(doc))
    return config


def inproc_app(
    root: Path,
    transport: httpx2.AsyncBaseTransport | None,
    clock: Callable[[], float] | None = None,
    *,
    max_response_bytes: int | None = None,
    sidecar_url: str | None = None,
) -> Any:
    """The host app in-process (``kits.hostapp`` configuration) over a fake sidecar transport
    (``transport=None``: real HTTP to ``sidecar_url``)."""
    import dataclasses

    from kits import hostapp as hostkit

    from aip_crewai.host.config import load_settings
    from aip_crewai.host.http.app import create_app

    config = host_files(root, max_response_bytes=max_response_bytes, sidecar_url=sidecar_url)
    settings = dataclasses.replace(load_settings(config, environ={}), readiness_interval_s=3600.0)
    return create_app(settings, sidecar_transport=transport, clock=clock or hostkit.FakeClock())


class AppThread:
    """An ASGI app whose lifespan and client run on an event loop in a background thread,
    so synchronous code (hypothesis tests, the chaos runner) can call it with a deadline.

    ``request(method, url, timeout=...)`` returns ``(status, headers, body bytes)``; a
    request that does not finish within the timeout raises :class:`Deadline` (a hang).
    """

    def __init__(self, app: Any, base_url: str = "http://host.test") -> None:
        import asyncio
        import threading

        self.app = app
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(base_url,), daemon=True, name="app-thread")
        self._thread.start()
        if not self._ready.wait(30):
            raise Deadline("the app did not start")
        if self._error is not None:
            raise self._error

    def _main(self, base_url: str) -> None:
        import asyncio

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve(base_url))

    async def _serve(self, base_url: str) -> None:
        import asyncio

        self._stop = asyncio.Event()
        try:
            async with self.app.router.lifespan_context(self.app):
                transport = httpx2.ASGITransport(app=self.app)
                async with httpx2.AsyncClient(transport=transport, base_url=base_url) as client:
                    self.client = client
                    self._ready.set()
                    await self._stop.wait()
        except BaseException as exc:  # surfaced by __init__
            self._error = exc
            self._ready.set()

    def run(self, coro: Any, timeout: float = 15.0) -> Any:
        """Run a coroutine on the app's loop; :class:`Deadline` if it takes longer than ``timeout`` s."""
        import asyncio
        import concurrent.futures

        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Deadline(f"no answer within {timeout} s (a hang)") from None

    def request(self, method: str, url: str, *, timeout: float = 15.0, **kwargs: Any) -> tuple[int, Any, bytes]:
        """One request, its whole answer; an SSE answer that reaches a pending action's ack (which the host
        keeps open until the decision, docs/reference/http-api.md "AIP 1.0 conformance") is read up to there, then disconnected."""

        async def call() -> tuple[int, Any, bytes]:
            if "text/event-stream" in dict(kwargs.get("headers") or {}).get("Accept", ""):
                return await self._sse(self.client.build_request(method, url, **kwargs))
            response = await self.client.request(method, url, **kwargs)
            return response.status_code, response.headers, response.content

        return self.run(call(), timeout)

    async def _sse(self, request: httpx2.Request) -> tuple[int, Any, bytes]:
        """Drive the app at the ASGI level (ASGITransport would wait for an endless body)."""
        import asyncio

        body = request.read()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "root_path": "",
            "client": ("127.0.0.1", 50000),
            "server": ("host.test", 80),
            "headers": list(request.headers.raw),
        }
        gone, messages = asyncio.Event(), asyncio.Queue()  # type: ignore[var-annotated]
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(scope, receive, messages.put))
        status, headers, content = 0, httpx2.Headers(), b""
        try:
            while True:
                message = await messages.get()
                if message["type"] == "http.response.start":
                    status, headers = message["status"], httpx2.Headers(message.get("headers") or [])
                    continue
                content += message.get("body", b"")
                if not message.get("more_body") or (b'"pending_approval"' in content and content.endswith(b"\n\n")):
                    return status, headers, content
        finally:
            gone.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.loop.close()
