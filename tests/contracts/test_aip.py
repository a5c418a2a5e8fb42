"""AIP envelopes: externally tagged bodies, exact field names."""

import msgspec
import pytest

from aip_crewai.contracts import aip

BASE = {
    "aip_version": "1.0",
    "message_type": "aip.core.v1.action",
    "message_id": "msg_1",
    "sent_at": "2026-11-29T00:00:00Z",
}


def decode(value):
    return msgspec.json.decode(msgspec.json.encode(value), type=aip.Envelope)


def test_action_envelope_round_trip():
    env = decode(
        {**BASE, "body": {"action": {"id": "act_1", "capability_id": "cap:crewai:c", "input": {"a": 1}}}, "from": "svc"}
    )
    assert env.body.action.input == {"a": 1} and env.from_ == "svc"
    assert msgspec.json.decode(msgspec.json.encode(env))["from"] == "svc"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"action": None},
        {"action": {"id": "a", "capability_id": "c"}, "error": {"code": "x", "message": "m", "category": "auth"}},
    ],
)
def test_body_must_hold_exactly_one_key(body):
    with pytest.raises(msgspec.ValidationError):
        decode({**BASE, "body": body})


def test_message_type_must_match_body():
    with pytest.raises(msgspec.ValidationError):
        decode(
            {**BASE, "message_type": "aip.core.v1.action_result", "body": {"action": {"id": "a", "capability_id": "c"}}}
        )


def test_unknown_envelope_fields_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode({**BASE, "body": {"action": {"id": "a", "capability_id": "c"}}, "surprise": 1})


def test_message_parts_are_tagged_by_type():
    result = aip.ActionResult(
        action_id="a", status="completed", message=[aip.TextPart(text="hi"), aip.JsonPart(data=[1])]
    )
    assert msgspec.json.decode(msgspec.json.encode(result))["message"] == [
        {"type": "text", "text": "hi"},
        {"type": "json", "data": [1]},
    ]


@pytest.mark.parametrize("action_id", ["résumé-2", "a b", "a/b", ""])
def test_action_ids_are_visible_ascii_without_slash(action_id):
    with pytest.raises(msgspec.ValidationError):
        decode({**BASE, "body": {"action": {"id": action_id, "capability_id": "cap:crewai:c"}}})
