"""The host in-process, for the host tests (tests/host/conftest.py registers its fixtures), the conformance suite
and the reliability suite: a complete configuration on disk, a fake sidecar, a fake clock, signed envelopes, and the app running in-process.

Layout written by ``host_files``: crews ``alpha`` (legacy policy: 4 ops),
``beta`` (all 10 ops), ``gamma`` (run only); tenants ``acme`` → alpha, beta;
``globex`` → gamma; ``closed`` → none. Principals (bearer tokens in
:data:`TOKENS`, Ed25519 keys from :data:`SEEDS`):

| id | tenant | roles | credential |
|---|---|---|---|
| acme-invoker | acme | invoker | bearer |
| acme-approver | acme | approver | ed25519 |
| acme-operator | acme | operator | bearer |
| acme-both | acme | invoker, approver | bearer + ed25519 |
| globex-invoker | globex | invoker | bearer |
| globex-signer | globex | invoker | ed25519 |
| closed-invoker | closed | invoker | bearer |
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.applications import Starlette

from aip_crewai.contracts.hashing import jcs
from aip_crewai.contracts.operations import OPERATION_NAMES
from aip_crewai.host.config import load_settings
from aip_crewai.host.http.app import create_app
from aip_crewai.host.settings import Settings
from aip_crewai.host.store.store import ms_to_rfc3339
from kits import aip

SIDECAR_TOKEN = "sidecar-secret-token"
NOW = 1_790_000_000.0  # 2026-09-21T…Z, epoch seconds

CREWS: list[dict[str, Any]] = [
    {"id": "alpha", "name": "Alpha", "description": "legacy policy"},
    {"id": "beta", "name": "Beta", "allowed_operations": list(OPERATION_NAMES)},
    {"id": "gamma", "name": "Gamma", "allowed_operations": ["run"]},
]
TENANTS = {"acme": ["alpha", "beta"], "globex": ["gamma"], "closed": []}
TOKENS = {
    "acme-invoker": "tok-acme-invoker",
    "acme-operator": "tok-acme-operator",
    "acme-both": "tok-acme-both",
    "globex-invoker": "tok-globex-invoker",
    "closed-invoker": "tok-closed-invoker",
}
SEEDS = {"acme-approver": b"\x01" * 32, "acme-both": b"\x02" * 32, "globex-signer": b"\x03" * 32}
PRINCIPALS: list[dict[str, Any]] = [
    {"id": "acme-invoker", "tenant": "acme", "roles": ["invoker"]},
    {"id": "acme-approver", "tenant": "acme", "roles": ["approver"]},
    {"id": "acme-operator", "tenant": "acme", "roles": ["operator"]},
    {"id": "acme-both", "tenant": "acme", "roles": ["invoker", "approver"]},
    {"id": "globex-invoker", "tenant": "globex", "roles": ["invoker"]},
    {"id": "globex-signer", "tenant": "globex", "roles": ["invoker"]},
    {"id": "closed-invoker", "tenant": "closed", "roles": ["invoker"]},
]


def private_key(principal_id: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(SEEDS[principal_id])


def public_key_b64(principal_id: str) -> str:
    raw = private_key(principal_id).public_key().public_bytes_raw()
    return base64.b64encode(raw).decode()


def toml_value(value: Any) -> str:
    """Enough TOML for the fixtures: strings, ints, floats, bools, lists."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(type(value))


def render_toml(doc: dict[str, Any]) -> str:
    """Render the host config document (tables, ``tenants.*`` and ``[[principals]]``)."""
    lines: list[str] = []
    for key, value in doc.items():
        if not isinstance(value, (dict, list)) or (
            isinstance(value, list) and value and not isinstance(value[0], dict)
        ):
            lines.append(f"{key} = {toml_value(value)}")
    for key, value in doc.items():
        if key == "tenants" and isinstance(value, dict):
            for name, table in value.items():
                lines.append(f"[tenants.{json.dumps(name)}]")
                lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        elif isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in value.items()]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for table in value:
                lines.append(f"[[{key}]]")
                lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def base_document() -> dict[str, Any]:
    principals = []
    for spec in PRINCIPALS:
        entry = dict(spec)
        if spec["id"] in TOKENS:
            entry["token_sha256"] = hashlib.sha256(TOKENS[spec["id"]].encode()).hexdigest()
        if spec["id"] in SEEDS:
            entry["ed25519_public_key"] = public_key_b64(spec["id"])
        principals.append(entry)
    return {
        "host": {"bind": "127.0.0.1:0", "store": "state/host.db"},
        "sidecar": {"url": "http://127.0.0.1:8090", "token_file": "sidecar.token"},
        "crews": {"file": "crews.json"},
        "tenants": {name: {"crews": crews} for name, crews in TENANTS.items()},
        "principals": principals,
    }


