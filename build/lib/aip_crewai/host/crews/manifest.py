"""Capability projection and the tenant-scoped manifest.

Pure part: :func:`crew_capabilities` turns one admitted descriptor into one
:class:`~aip_crewai.contracts.aip.Capability` per allowed operation, in
catalogue order, carrying the whole contract of ARCHITECTURE.md §6;
:class:`CapabilityIndex` does it once at startup for every crew and holds each
tenant's encoded manifest. The routes (``GET /aip/v1/manifest`` and ``GET
/aip/v1/capabilities``, same body) serve those bytes to any authenticated
principal of the tenant.

Tenant routing is default-deny: a crew absent from the tenant's list does not
exist for that tenant; :meth:`CapabilityIndex.resolve` answers
``capability.not_found`` exactly as for an unknown id.

Source: ARCHITECTURE.md §3, §4 ("Outputs"), §6 (projection), §7 (bindings, routing);
docs/reference/http-api.md "Capabilities".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ...contracts.aip import (
    CONNECTOR_PROFILE,
    MANIFEST_VERSION,
    NATIVE_PROFILE,
    PROFILES,
    ApprovalContract,
    Binding,
    Capability,
    CapabilityContract,
    CompensationContract,
    DataContract,
    ExecutionContract,
    IdempotencyContract,
    Manifest,
    Principal,
)
from ...contracts.artifacts import input_schema, plain_schema
from ...contracts.errors import CapabilityNotFound
from ...contracts.inputs import MAX_INPUT_BYTES
from ...contracts.operations import CATALOGUE, OperationSpec, capability_id, get, resolve_capability
from ...contracts.sidecar import DEFAULT_TIMEOUT_MS, MAX_IDEMPOTENCY_KEY_BYTES, MAX_TIMEOUT_MS
from .descriptors import CrewDescriptor
from .inputs import CrewInputs, project_input_schema

_SCHEMA = "https://json-schema.org/draft/2020-12/schema"
_JSON_OBJECT_OR_NULL = {"anyOf": [{"type": "object"}, {"type": "null"}]}
_JOB_STATUS = {"type": "string", "enum": ["queued", "running", "completed", "failed", "cancelled"]}

_TASK_OUTPUT = {
    "type": "object",
    "description": "One CrewAI TaskOutput; task_id is what replay takes.",
    "required": ["task_id", "raw"],
    "properties": {
        "task_id": {"type": "string"},
        "name": {"type": ["string", "null"]},
        "description": {"type": "string"},
        "expected_output": {"type": ["string", "null"]},
        "summary": {"type": ["string", "null"]},
        "raw": {"type": "string"},
        "agent": {"type": "string"},
        "output_format": {"type": "string"},
        "json_dict": _JSON_OBJECT_OR_NULL,
        "pydantic": _JSON_OBJECT_OR_NULL,
    },
}
_CREW_OUTPUT = {
    "type": "object",
    "description": "Serialized CrewAI CrewOutput.",
    "required": ["raw", "token_usage", "tasks_output"],
    "properties": {
        "raw": {"type": "string"},
        "token_usage": {"type": "object", "description": "CrewAI UsageMetrics (total_tokens, prompt_tokens, ...)."},
        "tasks_output": {"type": "array", "items": _TASK_OUTPUT},
        "json_dict": _JSON_OBJECT_OR_NULL,
        "pydantic": _JSON_OBJECT_OR_NULL,
    },
}
_JOB_VIEW = {
    "type": "object",
    "description": "The sidecar job view of the target run.",
    "required": ["action_id", "crew_id", "operation", "status", "event_count"],
    "properties": {
        "action_id": {"type": "string"},
        "crew_id": {"type": "string"},
        "operation": {"type": "string"},
        "status": _JOB_STATUS,
        "event_count": {"type": "integer", "minimum": 0},
        "output": {"description": "The run's output once completed, else null."},
    },
}
_EVENTS_PAGE = {
    "type": "object",
    "description": "Journal events of the target run from cursor.",
    "required": ["action_id", "cursor", "next_cursor", "status", "events"],
    "properties": {
        "action_id": {"type": "string"},
        "cursor": {"type": "integer", "minimum": 0},
        "next_cursor": {"type": "integer", "minimum": 0},
        "status": _JOB_STATUS,
        "events": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["event", "sequence", "data"],
                "properties": {
                    "event": {"type": "string", "enum": ["started", "chunk", "completed", "failed", "cancelled"]},
                    "sequence": {"type": "integer", "minimum": 0},
                    "data": {"type": "object"},
                },
            },
        },
    },
}
_COMPLETED = {"type": "string", "const": "completed"}
_ITERATIONS = {"type": "integer", "minimum": 1, "maximum": 100}


def _object(required: list[str], properties: dict[str, Any], description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "required": required, "properties": properties}


#: Output schema per operation (ARCHITECTURE.md §4 "Outputs").
OUTPUT_SCHEMAS: dict[str, dict[str, Any]] = {
    "run": _CREW_OUTPUT,
    "status": _JOB_VIEW,
    "events": _EVENTS_PAGE,
    "cancel": _JOB_VIEW,
    "batch_run": _object(
        ["results", "count"],
        {"results": {"type": "array", "items": _CREW_OUTPUT}, "count": {"type": "integer", "minimum": 0}},
        "One CrewOutput per input, in input order.",
    ),
    "replay": _CREW_OUTPUT,
    "train": _object(
        ["status", "artifact_name", "n_iterations"],
        {"status": _COMPLETED, "artifact_name": {"type": "string"}, "n_iterations": _ITERATIONS},
        "The training artifact was written.",
    ),
    "test": _object(
        ["status", "n_iterations", "eval_llm"],
        {
            "status": _COMPLETED,
            "n_iterations": _ITERATIONS,
            "eval_llm": {"type": "string"},
            "scores": {"type": "object", "description": "Evaluation scores when CrewAI reports them."},
        },
        "The evaluation finished.",
    ),
    "knowledge_query": _object(
        ["results"],
        {"results": {"type": "array", "items": {}, "description": "Bounded JSON results; empty when none."}},
        "Crew knowledge search results.",
    ),
    "memory_reset": _object(
        ["status", "command_type"],
        {
            "status": _COMPLETED,
            "command_type": {"type": "string"},
            "reset_targets": {
                "type": "array",
                "items": {"type": "string"},
                "description": "The domains actually reset (a reset can be partial).",
            },
        },
        "The memory domain was reset.",
    ),
}


def to_wire(value: Any) -> Any:
    """JSON builtins of an AIP object with every non-None field present.

    The contract Structs inherit ``omit_defaults=True``, which would drop
    published constants (``collision_behavior``, ``ttl_ms``, the data and
    approval contract, ``retryable: false``) from the wire. Here a field is
    omitted only when it is None; Struct field renames are honoured.
    """
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        tag_field = value.__struct_config__.tag_field
        if tag_field is not None:
            out[tag_field] = value.__struct_config__.tag
        for name, wire in zip(value.__struct_fields__, value.__struct_encode_fields__, strict=False):
            item = getattr(value, name)
            if item is not None:
                out[wire] = to_wire(item)
        return out
    if isinstance(value, (list, tuple)):
        return [to_wire(item) for item in value]
    if isinstance(value, dict):
        return {key: to_wire(item) for key, item in value.items()}
    return msgspec.to_builtins(value)


def output_schema(spec: OperationSpec) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of an operation's output (descriptions in plain text)."""
    return plain_schema({"$schema": _SCHEMA, "title": f"{spec.name} output", **OUTPUT_SCHEMAS[spec.name]})


