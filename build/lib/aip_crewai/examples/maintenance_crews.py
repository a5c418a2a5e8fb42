"""Offline crews for the maintenance operations (registry ``aip_crewai.examples.maintenance_crews:CREWS``).

What ``train``/``test``/``knowledge_query``/``memory_reset`` need beyond the
basic test crews, built from :mod:`aip_crewai.examples.offline_llm` (offline LLM and
embedder, a new LLM per factory call) and the ``echo``/``slow`` crews of
:mod:`aip_crewai.examples.testing`.

Deployment options are carried by the registry entry (the factory) as a
mapping attribute ``aip_crewai_options`` (read by
``aip_crewai.sidecar.operations._maintenance.crew_option``):

- ``training_feedback`` (str): what the job-scoped human-input provider
  answers during ``train`` (CrewAI cannot train with an empty feedback).
- ``eval_llm``: a callable ``model name -> BaseLLM`` used by ``test``
  (here: always an :class:`OfflineLLM` named after the requested model).

| crew id | shape | options |
|---|---|---|
| ``trainable`` | ``echo`` | feedback, offline eval LLM |
| ``trainable_slow`` | ``slow`` (300 ms per chunk) | feedback, offline eval LLM |
| ``memory_a``/``memory_b`` | 1 agent, 1 task, ``memory=True`` (names ``maintenance-memory-a``/``-b``) | — |
| ``shared_knowledge_x``/``_y`` | crew ``knowledge_sources=`` (CrewAI's shared collection) | — |
| ``agent_knowledge`` | an agent with ``knowledge_sources`` | — |
| ``asks_human`` | ``echo`` with ``human_input=True`` on its second task | — |
| ``blocked_tool_user`` | 1 agent with the ``tally`` tool; its model calls take 3 s and ignore a cancel in flight | — |
| ``broken_knowledge`` | verbose; crew ``knowledge_sources`` with an embedder that always raises (its text holds ``FAKE_SECRET``) | — |
| ``variant`` | ``echo``; its two task texts swap places when the sidecar's environment has ``AIP_CREWAI_TEST_CREW_VARIANT=swapped`` (a crew definition change across a restart) | — |

Source: ARCHITECTURE.md §2 (offline demo crews).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from crewai import Agent, Crew, Task
from crewai.knowledge.source.string_knowledge_source import StringKnowledgeSource
from crewai.rag.embeddings.providers.custom import CustomProvider
from crewai.rag.embeddings.providers.custom.embedding_callable import CustomEmbeddingFunction
from crewai.tools import tool

from aip_crewai.examples.offline_llm import CALL_LOG_ENV, FAKE_SECRET, OfflineLLM, offline_embedder
from aip_crewai.examples.testing import TWO_TASKS, build_crew, echo, slow
from aip_crewai.sidecar.operations._common import current_job

TRAINING_FEEDBACK = "Name the topic in the first words of the answer."
SHARED_X_TEXT = "The Kestrel glacier moves forty metres every winter across the fjord."
SHARED_Y_TEXT = "The Marrow orchard grows quince and medlar trees beside the old mill."
AGENT_TEXT = "The Tamsin observatory tracks comets with a copper refractor telescope."


def offline_eval_llm(name: str) -> OfflineLLM:
    """The ``eval_llm`` option: an offline evaluator whatever the model name."""
    return OfflineLLM(model=name, chunks_per_answer=1)


def with_options(factory: Callable[[], Crew], **options: Any) -> Callable[[], Crew]:
    """Wrap ``factory`` so the registry entry carries ``aip_crewai_options``."""

    def make() -> Crew:
        return factory()

    make.__name__ = getattr(factory, "__name__", "crew")
    make.aip_crewai_options = dict(options)  # type: ignore[attr-defined]
    return make


def _default_topic(inputs: dict[str, Any] | None) -> dict[str, Any]:
    """``before_kickoff_callbacks`` entry: ``topic`` defaults to ``"maintenance"``."""
    return {"topic": "maintenance", **(inputs or {})}


def _single(name: str, *, memory: bool = False, **crew_kwargs: Any) -> Crew:
    llm = OfflineLLM(model=f"offline-{name}")
    agent_kwargs = crew_kwargs.pop("agent_kwargs", {})
    agent = Agent(
        role=f"{name} analyst",
        goal="Restate the request about {topic} faithfully.",
        backstory="A deterministic offline agent used in tests.",
        llm=llm,
        allow_delegation=False,
        verbose=False,
        max_iter=3,
        **agent_kwargs,
    )
    task = Task(description="Summarize {topic}.", expected_output="One line.", agent=agent)
    return Crew(
        name=name,
        agents=[agent],
        tasks=[task],
        memory=memory,
        embedder=crew_kwargs.pop("embedder", None) or offline_embedder(),
        verbose=crew_kwargs.pop("verbose", False),
        tracing=False,
        before_kickoff_callbacks=[_default_topic],
        **crew_kwargs,
    )


def memory_a() -> Crew:
    """Crew with unified memory (root scope ``/crew/maintenance-memory-a``)."""
    return _single("maintenance-memory-a", memory=True)


def memory_b() -> Crew:
    """Crew with unified memory (root scope ``/crew/maintenance-memory-b``)."""
    return _single("maintenance-memory-b", memory=True)


def shared_knowledge_x() -> Crew:
    """Crew knowledge through ``knowledge_sources=`` (CrewAI's collection ``crew``)."""
    return _single(
        "maintenance-knowledge-x",
        knowledge_sources=[StringKnowledgeSource(content=SHARED_X_TEXT)],
    )


def shared_knowledge_y() -> Crew:
    """Like :func:`shared_knowledge_x`, other text, same CrewAI collection name."""
    return _single(
        "maintenance-knowledge-y",
        knowledge_sources=[StringKnowledgeSource(content=SHARED_Y_TEXT)],
    )


def agent_knowledge() -> Crew:
    """An agent with its own ``knowledge_sources`` (no crew knowledge)."""
    return _single(
        "maintenance-agent-knowledge",
        agent_kwargs={"knowledge_sources": [StringKnowledgeSource(content=AGENT_TEXT)]},
    )


#: Environment variable switching :func:`variant` to its changed definition (tests only).
VARIANT_ENV = "AIP_CREWAI_TEST_CREW_VARIANT"


def variant() -> Crew:
    """The ``echo`` crew, or with its two task texts swapped (same task count, other order)."""
    texts = list(reversed(TWO_TASKS)) if os.environ.get(VARIANT_ENV) == "swapped" else list(TWO_TASKS)
    return build_crew(OfflineLLM(model="offline-variant", chunks_per_answer=1), texts)


@tool("tally")
def tally(text: str) -> str:
    """Count the words of a text (tests: each run appends ``<time> <pid> tool:tally <action id>`` to the call log)."""
    path = os.environ.get(CALL_LOG_ENV)
    if path:
        job = current_job()
        action = quote(job.action_id, safe=":") if job is not None else "-"
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{time.time():.6f} {os.getpid()} tool:tally {action}\n")
    return f"the text has {len(str(text).split())} words"


def blocked_tool_user() -> Crew:
    """A tool-using crew whose model calls (10 chunks x 300 ms) finish even after a cancel."""
    llm = OfflineLLM(model="offline-blocked-tools", chunks_per_answer=10, delay_ms=300, uninterruptible=True)
    return build_crew(llm, ["Count the words of the topic {topic}."], tools=[tally])


class BrokenEmbedder(CustomEmbeddingFunction):
    """An embedder that always fails, quoting a secret (as a provider error with a key would)."""

    def __init__(self, **_config: Any) -> None:
        pass

    def __call__(self, input: Any) -> Any:  # noqa: A002 - CrewAI's parameter name
        raise RuntimeError(f"embedding refused for key {FAKE_SECRET}")

    @staticmethod
    def name() -> str:
        return "broken"


def broken_knowledge() -> Crew:
    """Crew knowledge whose embedder cannot work: CrewAI alone answers "no results".

    Verbose, so CrewAI prints "Failed to init knowledge: <error with the secret>" to stdout."""
    return _single(
        "maintenance-broken-knowledge",
        knowledge_sources=[StringKnowledgeSource(content=SHARED_X_TEXT)],
        embedder=CustomProvider(embedding_callable=BrokenEmbedder),
        verbose=True,
    )


def asks_human() -> Crew:
    """The ``echo`` crew whose second task asks a human for feedback (``human_input=True``)."""
    crew = echo()
    crew.tasks[1].human_input = True
    return crew


_OPTIONS = {"training_feedback": TRAINING_FEEDBACK, "eval_llm": offline_eval_llm}

CREWS: dict[str, Any] = {
    "trainable": with_options(echo, **_OPTIONS),
    "trainable_slow": with_options(slow, **_OPTIONS),
    "memory_a": memory_a,
    "memory_b": memory_b,
    "shared_knowledge_x": shared_knowledge_x,
    "shared_knowledge_y": shared_knowledge_y,
    "agent_knowledge": agent_knowledge,
    "variant": variant,
    "asks_human": asks_human,
    "blocked_tool_user": blocked_tool_user,
    "broken_knowledge": broken_knowledge,
}
