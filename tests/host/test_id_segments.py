"""Action ids may hold ``?``, ``#`` and ``%`` (printable ASCII but ``/``): the host's links and the client
put each id in one percent-encoded path segment."""

from __future__ import annotations

import httpx2
from kits.hostapp import action_env, bearer, post_message

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

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.url.raw_path)
        return httpx2.Response(200, json={})

    with AipClient("http://host.invalid", token="t", transport=httpx2.MockTransport(answer)) as client:
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


def test_an_id_of_dots_is_sent_as_escaped_dots_never_as_a_dot_segment():
    """``actions show ..`` asked for ``/aip/v1`` (an HTTP client resolves ``..``): an id of dots alone goes as
    ``%2E``s, in the client's requests and in the host's links."""
    seen: list[bytes] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.url.raw_path)
        return httpx2.Response(200, json={})

    with AipClient("http://host.invalid", token="t", transport=httpx2.MockTransport(answer)) as client:
        client.action("..")
        client.result(".")
        client.approval("..")
    assert seen == [b"/aip/v1/actions/%2E%2E", b"/aip/v1/actions/%2E/result", b"/aip/v1/approvals/%2E%2E"]
    assert action_links("...", "..")["cancel"] == "/aip/v1/actions/%2E%2E%2E/cancel"
    assert action_links("a..b", None)["self"] == "/aip/v1/actions/a..b"


async def test_an_action_whose_id_is_dots_is_read_back_through_its_link(client):
    submitted = await post_message(
        client, "acme-invoker", action_env("msg_dots", "..", "cap:crewai:alpha", {"topic": "t"}, key="k-dots")
    )
    assert submitted.status_code in (200, 202), submitted.text
    link = action_links("..", None)["self"]
    answer = await client.get(link, headers=bearer("acme-invoker"))
    assert answer.status_code == 200 and answer.json()["action_id"] == "..", answer.text
