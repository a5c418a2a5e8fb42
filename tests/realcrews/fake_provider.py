"""A fake OpenAI-compatible provider on loopback (chat completions, streaming, tool calls, embeddings).

:class:`FakeProvider` serves ``POST /v1/chat/completions`` (a JSON completion,
or with ``"stream": true`` the same answer as server-sent ``chat.completion.chunk``
events, one per :attr:`Answer.pieces` piece, then ``data: [DONE]``) and
``POST /v1/embeddings`` (deterministic vectors: a hashed bag of words, so texts
that share words are near). Every request body is recorded (:meth:`requests`)
so a test can assert that a fact reached a prompt.

Answers are scripted by marker (:meth:`script`): the first rule whose marker
occurs in the request's messages answers, taking its answers in order and
repeating the last one. :meth:`fail_next` answers the next matching chat
request with an HTTP status (e.g. 429 once); :meth:`refuse` closes the
listening socket, so connections are refused until :meth:`accept` again.

Plain stdlib (``http.server`` in a thread): it runs in the test process, and
the sidecar's workers reach it on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Dimensions of the fake embeddings.
EMBEDDING_DIMENSIONS = 64
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Answer:
    """One scripted chat answer: text (sent in ``pieces`` when streamed) or tool calls."""

    text: str = ""
    pieces: tuple[str, ...] = ()
    tool_calls: tuple[tuple[str, dict[str, Any]], ...] = ()

    def chunks(self) -> tuple[str, ...]:
        return self.pieces or ((self.text,) if self.text else ())


def text(value: str, *pieces: str) -> Answer:
    """A text answer; streamed as ``pieces`` when given (they must join to ``value``)."""
    if pieces and "".join(pieces) != value:
        raise ValueError("the pieces must join to the answer")
    return Answer(text=value, pieces=tuple(pieces))


def tool_call(name: str, **arguments: Any) -> Answer:
    """An answer asking for one native tool call."""
    return Answer(tool_calls=((name, arguments),))


Marker = str | tuple[str, ...]


def _matches(marker: Marker, value: str) -> bool:
    """Whether ``value`` holds the marker (every part of a tuple marker)."""
    return all(part in value for part in ((marker,) if isinstance(marker, str) else marker))


@dataclass
class _Rule:
    marker: Marker
    answers: list[Answer]
    served: int = 0

    def next(self) -> Answer:
        answer = self.answers[min(self.served, len(self.answers) - 1)]
        self.served += 1
        return answer


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    rules: list[_Rule] = field(default_factory=list)
    failures: list[tuple[str, Marker, int, str]] = field(default_factory=list)  # (path, marker, status, message)
    requests: list[dict[str, Any]] = field(default_factory=list)


def embed(value: str) -> list[float]:
    """The fake embedding of ``value``: a normalised hashed bag of lower-case words."""
    vector = [0.0] * EMBEDDING_DIMENSIONS
    for word in _WORD.findall(value.lower()):
        digest = hashlib.sha256(word.encode()).digest()
        vector[digest[0] % EMBEDDING_DIMENSIONS] += 1.0 if digest[1] % 2 else -1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def request_text(body: dict[str, Any]) -> str:
    """What markers are looked for in: a chat request's messages, an embeddings request's inputs."""
    inputs = body.get("input")
    if inputs is not None:
        return "\n".join([inputs] if isinstance(inputs, str) else [str(v) for v in inputs])
    return message_text(body)


def message_text(body: dict[str, Any]) -> str:
    """Every message content of a chat request, joined (string and list-of-parts contents)."""
    out = []
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "\n".join(out)


class FakeProvider:
    """The provider (see the module docstring). ``base_url`` ends in ``/v1``."""

    def __init__(self) -> None:
        self._state = _State()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # ------------------------------------------------------------- life

    def start(self) -> FakeProvider:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self._state))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-provider", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def refuse(self) -> None:
        """Close the listening socket: connections to :attr:`base_url` are refused."""
        self.stop()

    def accept(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            self.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # ------------------------------------------------------------- script

    def script(self, marker: Marker, *answers: Answer) -> None:
        """Answer chat requests whose messages contain ``marker`` (all its parts) with ``answers`` in order
        (the last repeats). The rule scripted last is tried first."""
        with self._state.lock:
            self._state.rules.insert(0, _Rule(marker, list(answers)))

    def fail_next(
        self,
        marker: Marker,
        status: int,
        *,
        times: int = 1,
        path: str = "/v1/chat/completions",
        message: str = "scripted failure",
    ) -> None:
        """Answer the next ``times`` requests to ``path`` containing ``marker`` with HTTP ``status`` and an OpenAI
        error body whose message is ``message`` (some gateways quote the request's API key there)."""
        with self._state.lock:
            self._state.failures.extend([(path, marker, status, message)] * times)

    def requests(self, marker: str | None = None, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        """Recorded request bodies to ``path`` (with ``_path``, ``_status``), those containing ``marker``."""
        with self._state.lock:
            seen = list(self._state.requests)
        return [r for r in seen if r["_path"] == path and (marker is None or _matches(marker, request_text(r)))]


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            """Quiet."""

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            record = {**body, "_path": self.path, "_status": 200}
            if self.path not in ("/v1/embeddings", "/v1/chat/completions"):
                return self._json(404, {"error": {"message": "not found", "type": "invalid_request_error"}})
            prompt = request_text(body)
            with state.lock:
                failure = next((f for f in state.failures if f[0] == self.path and _matches(f[1], prompt)), None)
                if failure is not None:
                    state.failures.remove(failure)
                    record["_status"] = failure[2]
                rule = next((r for r in state.rules if _matches(r.marker, prompt)), None)
                answer = rule.next() if rule and failure is None and "messages" in body else None
                state.requests.append(record)
            if failure is not None:
                return self._json(
                    failure[2],
                    {"error": {"message": failure[3], "type": "server_error"}},
                    {"retry-after-ms": "10", "retry-after": "0"},
                )
            if self.path == "/v1/embeddings":
                return self._embeddings(body)
            answer = answer or _default(body)
            if body.get("stream"):
                return self._stream(body, answer)
            return self._json(200, _completion(body, answer))

        def _embeddings(self, body: dict[str, Any]) -> None:
            inputs = body.get("input")
            items = [inputs] if isinstance(inputs, str) else list(inputs or [])
            data = [{"object": "embedding", "index": i, "embedding": embed(str(v))} for i, v in enumerate(items)]
            self._json(
                200,
                {
                    "object": "list",
                    "data": data,
                    "model": body.get("model", "fake-embed"),
                    "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
                },
            )

        def _json(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
            payload = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for key, header in (headers or {}).items():
                self.send_header(key, header)
            self.end_headers()
            self.wfile.write(payload)

        def _stream(self, body: dict[str, Any], answer: Answer) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            base = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
            }
            events: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
            events += [{"content": piece} for piece in answer.chunks()]
            for index, (name, arguments) in enumerate(answer.tool_calls):
                events.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": f"call_{index}",
                                "type": "function",
                                "function": {"name": name, "arguments": json.dumps(arguments)},
                            }
                        ]
                    }
                )
            for delta in events:
                self._event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            finish = "tool_calls" if answer.tool_calls else "stop"
            self._event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
            self._event({**base, "choices": [], "usage": _usage()})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, value: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(value).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def _usage() -> dict[str, int]:
    return {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def _completion(body: dict[str, Any], answer: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if answer.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(answer.tool_calls)
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if answer.tool_calls else "stop"}],
        "usage": _usage(),
    }


def _default(body: dict[str, Any]) -> Answer:
    """Without a matching rule: a structured request gets ``{}``-shaped JSON, any other a final answer."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
        return text("{}")
    return text("Thought: I can answer.\nFinal Answer: ok")
