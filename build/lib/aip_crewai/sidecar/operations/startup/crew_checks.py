"""The crew checks: what makes a registered crew unusable before its first model call.

The start-up preflight (:mod:`~aip_crewai.sidecar.operations.startup.preflight`) runs them once per crew
and publishes what they find (``crew_problems`` in ``GET /health``); every job runs them again at its
start (:func:`refuse_unusable_crew`, or the ones its operation needs), failing with a typed error and
``before_any_effect`` before any model call:

- human input: a task has ``human_input=True`` (:func:`refuse_human_input`, ``HumanInputUnsupported``);
- models: a CrewAI model without an API key (:func:`unconfigured_llms`, ``LlmUnconfigured``);
- knowledge: declared ``knowledge_sources`` CrewAI could not build or search (:func:`unavailable_knowledge`,
  ``KnowledgeUnavailable``; :func:`strict_search` is CrewAI's knowledge search without its catch-all,
  also used by ``knowledge_query``);
- memory: CrewAI memory whose embedder cannot embed (:func:`unavailable_memory`, ``MemoryUnavailable``).

No error text of an embedder or provider is ever published (it can hold secrets): the codes say it all.

Source: docs/security.md ("Tenant-scoped crew state": start-up preflight, knowledge, human input).
"""

from __future__ import annotations

from typing import Any

from crewai.knowledge.storage.knowledge_storage import KnowledgeStorage

from aip_crewai.sidecar.jobs.context import SafeJobError

#: Published when a crew asks for human input (the sidecar never reads standard input).

HUMAN_INPUT_MESSAGE = (
    "a task of this crew asks for human input (human_input=True); the sidecar has no human "
    "to ask and never reads standard input"
)


def refuse_human_input(crew: Any) -> None:
    """Fail a job whose crew has a ``human_input=True`` task, before any model call.

    Raises:
        SafeJobError: ``HumanInputUnsupported``, naming the 1-based task positions.

    Source: docs/security.md ("Tenant-scoped crew state": human input).
    """
    positions = [
        i for i, task in enumerate(getattr(crew, "tasks", None) or [], start=1) if getattr(task, "human_input", False)
    ]
    if positions:
        raise SafeJobError(
            f"{HUMAN_INPUT_MESSAGE} (task {', '.join(map(str, positions))})",
            error_type="HumanInputUnsupported",
            before_any_effect=True,
        )


#: Published when knowledge cannot be used (never the embedder's text: it can hold secrets).
KNOWLEDGE_UNAVAILABLE = (
    "the crew's knowledge cannot be used (its embedder or storage failed to initialise or "
    "to search); the error text is withheld"
)


def unavailable_knowledge(crew: Any) -> list[str]:
    """Where a crew declares knowledge that CrewAI could not build.

    CrewAI builds crew knowledge at construction and only *prints* a failure
    (``crew.py::create_crew_knowledge``: "Failed to init knowledge: <error>",
    ``crew.knowledge`` then None or left without its sources), and its
    search turns every error into no results; a kickoff then runs without
    retrieval. So a crew with ``knowledge_sources`` is probed: one strict
    search (:func:`strict_search`, one embedding of :data:`KNOWLEDGE_PROBE`
    by the crew's embedder).

    Returns:
        ``["crew"]`` when ``knowledge_sources`` is set and the crew has no
        knowledge storage or the probe raises, else ``[]``.

    Source: docs/security.md ("Tenant-scoped crew state": knowledge).
    """
    if not getattr(crew, "knowledge_sources", None):
        return []
    storage = getattr(getattr(crew, "knowledge", None), "storage", None)
    if storage is None:
        return ["crew"]
    if isinstance(storage, KnowledgeStorage):
        try:
            strict_search(storage, [KNOWLEDGE_PROBE], 1, 0.0)
        except Exception:  # noqa: BLE001 - the text can hold secrets; the code says it all
            return ["crew"]
    return []


#: The query of the knowledge probe (one embedding of the crew's embedder).
KNOWLEDGE_PROBE = "knowledge probe"


def strict_search(
    storage: KnowledgeStorage,
    query: list[str],
    limit: int,
    threshold: float,
    metadata_filter: dict[str, Any] | None = None,
) -> list[Any]:
    """``KnowledgeStorage.search`` of CrewAI 1.15.5 without its catch-all ``except`` (same arguments).

    Raises:
        ValueError: ``query`` is empty.
        Exception: the embedder's or the vector store's error, unchanged.
    """
    if not query:
        raise ValueError("Query cannot be empty")
    name = f"knowledge_{storage.collection_name}" if storage.collection_name else "knowledge"
    text = " ".join(query) if len(query) > 1 else query[0]
    results: list[Any] = storage._get_client().search(
        collection_name=name, query=text, limit=limit, metadata_filter=metadata_filter, score_threshold=threshold
    )
    return results


