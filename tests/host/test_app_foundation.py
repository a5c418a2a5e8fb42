"""The app shell: lifespan resources, error envelopes, middleware, /health, /metrics,
extensions, systemd notification (ARCHITECTURE.md §6, STYLE)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import tempfile
import types
from pathlib import Path

import httpx2
import msgspec
import pytest
import structlog
from kits.hostapp import bearer, running
from kits.poll import until
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aip_crewai.contracts.aip import Envelope
from aip_crewai.contracts.errors import ConnectorRemoteTemporary, IdempotencyConflict
from aip_crewai.host.http.authenticate import authenticate
from aip_crewai.host.http.state import host_state
from aip_crewai.host.sidecars.connection import USER_AGENT, SidecarHttp

EXT = "tests_host_fake_extension"


@pytest.fixture
def extension():
    """A fake extension module with routes and a lifespan (registered in sys.modules)."""
    module = types.ModuleType(EXT)
    module.events = []

    async def boom(request: Request):
        raise RuntimeError("secret detail that must not leak")

    async def conflict(request: Request):
        raise IdempotencyConflict(details={"idempotency_key": "k"})

    async def temporary(request: Request):
        raise ConnectorRemoteTemporary(operation="status", read_only=True, remote_status=503, retry_after_ms=1500)

    async def whoami(request: Request):
        principal = await authenticate(request)
        return JSONResponse({"id": principal.id, "context": structlog.contextvars.get_contextvars()})

    module.routes = lambda: [
        Route("/boom", boom),
        Route("/conflict", conflict),
        Route("/temporary", temporary),
        Route("/whoami", whoami),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        module.events.append(("enter", host_state(app).store is not None, host_state(app).http is not None))
        yield
        module.events.append(("exit",))

    module.lifespan = lifespan
    sys.modules[EXT] = module
    yield module
    del sys.modules[EXT]


@pytest.fixture
def app(make_app, extension):
    return make_app(extensions=[EXT])


def test_a_missing_extension_module_fails_the_build_instead_of_being_skipped(make_app):
    """Regression: modules were loaded by name and a missing one skipped, so a rename turned routes into 404s."""
    with pytest.raises(ModuleNotFoundError):
        make_app(extensions=["tests_host_no_such_module"])


def test_core_routes_come_from_direct_imports(make_app):
    """The action and approval routes are part of every app, with no name lookup."""
    paths = {getattr(route, "path", "") for route in make_app().routes}
    assert {
        "/aip/v1/messages",
        "/aip/v1/actions/{action_id:str}",
        "/aip/v1/approvals",
        "/aip/v1/approvals/{approval_id:str}/decision",
    } <= paths


def error_of(response: httpx2.Response) -> dict:
    assert response.headers["content-type"] == "application/aip+json"
    envelope = msgspec.json.decode(response.content, type=Envelope)  # a valid AIP envelope
    assert envelope.message_type == "aip.core.v1.error" and envelope.message_id.startswith("msg_")
    return response.json()["body"]["error"]["error"]


async def test_health_is_alive_and_unauthenticated(client):
    response = await client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "alive"}


async def test_unknown_route_is_an_aip_404(client):
    response = await client.get("/nope")
    assert response.status_code == 404
    assert error_of(response) == {
        "code": "route.not_found",
        "message": "no such route",
        "category": "permanent",
        "retryable": False,
        "source": "aip-crewai",
    }


async def test_wrong_method_is_an_aip_405(client):
    response = await client.post("/aip/v1/manifest")
    assert response.status_code == 405 and "GET" in response.headers["allow"]
    assert error_of(response)["code"] == "route.method_not_allowed"


async def test_aip_errors_render_with_their_status(app):
    async with running(app) as client:
        response = await client.get("/conflict")
        assert response.status_code == 409
        error = error_of(response)
        assert error["code"] == "action.idempotency_conflict" and error["details"] == {"idempotency_key": "k"}
        temporary = await client.get("/temporary")
        assert temporary.status_code == 503 and temporary.headers["retry-after"] == "2"
        assert error_of(temporary)["retryable"] is True and error_of(temporary)["retry_after_ms"] == 1500


async def test_unexpected_errors_are_a_generic_500_with_a_logged_traceback(app):
    async with running(app) as client:
        with structlog.testing.capture_logs() as logs:
            response = await client.get("/boom")
    assert response.status_code == 500
    assert error_of(response)["code"] == "host.internal_error"
    assert "secret detail" not in response.text
    failed = [e for e in logs if e["event"] == "request_failed"]
    assert failed and failed[0]["log_level"] == "error" and failed[0].get("exc_info")
    summary = [e for e in logs if e["event"] == "request_finished"]
    assert summary[-1]["status"] == 500 and summary[-1]["route"] == "/boom"


async def test_one_summary_line_per_request_without_secrets(client):
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        response = await client.get("/aip/v1/manifest?cursor=x", headers=bearer("acme-invoker"))
    summaries = [e for e in logs if e["event"] == "request_finished"]
    assert len(summaries) == 1
    line = summaries[0]
    assert line["route"] == "/aip/v1/manifest" and line["status"] == 200 and line["method"] == "GET"
    assert line["tenant"] == "acme" and line["principal"] == "acme-invoker"
    assert line["request_id"] == response.headers["x-request-id"] and line["response_bytes"] == len(response.content)
    assert "duration_ms" in line
    assert "tok-acme-invoker" not in repr(logs) and "cursor" not in repr(logs)


async def test_request_ids_are_bound_echoed_and_do_not_leak(app):
    async with running(app) as client:
        response = await client.get("/whoami", headers={**bearer("acme-invoker"), "X-Request-ID": "abc-123"})
        assert response.headers["x-request-id"] == "abc-123"
        context = response.json()["context"]
        assert context == {"request_id": "abc-123", "tenant": "acme", "principal": "acme-invoker"}
        odd = await client.get("/health", headers={"X-Request-ID": "bad id\twith spaces"})
        assert odd.headers["x-request-id"].startswith("req_")
    assert "request_id" not in structlog.contextvars.get_contextvars()


async def test_lifespan_owns_the_store_and_one_sidecar_client(app, extension, settings, monkeypatch):
    closed: list[object] = []

    async def aclose(self: SidecarHttp) -> None:
        closed.append(self)

    monkeypatch.setattr(SidecarHttp, "aclose", aclose)
    async with running(app):
        http = host_state(app).http
        request = http.request("GET", "/jobs/x", headers={})
        assert str(request.url) == "http://127.0.0.1:8090/jobs/x"
        assert request.extensions["timeout"]["connect"] == 10.0 and request.extensions["timeout"]["read"] is None
        assert request.headers["authorization"] == "Bearer sidecar-secret-token"
        assert request.headers["user-agent"] == USER_AGENT
        (_, probe), *_ = host_state(app).readiness.members
        assert probe.http.headers["user-agent"] == USER_AGENT
        assert host_state(app).store is not None and settings.store_path.exists()
        assert host_state(app).authenticator.claims is host_state(app).store
        assert extension.events == [("enter", True, True)]
    assert closed == [http] and extension.events[-1] == ("exit",)


async def test_metrics_need_the_operator_role(client):
    assert (await client.get("/metrics")).status_code == 401
    forbidden = await client.get("/metrics", headers=bearer("acme-invoker"))
    assert forbidden.status_code == 403 and error_of(forbidden)["code"] == "policy.forbidden"
    await client.get("/health")
    response = await client.get("/metrics", headers=bearer("acme-operator"))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert 'aip_host_requests_total{route="/health",method="GET",status="2xx"} 1' in text
    assert 'aip_host_requests_total{route="/metrics",method="GET",status="4xx"} 2' in text
    assert "# TYPE aip_host_fence_decisions_total counter" in text
    assert "# TYPE aip_host_ready gauge" in text and "aip_host_request_duration_seconds_count" in text
    assert "acme" not in text  # no tenant labels


def test_metric_exposition_escapes_labels():
    from aip_crewai.host.metrics import Metrics

    metrics = Metrics()
    metrics.fence_decisions.inc(fence='a"b', decision="x\\y\nz")
    metrics.actions.inc(2, operation="run", status="completed")
    text = metrics.render()
    assert 'aip_host_fence_decisions_total{fence="a\\"b",decision="x\\\\y\\nz"} 1' in text
    assert 'aip_host_actions_total{operation="run",status="completed"} 2' in text
    with pytest.raises(ValueError):
        metrics.actions.inc(operation="run")
    with pytest.raises(ValueError):
        metrics.actions.inc(-1, operation="run", status="x")


def test_every_documented_host_metric_is_exposed():
    """Each family of the metrics module's table is in the exposition, with its samples once counted: the
    webhook counters were defined and incremented but left out of the exposed list (docs/webhooks.md)."""
    import re

    from aip_crewai.host import metrics as host_metrics

    documented = re.findall(r"^\| ``(\w+)`` \| (\w+)", host_metrics.__doc__ or "", re.MULTILINE)
    assert len(documented) >= 15
    exposed = host_metrics.Metrics()
    exposed.webhook_attempts.inc(outcome="timeout")
    exposed.webhook_deliveries.inc(outcome="delivered")
    text = exposed.render()
    for name, kind in documented:
        assert f"# TYPE aip_host_{name} {kind}" in text, name
    assert 'aip_host_webhook_attempts_total{outcome="timeout"} 1' in text
    assert 'aip_host_webhook_deliveries_total{outcome="delivered"} 1' in text


async def test_ready_is_sent_to_notify_socket(make_app, settings):
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # AF_UNIX paths are short
        address = str(Path(short) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(address)
            sock.settimeout(5)
            async with running(make_app(dataclasses.replace(settings, notify_socket=address))):
                assert sock.recv(64) == b"READY=1"


async def test_startup_fails_on_an_unsafe_store(make_app, settings):
    settings.store_path.parent.chmod(0o777)
    app = make_app()
    with pytest.raises(Exception, match="group- or world-writable"):
        async with app.router.lifespan_context(app):
            pass


@pytest.mark.integration
def test_the_host_process_serves_and_stops_cleanly_on_sigterm(host_files):
    """`aip-crewai host --config` binds, answers /health, and exits 0 on SIGTERM."""
    import signal
    import subprocess

    from kits.hostapp import base_document

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    doc = base_document()
    doc["host"]["bind"] = f"127.0.0.1:{port}"
    host_files.write(doc)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(host_files.config), "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:

        def listening() -> httpx2.Response | None:
            try:
                return httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1)
            except httpx2.TransportError:
                if proc.poll() is not None:
                    raise
                return None

        response = until(listening, interval=0.05, what="the host listening")
        assert response.json() == {"status": "alive"}
        assert httpx2.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503  # no sidecar
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read().decode()
        assert '"event": "host_stopped"' in stderr and "sidecar-secret-token" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_probe_requests_are_logged_at_debug_and_others_at_info(client) -> None:
    """Issue 20 item 8: every /ready poll at info level drowned the log."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        await client.get("/ready")
        await client.get("/aip/v1/manifest", headers=bearer("acme-invoker"))
    levels = {e["route"]: e["log_level"] for e in logs if e["event"] == "request_finished"}
    assert levels == {"/ready": "debug", "/aip/v1/manifest": "info"}
