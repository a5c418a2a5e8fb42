"""Numbers in query strings and ``Last-Event-ID`` are ASCII digits: ``str.isdigit`` also takes ``²`` (a 500 when
``int()`` refused it) and ``٣`` (read as 3); both are a typed 400 now."""

from __future__ import annotations

import pytest
from kits.hostapp import action_env, bearer, post_message

OTHER_DIGITS = ["%C2%B2", "%D9%A3"]  # "²" (superscript two), "٣" (Arabic-Indic three)


@pytest.mark.parametrize("digit", OTHER_DIGITS)
async def test_a_number_in_another_script_is_a_typed_400_on_every_query(client, digit):
    pending = await post_message(client, "acme-invoker", action_env("msg_q", "act_q", "cap:crewai:alpha", {}, "k-q"))
    assert pending.status_code == 202, pending.text
    asked = {
        f"/aip/v1/approvals?limit={digit}": "acme-both",
        f"/aip/v1/approvals/events?cursor=apv_{digit}": "acme-both",
        f"/aip/v1/webhooks/deliveries?limit={digit}": "acme-operator",
        f"/aip/v1/actions/act_q/chunks?cursor={digit}": "acme-invoker",
    }
    for path, who in asked.items():
        answer = await client.get(path, headers=bearer(who))
        assert answer.status_code == 400, (path, answer.status_code, answer.text[:200])
        assert answer.json()["body"]["error"]["error"]["code"], path