def refuse_unavailable_knowledge(crew: Any) -> None:
    """Fail a job whose crew's knowledge could not be built, before any model call.

    Raises:
        SafeJobError: ``KnowledgeUnavailable`` with :data:`KNOWLEDGE_UNAVAILABLE`.
    """
    if unavailable_knowledge(crew):
        raise SafeJobError(KNOWLEDGE_UNAVAILABLE, error_type="KnowledgeUnavailable", before_any_effect=True)


#: Published when memory cannot be used (never the embedder's text).
MEMORY_UNAVAILABLE = (
    "the crew's memory cannot be used (its embedder failed to initialise or to embed); the error text is withheld"
)
#: The text of the memory probe (one embedding by the memory's embedder).
MEMORY_PROBE = "memory probe"


def unavailable_memory(crew: Any) -> bool:
    """Whether the crew has CrewAI memory (``memory=True`` or a ``Memory``) whose embedder cannot embed.

    CrewAI builds the memory's embedder lazily, on the first recall or save,
    and a failure there is only emitted (``Memory*FailedEvent``) while the
    run goes on; so the embedder is built and asked for one embedding of
    :data:`MEMORY_PROBE` (``memory/unified_memory.py::Memory._embedder``).
    """
    memory = getattr(crew, "_memory", None)
    if memory is None or not hasattr(type(memory), "_embedder"):
        return False
    from crewai.memory.types import embed_text

    try:
        return not embed_text(memory._embedder, MEMORY_PROBE)
    except Exception:  # noqa: BLE001 - the text can hold secrets; the code says it all
        return True


def refuse_unusable_crew(crew: Any) -> None:
    """:func:`refuse_human_input`, :func:`refuse_unconfigured_llms`,
    :func:`refuse_unavailable_knowledge` and an unusable memory, in that order.

    Raises:
        SafeJobError: ``HumanInputUnsupported``, ``LlmUnconfigured``, ``KnowledgeUnavailable`` or
            ``MemoryUnavailable``.
    """
    refuse_human_input(crew)
    refuse_unconfigured_llms(crew)
    refuse_unavailable_knowledge(crew)
    if unavailable_memory(crew):
        raise SafeJobError(MEMORY_UNAVAILABLE, error_type="MemoryUnavailable", before_any_effect=True)


# ------------------------------------------------------------------- model configuration

#: Modules of CrewAI's own LLM classes, whose ``api_key`` it fills from the provider's variable.
_CREWAI_LLM_MODULES = ("crewai.llms.providers.", "crewai.llm")


def unconfigured_llms(crew: Any) -> list[str]:
    """Where a crew uses a CrewAI model that has no API key (e.g. ``gpt-4o-mini`` without ``OPENAI_API_KEY``).

    Only CrewAI's own LLM classes are checked (a custom ``BaseLLM``, such as
    the offline test model, configures itself): one whose ``api_key`` field
    is empty could only fail at its first call, after an approval.

    Returns:
        ``["<where>: <provider>/<model>"]`` (``agent '<role>'``, ``manager``),
        in crew order; ``[]`` when every model has a key.

    Source: docs/security.md ("Tenant-scoped crew state": start-up preflight).
    """
    found = []
    slots = [
        (f"agent {getattr(a, 'role', '?')!r}", getattr(a, "llm", None)) for a in getattr(crew, "agents", None) or []
    ]
    slots.append(("manager", getattr(crew, "manager_llm", None)))  # function_calling_llm: deprecated, not read
    for where, llm in slots:
        module = type(llm).__module__
        if (
            llm is None
            or not module.startswith(_CREWAI_LLM_MODULES)
            or "api_key" not in getattr(type(llm), "model_fields", {})
        ):
            continue
        if not getattr(llm, "api_key", None):
            found.append(f"{where}: {getattr(llm, 'provider', None) or '?'}/{getattr(llm, 'model', '?')}")
    return found


def refuse_unconfigured_llms(crew: Any) -> None:
    """Fail a job whose crew uses a CrewAI model without an API key, before any model call.

    Raises:
        SafeJobError: ``LlmUnconfigured`` naming the models (never a key), ``before_any_effect``.
    """
    missing = unconfigured_llms(crew)
    if missing:
        raise SafeJobError(
            f"no API key is configured for {'; '.join(missing)} (set the provider's key variable "
            "in the sidecar's environment, e.g. OPENAI_API_KEY)",
            error_type="LlmUnconfigured",
            before_any_effect=True,
        )