@dataclasses.dataclass
class HostFiles:
    """A configuration directory; ``write(doc)`` (re)writes host.toml."""

    root: Path
    config: Path

    def write(self, doc: dict[str, Any] | None = None, *, crews: Any = None) -> Path:
        self.config.write_text(render_toml(base_document() if doc is None else doc))
        if crews is not None:
            (self.root / "crews.json").write_text(crews if isinstance(crews, str) else json.dumps(crews))
        return self.config


@pytest.fixture
def host_files(tmp_path: Path) -> HostFiles:
    root = tmp_path / "etc"
    root.mkdir(mode=0o700)
    (root / "state").mkdir(mode=0o700)
    token = root / "sidecar.token"
    token.write_text(SIDECAR_TOKEN + "\n")
    token.chmod(0o600)
    (root / "crews.json").write_text(json.dumps(CREWS))
    files = HostFiles(root, root / "host.toml")
    files.write()
    return files


class FakeClock:
    """Callable epoch-seconds clock that tests move by hand."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings(host_files: HostFiles) -> Settings:
    """Settings from ``host_files``; the readiness poller is slowed down so that
    tests decide when readiness is re-checked (they shorten it when they want polling)."""
    return dataclasses.replace(load_settings(host_files.config, environ={}), readiness_interval_s=3600.0)


class HealthSidecar:
    """A sidecar that only serves ``/health`` (``httpx2.MockTransport``): ``health`` is served as is
    (mutable); ``health_status`` overrides the status; ``requests`` records
    every request seen."""

    def __init__(self) -> None:
        self.health: Any = {
            "status": "ready",
            "crews": sorted(c["id"] for c in CREWS),
            "active_runs": 0,
            "retained_runs": 0,
            "max_retained_runs": 2000,
            "durable_journal": True,
            "stream_checkpoint_events": 128,
            "operations": sorted(OPERATION_NAMES),
            "training_directory": True,
        }
        self.health_status = 200
        self.requests: list[httpx2.Request] = []
        self.transport = httpx2.MockTransport(self.handle)

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        if request.url.path == "/health":
            if isinstance(self.health, Exception):
                raise self.health
            return httpx2.Response(self.health_status, json=self.health)
        return httpx2.Response(404, json={"detail": "not found"})


@pytest.fixture
def sidecar() -> HealthSidecar:
    return HealthSidecar()


@pytest.fixture
def make_app(settings: Settings, sidecar: HealthSidecar, clock: FakeClock) -> Callable[..., Starlette]:
    def factory(app_settings: Settings | None = None, **overrides: Any) -> Starlette:
        kwargs: dict[str, Any] = {"sidecar_transport": sidecar.transport, "clock": clock, **overrides}
        return create_app(app_settings or settings, **kwargs)

    return factory


@contextlib.asynccontextmanager
async def running(app: Starlette, **client_kwargs: Any) -> AsyncIterator[httpx2.AsyncClient]:
    """Run the app's lifespan and yield an in-process client (ASGITransport skips the lifespan)."""
    transport = httpx2.ASGITransport(app=app, **client_kwargs)
    async with app.router.lifespan_context(app):
        async with httpx2.AsyncClient(transport=transport, base_url="http://host.test") as client:
            yield client


@pytest.fixture
async def client(make_app: Callable[..., Starlette]) -> AsyncIterator[httpx2.AsyncClient]:
    async with running(make_app()) as http:
        yield http


def bearer(principal_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[principal_id]}"}


