"""The registry the real-crew suite's sidecars serve: the example crews behind a module that starts a thread
at import (``examples/realcrews/threaded_registry.py``), plus crews that cannot work:

- ``broken-knowledge``: crew knowledge whose embedder points at a port nothing listens on;
- ``broken-memory``: ``memory=True`` whose embedder points at that port;
- ``no-key``: CrewAI's OpenAI model without an API key.

Imported by the sidecar (``PYTHONPATH`` from ``realkit.sidecar_env``), never by the test process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import threaded_registry
from crewai import LLM, Crew, Task
from crewai.knowledge.source.string_knowledge_source import StringKnowledgeSource
from realcrews import _agent, embedder

if TYPE_CHECKING:
    from crewai.rag.embeddings.types import EmbedderConfig

#: Nothing listens on the discard port of loopback.
DEAD_URL = "http://127.0.0.1:9/v1"


def dead_embedder() -> EmbedderConfig:
    """The example's embedder config (an OpenAI provider spec), pointed at ``DEAD_URL``."""
    spec = embedder()
    spec["config"]["api_base"] = DEAD_URL
    return cast("EmbedderConfig", spec)


def broken_knowledge_crew() -> Crew:
    spec = dead_embedder()
    clerk = _agent("Clerk")
    task = Task(description="BROKEN-KNOWLEDGE-RUN {question}", expected_output="An answer.", agent=clerk)
    return Crew(
        agents=[clerk],
        tasks=[task],
        embedder=spec,
        knowledge_sources=[StringKnowledgeSource(content="Nobody will ever read this.")],
    )


def broken_memory_crew() -> Crew:
    spec = dead_embedder()
    clerk = _agent("Clerk")
    task = Task(description="BROKEN-MEMORY-RUN {question}", expected_output="An answer.", agent=clerk)
    return Crew(name="broken-memory", agents=[clerk], tasks=[task], memory=True, embedder=spec, chat_llm=clerk.llm)


def no_key_crew() -> Crew:
    clerk = _agent("Clerk", llm=LLM(model="openai/fake-chat", base_url=DEAD_URL, api_key=""))
    return Crew(agents=[clerk], tasks=[Task(description="NO-KEY-RUN", expected_output="An answer.", agent=clerk)])


CREWS = {
    **threaded_registry.CREWS,
    "broken-knowledge": broken_knowledge_crew,
    "broken-memory": broken_memory_crew,
    "no-key": no_key_crew,
}
