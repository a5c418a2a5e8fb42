"""The host launcher: a real host process on loopback, wired to a sidecar (the integration, browser,
real-crew and reliability suites).

``start_host(workdir, sidecar_url, sidecar_token)`` writes a host.toml with two
tenants and four principals, starts ``python -m aip_crewai.cli host`` (:func:`launch_host`), waits
for ``/ready`` and returns a :class:`Host`. Tokens are in :data:`TOKENS`; a test's own token principal
(``extra_principals``) is made by :func:`bearer_principal`.

Tenants: ``acme`` sees the crews of :data:`ACME_CREWS`; ``beta`` sees
``knowledge_b`` only. Principals: ``acme-app`` (invoker), ``acme-approver``
(approver), ``beta-app`` (invoker), ``beta-approver`` (approver).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import storebackend  # noqa: E402

from aip_crewai.client import AipClient  # noqa: E402
from kits.poll import Deadline, until

TOKENS = {
    "acme-app": "tok-acme-app-1",
    "acme-approver": "tok-acme-approver-1",
    "beta-app": "tok-beta-app-1",
    "beta-approver": "tok-beta-approver-1",
}
ROLES = {"acme-app": "invoker", "acme-approver": "approver", "beta-app": "invoker", "beta-approver": "approver"}
ACME_CREWS = ["echo", "slow", "chatty", "knowledge_a"]
ALL_STARTABLE = ["run", "status", "events", "cancel", "knowledge_query"]


def bearer_principal(principal_id: str, token: str, role: str, tenant: str = "acme") -> dict[str, str]:
    """A principal that signs in with a bearer token, as :func:`write_config` takes it (``extra_principals``):
    the host.toml entry holds the token's SHA-256 (``token_sha256``), the caller keeps ``token``."""
    return {
        "id": principal_id,
        "tenant": tenant,
        "role": role,
        "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Host:
    """One host process: its stderr in ``log``, its stdout in ``stdout_path`` when captured, its
    configuration directory ``workdir``."""

    process: subprocess.Popen[bytes]
    base_url: str
    log: Path
    workdir: Path
    stdout_path: Path | None = None

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    @property
    def stderr_path(self) -> Path:
        return self.log

    def client(self, principal: str, **kwargs: object) -> AipClient:
        """An AIP client (aip_crewai.client) with ``principal``'s bearer token."""
        return AipClient(self.base_url, token=TOKENS[principal], **kwargs)  # type: ignore[arg-type]

    def http(self, principal: str, **kwargs: Any) -> httpx2.Client:
        """A plain HTTP client with ``principal``'s bearer token (timeout 60 s)."""
        return httpx2.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {TOKENS[principal]}"},
            timeout=httpx2.Timeout(60.0, connect=10.0),
            **kwargs,
        )

    def output(self) -> bytes:
        """Everything the process wrote (stderr, then stdout when captured)."""
        return b"".join(p.read_bytes() for p in (self.log, self.stdout_path) if p is not None and p.exists())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` (default SIGTERM) and wait for the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=60)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) and wait for the exit status."""
        return self.stop(sig)


def launch_host(
    config: Path,
    stderr: Path,
    *,
    stdout: Path | None = None,
    env: dict[str, str] | None = None,
    json_logs: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``aip-crewai host --config <config>`` (without waiting): stderr to ``stderr``, stdout to ``stdout``
    (else nowhere), the test process's environment without ``NOTIFY_SOCKET`` plus ``env``; ``json_logs``
    adds ``--log-format json``."""
    environ = {**{k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}, **(env or {})}
    argv = [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config)]
    err = stderr.open("wb")
    out = stdout.open("wb") if stdout is not None else None
    try:
        return subprocess.Popen(
            [*argv, *(["--log-format", "json"] if json_logs else [])],
            stdin=subprocess.DEVNULL,
            stdout=out if out is not None else subprocess.DEVNULL,
            stderr=err,
            env=environ,
        )
    finally:
        err.close()
        if out is not None:
            out.close()


def write_config(
    workdir: Path,
    sidecar_url: str,
    sidecar_token: str,
    port: int,
    *,
    crews: list[dict] | None = None,
    tenants: dict[str, list[str]] | None = None,
    max_response_bytes: int | None = None,
    extra_principals: list[dict[str, str]] | None = None,
    host_options: dict[str, object] | None = None,
    store: str | None = None,
    sidecars: list[dict[str, object]] | None = None,
    extra_toml: str = "",
) -> Path:
    """host.toml (+ crews.json, sidecar.token 0600) in ``workdir``; returns the config path.

    Defaults: the crews of :data:`ACME_CREWS` (run, status, events, cancel,
    knowledge_query) plus ``knowledge_b``; tenants ``acme`` and ``beta``; the
    bearer principals of :data:`TOKENS`. ``extra_principals`` are added as given;
    ``host_options`` are more ``[host]`` keys (e.g. ``dispatch_deadline_seconds``); ``store`` is the
    ``[host] store`` value (a SQLite file, or a ``postgresql://`` URL); by default the suite's backend
    (:func:`storebackend.host_store`: ``host.db``, or under ``AIP_CREWAI_TEST_STORE=postgresql`` this
    workdir's own database and a stable ``host_id``); ``sidecars``: ``[[sidecars]]``
    entries (``url``, ``crews``, ...; the token file is shared) instead of ``[sidecar]``; ``extra_toml``: more
    tables appended as given (``[[webhooks]]`` entries).
    """
    if store is None:
        store, host_id = storebackend.host_store(workdir)
        if host_id is not None and "host_id" not in (host_options or {}):
            host_options = {"host_id": host_id, **(host_options or {})}
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_file = workdir / "sidecar.token"
    if not token_file.exists():
        token_file.write_text(sidecar_token + "\n")
        token_file.chmod(0o600)
    if crews is None:
        crews = [{"id": crew, "name": crew.title(), "allowed_operations": ALL_STARTABLE} for crew in ACME_CREWS]
        crews.append({"id": "knowledge_b", "name": "Knowledge B", "allowed_operations": ["knowledge_query"]})
    (workdir / "crews.json").write_text(json.dumps(crews))
    tenants = tenants or {"acme": ACME_CREWS, "beta": ["knowledge_b"]}
    lines = [
        "[host]",
        f'bind = "127.0.0.1:{port}"',
        f"store = {json.dumps(store)}",
        *([f"max_response_bytes = {max_response_bytes}"] if max_response_bytes else []),
        *[f"{key} = {json.dumps(value)}" for key, value in (host_options or {}).items()],
        "",
        *(
            ["[sidecar]", f'url = "{sidecar_url}"', 'token_file = "sidecar.token"', ""]
            if sidecars is None
            else [
                line
                for entry in sidecars
                for line in (
                    "[[sidecars]]",
                    'token_file = "sidecar.token"',
                    *[f"{k} = {json.dumps(v)}" for k, v in entry.items()],
                    "",
                )
            ]
        ),
        "[crews]",
        'file = "crews.json"',
        "",
    ]
    for tenant, crew_ids in tenants.items():
        lines += [f"[tenants.{json.dumps(tenant)}]", f"crews = {json.dumps(crew_ids)}", ""]
    principals = [
        bearer_principal(principal, token, ROLES[principal], tenant=principal.split("-")[0])
        for principal, token in TOKENS.items()
    ]
    for entry in principals + list(extra_principals or []):
        lines += [
            "[[principals]]",
            f'id = "{entry["id"]}"',
            f'tenant = "{entry["tenant"]}"',
            f'roles = ["{entry["role"]}"]',
        ]
        lines += [f'{key} = "{entry[key]}"' for key in ("token_sha256", "ed25519_public_key") if key in entry]
        lines.append("")
    config = workdir / "host.toml"
    config.write_text("\n".join(lines) + ("\n" + extra_toml if extra_toml else ""))
    return config


def start_host(
    workdir: Path,
    sidecar_url: str,
    sidecar_token: str,
    *,
    port: int | None = None,
    wait_ready: bool = True,
    crews: list[dict] | None = None,
    tenants: dict[str, list[str]] | None = None,
    extra_principals: list[dict[str, str]] | None = None,
    host_options: dict[str, object] | None = None,
    store: str | None = None,
    sidecars: list[dict[str, object]] | None = None,
    extra_toml: str = "",
    env: dict[str, str] | None = None,
) -> Host:
    """Start a host; with ``wait_ready`` block until ``/ready`` answers 200.

    ``crews``, ``tenants``, ``extra_principals``, ``host_options``, ``store``, ``sidecars`` and ``extra_toml`` go
    to :func:`write_config`; ``env`` is added to the test process's environment (:func:`launch_host`). Without
    ``port``, a free port is picked; when another process takes it before the host binds it (the host exits
    naming "Address already in use"), the host is started again on another one, up to
    :data:`PORT_ATTEMPTS` times (with ``wait_ready``: a loaded machine runs many tests' processes at once)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        chosen = port or free_port()
        config = write_config(
            workdir,
            sidecar_url,
            sidecar_token,
            chosen,
            crews=crews,
            tenants=tenants,
            extra_principals=extra_principals,
            host_options=host_options,
            store=store,
            sidecars=sidecars,
            extra_toml=extra_toml,
        )
        log = workdir / f"host-{chosen}-{time.monotonic_ns()}.log"
        process = launch_host(config, log, env=env)
        host = Host(process, f"http://127.0.0.1:{chosen}", log, workdir)
        if not wait_ready:
            return host
        try:
            _wait_ready(host)
        except _PortTaken:
            if port is not None or attempt == PORT_ATTEMPTS:
                raise AssertionError(f"host exited {process.returncode}:\n{log.read_text()}") from None
            continue
        return host
    raise AssertionError("unreachable")


#: Starts of a host on a freshly picked port that another process took first, before :func:`start_host` gives up.
PORT_ATTEMPTS = 5


class _PortTaken(Exception):
    """The host exited because its port was taken (a race with another process picking free ports)."""


def _wait_ready(host: Host) -> None:
    """Block until the host's ``/ready`` answers 200. Raises _PortTaken (its port was taken), AssertionError
    (it exited otherwise, its log in the message) or kits.poll.Deadline (not ready within 60 s)."""
    process, log = host.process, host.log

    def ready() -> bool:
        if process.poll() is not None:
            text = log.read_text()
            if "Address already in use" in text:
                raise _PortTaken
            raise AssertionError(f"host exited {process.returncode}:\n{text}")
        try:
            return httpx2.get(f"{host.base_url}/ready", timeout=5).status_code == 200
        except httpx2.TransportError:
            return False

    try:
        until(ready, timeout=60, interval=0.1, what="host /ready")
    except Deadline as exc:
        raise Deadline(f"{exc}:\n{log.read_text()}") from None


def submit_for_approval(host: Host, input: dict[str, Any], capability: str = "cap:crewai:echo") -> str:
    """Call ``capability`` as ``acme-app`` with ``input`` and a new action id and key; assert it waits for approval.

    Returns the action id."""
    from aip_crewai.client import new_id

    action_id = new_id("act")
    with host.client("acme-app") as app:
        answer = app.call(capability, input, action_id=action_id, idempotency_key=new_id("k"))
    assert answer["body"]["action_result"]["status"] == "pending_approval", answer
    return action_id