def execution_contract(spec: OperationSpec, cancellable: frozenset[str] | None = None) -> ExecutionContract:
    """The AIP ExecutionContract of an operation (pure).

    Every capability can be called ``sync`` (blocking), ``async`` (ack, then
    follow the action) and with an SSE stream of the host's own events;
    ``supports_streaming`` says whether the crew streams output chunks.
    Read-only operations are ``safe`` to retry; mutations are safe only with
    their idempotency key (the fence answers a repeat with the stored result).
    ``supports_cancel`` needs our table's cancel flag and, once the sidecar's
    ``/health`` was read, the operation in its ``cancellable_operations``
    (``cancellable``; None: not known yet).
    """
    return ExecutionContract(
        supports_sync=True,
        supports_async=True,
        supports_streaming=spec.stream,
        supports_cancel=spec.cancel and (cancellable is None or spec.name in cancellable),
        supports_retry=spec.retry,
        expected_completion="streaming" if spec.stream else "sync",
        retry_safety="safe" if spec.read_only else "safe_with_idempotency_key",
    )


def capability_description(crew: CrewDescriptor, spec: OperationSpec, *, with_crew: bool) -> str:
    """A capability's ``description``: what ``spec`` does for ``crew`` (the operation table's
    sentence, :meth:`~aip_crewai.contracts.operations.OperationSpec.describe`), followed by the
    crew's own description when ``with_crew`` (the crew's first capability only: it is said once
    per crew, docs/reference/http-api.md "Capabilities")."""
    sentence = spec.describe(crew.id)
    return f"{sentence} {crew.description}" if with_crew and crew.description else sentence


