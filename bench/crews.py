"""Bench-only crew registry: ``bench.crews:CREWS`` (offline, deterministic).

| crew id | shape | in-process ``akickoff`` on the 2-core bench machine |
|---|---|---|
| ``fast`` | 1 agent, 1 task, 1 chunk per answer | about 23 ms (CrewAI's own floor: Flow setup, pydantic models) |
| ``echo`` | :func:`aip_crewai.examples.testing.echo` (2 tasks, 3 chunks each) | about 35 ms |
| ``chatty`` | :func:`aip_crewai.examples.testing.chatty` (2 tasks, 500 chunks each: 1,000 per run) | about 90 ms |
| ``slow`` | :func:`aip_crewai.examples.testing.slow` (300 ms per chunk) | about 6 s |
| ``blocking`` | :func:`aip_crewai.examples.isolation_crews.blocking_tool` (its tool blocks 5 s in ``time.sleep``) | about 5 s |
| ``memory_stall`` | :func:`aip_crewai.examples.isolation_crews.memory_stall` (each memory drain blocks 2 s) | several s |

Each entry is a zero-argument factory, so every job (and every in-process
baseline call) gets a fresh crew and a fresh LLM object.
"""

from __future__ import annotations

from typing import Any

from crewai import Crew

from aip_crewai.examples.isolation_crews import blocking_tool, memory_stall
from aip_crewai.examples.offline_llm import OfflineLLM
from aip_crewai.examples.testing import build_crew, chatty, echo, slow


def fast() -> Crew:
    """The fastest real crew: one agent, one task, one chunk per answer."""
    return build_crew(OfflineLLM(model="offline-fast", chunks_per_answer=1), ["Say {topic}."], role="Fast echo")


CREWS: dict[str, Any] = {
    "fast": fast,
    "echo": echo,
    "chatty": chatty,
    "slow": slow,
    "blocking": blocking_tool,
    "memory_stall": memory_stall,
}
