"""The real-crew suite's kit: the example deployment (``examples/realcrews``) run as a tenant would use it.

:func:`start_deployment` starts a real sidecar on the example registry (by
default :data:`SUITE_REGISTRY`: the example crews behind a module that
starts a thread at import, and two that cannot work) with ``REALCREWS_BASE_URL`` at a
:class:`~fake_provider.FakeProvider`, and a real host in front of it whose
crews come from the example's ``crews.json``. Tenants: ``acme`` sees every
example crew, ``beta`` only ``memory`` (principals of ``kits.host.TOKENS``).

Observing (docs/observing.md "Observing actions"): the host signs receipts with a 0600 key
(``receipt.key`` in the workdir; :attr:`Deployment.receipt_public_key`), ``acme-operator``
(:data:`OPERATOR_TOKEN`) reads ``/metrics`` and ``GET /aip/v1/usage``, the ``tools`` crew is priced
(:data:`PRICES`), and with ``otlp`` given both
processes export their traces to that receiver (the standard ``OTEL_*`` variables).

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

import httpx2
from fake_provider import FakeProvider
from kits.host import Host, bearer_principal, start_host
from kits.otlp_receiver import OtlpReceiver, otel_env
from kits.sidecar import TOKEN, Sidecar, launch, wait_ready

from aip_crewai.client import AipClient, new_id
from aip_crewai.plumbing.keys import generate_ed25519

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
#: The bearer token of ``acme-operator`` (operator role of tenant ``acme``: ``/metrics``, ``GET /aip/v1/usage``).
OPERATOR_TOKEN = "tok-acme-operator-realcrews"
#: The price of the ``fake-chat`` model per million tokens (``[pricing]``), which the ``tools`` crew runs.
PRICES = {"prompt": "2.5", "completion": "10"}
PRICING = f"""[pricing]
currency = "USD"
[pricing.models."fake-chat"]
prompt = "{PRICES["prompt"]}"
completion = "{PRICES["completion"]}"
[pricing.crews]
tools = "fake-chat"
"""
OPERATOR = bearer_principal("acme-operator", OPERATOR_TOKEN, "operator")


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
    #: The host's receipt public key (base64, as ``aip-crewai keys generate receipt`` prints it).
    receipt_public_key: str = ""
    #: Where both processes export their spans, when tracing is on.
    otlp: OtlpReceiver | None = None

    def operator(self) -> httpx2.Client:
        """A plain HTTP client of the host as ``acme-operator`` (timeout 60 s)."""
        return httpx2.Client(
            base_url=self.host.base_url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=60.0
        )

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
    workdir: Path,
    provider: FakeProvider,
    *,
    isolation: str | None = None,
    registry: str = SUITE_REGISTRY,
    otlp: OtlpReceiver | None = None,
) -> Deployment:
    """A sidecar on the example registry and a host in front of it (see the module docstring); with ``otlp``
    both export their spans to it."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    escapes = EscapeRecorder()
    args = ["--registry", registry, "--allowed-operations", "run,knowledge_query", "--max-concurrency", "3"]
    args += ["--isolation", isolation] if isolation else []
    # the suite's conftest set OTEL_SDK_DISABLED=true in this process (for CrewAI); the children are told otherwise
    tracing = {**otel_env(otlp.endpoint), "OTEL_SDK_DISABLED": "false"} if otlp is not None else {}
    process = launch(workdir, args=args, env={**sidecar_env(provider, escapes), **tracing})
    stderr = workdir / "stderr.log"
    sidecar = Sidecar(process, "", TOKEN, workdir / "journal.db", workdir, workdir / "calls.log", stderr, args)
    try:
        sidecar.base_url = wait_ready(process, stderr)
        crews = example_crews() + [
            {"id": crew, "name": crew, "allowed_operations": ["run", "status", "events"]} for crew in BROKEN_CREWS
        ]
        ids = [crew["id"] for crew in crews]
        (workdir / "host").mkdir(mode=0o700, exist_ok=True)
        receipt_key = workdir / "host" / "receipt.key"
        public_key = generate_ed25519(receipt_key)  # 0600
        host = start_host(
            workdir / "host",
            sidecar.base_url,
            TOKEN,
            crews=crews,
            tenants={"acme": ids, "beta": ["memory"]},
            extra_principals=[OPERATOR],
            host_options={"receipt_key_file": str(receipt_key)},
            extra_toml=PRICING,
            env=tracing,
        )
    except BaseException:
        if process.poll() is None:
            process.kill()
        escapes.close()
        raise
    return Deployment(provider, sidecar, host, escapes, workdir, ids, public_key, otlp)


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
