"""The tenant client reads every frame a host can send: a ``result`` envelope carrying an output of up to
4 MiB (``contracts.sidecar.MAX_OUTPUT_BYTES``) arrives whole; only a frame past ``client.MAX_FRAME_BYTES`` is
refused, typed (``SSEFrameTooLarge``), which the CLI prints as one line."""

from __future__ import annotations

import json

import httpx
import pytest

from aip_crewai.client import MAX_FRAME_BYTES, AipClient
from aip_crewai.contracts.sidecar import MAX_OUTPUT_BYTES
from aip_crewai.sse import SSEFrameTooLarge, encode_event


def _client_streaming(frame_data: str) -> AipClient:
    body = encode_event(frame_data, event="result", id="sse_1")

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream"})

    client = AipClient("http://host.test", token="t")
    client.http = httpx.Client(base_url="http://host.test", transport=httpx.MockTransport(answer))
    return client


def test_a_result_with_the_largest_output_is_read_whole() -> None:
    output = {"raw": "x" * (MAX_OUTPUT_BYTES - 64)}
    envelope = {"message_type": "aip.core.v1.action_result", "body": {"action_result": {"output": output}}}
    events = list(_client_streaming(json.dumps(envelope)).follow("act_1"))
    assert [event for event, _ in events] == ["result"]
    assert events[0][1]["body"]["action_result"]["output"] == output


def test_a_frame_past_the_bound_is_refused_typed() -> None:
    with pytest.raises(SSEFrameTooLarge):
        list(_client_streaming("x" * (MAX_FRAME_BYTES + 1)).follow("act_1"))
