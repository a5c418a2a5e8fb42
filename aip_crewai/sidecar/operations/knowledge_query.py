"""Operation ``knowledge_query``: search the crew-level knowledge (read-only).

Input ``{query: [str], results_limit=3, score_threshold=0.35}``; output
``{"results": [...]}``: CrewAI's ``SearchResult`` dicts (``{id, content,
metadata, score}``) each passed through ``to_bounded_json``; CrewAI's None
("the crew has no knowledge") becomes ``[]``.

- The SYNC ``Crew.query_knowledge`` runs in a worker thread:
  ``aquery_knowledge`` silently returns ``[]`` with the default synchronous
  Chroma client (``KnowledgeStorage.asearch`` swallows the TypeError).
- Isolation: CrewAI names knowledge collections by fixed strings: ``"crew"``
  for every crew's ``knowledge_sources`` (``crew.py::create_crew_knowledge``)
  and the agent role for agent knowledge (``agent/core.py::set_knowledge``),
  so all crews of a storage dir share ``knowledge_crew`` (a query could
  return another crew's texts, a reset would clear them). Inside
  :func:`knowledge_namespace` every ``Knowledge`` built gets a collection
  private to the crew id, through CrewAI's storage-factory seam
  (``knowledge/storage/factory.py::set_knowledge_storage_factory``) and a
  contextvar, so concurrent jobs of different crews never meet. The crew is
  built inside the namespace (CrewAI embeds crew knowledge at construction).

Source: ARCHITECTURE.md §3 (knowledge_query input), §4 (outputs), §5 (CrewAI
knowledge).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from crewai.knowledge.storage import factory as storage_factory
from crewai.knowledge.storage.knowledge_storage import KnowledgeStorage

from aip_crewai.sidecar.context import JobContext
from aip_crewai.sidecar.operations._common import job_scope, to_bounded_json
from aip_crewai.sidecar.registry import CrewSource

_namespace: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "aip_crewai_knowledge_namespace", default=None
)
_previous_factory: Any = None


def private_collection_name(crew_id: str, collection_name: str | None) -> str:
    """A Chroma-safe collection name owned by one crew id.

    Returns:
        ``aip_<16 hex of sha256(crew_id)>_<8 hex of sha256(collection_name)>``
        (CrewAI prefixes ``knowledge_``: 38 characters, within Chroma's 3..63;
        distinct crew ids or names give distinct collections).
    """
    crew_part = hashlib.sha256(crew_id.encode("utf-8")).hexdigest()[:16]
    name_part = hashlib.sha256((collection_name or "").encode("utf-8")).hexdigest()[:8]
    return f"aip_{crew_part}_{name_part}"


def _namespaced_storage(embedder: Any, collection_name: str | None) -> Any:
    """CrewAI knowledge-storage factory: private names inside a namespace."""
    crew_id = _namespace.get()
    if crew_id is None:
        return _previous_factory(embedder, collection_name) if _previous_factory else None
    name = private_collection_name(crew_id, collection_name)
    if _previous_factory is not None:
        custom = _previous_factory(embedder, name)
        if custom is not None:
            return custom
    return KnowledgeStorage(embedder=embedder, collection_name=name)


def install_knowledge_namespacing() -> None:
    """Register :func:`_namespaced_storage` as CrewAI's storage factory (idempotent).

    A factory registered earlier is kept and called with the private name;
    one registered later replaces ours (the namespacing then stops).
    """
    global _previous_factory
    current = storage_factory._factory  # CrewAI offers a setter only; read its slot
    if current is _namespaced_storage:
        return
    _previous_factory = current
    storage_factory.set_knowledge_storage_factory(_namespaced_storage)


install_knowledge_namespacing()


@contextmanager
def knowledge_namespace(crew_id: str) -> Iterator[None]:
    """Build every ``Knowledge`` of this context in collections private to ``crew_id``.

    Follows ``asyncio.to_thread`` and tasks started inside (a contextvar).
    Re-entering with the same crew id is harmless.
    """
    token = _namespace.set(crew_id)
    try:
        yield
    finally:
        _namespace.reset(token)


async def execute(source: CrewSource, input: dict[str, Any], ctx: JobContext) -> dict[str, Any]:
    """Query the crew-level knowledge of a fresh crew.

    Args:
        source: the crew source.
        input: ``{"query": [str, ...], "results_limit"?: 1..100 (default 3),
            "score_threshold"?: 0..1 (default 0.35)}``.
        ctx: the job context.

    Returns:
        ``{"results": [{"id", "content", "metadata", "score"}, ...]}``.

    Raises:
        Exception: CrewAI or embedder errors, unchanged.
    """
    query = [str(q) for q in input["query"]]
    results_limit = int(input.get("results_limit", 3))
    score_threshold = float(input.get("score_threshold", 0.35))
    with job_scope(ctx), knowledge_namespace(ctx.crew_id):
        results = await asyncio.to_thread(_query, source, query, results_limit, score_threshold)
    return {"results": [to_bounded_json(item) for item in results or []]}


def _query(source: CrewSource, query: list[str], limit: int, threshold: float) -> list[Any] | None:
    """Worker thread: build the crew (it embeds its sources), then search."""
    crew = source.new_crew()
    return crew.query_knowledge(query, results_limit=limit, score_threshold=threshold)
