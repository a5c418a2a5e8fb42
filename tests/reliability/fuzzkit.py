"""Hypothesis strategies and checks for hostile input against the apps in-process.

:func:`host_requests` draws requests for every host route: action envelopes
for every operation of the catalogue (plausible and hostile inputs: wrong
types, huge and deep values, control characters, unknown fields, odd action
ids and keys), mutated envelopes, raw bodies, odd headers, cursors and
``Last-Event-ID`` values. :func:`sidecar_requests` does the same for the
sidecar contract. :func:`check_answer` states the invariant: never a 5xx,
always a well-formed body (an AIP error envelope, JSON, or an SSE stream),
never a hang (``relkit.AppThread`` raises ``Deadline``).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from aip_crewai.contracts.operations import OPERATION_NAMES
from aip_crewai.sse import SSEDecoder

_text = st.text(max_size=24)
_odd_text = st.one_of(
    _text,
    st.sampled_from(
        [
            "",
            " ",
            "a?b",
            "a#b",
            "a%2Fb",
            "a/b",
            "..",
            "\u00e9\u2603",
            "\x00",
            "x\n",
            "\ud7ff",
            "sha256:" + "0" * 64,
            "a" * 300,
            "msg_" + "z" * 10,
            "\u2028",
            "\ufeff",
        ]
    ),
)
_ints = st.one_of(
    st.integers(-3, 200), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 100, 101, 100000, 2**53 + 1])
)
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False, allow_infinity=False), _odd_text)
_json = st.recursive(
    _scalars,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(_text, kids, max_size=3)),
    max_leaves=12,
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A plausible value, or anything at all."""
    return st.one_of(value, value, _json)


#: Placeholder for a deeply nested value (json.dumps cannot encode one that deep).
DEEP = "__deep_nesting__"


