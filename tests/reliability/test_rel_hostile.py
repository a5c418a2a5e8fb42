"""Hostile input: fuzzed requests against both apps in-process, and a corpus of malformed
sidecar streams through the host, in-process and over real HTTP (ARCHITECTURE.md §3, §6, §8)."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import fuzzkit
import httpx2
import pytest
import streamkit
from hypothesis import HealthCheck, given, settings
from kits.fake_sidecar import FakeSidecar
from kits.hostapp import SIDECAR_TOKEN, bearer, envelope, sign
from relkit import ACME_CREWS, OPERATIONS, TOKEN, AppThread, Processes, inproc_app

pytestmark = [pytest.mark.host_processes]

FUZZ = settings(
    max_examples=int(os.environ.get("AIP_CREWAI_FUZZ_EXAMPLES", "800")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
INPROC_WHO = streamkit.Principals(bearer("acme-invoker"), bearer("acme-both"), "cap:crewai:beta")


@pytest.fixture(scope="module")
def host_app(tmp_path_factory):
    """The host in-process over the scripted stream corpus (FakeSidecar for every other route)."""
    app = AppThread(
        inproc_app(tmp_path_factory.mktemp("hostile") / "etc", streamkit.StreamingTransport(FakeSidecar(SIDECAR_TOKEN)))
    )
    try:
        yield app
    finally:
        app.close()


@pytest.fixture(scope="module")
def sidecar_app(tmp_path_factory):
    """The sidecar in-process with the fake executor of tests/sidecar (crews finish at once)."""
    from kits.sidecar_fakes import FAKE_CREWS, FakeExecutor, make_settings
    from kits.sidecar_fakes import TOKEN as FAKE_TOKEN

    from aip_crewai.sidecar.http.app import create_app

    root = tmp_path_factory.mktemp("hostile-sidecar")
    root.chmod(0o700)
    app = AppThread(
        create_app(make_settings(root, max_retained_runs=100_000), crews=FAKE_CREWS, executor=FakeExecutor()),
        base_url="http://sidecar",
    )
    app.token = FAKE_TOKEN
    try:
        yield app
    finally:
        app.close()


# ------------------------------------------------------------------- fuzzing


@pytest.mark.timeout(240)
@FUZZ
@given(request=fuzzkit.host_requests())
def test_rel_fuzzed_host_requests_never_5xx_crash_or_hang(host_app, request):
    """Every route and every operation's input, hostile envelopes and headers: a 4xx or a success, in time."""
    status, headers, content = host_app.request(request[0], request[1], timeout=15, **request[2])
    fuzzkit.check_answer(request, status, headers, content)


@pytest.mark.timeout(240)
@FUZZ
@given(request=fuzzkit.sidecar_requests())
def test_rel_fuzzed_sidecar_requests_never_5xx_crash_or_hang(sidecar_app, request):
    """Every sidecar route with hostile bodies, ids, cursors and headers (authenticated)."""
    method, url, kwargs = request
    kwargs = {**kwargs, "headers": {**kwargs.get("headers", {}), "Authorization": f"Bearer {sidecar_app.token}"}}
    status, headers, content = sidecar_app.request(method, url, timeout=15, **kwargs)
    fuzzkit.check_sidecar_answer(request, status, headers, content)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [995, 1000, 5000, 100_000])
def test_rel_deeply_nested_bodies_are_400_not_500(host_app, sidecar_app, depth):
    """Regression: a body nested deeper than msgspec allows raised RecursionError (500) on the host's
    message route and the sidecar's job routes; a signed envelope nested just under it made the RFC 8785
    canonicalization recurse too deep (500). All are now client errors."""
    nested = b"[" * depth + b"]" * depth
    aip_json = {"Content-Type": "application/aip+json"}
    status, _, content = host_app.request(
        "POST", "/aip/v1/messages", content=nested, headers={**aip_json, **bearer("acme-invoker")}
    )
    assert status == 400 and json.loads(content)["body"]["error"]["error"]["code"], content[:200]
    env = envelope("msg_deep")
    env["body"]["action"]["input"] = {"x": fuzzkit.DEEP}
    signed = sign(env, "globex-signer")  # the signature over a placeholder: the checks before it must not crash
    status, _, content = host_app.request(
        "POST", "/aip/v1/messages", content=fuzzkit.encode(signed, depth), headers=aip_json
    )
    assert status in (400, 401), content[:200]
    for path in ("/jobs", "/jobs/stream", "/jobs/a/cancel"):
        status, _, content = sidecar_app.request(
            "POST",
            path,
            content=nested,
            headers={
                "Authorization": f"Bearer {sidecar_app.token}",
                "Idempotency-Key": "k",
                "Content-Type": "application/json",
            },
        )
        assert status in (400, 413, 422), (path, status, content[:200])


