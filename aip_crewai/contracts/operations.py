"""The operation catalogue: the single source of truth for the ten operations.

Every other module (manifest projection, fences, sidecar admission, CLI,
generated artifacts) reads :data:`CATALOGUE`; none restates it.

Source: ARCHITECTURE.md §3; docs/reference/http-api.md "Capabilities" ("Compare all operations",
"Interpret methods and fixed sidecar paths").
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import inputs

CAPABILITY_PREFIX = "cap:crewai:"


class Kind(str, enum.Enum):
    AGENT = "agent"
    TOOL = "tool"
    WORKFLOW = "workflow"


class Risk(str, enum.Enum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class KeyRequirement(str, enum.Enum):
    REQUIRED = "required"
    OPTIONAL = "optional"


MUTATION_SIDE_EFFECTS = ("read", "write", "external_network", "code_execution")
READ_ONLY_SIDE_EFFECTS = ("read", "external_network")


@dataclass(frozen=True)
class OperationSpec:
    """One row of the catalogue.

    ``path`` is the sidecar route (``{run_action_id}`` is substituted for the
    job-inspection operations); ``stream_path`` the route used when streaming
    (None when the operation does not stream).
    """

    name: str
    display_name: str
    family: str
    kind: Kind
    risk: Risk
    mutation: bool
    approval: bool
    key: KeyRequirement
    stream: bool
    cancel: bool
    retry: bool
    method: str
    path: str
    stream_path: str | None
    input_type: Any
    input_summary: str
    #: What the operation does for one crew, one plain-text sentence with ``{crew}`` for the crew id
    #: (the manifest's per-capability ``description``, :meth:`describe`).
    does: str

    @property
    def suffix(self) -> str | None:
        """Capability-id suffix; None for ``run`` (never append ``:run``)."""
        return None if self.name == "run" else self.name

    def describe(self, crew_id: str) -> str:
        """What this operation does for crew ``crew_id``: one plain-text sentence (no markup), e.g.
        ``Run crew 'echo' once with the given inputs.`` (the manifest's capability ``description``,
        docs/reference/http-api.md "Capabilities")."""
        return self.does.replace("{crew}", crew_id)

    @property
    def side_effects(self) -> tuple[str, ...]:
        return MUTATION_SIDE_EFFECTS if self.mutation else READ_ONLY_SIDE_EFFECTS

    @property
    def startable(self) -> bool:
        """True for operations that start a sidecar job through ``POST /jobs``."""
        return self.path == "/jobs"

    @property
    def read_only(self) -> bool:
        return not self.mutation


_RUN_FAMILY = "run-lifecycle-and-replay"
_TRAIN_FAMILY = "training-and-testing"
_KNOWLEDGE_FAMILY = "knowledge-and-memory"
_JOB = "/jobs/{run_action_id}"

_REQ, _OPT = KeyRequirement.REQUIRED, KeyRequirement.OPTIONAL
_A, _T, _W = Kind.AGENT, Kind.TOOL, Kind.WORKFLOW
_L, _M, _H = Risk.LOW, Risk.MEDIUM, Risk.HIGH

#: The ten operations in their published order (ARCHITECTURE.md §3).
CATALOGUE: tuple[OperationSpec, ...] = (
    #            name, display, family, kind, risk, mutation, approval, key, stream, cancel, retry, method, path, stream path, input
    OperationSpec(
        "run",
        "Run",
        _RUN_FAMILY,
        _A,
        _M,
        True,
        True,
        _REQ,
        True,
        True,
        False,
        "POST",
        "/jobs",
        "/jobs/stream",
        inputs.RunInput,
        "object of at most 512 properties, passed as CrewAI inputs",
        does="Run crew '{crew}' once with the given inputs (its CrewAI kickoff inputs).",
    ),
    OperationSpec(
        "status",
        "Status",
        _RUN_FAMILY,
        _T,
        _L,
        False,
        False,
        _OPT,
        False,
        False,
        True,
        "GET",
        _JOB,
        None,
        inputs.StatusInput,
        "run_action_id",
        does="Read the status of a job of crew '{crew}', named by its run_action_id.",
    ),
    OperationSpec(
        "events",
        "Events",
        _RUN_FAMILY,
        _T,
        _L,
        False,
        False,
        _OPT,
        True,
        False,
        True,
        "GET",
        _JOB + "/events",
        _JOB + "/events",
        inputs.EventsInput,
        "run_action_id, cursor 0..100000",
        does="Read the recorded events of a job of crew '{crew}', from a cursor.",
    ),
    OperationSpec(
        "cancel",
        "Cancel",
        _RUN_FAMILY,
        _T,
        _M,
        True,
        True,
        _REQ,
        False,
        False,
        False,
        "POST",
        _JOB + "/cancel",
        None,
        inputs.CancelInput,
        "run_action_id, reason up to 2048 characters",
        does="Cancel a queued or running job of crew '{crew}', named by its run_action_id.",
    ),
    OperationSpec(
        "batch_run",
        "Batch run",
        _RUN_FAMILY,
        _A,
        _M,
        True,
        True,
        _REQ,
        True,
        True,
        False,
        "POST",
        "/jobs",
        "/jobs/stream",
        inputs.BatchRunInput,
        "inputs: 1..100 objects",
        does="Run crew '{crew}' once per input object (1..100), results in input order.",
    ),
    OperationSpec(
        "replay",
        "Replay",
        _RUN_FAMILY,
        _A,
        _M,
        True,
        True,
        _REQ,
        True,
        True,
        False,
        "POST",
        "/jobs",
        "/jobs/stream",
        inputs.ReplayInput,
        "task_id 1..256 bytes, inputs",
        does="Re-run crew '{crew}' from one task of a retained run.",
    ),
    OperationSpec(
        "train",
        "Train",
        _TRAIN_FAMILY,
        _W,
        _H,
        True,
        True,
        _REQ,
        True,
        True,
        False,
        "POST",
        "/jobs",
        "/jobs/stream",
        inputs.TrainInput,
        "n_iterations 1..100, artifact_name, inputs",
        does="Train crew '{crew}' for n_iterations and write a training artifact.",
    ),
    OperationSpec(
        "test",
        "Test",
        _TRAIN_FAMILY,
        _W,
        _M,
        True,
        True,
        _REQ,
        True,
        True,
        False,
        "POST",
        "/jobs",
        "/jobs/stream",
        inputs.TestInput,
        "n_iterations 1..100, eval_llm, inputs",
        does="Evaluate crew '{crew}' for n_iterations with an evaluator model (eval_llm).",
    ),
    OperationSpec(
        "knowledge_query",
        "Knowledge query",
        _KNOWLEDGE_FAMILY,
        _T,
        _L,
        False,
        False,
        _REQ,
        False,
        False,
        True,
        "POST",
        "/jobs",
        None,
        inputs.KnowledgeQueryInput,
        "query: 1..100 strings of at most 4096 bytes, results_limit 1..100, score_threshold 0..1",
        does="Search the knowledge sources of crew '{crew}'.",
    ),
    OperationSpec(
        "memory_reset",
        "Memory reset",
        _KNOWLEDGE_FAMILY,
        _T,
        _H,
        True,
        True,
        _REQ,
        False,
        False,
        False,
        "POST",
        "/jobs",
        None,
        inputs.MemoryResetInput,
        "command_type",
        does="Reset one memory domain of crew '{crew}', or all of them.",
    ),
)

OPERATIONS: Mapping[str, OperationSpec] = {spec.name: spec for spec in CATALOGUE}
OPERATION_NAMES: tuple[str, ...] = tuple(OPERATIONS)
#: Operations a sidecar always serves, whatever it allows to start (ARCHITECTURE.md §4 health).
INSPECTION_OPERATIONS: frozenset[str] = frozenset(s.name for s in CATALOGUE if not s.startable)
STARTABLE_OPERATIONS: tuple[str, ...] = tuple(s.name for s in CATALOGUE if s.startable)
#: Published default when a descriptor has no ``allowed_operations`` (ARCHITECTURE.md §7).
LEGACY_DEFAULT_OPERATIONS: tuple[str, ...] = ("run", "status", "events", "cancel")


def get(name: str) -> OperationSpec:
    """Return the spec of operation ``name``. Raises KeyError when unknown."""
    return OPERATIONS[name]


def capability_id(crew_id: str, operation: str) -> str:
    """Capability id of (crew, operation): ``cap:crewai:<crew>[:<op>]``.

    Raises KeyError for an unknown operation. Source: ARCHITECTURE.md §3.
    """
    suffix = OPERATIONS[operation].suffix
    return f"{CAPABILITY_PREFIX}{crew_id}" if suffix is None else f"{CAPABILITY_PREFIX}{crew_id}:{suffix}"


def resolve_capability(cap_id: str, allowed: Mapping[str, Iterable[str]]) -> tuple[str, str] | None:
    """Resolve a capability id against configured crews.

    Args:
        cap_id: e.g. ``cap:crewai:support-primary:status``.
        allowed: crew id -> its allowed operation names.

    Returns:
        ``(crew_id, operation)`` or None when nothing matches. An exact crew id
        means ``run``; otherwise the LONGEST crew id followed by ``:`` and an
        allowed suffix wins. ``:run`` is never a suffix.

    Source: ARCHITECTURE.md §3 (capability-id resolution).
    """
    if not cap_id.startswith(CAPABILITY_PREFIX):
        return None
    rest = cap_id[len(CAPABILITY_PREFIX) :]
    if rest in allowed:
        return (rest, "run") if "run" in set(allowed[rest]) else None
    for crew_id in sorted(allowed, key=len, reverse=True):
        if rest.startswith(crew_id + ":"):
            suffix = rest[len(crew_id) + 1 :]
            spec = OPERATIONS.get(suffix)
            if spec is not None and spec.suffix is not None and suffix in set(allowed[crew_id]):
                return crew_id, suffix
    return None


def aggregate_counts() -> dict[str, Any]:
    """Counts published with the catalogue (docs/reference/http-api.md "Capabilities")."""
    return {
        "operations": len(CATALOGUE),
        "risk": {r.value: sum(1 for s in CATALOGUE if s.risk is r) for r in Risk},
        "approval_required": sum(1 for s in CATALOGUE if s.approval),
        "idempotency_key_required": sum(1 for s in CATALOGUE if s.key is KeyRequirement.REQUIRED),
        "streaming": sum(1 for s in CATALOGUE if s.stream),
        "cancellable": sum(1 for s in CATALOGUE if s.cancel),
    }
