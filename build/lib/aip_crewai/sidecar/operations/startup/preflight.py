"""Start-up check of every registered crew: problems a job would only meet later.

Each crew is built once, as a job would build it, before the sidecar
reports ready, in a namespace of its own (:data:`PREFLIGHT_TENANT`, a name
no job's tenant can have) whose memory directory and crew knowledge
collection are removed afterwards: the check leaves no crew state. The
problems found are published per crew in ``GET /health`` (``crew_problems``),
beside each crew's inputs (``crew_inputs``, see :class:`Preflight`), and logged once (``crew_unusable``, crew id and codes only). A crew with a
problem stays registered: its jobs fail with the same typed error at their
start (``crew_checks.refuse_unusable_crew``), before any model call.

Codes:

- ``llm_unconfigured``: an agent (or the manager) uses a CrewAI model
  without an API key (``crew_checks.unconfigured_llms``); jobs fail
  ``LlmUnconfigured`` with ``uncertain_outcome: false`` before any model call.
- ``knowledge_unavailable``: the crew declares ``knowledge_sources`` but
  CrewAI could not build its knowledge (a broken embedder, no provider key
  for the default one); CrewAI itself would only print the error and run
  without retrieval.
- ``memory_unavailable``: the crew has CrewAI memory whose embedder cannot
  embed (``crew_checks.unavailable_memory``); CrewAI would only emit the failure
  and run without recall; jobs fail ``MemoryUnavailable``.
- ``human_input``: a task has ``human_input=True`` (the sidecar never reads
  standard input).
- ``build_failed``: the factory raised, or returned no crew (the error text
  is withheld: it can hold secrets).

Source: docs/security.md ("Tenant-scoped crew state": knowledge, human input);
ARCHITECTURE.md §4 (``/health``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from crewai.knowledge.storage.knowledge_storage import KnowledgeStorage

from aip_crewai.sidecar.operations.knowledge_query import knowledge_namespace, namespace_storage_dir
from aip_crewai.sidecar.operations.startup.crew_checks import (
    unavailable_knowledge,
    unavailable_memory,
    unconfigured_llms,
)
from aip_crewai.sidecar.registry import CrewSource
from aip_crewai.sidecar.tenancy import namespace_key

#: The tenant the preflight builds crews for: a job's tenant never contains ``:`` (``tenancy.tenant_of``).
PREFLIGHT_TENANT = "preflight:"

log = structlog.get_logger("aip_crewai.sidecar")


#: At most this many input names are reported per crew (the host's input bound is 512 properties).
MAX_REPORTED_INPUTS = 512
#: Longest input name reported, characters (longer placeholders are left out).
MAX_INPUT_NAME_CHARS = 256


@dataclass(frozen=True)
class Preflight:
    """What the start-up check found, per crew id.

    Attributes:
        problems: ``{crew_id: [code, ...]}`` for crews with a problem (codes
            in the order of the module docstring); others are absent.
        inputs: ``{crew_id: {"placeholders": [name, ...], "defaults": bool,
            "memory_domains": [target, ...]}}`` for every crew that could be
            built: the ``{name}`` placeholders of its tasks' and agents' texts
            (``Crew.fetch_inputs``), sorted, whether it has
            ``before_kickoff_callbacks`` (which may fill missing inputs, so the
            placeholders are then optional), and the ``memory_reset`` targets
            it has (:func:`memory_domains`).
    """

    problems: dict[str, list[str]] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)


def preflight(registry: Mapping[str, CrewSource]) -> Preflight:
    """Build each crew once; report its problems and its inputs. Never raises for a crew's own failure.

    Args:
        registry: crew id -> source (``registry.load_registry``).
    """
    result = Preflight()
    for crew_id in sorted(registry):
        found, inputs = check(registry[crew_id])
        if found:
            result.problems[crew_id] = found
            log.warning("crew_unusable", crew_id=crew_id, problems=found)
        if inputs is not None:
            result.inputs[crew_id] = inputs
    return result


def crew_problems(registry: Mapping[str, CrewSource]) -> dict[str, list[str]]:
    """:attr:`Preflight.problems` of :func:`preflight`."""
    return preflight(registry).problems


def check(source: CrewSource) -> tuple[list[str], dict[str, Any] | None]:
    """The problem codes of one crew (``[]`` if none) and its inputs (None when it cannot be built)."""
    crew: Any = None
    try:
        with knowledge_namespace(source.crew_id, PREFLIGHT_TENANT):
            crew = source.new_crew()
            found = []
            if unconfigured_llms(crew):
                found.append("llm_unconfigured")
            if unavailable_knowledge(crew):
                found.append("knowledge_unavailable")
            if unavailable_memory(crew):
                found.append("memory_unavailable")
            if any(getattr(task, "human_input", False) for task in getattr(crew, "tasks", None) or []):
                found.append("human_input")
            return found, crew_inputs(crew)
    except Exception as exc:  # noqa: BLE001 - a crew author's error; its text can hold secrets
        log.warning("crew_build_failed", crew_id=source.crew_id, error_type=type(exc).__name__)
        return ["build_failed"], None
    finally:
        _forget(source.crew_id, crew)


def crew_inputs(crew: Any) -> dict[str, Any]:
    """``{"placeholders": [name, ...], "defaults": bool, "memory_domains": [target, ...]}`` of a crew
    (see :class:`Preflight`)."""
    fetch = getattr(crew, "fetch_inputs", None)
    names = sorted(n for n in (fetch() if callable(fetch) else ()) if 0 < len(n) <= MAX_INPUT_NAME_CHARS)
    return {
        "placeholders": names[:MAX_REPORTED_INPUTS],
        "defaults": bool(getattr(crew, "before_kickoff_callbacks", None)),
        "memory_domains": memory_domains(crew),
    }


def memory_domains(crew: Any) -> list[str]:
    """The ``memory_reset`` targets a job of this crew would find initialized, in
    ``memory_reset.TARGETS`` order: ``memory`` (CrewAI memory), ``kickoff_outputs`` (the replay table),
    ``knowledge`` (crew or agent knowledge declared), ``agent_knowledge`` (an agent declares
    ``knowledge_sources``: a reset builds it first). Declared sources count even where building them failed
    (``knowledge_unavailable`` says so): the host refuses only what the crew provably lacks."""
    agent_knowledge = any(
        getattr(a, "knowledge", None) is not None or getattr(a, "knowledge_sources", None)
        for a in getattr(crew, "agents", None) or []
    )
    found = {
        "memory": getattr(crew, "_memory", None) is not None,
        "kickoff_outputs": getattr(crew, "_task_output_handler", None) is not None,
        "knowledge": getattr(crew, "knowledge", None) is not None
        or bool(getattr(crew, "knowledge_sources", None))
        or agent_knowledge,
        "agent_knowledge": agent_knowledge,
    }
    return [target for target in ("memory", "kickoff_outputs", "knowledge", "agent_knowledge") if found[target]]


def _forget(crew_id: str, crew: Any) -> None:
    """Remove what building ``crew`` in the preflight namespace stored (best effort)."""
    storage = getattr(getattr(crew, "knowledge", None), "storage", None)
    if isinstance(storage, KnowledgeStorage):
        try:
            storage.reset()
        except Exception as exc:  # noqa: BLE001 - a broken store is what the preflight reports
            log.debug("preflight_knowledge_not_removed", crew_id=crew_id, error_type=type(exc).__name__)
    shutil.rmtree(namespace_storage_dir(namespace_key(PREFLIGHT_TENANT, crew_id)), ignore_errors=True)