@pytest.mark.timeout(30)
def test_rel_action_ids_unsafe_in_urls_reach_their_own_sidecar_job(host_app):
    """Regression: an action id with ``?``, ``#`` or ``%`` went into sidecar URL paths as is: ``a?x`` read
    and cancelled job ``a`` (httpx took ``?x`` for a query), ``a%41`` read ``aA``; and a non-ASCII
    idempotency key crashed the dispatch (HTTP headers take ASCII only). Each action now has its own job."""
    ids = ["plain_1", "plain_1?x", "plain_1#x", "plain_%41", "sha256:" + "0" * 64]
    for n, action_id in enumerate(ids):
        env = envelope(f"msg_ids_{n}")
        env["body"]["action"] = {
            "id": action_id,
            "capability_id": "cap:crewai:beta:knowledge_query",
            "input": {"query": [f"q{n}"]},
            "idempotency_key": f"cl\u00e9-{n}",
        }
        status, _, content = host_app.request("POST", "/aip/v1/messages", json=env, headers=bearer("acme-invoker"))
        result = json.loads(content)["body"]["action_result"]
        assert status == 200 and result["status"] == "completed", (action_id, content[:300])
    for n, action_id in enumerate(ids):
        env = envelope(f"msg_ids_status_{n}")
        env["body"]["action"] = {
            "id": f"st_{n}",
            "capability_id": "cap:crewai:beta:status",
            "input": {"run_action_id": action_id},
        }
        status, _, content = host_app.request("POST", "/aip/v1/messages", json=env, headers=bearer("acme-invoker"))
        view = json.loads(content)["body"]["action_result"]["output"]
        assert status == 200 and view["action_id"] == action_id and view["status"] == "completed", content[:300]
        assert view["output"] == {"results": [{"content": "policy"}]}  # its own job, not plain_1's


# ------------------------------------------------------------ stream corpus


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [*streamkit.INPROC, "too_many_events"])
def test_rel_stream_corpus_through_the_host_in_process(host_app, name):
    """Each stream of the corpus, through dispatch, normalization and the store: its documented outcome
    (and, after a stream failure, a cancel sent to the sidecar)."""
    case = streamkit.stream_case(name)
    measure = name == "oversize_frame"  # 8 MiB offered in one frame: memory stays near the 1 MiB frame bound
    if measure:
        tracemalloc.start()
    try:
        outcome = streamkit.run_case(host_app.request, INPROC_WHO, name, f"act_corpus_{name}")
        peak = tracemalloc.get_traced_memory()[1] if measure else 0
    finally:
        if measure:
            tracemalloc.stop()
    streamkit.check_case(name, outcome, case)
    assert peak < 4 * 1024 * 1024, f"peak {peak} bytes"


@pytest.mark.timeout(60)
def test_rel_response_over_the_host_bound_is_response_too_large(tmp_path):
    app = AppThread(
        inproc_app(tmp_path / "etc", streamkit.StreamingTransport(FakeSidecar(SIDECAR_TOKEN)), max_response_bytes=65536)
    )
    try:
        outcome = streamkit.run_case(app.request, INPROC_WHO, "response_too_large", "act_big")
    finally:
        app.close()
    streamkit.check_case("response_too_large", outcome, streamkit.stream_case("response_too_large"))


#: The browser origin the real host below allows (``[host] cors_origins``).
CORS_ORIGIN = "https://console.example"


