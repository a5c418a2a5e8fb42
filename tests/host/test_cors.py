"""CORS for browsers: `[host] cors_origins`, an allowed and a refused origin."""

from __future__ import annotations

import dataclasses

import pytest
from kits.hostapp import HostFiles, base_document, bearer, running

from aip_crewai.host.config import MAX_CORS_ORIGINS, HostConfigError, load_settings

ALLOWED = "https://console.example"
REFUSED = "https://evil.example"


def load(files: HostFiles, origins):
    doc = base_document()
    doc["host"]["cors_origins"] = origins
    files.write(doc)
    return load_settings(files.config, environ={})


def test_origins_are_exact_http_or_https_origins(host_files: HostFiles) -> None:
    settings = load(host_files, ["https://Console.Example", "http://127.0.0.1:5173", "http://[::1]:8080"])
    assert settings.cors_origins == ("https://console.example", "http://127.0.0.1:5173", "http://[::1]:8080")
    assert load(host_files, []).cors_origins == ()
    for bad in ("*", "https://a.example/", "https://a.example/path", "ftp://a.example", "a.example", ""):
        with pytest.raises(HostConfigError) as info:
            load(host_files, ["https://ok.example", bad])
        assert info.value.key == "host.cors_origins[1]"


def test_at_most_the_documented_number_of_origins(host_files: HostFiles) -> None:
    origins = [f"https://o{i}.example" for i in range(MAX_CORS_ORIGINS + 1)]
    assert len(load(host_files, origins[:-1]).cors_origins) == MAX_CORS_ORIGINS
    with pytest.raises(HostConfigError) as info:
        load(host_files, origins)
    assert info.value.key.startswith("host.cors_origins")


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, last-event-id",
}


async def test_a_preflight_from_an_allowed_origin_is_answered_and_a_refused_one_is_not(make_app, settings) -> None:
    app = make_app(dataclasses.replace(settings, cors_origins=(ALLOWED,)))
    async with running(app) as http:
        allowed = await http.options("/aip/v1/messages", headers={"Origin": ALLOWED, **PREFLIGHT})
        refused = await http.options("/aip/v1/messages", headers={"Origin": REFUSED, **PREFLIGHT})
        read = await http.get("/aip/v1/manifest", headers={"Origin": ALLOWED, **bearer("acme-invoker")})
        foreign_read = await http.get("/aip/v1/manifest", headers={"Origin": REFUSED, **bearer("acme-invoker")})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED
    allowed_headers = {h.strip().lower() for h in allowed.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "last-event-id"} <= allowed_headers
    assert "access-control-allow-credentials" not in allowed.headers
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert not [name for name in refused.headers if name.lower().startswith("access-control-")], refused.headers
    assert read.headers["access-control-allow-origin"] == ALLOWED
    assert "x-request-id" in read.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-origin" not in foreign_read.headers


@pytest.mark.parametrize("origin", [REFUSED, "null"])
@pytest.mark.parametrize("method", ["POST", "PUT"])
async def test_a_refused_preflight_carries_no_cors_header_at_all(make_app, settings, origin, method) -> None:
    """Regression (second review): a preflight from a disallowed or ``null`` origin got 400 with
    ``Access-Control-Allow-Methods``/``-Headers``; docs/reference/configuration.md says "without CORS headers"."""
    app = make_app(dataclasses.replace(settings, cors_origins=(ALLOWED,)))
    async with running(app) as http:
        refused = await http.options(
            "/aip/v1/messages", headers={"Origin": origin, **PREFLIGHT, "Access-Control-Request-Method": method}
        )
        wrong_method = await http.options(
            "/aip/v1/messages", headers={"Origin": ALLOWED, **PREFLIGHT, "Access-Control-Request-Method": "PUT"}
        )
    for answer in (refused, wrong_method):
        assert answer.status_code == 400
        assert not [name for name in answer.headers if name.lower().startswith("access-control-")], answer.headers


async def test_without_origins_there_are_no_cors_headers(client) -> None:
    preflight = await client.options("/aip/v1/messages", headers={"Origin": ALLOWED, **PREFLIGHT})
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 405


async def test_a_browser_may_send_an_rfc9421_signature_cross_origin(make_app, settings) -> None:
    app = make_app(dataclasses.replace(settings, cors_origins=(ALLOWED,)))
    async with running(app) as http:
        preflight = await http.options(
            "/aip/v1/approvals/apr_1/decision",
            headers={
                "Origin": ALLOWED,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, signature, signature-input, content-digest",
            },
        )
    assert preflight.status_code == 200
    allowed_headers = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"signature", "signature-input", "content-digest"} <= allowed_headers


BOOM_EXTENSION = "tests_host_cors_boom"


@pytest.fixture
def boom_extension():
    """A route that fails unexpectedly (a 500) and one that finds the store unavailable (a 503)."""
    import sys
    import types

    from starlette.requests import Request
    from starlette.routing import Route

    from aip_crewai.host.store.records import StoreUnavailable

    async def boom(request: Request):
        raise RuntimeError("unexpected")

    async def store_down(request: Request):
        raise StoreUnavailable()

    module = types.ModuleType(BOOM_EXTENSION)
    module.routes = lambda: [Route("/boom", boom), Route("/store-down", store_down)]
    sys.modules[BOOM_EXTENSION] = module
    yield module
    del sys.modules[BOOM_EXTENSION]


async def test_every_error_response_carries_cors_headers_for_an_allowed_origin(
    make_app, settings, boom_extension
) -> None:
    """500s included: the error handling runs inside the CORS middleware (a browser can read every error)."""
    app = make_app(dataclasses.replace(settings, cors_origins=(ALLOWED,)), extensions=[BOOM_EXTENSION])
    async with running(app) as http:
        answers = {
            500: await http.get("/boom", headers={"Origin": ALLOWED}),
            503: await http.get("/store-down", headers={"Origin": ALLOWED}),
            404: await http.get("/nowhere", headers={"Origin": ALLOWED}),
            401: await http.get("/aip/v1/manifest", headers={"Origin": ALLOWED}),
            400: await http.post(
                "/aip/v1/messages",
                content=b"not json",
                headers={"Origin": ALLOWED, **bearer("acme-invoker"), "Content-Type": "application/aip+json"},
            ),
        }
        foreign = await http.get("/boom", headers={"Origin": REFUSED})
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)
        assert answer.headers["access-control-allow-origin"] == ALLOWED, status
        assert answer.headers["content-type"].startswith("application/aip+json"), status
    assert answers[500].json()["body"]["error"]["error"]["code"] == "host.internal_error"
    assert answers[503].headers["retry-after"] == "1"
    assert foreign.status_code == 500 and "access-control-allow-origin" not in foreign.headers