def capability_for(
    crew: CrewDescriptor,
    spec: OperationSpec,
    inputs: CrewInputs | None = None,
    cancellable: frozenset[str] | None = None,
    *,
    with_crew: bool = True,
) -> Capability:
    """The capability of one (crew, operation), with the whole contract (docs/reference/http-api.md "Capabilities");
    ``inputs`` (the sidecar's report for the crew) names the kickoff inputs in the input schema;
    ``with_crew``: its description ends with the crew's (:func:`capability_description`)."""
    contract = CapabilityContract(
        side_effects=list(spec.side_effects),
        idempotency=IdempotencyContract(requirement=spec.key.value),
        execution=execution_contract(spec, cancellable),
        data=DataContract(),
        approval=ApprovalContract(required=True) if spec.approval else None,
        compensation=CompensationContract() if spec.mutation else None,
    )
    return Capability(
        id=capability_id(crew.id, spec.name),
        name=f"CrewAI {crew.name}: {spec.display_name}",
        kind=spec.kind.value,
        risk=spec.risk.value,
        input_schema=plain_schema(project_input_schema(input_schema(spec), spec.name, inputs)),
        output_schema=output_schema(spec),
        requires_human_approval=spec.approval,
        bindings=[
            Binding(profile=NATIVE_PROFILE, method="POST", path="/aip/v1/messages", message_type="aip.core.v1.action"),
            Binding(
                profile=CONNECTOR_PROFILE,
                protocol="http",
                method=spec.method,
                path=spec.path,
                stream_path=spec.stream_path,
            ),
        ],
        contract=contract,
        description=capability_description(crew, spec, with_crew=with_crew),
    )


def crew_capabilities(
    crew: CrewDescriptor, inputs: CrewInputs | None = None, cancellable: frozenset[str] | None = None
) -> tuple[Capability, ...]:
    """One capability per allowed operation of ``crew``, in catalogue order; the first (``run``
    when allowed) carries the crew's description after its own sentence."""
    allowed = [spec for spec in CATALOGUE if spec.name in set(crew.allowed_operations)]
    return tuple(
        capability_for(crew, spec, inputs, cancellable, with_crew=index == 0) for index, spec in enumerate(allowed)
    )


#: The host as the manifest's ``agent``.
HOST_AGENT = Principal(id="aip-crewai-host", kind="service", display_name="aip-crewai: AIP gateway to CrewAI crews")
#: Published bounds (docs/reference/http-api.md "AIP 1.0 conformance"), in the manifest's free-form ``limits``.
LIMITS: dict[str, Any] = {
    "max_input_bytes": MAX_INPUT_BYTES,
    "default_timeout_ms": DEFAULT_TIMEOUT_MS,
    "max_timeout_ms": MAX_TIMEOUT_MS,
    "idempotency_key_max_bytes": MAX_IDEMPOTENCY_KEY_BYTES,
    "idempotency_ttl_ms": 86_400_000,
    "approval_ttl_ms": 900_000,
}


