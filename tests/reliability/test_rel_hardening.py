"""Security hardening (issue 16): each finding of the independent review, replayed against the real
host and sidecar on loopback. The README's "Security" section lists each bound tested here.

Error bodies are read through :func:`error_code` only, so a change of the error envelope's layout
adapts in one place; the tests assert statuses, error codes and stored state.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from chaoslib import uid
from relkit import post_action

pytestmark = [pytest.mark.integration]


def error_code(response: httpx.Response) -> str | None:
    """The ``ProtocolError.code`` of an AIP error answer, whatever envelope carries it
    (``{"body": {"error": …}}`` or ``{"error": {"error": …}}``); None when there is none."""
    try:
        data: Any = response.json()
    except ValueError:
        return None
    for path in (("body", "error"), ("error", "error"), ("error",)):
        node = data
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get("code"), str):
            return node["code"]
    return None


def action_result(response: httpx.Response) -> dict[str, Any]:
    return response.json()["body"]["action_result"]  # type: ignore[no-any-return]


# --- 1. idempotency reservations only for admitted requests -------------------------------------


@pytest.mark.timeout(60)
def test_rel_a_refused_request_leaves_its_idempotency_key_free(stack):
    """Regression (item 1): a request refused with 409 (its action id taken) reserved its key, and a later
    request with that key and input got the OTHER action's result, with no approval and no execution."""
    _, _, host = stack
    taken, fresh, key = uid("h1-taken"), uid("h1-fresh"), uid("h1-key")
    with host.client("acme-app") as app:
        first = post_action(app, "cap:crewai:echo", {"topic": "first"}, taken, uid("h1-other"))
        assert first.status_code == 202 and action_result(first)["status"] == "pending_approval"
        refused = post_action(app, "cap:crewai:echo", {"topic": "second"}, taken, key)
        assert refused.status_code == 409 and error_code(refused) == "action.idempotency_conflict"
        again = post_action(app, "cap:crewai:echo", {"topic": "second"}, fresh, key)
        assert again.status_code == 202
        result = action_result(again)
        assert result["action_id"] == fresh and result["status"] == "pending_approval"
        assert result["approval"]["approval_id"] != action_result(first)["approval"]["approval_id"]
        assert app.get(f"/aip/v1/actions/{fresh}").json()["status"] == "pending_approval"
        replay = post_action(app, "cap:crewai:echo", {"topic": "second"}, uid("h1-third"), key)
        assert replay.status_code == 202 and action_result(replay)["action_id"] == fresh
