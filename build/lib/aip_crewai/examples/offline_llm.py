"""A deterministic offline LLM and embedder for tests and the demo (no network).

:class:`OfflineLLM` behaves like a streaming provider to CrewAI: each call
emits ``LLMCallStartedEvent``, ``chunks_per_answer`` ``LLMStreamChunkEvent``\\ s
and ``LLMCallCompletedEvent`` inside ``llm_call_context()`` (as
``crewai/llm.py`` does), carrying ``from_task``/``from_agent`` so chunks are
attributed to the right task and agent. Answers are derived from the prompt
only:

- with ``response_model`` (converters, train/test evaluators): an instance of
  that pydantic model built field by field (numbers ``8``/``8.0``, strings
  ``"offline <field>"``, one-item lists, first enum/literal value);
- with native ``tools`` and no tool result yet: one tool call of the first
  tool (arguments derived from its JSON schema), streamed on the tool channel;
  after a tool result: a plain final answer quoting it;
- a knowledge query-rewrite prompt (``The original query is: ...``): that
  query, verbatim;
- otherwise ReAct text ``Thought: ...\\nFinal Answer: <model>: <task line>``
  where the task line is the interpolated ``Current Task:`` of the prompt.

Knobs: ``chunks_per_answer`` (>= 1), ``delay_ms`` per chunk (``time.sleep``
in ``call``, ``asyncio.sleep`` in ``acall``: a deliberately slow fake),
``fail`` (raise ``RuntimeError`` whose text holds :data:`FAKE_SECRET`, to prove
provider text never reaches clients; the ``LLMCallFailedEvent`` carries only
the exception class name). Before every model call (and between
chunks) the sidecar's cooperative cancel check runs. If the environment
variable ``AIP_CREWAI_TEST_CALL_LOG`` names a file, one line per model call is
appended to it (``<unix time> <pid> <model> <action id>``; the action id of
the sidecar job making the call, percent-encoded, or ``-``), so other
processes can count calls, per action too.

:class:`OfflineEmbedder` is a hashed bag-of-words embedder (257 dims) for
knowledge sources: use :func:`offline_embedder`, which wraps
it as ``CustomProvider(embedding_callable=OfflineEmbedder)`` (a dict spec
``{"provider": "custom", ...}`` fails CrewAI's validation).
:func:`crew_knowledge` builds crew knowledge in a collection of its own, on a
storage whose async search works (:class:`ThreadedKnowledgeStorage`).

Source: ARCHITECTURE.md §2 (offline demo crews), ARCHITECTURE.md §5 (offline LLM).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import os
import re
import threading
import time
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
from crewai.events.types.llm_events import LLMCallType
from crewai.knowledge.knowledge import Knowledge
from crewai.knowledge.source.string_knowledge_source import StringKnowledgeSource
from crewai.knowledge.storage.knowledge_storage import KnowledgeStorage
from crewai.llms.base_llm import BaseLLM, llm_call_context
from crewai.rag.embeddings.providers.custom import CustomProvider
from crewai.rag.embeddings.providers.custom.embedding_callable import (
    CustomEmbeddingFunction,
)
from pydantic import BaseModel

from aip_crewai.sidecar.operations._common import check_cancelled, current_job

FAKE_SECRET = "sk-test-SECRET-7f3a9c"
CALL_LOG_ENV = "AIP_CREWAI_TEST_CALL_LOG"
_TASK_LINE = re.compile(r"Current Task:\s*(.+?)(?:\n\s*\n|\nThis is the expected|$)", re.S)
_REWRITE_QUERY = re.compile(r"The original query is:\s*(.+?)(?:\n\s*\n|$)", re.S)
_call_log_lock = threading.Lock()


class OfflineLLM(BaseLLM):
    """Deterministic, natively async, streaming fake LLM.

    Args:
        model: model name shown in events and answers (default
            ``"offline-echo"``; must be non-empty).
        chunks_per_answer: number of stream chunks per answer, >= 1.
        delay_ms: sleep before each chunk, milliseconds.
        fail: raise ``RuntimeError`` (containing :data:`FAKE_SECRET`) on every
            call.
        uninterruptible: no cancel check between chunks (a provider call
            blocked in flight: it answers in full after a cancel).
    """

    llm_type: str = "offline"
    chunks_per_answer: int = 3
    delay_ms: float = 0.0
    fail: bool = False
    uninterruptible: bool = False

    def __init__(self, **data: Any) -> None:
        data.setdefault("model", "offline-echo")
        data.setdefault("provider", "offline")
        if int(data.get("chunks_per_answer", 3)) < 1:
            raise ValueError("chunks_per_answer must be >= 1")
        super().__init__(**data)

    # -- capability flags ---------------------------------------------------

    def supports_function_calling(self) -> bool:
        return True

    def supports_stop_words(self) -> bool:
        return True

    def get_context_window_size(self) -> int:
        return 32768

    # -- calls ----------------------------------------------------------------

    def call(
        self,
        messages: Any,
        tools: list[dict[str, Any]] | None = None,
        callbacks: list[Any] | None = None,
        available_functions: dict[str, Any] | None = None,
        from_task: Any = None,
        from_agent: Any = None,
        response_model: type[BaseModel] | None = None,
    ) -> Any:
        """Answer synchronously; sleeps ``delay_ms`` before each chunk."""
        check_cancelled()
        self._log_call()
        with llm_call_context():
            self._emit_call_started_event(
                messages=messages,
                tools=tools,
                callbacks=callbacks,
                available_functions=available_functions,
                from_task=from_task,
                from_agent=from_agent,
            )
            try:
                reply = self._reply(messages, tools, response_model)
                for piece in reply.pieces:
                    if self.delay_ms:
                        time.sleep(self.delay_ms / 1000)
                    if not self.uninterruptible:
                        check_cancelled()
                    self._emit_piece(piece, reply, from_task, from_agent)
            except BaseException as exc:
                self._emit_call_failed_event(error=type(exc).__name__, from_task=from_task, from_agent=from_agent)
                raise
            return self._finish(reply, messages, from_task, from_agent)

    async def acall(
        self,
        messages: Any,
        tools: list[dict[str, Any]] | None = None,
        callbacks: list[Any] | None = None,
        available_functions: dict[str, Any] | None = None,
        from_task: Any = None,
        from_agent: Any = None,
        response_model: type[BaseModel] | None = None,
    ) -> Any:
        """Answer natively async; ``await asyncio.sleep`` before each chunk."""
        check_cancelled()
        self._log_call()
        with llm_call_context():
            self._emit_call_started_event(
                messages=messages,
                tools=tools,
                callbacks=callbacks,
                available_functions=available_functions,
                from_task=from_task,
                from_agent=from_agent,
            )
            try:
                reply = self._reply(messages, tools, response_model)
                for piece in reply.pieces:
                    if self.delay_ms:
                        await asyncio.sleep(self.delay_ms / 1000)
                    if not self.uninterruptible:
                        check_cancelled()
                    self._emit_piece(piece, reply, from_task, from_agent)
            except BaseException as exc:
                self._emit_call_failed_event(error=type(exc).__name__, from_task=from_task, from_agent=from_agent)
                raise
            return self._finish(reply, messages, from_task, from_agent)

    # -- internals --------------------------------------------------------------

    def _reply(
        self,
        messages: Any,
        tools: list[dict[str, Any]] | None,
        response_model: type[BaseModel] | None,
    ) -> _Reply:
        if self.fail:
            raise RuntimeError(f"offline provider rejected the request (api_key={FAKE_SECRET})")
        text = _prompt_text(messages)
        subject = _subject(text)
        if response_model is not None:
            data = fake_model_data(response_model)
            body = json.dumps(data)
            return _Reply(self, body, response_model.model_validate(data), None)
        if tools and not _has_tool_result(messages):
            call = _tool_call(tools[0], subject)
            return _Reply(self, call["function"]["arguments"], [call], call)
        if tools:
            body = f"{self.model}: {subject} (tool said: {_last_tool_result(messages)})"
            return _Reply(self, body, body, None)
        rewrite = _REWRITE_QUERY.search(text)
        if rewrite and "Current Task:" not in text:
            body = " ".join(rewrite.group(1).split())[:300] or subject
            return _Reply(self, body, body, None)
        answer = f"{self.model}: {subject}"
        body = f"Thought: I now know the final answer\nFinal Answer: {answer}"
        if len(body) < self.chunks_per_answer:
            body += " ." * ((self.chunks_per_answer - len(body)) // 2 + 1)
        return _Reply(self, body, body, None)

    def _emit_piece(self, piece: str, reply: _Reply, from_task: Any, from_agent: Any) -> None:
        tool_call = None
        call_type = LLMCallType.LLM_CALL
        if reply.tool_call is not None:
            call_type = LLMCallType.TOOL_CALL
            tool_call = {
                "id": reply.tool_call["id"],
                "type": "function",
                "index": 0,
                "function": {
                    "name": reply.tool_call["function"]["name"],
                    "arguments": piece,
                },
            }
        self._emit_stream_chunk_event(
            chunk=piece,
            from_task=from_task,
            from_agent=from_agent,
            tool_call=tool_call,
            call_type=call_type,
        )

    def _finish(self, reply: _Reply, messages: Any, from_task: Any, from_agent: Any) -> Any:
        prompt_tokens = len(_prompt_text(messages).split())
        completion_tokens = len(reply.body.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        self._track_token_usage_internal(usage)
        self._emit_call_completed_event(
            response=reply.body,
            call_type=LLMCallType.TOOL_CALL if reply.tool_call else LLMCallType.LLM_CALL,
            from_task=from_task,
            from_agent=from_agent,
            messages=messages,
            usage=usage,
        )
        return reply.result

    def _log_call(self) -> None:
        path = os.environ.get(CALL_LOG_ENV)
        if not path:
            return
        job = current_job()
        # 4th column: the sidecar job's action id (percent-encoded, "-" outside a job),
        # so tests count executions per action across processes.
        action = quote(job.action_id, safe=":") if job is not None else "-"
        line = f"{time.time():.6f} {os.getpid()} {self.model} {action}\n"
        with _call_log_lock, open(path, "a", encoding="utf-8") as fh:
            fh.write(line)


class _Reply:
    """One planned answer: the streamed body, its pieces and the return value."""

    def __init__(self, llm: OfflineLLM, body: str, result: Any, tool_call: Any) -> None:
        self.body = body
        self.result = result
        self.tool_call = tool_call
        self.pieces = split_chunks(body, llm.chunks_per_answer)


def split_chunks(text: str, n: int) -> list[str]:
    """Split ``text`` into ``n`` contiguous, non-empty pieces (fewer if too short)."""
    n = max(1, min(n, len(text) or 1))
    bounds = [len(text) * i // n for i in range(n + 1)]
    return [text[bounds[i] : bounds[i + 1]] for i in range(n)]


def _prompt_text(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    parts: list[str] = []
    for message in messages or []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(b.get("text", "")) for b in content if isinstance(b, Mapping))
    return "\n".join(parts)


def _subject(text: str) -> str:
    """The interpolated task line of a prompt (the last ``Current Task:``), or its tail."""
    matches = _TASK_LINE.findall(text)
    raw = matches[-1] if matches else text[-200:]
    return " ".join(raw.split())[:300] or "(empty prompt)"


def _has_tool_result(messages: Any) -> bool:
    return isinstance(messages, list) and any(isinstance(m, Mapping) and m.get("role") == "tool" for m in messages)


def _last_tool_result(messages: Any) -> str:
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "tool":
            return " ".join(str(message.get("content", "")).split())[:200]
    return ""


def _tool_call(tool: Mapping[str, Any], subject: str) -> dict[str, Any]:
    function = tool.get("function", tool)
    name = str(function.get("name", "tool"))
    properties = (function.get("parameters") or {}).get("properties") or {}
    args = {key: _schema_value(schema, subject) for key, schema in properties.items()}
    digest = hashlib.sha256(f"{name}:{subject}".encode()).hexdigest()[:12]
    return {
        "id": f"call_offline_{digest}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _schema_value(schema: Any, subject: str) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    return {"integer": 8, "number": 8.0, "boolean": True, "array": [subject], "object": {}}.get(str(kind), subject)


def fake_model_data(model: type[BaseModel]) -> dict[str, Any]:
    """Build deterministic field values that validate against ``model``.

    Args:
        model: a pydantic model class.

    Returns:
        A dict with one value per field (numbers 8/8.0, ``"offline <name>"``
        strings, one-element lists, first enum/literal value, nested models).
    """
    return {name: _fake_value(field.annotation, name, 0) for name, field in model.model_fields.items()}


def _fake_value(annotation: Any, name: str, depth: int) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return None
    if origin is typing.Annotated:
        return _fake_value(args[0], name, depth)
    if origin is typing.Union or origin is types.UnionType:
        choices = [a for a in args if a is not type(None)]
        return _fake_value(choices[0], name, depth) if choices else None
    if origin is typing.Literal:
        return args[0]
    if origin in (list, set, frozenset, Sequence) or origin is typing.Sequence:
        return [_fake_value(args[0] if args else str, name, depth + 1)]
    if origin is tuple:
        return [_fake_value(a, name, depth + 1) for a in args if a is not Ellipsis]
    if origin in (dict, Mapping):
        value_type = args[1] if len(args) == 2 else str
        return {"key": _fake_value(value_type, name, depth + 1)}
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return (
                {}
                if depth > 4
                else {n: _fake_value(f.annotation, n, depth + 1) for n, f in annotation.model_fields.items()}
            )
        if issubclass(annotation, enum.Enum):
            return next(iter(annotation)).value
        if issubclass(annotation, bool):
            return True
        if issubclass(annotation, int):
            return 8
        if issubclass(annotation, float):
            return 8.0
    return f"offline {name}"


class OfflineEmbedder(CustomEmbeddingFunction):
    """Hashed bag-of-words embedding, deterministic, offline.

    Words are lower-cased ``\\w+`` tokens; each adds 1 to the bucket given by
    the first 4 bytes of its SHA-256 (256 buckets, L2-normalized). One extra
    dimension holds ``+0.8`` for documents and ``-0.8`` for queries (Chroma
    embeds queries through ``embed_query``). Why: CrewAI scores a hit as
    ``1 - cosine_distance / 2``, so a text sharing no word with the query
    would still score 0.5, above the default threshold 0.35; with the offset
    it scores about 0.30, while a query sharing a fair part of its words
    (bag-of-words cosine above about 0.15) scores above 0.35.
    """

    BUCKETS = 256
    OFFSET = 0.8

    def __init__(self, **_config: Any) -> None:
        super().__init__()

    def __call__(self, input: Sequence[str]) -> list[np.ndarray[Any, Any]]:  # noqa: A002
        return [embed_text(text, self.OFFSET) for text in _texts(input)]

    def embed_query(self, input: Sequence[str]) -> list[np.ndarray[Any, Any]]:  # noqa: A002
        return [embed_text(text, -self.OFFSET) for text in _texts(input)]

    @staticmethod
    def name() -> str:
        return "aip-crewai-offline"

    def is_legacy(self) -> bool:
        """Tell Chroma to store no embedder config (else it warns and falls back)."""
        return True


def _texts(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def embed_text(text: str, offset: float) -> np.ndarray[Any, Any]:
    """Embed one text: 256 normalized word buckets plus the ``offset`` dimension."""
    buckets = OfflineEmbedder.BUCKETS
    vector = np.zeros(buckets + 1, dtype=np.float32)
    for word in re.findall(r"\w+", text.lower()):
        bucket = int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big")
        vector[bucket % buckets] += 1.0
    norm = float(np.linalg.norm(vector))
    if norm > 0.0:
        vector /= norm
    vector[buckets] = offset
    return vector


def offline_embedder() -> CustomProvider:
    """Return the crew ``embedder`` value for :class:`OfflineEmbedder`."""
    return CustomProvider(embedding_callable=OfflineEmbedder)


class ThreadedKnowledgeStorage(KnowledgeStorage):
    """KnowledgeStorage whose async methods run the sync ones in a worker thread.

    CrewAI's default Chroma client is synchronous, and ``KnowledgeStorage.asearch``
    then fails ("requires an AsyncClientAPI"), logs, and returns ``[]``: under
    ``akickoff`` agents would silently get no knowledge.
    """

    async def asearch(
        self,
        query: list[str],
        limit: int = 5,
        metadata_filter: dict[str, Any] | None = None,
        score_threshold: float = 0.6,
    ) -> list[Any]:
        return await asyncio.to_thread(self.search, query, limit, metadata_filter, score_threshold)

    async def asave(self, documents: list[str]) -> None:
        await asyncio.to_thread(self.save, documents)

    async def areset(self) -> None:
        await asyncio.to_thread(self.reset)


def crew_knowledge(collection_name: str, texts: Sequence[str], embedder: Any) -> Knowledge:
    """Build crew knowledge from plain texts in its own Chroma collection.

    Args:
        collection_name: stored as ``knowledge_<collection_name>``; give each
            crew its own (CrewAI's ``knowledge_sources=`` puts every crew in
            ``knowledge_crew``, so crews would read and reset each other's).
        texts: one ``StringKnowledgeSource`` per text, embedded now (upsert).
        embedder: crew embedder spec (e.g. :func:`offline_embedder`); None
            means CrewAI's default (networked) embedder.

    Returns:
        A ``Knowledge`` for ``Crew(knowledge=..., embedder=...)``.
    """
    storage = ThreadedKnowledgeStorage(embedder=embedder, collection_name=collection_name)
    knowledge = Knowledge(
        collection_name=collection_name,
        sources=[StringKnowledgeSource(content=text) for text in texts],
        embedder=embedder,
        storage=storage,
    )
    knowledge.add_sources()
    return knowledge