@pytest.fixture(scope="module")
def http_host(tmp_path_factory):
    """A real host process (allowing the browser origin :data:`CORS_ORIGIN`) in front of a real HTTP fake
    sidecar serving the corpus."""
    fake = streamkit.FakeSidecarServer(TOKEN, [*ACME_CREWS, "knowledge_b"], OPERATIONS)
    procs = Processes(tmp_path_factory.mktemp("hostile-http"))
    try:
        host = procs.host(fake.base_url, host_options={"cors_origins": [CORS_ORIGIN]})
        yield host, fake
    finally:
        procs.close()
        fake.close()


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


#: Who calls and approves on the real host (kits.host's bearer principals), and its run capability.
HTTP_WHO = streamkit.Principals(
    {"Authorization": "Bearer tok-acme-app-1"}, {"Authorization": "Bearer tok-acme-approver-1"}, "cap:crewai:echo"
)


def _run_over_http(host, name: str, action_id: str) -> dict[str, object]:
    """streamkit.run_case through the real host's HTTP API."""
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:

        def request(method, url, **kwargs):
            response = http.request(method, url, **kwargs)
            return response.status_code, response.headers, response.content

        return streamkit.run_case(request, HTTP_WHO, name, action_id)


@pytest.mark.processes  # http_host starts a host process (module scope: the fast tier's guard cannot see it)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", streamkit.OVER_HTTP)
def test_rel_stream_corpus_over_real_http_to_a_real_host(http_host, name):
    """Split reads, a BOM, U+2028, a trickle of one byte per 10 ms, a 64 MiB frame: the documented outcome
    from a real host process, whose peak memory stays bounded."""
    host, _ = http_host
    before = _vm_hwm_kib(host.process.pid)
    outcome = _run_over_http(host, name, f"act_http_{name}")
    streamkit.check_case(name, outcome, streamkit.stream_case(name, big=True))
    if name == "oversize_frame":  # 64 MiB offered: the host's peak RSS grows by far less
        grown = _vm_hwm_kib(host.process.pid) - before
        assert grown < 24 * 1024, f"host peak memory grew by {grown} KiB"


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_rel_a_frame_nested_past_the_decoders_bound_is_an_invalid_stream_from_a_real_host(http_host):
    """Regression (second review): a sidecar frame nested 1,500 deep failed the action with
    ``internal.error``. Over real HTTP, a stream whose one chunk event nests 100,000 arrays deep ends the
    action failed with ``connector.crewai.invalid_stream`` (and a confirmed cancel); the host stays healthy:
    its process runs, ``/health`` and ``/ready`` answer 200, the next valid run completes, and its log holds
    no traceback."""
    host, _ = http_host
    name = "frame_nested_past_the_decoders_bound"
    outcome = _run_over_http(host, name, "act_http_deep_frame")
    streamkit.check_case(name, outcome, streamkit.stream_case(name))
    assert host.process.poll() is None
    for path in ("/health", "/ready"):
        assert httpx2.get(f"{host.base_url}{path}", timeout=30).status_code == 200, path
    after = _run_over_http(host, "bom_at_start", "act_http_after_deep_frame")
    streamkit.check_case("bom_at_start", after, streamkit.stream_case("bom_at_start"))
    log = host.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log, log[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
def test_rel_a_refused_cors_preflight_from_a_real_host_carries_no_cors_header(http_host, origin):
    """Regression (second review, item 6): a preflight from a disallowed or ``null`` origin got 400
    with ``Access-Control-Allow-Methods``/``-Headers``. From the real host: 400 and no ``Access-Control-*``
    header at all, as for a method the allowed origin may not use; the allowed origin's preflight is answered."""
    host, _ = http_host
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:
        allowed = http.options("/aip/v1/messages", headers={"Origin": CORS_ORIGIN, **preflight})
        refused = http.options("/aip/v1/messages", headers={"Origin": origin, **preflight})
        wrong_method = http.options(
            "/aip/v1/messages",
            headers={"Origin": CORS_ORIGIN, **preflight, "Access-Control-Request-Method": "PUT"},
        )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == CORS_ORIGIN
    for answer in (refused, wrong_method):
        assert answer.status_code == 400, answer.text
        assert not [h for h in answer.headers if h.lower().startswith("access-control-")], answer.headers
