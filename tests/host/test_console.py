"""The approval console's files: served at /console/ with a strict CSP, only the three
shipped files, and 404 everywhere once `[host] console = false`. The page itself is exercised in Chromium
by tests/browser."""

from __future__ import annotations

import dataclasses

from kits.hostapp import HostFiles, base_document, running

from aip_crewai.host.config import load_settings


async def test_the_console_serves_its_three_files_with_a_strict_policy(make_app, settings) -> None:
    async with running(make_app(settings)) as http:
        redirect = await http.get("/console")
        page = await http.get("/console/")
        script = await http.get("/console/console.js")
        style = await http.get("/console/console.css")
        other = await http.get("/console/host.toml")
        traversal = await http.get("/console/..%2Fconfig.py")
    assert redirect.status_code == 308 and redirect.headers["location"] == "/console/"
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert b'<script src="console.js" defer></script>' in page.content
    assert script.headers["content-type"].startswith("text/javascript") and b"signedHeaders" in script.content
    assert style.headers["content-type"].startswith("text/css")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert other.status_code == 404 and traversal.status_code == 404


async def test_console_false_turns_every_console_route_into_a_404(make_app, settings) -> None:
    async with running(make_app(dataclasses.replace(settings, console=False))) as http:
        answers = [await http.get(path) for path in ("/console", "/console/", "/console/console.js")]
    assert [a.status_code for a in answers] == [404, 404, 404]
    assert all(a.json()["body"]["error"]["error"]["code"] == "route.not_found" for a in answers)


def test_the_setting_defaults_to_on_and_reads_from_the_host_table(host_files: HostFiles) -> None:
    doc = base_document()
    host_files.write(doc)
    assert load_settings(host_files.config, environ={}).console is True
    doc["host"]["console"] = False
    host_files.write(doc)
    assert load_settings(host_files.config, environ={}).console is False
