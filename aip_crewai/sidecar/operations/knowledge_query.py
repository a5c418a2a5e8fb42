"""Operation ``knowledge_query``: search the crew-level knowledge (read-only).

Input ``{query: [str], results_limit=3, score_threshold=0.35}``; output
``{"results": [...]}``: CrewAI's ``SearchResult`` dicts (``{id, content,
metadata, score}``) each passed through ``to_bounded_json``; CrewAI's None
("the crew has no knowledge") becomes ``[]``.

- The SYNC ``Crew.query_knowledge`` runs in a worker thread: CrewAI's own
  ``aquery_knowledge`` returns ``[]`` with the default synchronous Chroma
  client (``KnowledgeStorage.asearch`` swallows the TypeError); every
  ``Knowledge`` built while the sidecar runs gets a :class:`JobKnowledgeStorage`,
  whose async search works (the same cause broke knowledge inside runs).
- Isolation: CrewAI names knowledge collections by fixed strings: ``"crew"``
  for every crew's ``knowledge_sources`` (``crew.py::create_crew_knowledge``)
  and the agent role for agent knowledge (``agent/core.py::set_knowledge``),
  so all crews of a storage dir share ``knowledge_crew`` (a query could
  return another crew's texts, a reset would clear them). Inside
  :func:`knowledge_namespace` every ``Knowledge`` built gets a collection
  private to the ``(tenant, crew id)`` pair, through CrewAI's storage-factory
  seam (``knowledge/storage/factory.py::set_knowledge_storage_factory``) and a
  contextvar, so concurrent jobs of different crews or tenants never meet.
  The crew is built inside the namespace (CrewAI embeds crew knowledge at
  construction).
- Memory: CrewAI keys crew memory by crew *name* only, in one LanceDB table
  of the storage dir (``<storage>/memory``; ``crew.py::create_crew_memory``).
  Inside the same namespace every ``Memory`` built with the default
  ``storage="lancedb"`` gets its own LanceDB directory
  ``<state dir>/namespaces/<32 hex of the namespace>/memory`` through CrewAI's
  memory-storage factory (``memory/storage/factory.py``), so two tenants
  routed to one crew never recall, nor reset, each other's memories. A
  ``Memory`` object the registry module built outside any job (a module
  global) cannot be namespaced: build memory inside the crew factory.

Source: ARCHITECTURE.md §3 (knowledge_query input), §4 (outputs), §5 (CrewAI
knowledge); docs/security.md ("Tenant-scoped crew state").
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crewai.knowledge.storage import factory as storage_factory
from crewai.knowledge.storage.knowledge_storage import KnowledgeStorage
from crewai.memory.storage import factory as memory_factory
from crewai_core.paths import db_storage_path

from aip_crewai.sidecar.crewai_env import namespaces_dir
from aip_crewai.sidecar.jobs.context import JobContext, SafeJobError
from aip_crewai.sidecar.operations._common import job_scope, to_bounded_json
from aip_crewai.sidecar.operations.startup.crew_checks import KNOWLEDGE_UNAVAILABLE, strict_search
from aip_crewai.sidecar.registry import CrewSource
from aip_crewai.sidecar.tenancy import DEFAULT_TENANT, namespace_key, private_collection_name

_namespace: contextvars.ContextVar[str | None] = contextvars.ContextVar("aip_crewai_knowledge_namespace", default=None)
_previous_factory: Any = None
_previous_memory_factory: Any = None


def namespace_storage_dir(namespace: str) -> Path:
    """Directory private to one namespace (created 0700 on use): its memory, and a job's ``TMPDIR``.

    Beside CrewAI's storage (``<state dir>/crewai``), not in it: a worker is granted the shared storage
    and only its own namespace directory (``isolation/sandbox.py``).

    Returns:
        ``<state dir>/namespaces/<32 hex of sha256(namespace)>``.
    """
    digest = hashlib.sha256(namespace.encode("utf-8")).hexdigest()[:32]
    return namespaces_dir(Path(db_storage_path()).parent) / digest


class JobKnowledgeStorage(KnowledgeStorage):
    """CrewAI's Chroma knowledge storage whose searches work inside ``akickoff`` and never fail silently.

    Root cause (CrewAI 1.15.5): an agent's knowledge retrieval under
    ``akickoff`` awaits ``Knowledge.aquery`` -> ``KnowledgeStorage.asearch`` ->
    ``ChromaDBClient.asearch``, which needs an ``AsyncClientAPI``; but
    ``KnowledgeStorage`` always builds a synchronous ``PersistentClient``
    (``rag/chromadb/factory.py::create_client``), so every async search raised
    ``TypeError("Asynchronous method asearch() requires an AsyncClientAPI")``,
    which ``asearch`` logged (a traceback on the root logger) and turned into
    "no results": the run went on without its knowledge. Here ``asearch``
    runs the synchronous search in a worker thread when the client is
    synchronous (``asyncio.to_thread`` carries the job's contextvars), and both
    searches raise instead of returning ``[]`` (``crew_checks.strict_search``):
    CrewAI then emits ``KnowledgeSearchQueryFailedEvent``, which fails the job
    (``_swallowed``).
    """

    def search(
        self,
        query: list[str],
        limit: int = 5,
        metadata_filter: dict[str, Any] | None = None,
        score_threshold: float = 0.6,
    ) -> list[Any]:
        return strict_search(self, query, limit, score_threshold, metadata_filter)

    async def asearch(
        self,
        query: list[str],
        limit: int = 5,
        metadata_filter: dict[str, Any] | None = None,
        score_threshold: float = 0.6,
    ) -> list[Any]:
        from crewai.rag.chromadb.utils import _is_async_client

        client = getattr(self._get_client(), "client", None)
        if client is not None and _is_async_client(client):
            name = f"knowledge_{self.collection_name}" if self.collection_name else "knowledge"
            text = " ".join(query) if len(query) > 1 else (query[0] if query else "")
            if not text:
                raise ValueError("Query cannot be empty")
            results: list[Any] = await self._get_client().asearch(
                collection_name=name,
                query=text,
                limit=limit,
                metadata_filter=metadata_filter,
                score_threshold=score_threshold,
            )
            return results
        return await asyncio.to_thread(self.search, query, limit, metadata_filter, score_threshold)


def _namespaced_storage(embedder: Any, collection_name: str | None) -> Any:
    """CrewAI knowledge-storage factory: a :class:`JobKnowledgeStorage`, its name private inside a namespace.

    A factory registered before ours is asked first (with the private name); its storage is used as it is.
    """
    namespace = _namespace.get()
    name = private_collection_name(namespace, collection_name) if namespace is not None else collection_name
    if _previous_factory is not None:
        custom = _previous_factory(embedder, name)
        if custom is not None:
            return custom
    return JobKnowledgeStorage(embedder=embedder, collection_name=name)


def _namespaced_memory(spec: str) -> Any:
    """CrewAI memory-storage factory: a private LanceDB directory inside a namespace.

    Only the default spec ``"lancedb"`` is redirected; any other spec (a
    path, ``qdrant-edge``) is the crew author's explicit choice and is left
    to CrewAI (or to a factory registered before ours).
    """
    namespace = _namespace.get()
    if namespace is not None and spec == "lancedb":
        from crewai.memory.storage.lancedb_storage import LanceDBStorage

        directory = namespace_storage_dir(namespace)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return LanceDBStorage(path=directory / "memory")
    return _previous_memory_factory(spec) if _previous_memory_factory is not None else None


def install_knowledge_namespacing() -> None:
    """Register :func:`_namespaced_storage` and :func:`_namespaced_memory` as
    CrewAI's knowledge and memory storage factories (idempotent).

    A factory registered earlier is kept and called (with the private name
    for knowledge); one registered later replaces ours (the namespacing then
    stops).
    """
    global _previous_factory, _previous_memory_factory
    current = storage_factory._factory  # CrewAI offers a setter only; read its slot
    if current is not _namespaced_storage:
        _previous_factory = current
        storage_factory.set_knowledge_storage_factory(_namespaced_storage)
    current_memory = memory_factory._factory
    if current_memory is not _namespaced_memory:
        _previous_memory_factory = current_memory
        memory_factory.set_memory_storage_factory(_namespaced_memory)


install_knowledge_namespacing()


@contextmanager
def knowledge_namespace(crew_id: str, tenant: str = DEFAULT_TENANT) -> Iterator[None]:
    """Build every ``Knowledge`` and ``Memory`` of this context private to ``(tenant, crew_id)``.

    Follows ``asyncio.to_thread`` and tasks started inside (a contextvar).
    Re-entering with the same pair is harmless.

    Args:
        crew_id: the registry crew id.
        tenant: the job's tenant (``JobContext.tenant``; ``""`` the default tenant).
    """
    token = _namespace.set(namespace_key(tenant, crew_id))
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
        SafeJobError: ``KnowledgeUnavailable``: the crew declares knowledge
            that cannot be built or searched (fixed message).
        Exception: other CrewAI errors, unchanged.
    """
    query = [str(q) for q in input["query"]]
    results_limit = int(input.get("results_limit", 3))
    score_threshold = float(input.get("score_threshold", 0.35))
    with job_scope(ctx), knowledge_namespace(ctx.crew_id, ctx.tenant):
        results = await asyncio.to_thread(_query, source, query, results_limit, score_threshold)
    return {"results": [to_bounded_json(item) for item in results or []]}


def _query(source: CrewSource, query: list[str], limit: int, threshold: float) -> list[Any] | None:
    """Worker thread: build the crew (it embeds its sources), then search strictly.

    CrewAI turns every knowledge failure into "no results": a failed
    ``Knowledge`` construction is only printed (``crew.py::create_crew_knowledge``,
    exception text included) and ``KnowledgeStorage.search`` logs the
    exception and returns ``[]``. So a crew that declares ``knowledge_sources``
    but has no ``knowledge`` is unavailable, and the search runs without
    CrewAI's catch-all (``crew_checks.strict_search``).

    Raises:
        SafeJobError: ``KnowledgeUnavailable``, with a fixed message.
    """
    crew = source.job_crew()
    storage = getattr(getattr(crew, "knowledge", None), "storage", None)
    if storage is None and getattr(crew, "knowledge_sources", None):
        raise SafeJobError(KNOWLEDGE_UNAVAILABLE, error_type="KnowledgeUnavailable", before_any_effect=True)
    if not isinstance(storage, KnowledgeStorage):
        found: list[Any] | None = crew.query_knowledge(query, results_limit=limit, score_threshold=threshold)
        return found
    try:
        return strict_search(storage, query, limit, threshold)
    except Exception as exc:
        raise SafeJobError(KNOWLEDGE_UNAVAILABLE, error_type="KnowledgeUnavailable", before_any_effect=True) from exc