def encode(value: Any, depth: int, *, ascii_only: bool = True) -> bytes:
    """JSON of ``value`` with :data:`DEEP` replaced by ``depth`` nested arrays."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode("utf-8", "surrogatepass")


_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "run": {"topic": _odd_text},
    "status": {"run_action_id": _odd_text},
    "events": {"run_action_id": _odd_text, "cursor": _ints},
    "cancel": {"run_action_id": _odd_text, "reason": _odd_text},
    "batch_run": {"inputs": st.lists(st.dictionaries(_text, _scalars, max_size=2), max_size=3)},
    "replay": {"task_id": _odd_text, "inputs": st.dictionaries(_text, _scalars, max_size=2)},
    "train": {
        "n_iterations": _ints,
        "artifact_name": _odd_text,
        "inputs": st.dictionaries(_text, _scalars, max_size=2),
    },
    "test": {"n_iterations": _ints, "eval_llm": _odd_text},
    "knowledge_query": {
        "query": st.lists(_odd_text, max_size=3),
        "results_limit": _ints,
        "score_threshold": st.one_of(st.floats(allow_nan=False, allow_infinity=False), _ints),
    },
    "memory_reset": {
        "command_type": st.one_of(
            st.sampled_from(["memory", "knowledge", "agent_knowledge", "kickoff_outputs", "all"]), _odd_text
        )
    },
}


@st.composite
def operation_input(draw: st.DrawFn, operation: str) -> Any:
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return draw(_json)
    if choice == 1:
        return DEEP  # replaced by a nesting of about msgspec's depth bound in the encoded body
    fields = _FIELDS[operation]
    value = {name: draw(_maybe(strategy)) for name, strategy in fields.items()}
    for name in list(value):
        if draw(st.integers(0, 4)) == 0:
            del value[name]
    if draw(st.integers(0, 4)) == 0:
        value[draw(_text)] = draw(_json)
    return value


_CREWS = ["beta", "alpha", "gamma", "nope"]


@st.composite
def action_envelope(draw: st.DrawFn) -> Any:
    operation = draw(st.sampled_from(sorted(OPERATION_NAMES)))
    crew = draw(st.sampled_from(_CREWS))
    capability = f"cap:crewai:{crew}" + ("" if operation == "run" else f":{operation}")
    if draw(st.integers(0, 7)) == 0:
        capability = draw(_odd_text)
    odd_id = draw(st.integers(0, 3)) == 0
    action: dict[str, Any] = {
        "id": draw(_odd_text) if odd_id else f"act_{draw(st.integers(0, 30))}",
        "capability_id": capability,
        "input": draw(operation_input(operation)),
    }
    if draw(st.integers(0, 3)) > 0:
        odd_key = draw(st.integers(0, 3)) == 0
        action["idempotency_key"] = draw(_odd_text) if odd_key else f"k{draw(st.integers(0, 5))}"
    for name, strategy in (("timeout_ms", _ints), ("mode", st.sampled_from(["stream", "sync", "x", ""]))):
        if draw(st.integers(0, 3)) == 0:
            action[name] = draw(_maybe(strategy))
    envelope: dict[str, Any] = {
        "aip_version": "1.0",
        "message_type": "aip.core.v1.action",
        "message_id": f"msg_{draw(st.integers(0, 10**9))}",
        "sent_at": draw(st.sampled_from(["2026-09-21T23:33:20.000Z", "2026-09-21T23:33:20Z"])),
        "body": {"action": action},
    }
    mutation = draw(st.integers(0, 15))  # most envelopes are well-formed, so the inputs reach the fences
    if mutation == 0:
        envelope["body"] = draw(_json)
    elif mutation == 1:
        envelope[draw(_text)] = draw(_json)
    elif mutation == 2:
        envelope["security"] = draw(
            st.one_of(
                _json,
                st.fixed_dictionaries(
                    {
                        "scheme": st.just("ed25519"),
                        "key_id": st.sampled_from(["globex-signer", "acme-approver", "nobody"]),
                        "signature": st.one_of(_odd_text, st.just("A" * 86)),
                    }
                ),
            )
        )
    elif mutation == 3:
        del envelope[draw(st.sampled_from(sorted(envelope)))]
    elif mutation == 4:
        envelope[draw(st.sampled_from(sorted(envelope)))] = draw(_json)
    elif mutation == 5:
        envelope["aip_version"] = draw(st.sampled_from(["2.0", "", "1"]))
        envelope["message_type"] = draw(st.sampled_from(["aip.core.v1.ack", "x", "aip.core.v1.action"]))
        envelope["message_id"] = draw(_odd_text)
        envelope["sent_at"] = draw(st.sampled_from(["yesterday", "", "2026-13-40T99:99:99Z"]))
    if draw(st.integers(0, 3)) == 0:
        envelope["idempotency_key"] = draw(st.one_of(st.just(action.get("idempotency_key", "k0")), _odd_text))
    return envelope


def _declared(usual: str) -> st.SearchStrategy[str]:
    """A body's ``Content-Type``: mostly ``usual`` (so the body is parsed), sometimes with parameters, another
    type or empty (a 415 before the body is read)."""
    return st.sampled_from([usual] * 6 + [f"{usual}; charset=utf-8", "text/plain", ""])


_PRINCIPALS = ["tok-acme-invoker", "tok-acme-operator", "tok-acme-both", "tok-globex-invoker", "tok-closed-invoker"]


@st.composite
def host_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, Any]]:
    """``(method, url, httpx request kwargs)`` for one host request."""
    token = draw(
        st.sampled_from(["tok-acme-invoker"] * 8 + ["tok-acme-both"] * 3 + _PRINCIPALS + ["", "x", "tok-acme-invoker "])
    )
    headers: dict[str, str] = {"Authorization": f"Bearer {token}"} if token else {}
    if draw(st.booleans()):
        headers["Accept"] = draw(st.sampled_from(["text/event-stream", "application/json", "*/*"]))
    if draw(st.integers(0, 3)) == 0:
        headers["Last-Event-ID"] = draw(st.one_of(st.just(f"sse_{draw(st.integers(-2, 12))}"), _ascii_header()))
    route = draw(st.integers(0, 9))
    action_id = draw(st.one_of(st.just(f"act_{draw(st.integers(0, 30))}"), _path_text()))
    if route <= 4:
        envelope = draw(action_envelope())
        if draw(st.integers(0, 9)) == 0:
            content = draw(st.one_of(st.binary(max_size=64), st.just(b"[" * 5000 + b"]" * 5000)))
        else:
            content = encode(envelope, draw(st.integers(990, 1100)), ascii_only=draw(st.booleans()))
        headers["Content-Type"] = draw(_declared("application/aip+json"))
        return "POST", "/aip/v1/messages", {"content": content, "headers": headers}
    if route == 5:
        suffix = draw(st.sampled_from(["", "/result", "/events", "/chunks"]))
        params = (
            {"cursor": draw(st.one_of(_ascii_header(), st.integers(-5, 2**40).map(str)))} if draw(st.booleans()) else {}
        )
        return "GET", f"/aip/v1/actions/{action_id}{suffix}", {"headers": headers, "params": params}
    if route == 6:
        return "POST", f"/aip/v1/actions/{action_id}/cancel", {"headers": headers}
    if route == 7:
        params = {
            k: draw(_ascii_header())
            for k in draw(st.lists(st.sampled_from(["status", "cursor", "limit"]), max_size=3, unique=True))
        }
        approval = draw(st.one_of(st.just(""), _path_text().map(lambda t: "/" + t)))
        return "GET", f"/aip/v1/approvals{approval}", {"headers": headers, "params": params}
    if route == 8:
        body = draw(
            st.one_of(
                _json,
                st.fixed_dictionaries(
                    {"decision": st.sampled_from(["approved", "denied", "maybe"]), "reason": _odd_text}
                ),
            )
        )
        headers["Content-Type"] = draw(_declared("application/json"))
        return (
            "POST",
            f"/aip/v1/approvals/{draw(_path_text())}/decision",
            {"content": json.dumps(body).encode("utf-8", "surrogatepass"), "headers": headers},
        )
    path = draw(
        st.sampled_from(
            ["/aip/v1/manifest", "/aip/v1/capabilities", "/metrics", "/health", "/ready", "/aip/v1/nowhere"]
        )
    )
    return draw(st.sampled_from(["GET", "POST", "DELETE"])), path, {"headers": headers}


def _ascii_header() -> st.SearchStrategy[str]:
    return st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20)


def _path_text() -> st.SearchStrategy[str]:
    from urllib.parse import quote

    return _odd_text.filter(lambda t: t != "").map(lambda t: quote(t, safe=""))


def check_answer(request: tuple[str, str, dict[str, Any]], status: int, headers: Any, content: bytes) -> None:
    """Never a 5xx; JSON bodies decode; SSE bodies are whole frames of JSON; errors carry a code."""
    method, url, _ = request
    assert status < 500 or (url == "/ready" and status == 503), f"{method} {url} -> {status}: {content[:300]!r}"
    ctype = headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        decoder = SSEDecoder()
        events = decoder.feed(content)
        decoder.close()
        for event in events:
            json.loads(event.data)
        return
    if not content or not (ctype.startswith("application/aip+json") or ctype.startswith("application/json")):
        return  # e.g. GET /metrics with an operator token: Prometheus text
    body = json.loads(content)
    if status >= 400 and ctype.startswith("application/aip+json"):
        assert body["body"]["error"]["error"]["code"], body


@st.composite
def sidecar_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, Any]]:
    """``(method, url, kwargs)`` for the sidecar contract (authenticated, fake crews that finish at once)."""
    operation = draw(st.sampled_from(sorted(OPERATION_NAMES)))
    crew = draw(st.sampled_from(["echo", "failing", "safe", "nope", ""]))
    job_id = draw(st.one_of(st.just(f"job-{draw(st.integers(0, 20))}"), _odd_text))
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        headers["Idempotency-Key"] = draw(st.one_of(st.just("k"), _ascii_header()))
    if draw(st.booleans()):
        headers["X-AIP-Action-ID"] = draw(_ascii_header())
    if draw(st.integers(0, 3)) == 0:
        headers["Last-Event-ID"] = draw(_ascii_header())
    route = draw(st.integers(0, 6))
    if route <= 2:
        body: Any = {
            "crew_id": crew,
            "action_id": job_id,
            "operation": operation,
            "input": draw(operation_input(operation)),
        }
        if draw(st.integers(0, 3)) == 0:
            body["timeout_ms"] = draw(_maybe(_ints))
        if draw(st.integers(0, 5)) == 0:
            body = draw(_json)
        content = encode(body, draw(st.integers(990, 1100)))
        if draw(st.integers(0, 9)) == 0:
            content = draw(st.one_of(st.binary(max_size=64), st.just(b"[" * 5000 + b"]" * 5000)))
        headers["Content-Type"] = draw(_declared("application/json"))
        return "POST", draw(st.sampled_from(["/jobs", "/jobs/stream"])), {"content": content, "headers": headers}
    path_id = draw(_path_text())
    if route == 3:
        headers["Accept"] = draw(st.sampled_from(["text/event-stream", "application/json"]))
        params = (
            {"cursor": draw(st.one_of(_ascii_header(), st.integers(-5, 2**40).map(str)))} if draw(st.booleans()) else {}
        )
        return "GET", f"/jobs/{path_id}{draw(st.sampled_from(['', '/events']))}", {"headers": headers, "params": params}
    if route == 4:
        body = draw(
            st.one_of(
                _json,
                st.fixed_dictionaries({"crew_id": st.just(crew), "action_id": st.just(job_id), "reason": _odd_text}),
            )
        )
        headers["Content-Type"] = draw(_declared("application/json"))
        return (
            "POST",
            f"/jobs/{path_id}/cancel",
            {"content": json.dumps(body).encode("utf-8", "surrogatepass"), "headers": headers},
        )
    if route == 5:
        headers["X-AIP-Archive-Confirmation"] = draw(_ascii_header())
        return "DELETE", f"/jobs/{path_id}", {"headers": headers}
    return (
        draw(st.sampled_from(["GET", "POST"])),
        draw(st.sampled_from(["/health", "/metrics", "/nowhere"])),
        {"headers": headers},
    )


def check_sidecar_answer(request: tuple[str, str, dict[str, Any]], status: int, headers: Any, content: bytes) -> None:
    method, url, _ = request
    # ARCHITECTURE.md §4: 502 a failed blocking job, 504 a wait past its timeout, 507 a full journal; never a 500
    assert status < 500 or status in (502, 504, 507), f"{method} {url} -> {status}: {content[:300]!r}"
    if status == 502:  # the generic message, never the provider's text
        assert b"sk-live" not in content and json.loads(content)["status"] == "failed", content[:300]
    ctype = headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        decoder = SSEDecoder()
        for event in decoder.feed(content):
            json.loads(event.data)
        return
    if ctype.startswith("application/json") and content:
        body = json.loads(content)
        if status >= 400:
            assert isinstance(body.get("detail"), str), body
