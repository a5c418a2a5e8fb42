"""Deterministic offline test crews: registry ``aip_crewai.examples.testing:CREWS``.

Every crew uses :class:`aip_crewai.examples.offline_llm.OfflineLLM` (a new LLM object
per factory call: CrewAI's token usage is cumulative per LLM object),
``tracing=False`` and ``verbose=False``. Inputs: task texts interpolate
``{topic}``; a missing ``topic`` defaults to ``"nothing in particular"`` (a
``before_kickoff_callbacks`` entry fills it before CrewAI interpolates, because
CrewAI fails on a placeholder without a value). Extra input keys are ignored.

| crew id | shape | knobs |
|---|---|---|
| ``echo`` | 1 agent, 2 tasks | 3 chunks per answer, no delay |
| ``echo-template`` | same as ``echo``, registered as a pristine Crew *instance* (cloned per job with ``Crew.copy()``) | same |
| ``slow`` | 1 agent, 2 tasks | 10 chunks per answer, 300 ms per chunk (about 6 s per run) |
| ``failing`` | 1 agent, 1 task | every model call raises ``RuntimeError`` containing ``FAKE_SECRET`` |
| ``chatty`` | 1 agent, 2 tasks | 500 chunks per answer (1000 per run), no delay |
| ``tool_user`` | 1 agent with the ``word_counter`` tool, 1 task | native tool call streamed on the ``tools`` channel, then the answer |
| ``knowledge_a`` | 1 agent, 1 task, crew knowledge: the lighthouse text | Chroma collection ``knowledge_example_a`` |
| ``knowledge_b`` | 1 agent, 1 task, crew knowledge: the volcano text | Chroma collection ``knowledge_example_b`` |

The knowledge crews pass ``knowledge=crew_knowledge(...)`` (a ``Knowledge``
over one ``StringKnowledgeSource`` in its own collection, with the offline
embedder) instead of ``knowledge_sources=``: CrewAI puts every crew's
``knowledge_sources`` in one collection (``knowledge_crew``) of the storage
dir, so two crews would read (and reset) each other's texts. Its storage also
answers CrewAI's async search (used by agents under ``akickoff``).

Source: ARCHITECTURE.md §2 (examples/), §5 (fresh crew per job).
"""

from __future__ import annotations

from typing import Any

from crewai import Agent, Crew, Task
from crewai.knowledge.knowledge import Knowledge
from crewai.tools import tool

from aip_crewai.examples.offline_llm import OfflineLLM, crew_knowledge, offline_embedder

DEFAULT_INPUTS: dict[str, Any] = {"topic": "nothing in particular"}

KNOWLEDGE_A_TEXT = (
    "The Halvard lighthouse keeper logs the beacon lamp every night. "
    "The lighthouse lamp uses a rotating lens and a foghorn for storms."
)
KNOWLEDGE_B_TEXT = (
    "The Orvik volcano erupts basalt lava from its summit crater. "
    "Volcano ash clouds close the airport whenever the crater vents."
)


def fill_default_inputs(inputs: dict[str, Any] | None) -> dict[str, Any]:
    """``before_kickoff_callbacks`` entry: add :data:`DEFAULT_INPUTS` for missing keys.

    Module-level on purpose: CrewAI warns that closures cannot be serialized
    for checkpointing.
    """
    return {**DEFAULT_INPUTS, **(inputs or {})}


@tool("word_counter")
def word_counter(text: str) -> str:
    """Count the words of a text and return the count as a sentence."""
    return f"the text has {len(str(text).split())} words"


def build_crew(
    llm: OfflineLLM,
    descriptions: list[str],
    *,
    role: str = "Echo analyst",
    tools: list[Any] | None = None,
    knowledge: Knowledge | None = None,
) -> Crew:
    """Build a one-agent crew with one task per description (tests build variants).

    Args:
        llm: the agent's LLM (use a new object per crew).
        descriptions: task descriptions, in order; may use ``{topic}``.
        role: the agent role (shown as ``agent_role`` on chunks).
        tools: the agent's tools.
        knowledge: crew knowledge (then the offline embedder is the crew embedder).
    """
    agent = Agent(
        role=role,
        goal="Restate the request about {topic} faithfully.",
        backstory="A deterministic offline agent used in tests.",
        llm=llm,
        tools=tools or [],
        allow_delegation=False,
        verbose=False,
        max_iter=3,
    )
    tasks = [Task(description=text, expected_output="One line about {topic}.", agent=agent) for text in descriptions]
    return Crew(
        agents=[agent],
        tasks=tasks,
        verbose=False,
        tracing=False,
        knowledge=knowledge,
        embedder=offline_embedder() if knowledge is not None else None,
        before_kickoff_callbacks=[fill_default_inputs],
    )


TWO_TASKS = ["Summarize the topic {topic}.", "Restate the summary of {topic}."]


def echo() -> Crew:
    """Fast crew: 1 agent, 2 tasks, 3 chunks per answer."""
    return build_crew(OfflineLLM(model="offline-echo", chunks_per_answer=3), TWO_TASKS)


def slow() -> Crew:
    """Slow crew for cancel tests: 2 tasks x 10 chunks x 300 ms (about 6 s)."""
    llm = OfflineLLM(model="offline-slow", chunks_per_answer=10, delay_ms=300)
    return build_crew(llm, TWO_TASKS)


def failing() -> Crew:
    """Every model call raises RuntimeError carrying a fake secret."""
    return build_crew(OfflineLLM(model="offline-failing", fail=True), ["Summarize {topic}."])


def chatty() -> Crew:
    """Streams 1000 chunks per run (2 answers x 500 chunks), no delay."""
    llm = OfflineLLM(model="offline-chatty", chunks_per_answer=500)
    return build_crew(llm, TWO_TASKS)


def tool_user() -> Crew:
    """One agent with the ``word_counter`` tool: a ``tools`` channel chunk, then text."""
    llm = OfflineLLM(model="offline-tools", chunks_per_answer=2)
    return build_crew(llm, ["Count the words of the topic {topic}."], tools=[word_counter])


def knowledge_a() -> Crew:
    """Crew knowledge about a lighthouse (collection ``knowledge_example_a``)."""
    return build_crew(
        OfflineLLM(model="offline-knowledge-a"),
        ["Answer a question about {topic} using the lighthouse notes."],
        knowledge=crew_knowledge("example_a", [KNOWLEDGE_A_TEXT], offline_embedder()),
    )


def knowledge_b() -> Crew:
    """Crew knowledge about a volcano (collection ``knowledge_example_b``)."""
    return build_crew(
        OfflineLLM(model="offline-knowledge-b"),
        ["Answer a question about {topic} using the volcano notes."],
        knowledge=crew_knowledge("example_b", [KNOWLEDGE_B_TEXT], offline_embedder()),
    )


CREWS: dict[str, Any] = {
    "echo": echo,
    "echo-template": echo(),
    "slow": slow,
    "failing": failing,
    "chatty": chatty,
    "tool_user": tool_user,
    "knowledge_a": knowledge_a,
    "knowledge_b": knowledge_b,
}
