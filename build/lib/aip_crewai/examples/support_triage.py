"""The realistic demo crew: registry ``aip_crewai.examples.support_triage:CREWS``, crew id ``support-triage``.

Two agents (a triage analyst and a resolution writer) and three sequential
tasks: classify the ticket, find the support-policy clauses that apply,
draft a reply. Inputs: ``customer`` and ``ticket`` (both optional; defaults
in :data:`DEFAULT_INPUTS`). The crew has knowledge: a short refund/support
policy (:data:`POLICY_TEXT`), in its own Chroma collection under the sidecar's
CrewAI storage dir.

Model selection (read at each factory call, i.e. per job):

- default: the deterministic :class:`aip_crewai.examples.offline_llm.OfflineLLM`
  (8 chunks per answer, 10 ms per chunk) and the offline hashed embedder. No
  network, no API key. Knowledge collection ``knowledge_support_triage_offline``.
- ``AIP_CREWAI_DEMO_MODEL=<model>`` (e.g. ``gpt-4o-mini``): ``crewai.LLM(model=
  <model>, stream=True)`` for both agents and CrewAI's default embedder, with
  no change elsewhere; the provider's usual credentials (e.g.
  ``OPENAI_API_KEY``) must be in the sidecar's environment. Knowledge
  collection ``knowledge_support_triage_model`` (the embeddings differ in
  size, so the two modes never share a collection).

``tracing=False`` and ``verbose=False``; a new LLM object per factory call.

Source: ARCHITECTURE.md §2 (examples/: offline demo crews), §11 (``make run``).
"""

from __future__ import annotations

import os
from typing import Any

from crewai import LLM, Agent, Crew, Task
from crewai.llms.base_llm import BaseLLM

from aip_crewai.examples.offline_llm import OfflineLLM, crew_knowledge, offline_embedder

DEMO_MODEL_ENV = "AIP_CREWAI_DEMO_MODEL"
CREW_ID = "support-triage"

DEFAULT_INPUTS: dict[str, Any] = {
    "customer": "Dana Reyes",
    "ticket": "I was charged twice for my annual plan this month. Please refund one charge.",
}

POLICY_TEXT = (
    "Refund policy: duplicate charges are refunded in full within 5 business days "
    "of the request. Annual plans may be refunded pro rata within 30 days of renewal. "
    "Support policy: billing tickets are answered within 1 business day; outages and "
    "security issues are urgent and answered within 2 hours. Never ask a customer for "
    "a full card number or password; confirm identity with the account email."
)


def fill_default_inputs(inputs: dict[str, Any] | None) -> dict[str, Any]:
    """``before_kickoff_callbacks`` entry: add :data:`DEFAULT_INPUTS` for missing keys."""
    return {**DEFAULT_INPUTS, **(inputs or {})}


def _model_llm() -> BaseLLM | None:
    model = os.environ.get(DEMO_MODEL_ENV, "").strip()
    if not model:
        return None
    llm = LLM(model=model, stream=True)
    if not isinstance(llm, BaseLLM):
        raise TypeError(f"crewai.LLM({model!r}) is not a BaseLLM")
    return llm


def support_triage() -> Crew:
    """Build a fresh support-triage crew (see the module docstring)."""
    model_llm = _model_llm()
    if model_llm is None:
        embedder: Any = offline_embedder()
        collection = "support_triage_offline"
        triage_llm: BaseLLM = OfflineLLM(model="offline-triage", chunks_per_answer=8, delay_ms=10)
        writer_llm: BaseLLM = OfflineLLM(model="offline-writer", chunks_per_answer=8, delay_ms=10)
    else:
        embedder = None
        collection = "support_triage_model"
        triage_llm = model_llm
        writer_llm = _model_llm() or model_llm

    analyst = Agent(
        role="Support triage analyst",
        goal="Classify tickets from {customer} and find the support policy that applies.",
        backstory=(
            "You have triaged thousands of support tickets and know the company's refund and support policies by heart."
        ),
        llm=triage_llm,
        allow_delegation=False,
        verbose=False,
        max_iter=3,
    )
    writer = Agent(
        role="Resolution writer",
        goal="Draft courteous, policy-compliant replies to {customer}.",
        backstory="You write clear, friendly support replies that promise only what policy allows.",
        llm=writer_llm,
        allow_delegation=False,
        verbose=False,
        max_iter=3,
    )
    classify = Task(
        description=(
            'Classify the support ticket from {customer}: "{ticket}". Give the category '
            "(billing, refund, technical, account or other) and the urgency (low, normal, urgent)."
        ),
        expected_output="Two lines: 'Category: ...' and 'Urgency: ...'.",
        agent=analyst,
    )
    policy = Task(
        description=(
            "Find the support and refund policy clauses that apply to the ticket from "
            '{customer}: "{ticket}". Quote them.'
        ),
        expected_output="The applicable policy clauses, quoted, one per line.",
        agent=analyst,
    )
    reply = Task(
        description=(
            'Draft the reply to {customer} about "{ticket}", following the classification '
            "and the quoted policy clauses."
        ),
        expected_output="A short, polite email reply signed 'Support team'.",
        agent=writer,
        context=[classify, policy],
    )
    return Crew(
        agents=[analyst, writer],
        tasks=[classify, policy, reply],
        knowledge=crew_knowledge(collection, [POLICY_TEXT], embedder),
        embedder=embedder,
        before_kickoff_callbacks=[fill_default_inputs],
        tracing=False,
        verbose=False,
    )


CREWS: dict[str, Any] = {CREW_ID: support_triage}
