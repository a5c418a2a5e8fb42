"""Action ids may hold ``?``, ``#`` and ``%`` (printable ASCII but ``/``): the host's links and the client
put each id in one percent-encoded path segment."""

from __future__ import annotations

import httpx

from aip_crewai.client import AipClient
from aip_crewai.host.http.routes import action_links

ODD = "q?m%x#y"


def test_links_percent_encode_the_ids():
    links = action_links(ODD, "apr?1")
    assert links["self"] == "/aip/v1/actions/q%3Fm%25x%23y"
    assert links["result"] == "/aip/v1/actions/q%3Fm%25x%23y/result"
    assert links["approval"] == "/aip/v1/approvals/apr%3F1"
    assert action_links("act_1", None)["events"] == "/aip/v1/actions/act_1/events"


def test_the_client_sends_each_id_as_one_encoded_segment():
    seen: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path)
        return httpx.Response(200, json={})

    with AipClient("http://host.invalid", token="t", transport=httpx.MockTransport(answer)) as client:
        client.action(ODD)
        client.result(ODD)
        client.cancel(ODD)
        client.approval("apr#1")
    assert seen == [
        b"/aip/v1/actions/q%3Fm%25x%23y",
        b"/aip/v1/actions/q%3Fm%25x%23y/result",
        b"/aip/v1/actions/q%3Fm%25x%23y/cancel",
        b"/aip/v1/approvals/apr%231",
    ]
