"""An example crew registry built the way CrewAI's documentation builds crews.

Point the sidecar at it with ``--registry realcrews:CREWS`` and this folder on
``PYTHONPATH`` (``sidecar.env``). Every crew talks to one OpenAI-compatible
provider, given by the environment (a crew module of your own reads its
configuration the same way, or from its own settings file):

- ``REALCREWS_BASE_URL``: the provider's base URL (e.g. ``https://api.openai.com/v1``,
  a vLLM or LiteLLM proxy, or the test suite's fake provider);
- ``REALCREWS_API_KEY``: its API key;
- ``REALCREWS_MODEL`` / ``REALCREWS_EMBED_MODEL``: the chat and embedding models.

Each entry of :data:`CREWS` is a zero-argument factory: the sidecar calls it
once per job, so no job sees another's interpolated texts, memory or tools.
Nothing here opens a connection at import time.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crewai import LLM, Agent, Crew, Process, Task
from crewai.knowledge.source.string_knowledge_source import StringKnowledgeSource
from crewai.knowledge.source.text_file_knowledge_source import TextFileKnowledgeSource
from crewai.tools import tool
from pydantic import BaseModel

HERE = Path(__file__).resolve().parent
#: The fact the knowledge crews know (the suite checks it reaches a prompt).
KNOWLEDGE_FACT = "The lighthouse keeper's cat is named Marmalade-7731."
#: The fact of ``knowledge/handbook.txt``.
FILE_FACT = "TIDE-NORTH-4411"
AGENT_FACT = "The ferry captain's parrot is called Biscuit-5150."


def _setting(name: str, default: str) -> str:
    return os.environ.get(name) or default


def llm(*, stream: bool = False) -> LLM:
    """The chat model at the configured provider (CrewAI's native OpenAI client)."""
    return LLM(
        model=_setting("REALCREWS_MODEL", "openai/gpt-4o-mini"),
        base_url=_setting("REALCREWS_BASE_URL", "https://api.openai.com/v1"),
        api_key=_setting("REALCREWS_API_KEY", ""),
        stream=stream,
        max_retries=2,
        timeout=60,
    )


def embedder() -> dict[str, Any]:
    """CrewAI's OpenAI embedder config, pointed at the same provider."""
    return {
        "provider": "openai",
        "config": {
            "api_key": _setting("REALCREWS_API_KEY", ""),
            "api_base": _setting("REALCREWS_BASE_URL", "https://api.openai.com/v1"),
            "model_name": _setting("REALCREWS_EMBED_MODEL", "text-embedding-3-small"),
        },
    }


def _agent(role: str, **kwargs: Any) -> Agent:
    return Agent(
        role=role,
        goal=f"Do the {role.lower()}'s job well",
        backstory=f"An experienced {role.lower()}.",
        llm=kwargs.pop("llm", None) or llm(),
        allow_delegation=False,
        verbose=False,
        max_iter=4,
        **kwargs,
    )


# ------------------------------------------------------------------------------- knowledge


def knowledge_crew() -> Crew:
    """Crew knowledge: a string source and a file source, embedded by the provider."""
    researcher = _agent("Researcher")
    task = Task(description="KNOWLEDGE-RUN {question}", expected_output="A short answer.", agent=researcher)
    return Crew(
        agents=[researcher],
        tasks=[task],
        embedder=embedder(),
        knowledge_sources=[
            StringKnowledgeSource(content=KNOWLEDGE_FACT),
            TextFileKnowledgeSource(file_paths=[HERE / "knowledge" / "handbook.txt"]),
        ],
    )


def agent_knowledge_crew() -> Crew:
    """Knowledge on the agent, not on the crew."""
    captain = _agent(
        "Harbour master", knowledge_sources=[StringKnowledgeSource(content=AGENT_FACT)], embedder=embedder()
    )
    task = Task(description="AGENT-KNOWLEDGE-RUN {question}", expected_output="A short answer.", agent=captain)
    return Crew(agents=[captain], tasks=[task])


# ---------------------------------------------------------------------------------- memory


def memory_crew() -> Crew:
    """``memory=True`` with the provider's embedder (and its LLM for memory analysis)."""
    clerk = _agent("Clerk")
    task = Task(description="MEMORY-RUN {note}", expected_output="A short answer.", agent=clerk)
    return Crew(name="memory-crew", agents=[clerk], tasks=[task], memory=True, embedder=embedder(), chat_llm=llm())


# ------------------------------------------------------------------------ structured output


class Verdict(BaseModel):
    """A structured task result."""

    label: str
    score: int


def structured_crew() -> Crew:
    """``output_pydantic`` then ``output_json`` tasks."""
    analyst = _agent("Analyst")
    first = Task(
        description="STRUCTURED-PYDANTIC Classify {subject}.",
        expected_output="A label and a score.",
        agent=analyst,
        output_pydantic=Verdict,
    )
    second = Task(
        description="STRUCTURED-JSON Classify {subject} again.",
        expected_output="A label and a score.",
        agent=analyst,
        output_json=Verdict,
    )
    return Crew(agents=[analyst], tasks=[first, second])


# ------------------------------------------------------------------------------ processes


def hierarchical_crew() -> Crew:
    """``Process.hierarchical`` with a manager LLM delegating to two workers."""
    writer, checker = _agent("Writer"), _agent("Checker")
    task = Task(description="HIERARCHICAL-RUN Write one line about {topic}.", expected_output="One line.")
    return Crew(agents=[writer, checker], tasks=[task], process=Process.hierarchical, manager_llm=llm())


def sequential_crew() -> Crew:
    """Two sequential tasks, the second reading the first through ``context``."""
    scout, editor = _agent("Scout"), _agent("Editor")
    find = Task(description="SEQUENTIAL-FIRST Find one fact about {topic}.", expected_output="One fact.", agent=scout)
    edit = Task(
        description="SEQUENTIAL-SECOND Polish the fact.",
        expected_output="One polished fact.",
        agent=editor,
        context=[find],
    )
    return Crew(agents=[scout, editor], tasks=[find, edit], process=Process.sequential)


# ----------------------------------------------------------------------------------- tools


class LookupFailed(RuntimeError):
    """What :func:`failing_lookup` raises (its text quotes a secret, which must never be published)."""


@tool("failing_lookup")
def failing_lookup(query: str) -> str:
    """Look a record up in the archive (always fails)."""
    raise LookupFailed(f"archive refused {query!r} with key sk-live-SECRET-0000")


@tool("parallel_count")
def parallel_count(words: str) -> str:
    """Count the letters of each word, in a thread pool."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        counts = list(pool.map(len, words.split()))
    return f"counts={counts}"


@tool("async_echo")
async def async_echo(text: str) -> str:
    """Echo the text after an asynchronous pause."""
    await asyncio.sleep(0)
    return f"echo={text}"


def tools_crew() -> Crew:
    """An agent with a tool using a thread pool and an async tool."""
    worker = _agent("Toolsmith", tools=[parallel_count, async_echo])
    task = Task(description="TOOLS-RUN Use your tools on {words}.", expected_output="The tool results.", agent=worker)
    return Crew(agents=[worker], tasks=[task])


def failing_tool_crew() -> Crew:
    """An agent whose only tool raises."""
    worker = _agent("Archivist", tools=[failing_lookup])
    task = Task(description="FAILING-TOOL-RUN Look up {query}.", expected_output="The record.", agent=worker)
    return Crew(agents=[worker], tasks=[task])


def plain_crew() -> Crew:
    """One agent, one task: the provider's status and streaming cases."""
    writer = _agent("Writer", llm=llm(stream=True))
    task = Task(description="PLAIN-RUN {prompt}", expected_output="A short answer.", agent=writer)
    return Crew(agents=[writer], tasks=[task])


CREWS = {
    "knowledge": knowledge_crew,
    "agent-knowledge": agent_knowledge_crew,
    "memory": memory_crew,
    "structured": structured_crew,
    "hierarchical": hierarchical_crew,
    "sequential": sequential_crew,
    "tools": tools_crew,
    "failing-tool": failing_tool_crew,
    "plain": plain_crew,
}