def envelope(
    message_id: str = "msg_1", *, sent_at_s: float = NOW, body: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """:func:`kits.aip.envelope` of ``body``, by default the action ``act_1`` (``cap:crewai:alpha``, input
    ``{"topic": "x"}``), sent at ``sent_at_s`` (epoch seconds; by default the fake clock's :data:`NOW`)."""
    return aip.envelope(
        aip.action("act_1", "cap:crewai:alpha", {"topic": "x"}) if body is None else body,
        message_id=message_id,
        sent_at=ms_to_rfc3339(int(sent_at_s * 1000)),
        **extra,
    )


def action_env(
    message_id: str, action_id: str, cap: str, inp: dict[str, Any], key: str | None = None
) -> dict[str, Any]:
    """:func:`envelope` carrying the action ``action_id`` for ``cap`` with input ``inp`` (and ``key``)."""
    return envelope(message_id, body=aip.action(action_id, cap, inp, key or None))


class Clock:
    """A settable store clock (epoch ms) for an in-process ActionService."""

    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.ms


async def open_action_service(
    tmp_path: Path, tenants: dict[str, Any], *, sidecar: Any = None, **kwargs: Any
) -> tuple[Any, Any, Any, Clock]:
    """An ActionService over a SQLite store in ``tmp_path`` and ``sidecar`` (a new FakeSidecar by
    default); returns ``(service, sidecar, http, clock)`` (close ``http`` and ``service.store`` after)."""
    from aip_crewai.host.actions.dispatch import Dispatcher
    from aip_crewai.host.actions.service import ActionService
    from aip_crewai.host.sidecars.client import SidecarClient
    from aip_crewai.host.sidecars.connection import SidecarHttp
    from aip_crewai.host.store.store import Store
    from kits.fake_sidecar import FakeSidecar

    tmp_path.chmod(0o700)
    clock = Clock()
    store = await Store.open(tmp_path / "host.db", clock=lambda: clock.ms / 1000)
    sidecar = FakeSidecar() if sidecar is None else sidecar
    http = SidecarHttp.of("http://127.0.0.1:8090", token="sidecar-token", transport=sidecar.transport())
    service = ActionService(
        store,
        Dispatcher(SidecarClient(http, max_response_bytes=1 << 20), max_response_bytes=1 << 20),
        tenants,
        now_ms=clock,
        **kwargs,
    )
    return service, sidecar, http, clock


def sign(obj: dict[str, Any], principal_id: str, *, key_id: str | None = None) -> dict[str, Any]:
    """Sign ``obj`` as ``principal_id``: RFC 8785 of the envelope with
    ``security = {scheme, key_id}``, signature added afterwards."""
    unsigned = {**obj, "security": {"scheme": "ed25519", "key_id": key_id or principal_id}}
    signature = private_key(principal_id).sign(jcs(unsigned))
    encoded = base64.urlsafe_b64encode(signature).decode().rstrip("=")
    return {**obj, "security": {**unsigned["security"], "signature": encoded}}


def os_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


async def submit_action(
    http: httpx2.AsyncClient,
    action_id: str,
    *,
    principal: str = "acme-invoker",
    capability: str = "cap:crewai:beta",
    input: Any = None,
) -> dict[str, Any]:
    """POST an ``aip.core.v1.action`` (key ``k-<action id>``) as ``principal``'s bearer; returns the
    result's ``output`` (for a mutation: ``approval_id``, ``policy_hash``, ...)."""
    env = envelope(
        f"msg_{action_id}",
        body=aip.action(action_id, capability, {"topic": "t"} if input is None else input, f"k-{action_id}"),
    )
    answer = await http.post(
        "/aip/v1/messages",
        content=json.dumps(env),
        headers={"Content-Type": "application/aip+json", **bearer(principal)},
    )
    assert answer.status_code == 202, answer.text
    return answer.json()["body"]["action_result"]["output"]


def calls_of(obj: Any, name: str, monkeypatch: Any) -> list[tuple[Any, ...]]:
    """The positional arguments of every call of ``obj``'s async method ``name`` from now on (it still runs)."""
    calls: list[tuple[Any, ...]] = []
    method = getattr(obj, name)

    async def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await method(*args, **kwargs)

    monkeypatch.setattr(obj, name, recorded)
    return calls


def hold_store_call(store: Any, name: str, monkeypatch: Any) -> tuple[asyncio.Event, list[str]]:
    """Hold every call of the store's method ``name`` until the returned event is set; the list names each
    call's action id (its second argument) as it arrives."""
    method, release, entered = getattr(store, name), asyncio.Event(), []

    async def held(*args: Any, **kwargs: Any) -> Any:
        entered.append(args[1])
        await release.wait()
        return await method(*args, **kwargs)

    monkeypatch.setattr(store, name, held)
    return release, entered


def count_store_calls(store: Any, monkeypatch: Any) -> list[str]:
    """The names of the store's worker functions run from now on (each one thread hop)."""
    calls: list[str] = []
    run = store._run

    async def counted(fn: Any, *args: Any) -> Any:
        calls.append(getattr(fn, "__name__", repr(fn)))
        return await run(fn, *args)

    monkeypatch.setattr(store, "_run", counted)
    return calls


async def post_message(http: httpx2.AsyncClient, principal: str, env: dict[str, Any]) -> httpx2.Response:
    """POST the envelope ``env`` to ``/aip/v1/messages`` with ``principal``'s bearer."""
    return await http.post(
        "/aip/v1/messages",
        content=json.dumps(env),
        headers={"Content-Type": "application/aip+json", **bearer(principal)},
    )


async def completed_run(http: httpx2.AsyncClient) -> None:
    """``act_run`` of acme-invoker on crew beta (key ``run-1``), approved by acme-both and completed at the
    scripted sidecar (a blocking re-call)."""
    run = action_env("msg_run", "act_run", "cap:crewai:beta", {"topic": "t"}, key="run-1")
    answer = await post_message(http, "acme-invoker", run)
    approval_id = answer.json()["body"]["action_result"]["output"]["approval_id"]
    decided = await http.post(
        f"/aip/v1/approvals/{approval_id}/decision",
        headers=bearer("acme-both"),
        json={"decision": "approved", "reason": "ok"},
    )
    assert decided.status_code == 200, decided.text
    run["message_id"] = "msg_run_2"
    assert (await post_message(http, "acme-invoker", run)).json()["body"]["action_result"]["status"] == "completed"
