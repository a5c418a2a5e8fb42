"""The real-crew suite's kit: the example deployment (``examples/realcrews``) run as a tenant would use it.

:func:`start_deployment` starts a real sidecar on the example registry (by
default :data:`SUITE_REGISTRY`: the example crews behind a module that
starts a thread at import, and two that cannot work) with ``REALCREWS_BASE_URL`` at a
:class:`~fake_provider.FakeProvider`, and a real host in front of it whose
crews come from the example's ``crews.json``. Tenants: ``acme`` sees every
example crew, ``beta`` only ``memory`` (principals of ``kits.host.TOKENS``).

Every HTTP client of the sidecar's processes is pointed at a recording proxy
(``HTTP(S)_PROXY``, loopback excluded by ``NO_PROXY``): anything that tries to
leave loopback through a proxy-aware client (CrewAI's telemetry and tracing
exporters, a version check) is counted in :attr:`Deployment.escapes`.

:func:`run_action` runs one crew as a tenant: ``run`` with an idempotency
key, the approval by the tenant's approver, then the action's whole AIP
event stream.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fake_provider import FakeProvider
from kits.host import Host, start_host
from kits.sidecar import TOKEN, Sidecar, launch, wait_ready

from aip_crewai.client import AipClient, new_id

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXAMPLE = ROOT / "examples" / "realcrews"

#: The API key the crews send (the suite checks it never appears in a published message).
API_KEY = "sk-fake-realcrews-SECRET-1234"
#: The example crews behind a thread started at import, plus two crews that cannot work (``suite_registry.py``).
SUITE_REGISTRY = "suite_registry:CREWS"
#: The crews of :data:`SUITE_REGISTRY` that are not in the example's ``crews.json``.
BROKEN_CREWS = {
    "broken-knowledge": ("knowledge_unavailable", "KnowledgeUnavailable"),
    "broken-memory": ("memory_unavailable", "MemoryUnavailable"),
    "no-key": ("llm_unconfigured", "LlmUnconfigured"),
}
#: ``/health`` ``crew_problems`` of :data:`SUITE_REGISTRY`.
CREW_PROBLEMS = {crew: [code] for crew, (code, _error) in BROKEN_CREWS.items()}


class EscapeRecorder:
    """A loopback TCP listener that counts connections (the proxy no client should ever reach)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.attempts = 0
        threading.Thread(target=self._accept, name="escape-recorder", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.attempts += 1
            conn.close()

    def close(self) -> None:
        self._sock.close()


@dataclass
class Deployment:
    provider: FakeProvider
    sidecar: Sidecar
    host: Host
    escapes: EscapeRecorder
    workdir: Path
    crews: list[str] = field(default_factory=list)

    def close(self) -> None:
        self.host.stop()
        if self.sidecar.process.poll() is None:
            self.sidecar.kill()
        self.escapes.close()


def example_crews() -> list[dict[str, Any]]:
    crews: list[dict[str, Any]] = json.loads((EXAMPLE / "crews.json").read_text())
    return crews


def sidecar_env(provider: FakeProvider, escapes: EscapeRecorder) -> dict[str, str]:
    """The example's provider settings, pointed at ``provider``; the recording proxy for the rest."""
    proxy = f"http://127.0.0.1:{escapes.port}"
    return {
        "PYTHONPATH": f"{EXAMPLE}:{HERE}:{ROOT}",
        "REALCREWS_BASE_URL": provider.base_url,
        "REALCREWS_API_KEY": API_KEY,
        "REALCREWS_MODEL": "openai/fake-chat",
        "REALCREWS_EMBED_MODEL": "fake-embed",
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
        "http_proxy": proxy,
        "https_proxy": proxy,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def start_deployment(
    workdir: Path, provider: FakeProvider, *, isolation: str | None = None, registry: str = SUITE_REGISTRY
) -> Deployment:
    """A sidecar on the example registry and a host in front of it (see the module docstring)."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    escapes = EscapeRecorder()
    args = ["--registry", registry, "--allowed-operations", "run,knowledge_query", "--max-concurrency", "3"]
    args += ["--isolation", isolation] if isolation else []
    process = launch(workdir, args=args, env=sidecar_env(provider, escapes))
    stderr = workdir / "stderr.log"
    sidecar = Sidecar(process, "", TOKEN, workdir / "journal.db", workdir, workdir / "calls.log", stderr, args)
    try:
        sidecar.base_url = wait_ready(process, stderr)
        crews = example_crews() + [
            {"id": crew, "name": crew, "allowed_operations": ["run", "status", "events"]} for crew in BROKEN_CREWS
        ]
        ids = [crew["id"] for crew in crews]
        host = start_host(
            workdir / "host", sidecar.base_url, TOKEN, crews=crews, tenants={"acme": ids, "beta": ["memory"]}
        )
    except BaseException:
        if process.poll() is None:
            process.kill()
        escapes.close()
        raise
    return Deployment(provider, sidecar, host, escapes, workdir, ids)


@dataclass
class Outcome:
    """One action as its tenant saw it: the AIP events in order and the final ``action_result``."""

    action_id: str
    events: list[tuple[str, dict[str, Any]]]
    result: dict[str, Any]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [env["body"]["stream_chunk"] for name, env in self.events if name == "chunk"]

    def texts(self, kind: str) -> list[str]:
        """The text parts of the chunks of ``kind``, in order."""
        return [c["part"]["text"] for c in self.chunks if c.get("kind") == kind and c.get("part")]


def run_action(deployment: Deployment, crew: str, inputs: dict[str, Any], *, tenant: str = "acme") -> Outcome:
    """Run ``crew`` with ``inputs`` as ``tenant``'s invoker, approved by its approver; follow to the end."""
    host = deployment.host
    action_id = new_id("act")
    with host.client(f"{tenant}-app") as app, host.client(f"{tenant}-approver") as approver:
        pending = app.call(f"cap:crewai:{crew}", inputs, action_id=action_id, idempotency_key=new_id("key"))
        result = pending["body"]["action_result"]
        if result["status"] == "pending_approval":
            approver.decide(result["output"]["approval_id"], "approved", "real-crew suite")
        events = list(app.follow(action_id))
    final = events[-1][1]["body"]["action_result"] if events and events[-1][0] == "result" else {}
    return Outcome(action_id, events, final)


def client(deployment: Deployment, principal: str = "acme-app") -> AipClient:
    return deployment.host.client(principal)


#: The example's knowledge facts (``examples/realcrews/realcrews.py``; not imported: that imports CrewAI).
KNOWLEDGE_FACT_TEXT = "Marmalade-7731"
FILE_FACT_TEXT = "TIDE-NORTH-4411"
AGENT_FACT_TEXT = "Biscuit-5150"