def manifest_for(capabilities: list[Capability]) -> Manifest:
    """A tenant's Manifest: the host as ``agent``, the profiles, the capabilities it may call, the limits."""
    return Manifest(
        manifest_version=MANIFEST_VERSION,
        agent=HOST_AGENT,
        profiles=list(PROFILES),
        capabilities=capabilities,
        limits=LIMITS,
    )


@dataclass(frozen=True)
class ResolvedCapability:
    """A capability id resolved for one tenant."""

    crew: CrewDescriptor
    spec: OperationSpec
    capability: Capability


class CapabilityIndex:
    """Every crew's capabilities and every tenant's manifest, built once.

    Args:
        crews: admitted descriptors (file order = manifest order).
        tenants: tenant -> crew ids it may see.
    """

    def __init__(self, crews: Iterable[CrewDescriptor], tenants: Mapping[str, Iterable[str]]) -> None:
        self.crews = {crew.id: crew for crew in crews}
        self.tenants = {tenant: tuple(crew_ids) for tenant, crew_ids in tenants.items()}
        self.crew_inputs: dict[str, CrewInputs] = {}
        #: crew id -> what its sidecar can cancel (absent: not known yet, our own table applies).
        self.cancellable: dict[str, frozenset[str]] = {}
        self._build()

    def set_cancellable(self, cancellable: frozenset[str], crews: Iterable[str] | None = None) -> None:
        """Publish ``supports_cancel`` of ``crews`` (None: every crew) from what their sidecar can
        cancel (rebuilds the manifests)."""
        for crew_id in self.crews if crews is None else crews:
            self.cancellable[crew_id] = cancellable
        self._build()

    def set_crew_inputs(self, inputs: Mapping[str, CrewInputs]) -> None:
        """Project the sidecar's reported crew inputs into every input schema (rebuilds the manifests)."""
        self.crew_inputs = dict(inputs)
        self._build()

    def _build(self) -> None:
        by_crew = {
            crew_id: crew_capabilities(crew, self.crew_inputs.get(crew_id), self.cancellable.get(crew_id))
            for crew_id, crew in self.crews.items()
        }
        visible_by_tenant: dict[str, dict[str, tuple[str, ...]]] = {}
        manifests: dict[str, bytes] = {}
        for tenant, crew_ids in self.tenants.items():
            wanted = set(crew_ids)
            visible = {cid: crew.allowed_operations for cid, crew in self.crews.items() if cid in wanted}
            visible_by_tenant[tenant] = visible
            manifests[tenant] = msgspec.json.encode(
                to_wire(manifest_for([cap for cid in visible for cap in by_crew[cid]]))
            )
        # swapped whole: a reader sees the old or the new index, never a mix
        self.by_crew, self._visible, self._manifests = by_crew, visible_by_tenant, manifests
        self._by_id = {cap.id: cap for caps in by_crew.values() for cap in caps}

    def manifest_bytes(self, tenant: str) -> bytes:
        """The encoded manifest of ``tenant`` (no capabilities for an unknown or closed tenant)."""
        encoded = self._manifests.get(tenant)
        if encoded is None:
            encoded = msgspec.json.encode(to_wire(manifest_for([])))
        return encoded

    def manifest(self, tenant: str) -> Manifest:
        return msgspec.json.decode(self.manifest_bytes(tenant), type=Manifest)

    def visible_crews(self, tenant: str) -> dict[str, tuple[str, ...]]:
        """crew id -> allowed operations, for the crews ``tenant`` may see."""
        return dict(self._visible.get(tenant, {}))

    def resolve(self, tenant: str, cap_id: str) -> ResolvedCapability:
        """Resolve ``cap_id`` for ``tenant`` (longest crew id, ARCHITECTURE.md §3).

        Raises:
            CapabilityNotFound: unknown id, an operation the crew does not
                allow, or a crew the tenant may not see (indistinguishable).
        """
        found = resolve_capability(cap_id, self._visible.get(tenant, {}))
        if found is None:
            raise CapabilityNotFound(cap_id)
        crew_id, operation = found
        return ResolvedCapability(self.crews[crew_id], get(operation), self._by_id[capability_id(crew_id, operation)])
