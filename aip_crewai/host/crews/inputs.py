"""Crew inputs the sidecar reports, projected into input schemas and checked before any approval (pure).

Our sidecar's ``GET /health`` carries ``crew_inputs``: per crew the
``{name}`` placeholders of its tasks' and agents' texts and whether the crew
has ``before_kickoff_callbacks`` (``defaults``: they may fill a missing
input). The host then

- lists the placeholders as properties of the kickoff inputs in the input
  schemas of ``run``, ``batch_run``, ``train`` and ``test``, required unless
  the crew fills defaults (still at most 512 properties);
- refuses a submission that lacks a required one with 400
  ``action.invalid_input`` naming it (``$.topic``, ``$.inputs[2].topic``,
  ``$.inputs.topic``), before an approval is requested;
- refuses a ``memory_reset`` of a domain the crew does not have
  (``memory_domains``, e.g. ``memory`` of a crew without CrewAI memory) with
  400 ``action.invalid_input`` at ``$.command_type`` naming the crew's domains,
  before an approval is requested (``all`` resets what there is).

A peer sidecar without the field (or a crew missing from it) keeps the open
schema and no check. Malformed entries are ignored, never trusted.

Source: docs/reference/http-api.md "Capabilities" (crew inputs); ARCHITECTURE.md §4 (``/health``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...contracts.errors import InvalidInput

#: Where each operation carries CrewAI kickoff inputs: the whole input, a list under
#: ``inputs``, or one object under ``inputs`` (``replay`` reuses the retained run's).
KICKOFF_INPUTS = {"run": "input", "batch_run": "list", "train": "field", "test": "field"}
#: At most this many placeholders are used per crew (the kickoff input bound).
MAX_PLACEHOLDERS = 512
#: Longest placeholder name used, characters.
MAX_PLACEHOLDER_CHARS = 256


#: The ``memory_reset`` targets a sidecar may report (``memory_reset`` input ``command_type`` but ``all``).
MEMORY_DOMAINS = ("memory", "kickoff_outputs", "knowledge", "agent_knowledge")


@dataclass(frozen=True)
class CrewInputs:
    """One crew's reported inputs: sorted placeholder names, whether the crew fills defaults, and its
    ``memory_reset`` targets (None: not reported, nothing is checked)."""

    placeholders: tuple[str, ...]
    defaults: bool
    memory_domains: tuple[str, ...] | None = None

    @property
    def required(self) -> tuple[str, ...]:
        """The names a submission must carry (none when the crew fills defaults)."""
        return () if self.defaults else self.placeholders


def parse_crew_inputs(value: Any) -> dict[str, CrewInputs]:
    """``crew_inputs`` of a sidecar ``/health`` body → crew id → :class:`CrewInputs`.

    Args:
        value: ``{crew_id: {"placeholders": [str], "defaults": bool,
            "memory_domains"?: [str]}}`` or anything else (then ``{}``).

    Returns:
        The well-formed entries only; names that are not non-empty strings
        of at most :data:`MAX_PLACEHOLDER_CHARS` are dropped, at most
        :data:`MAX_PLACEHOLDERS` kept per crew.
    """
    if not isinstance(value, dict):
        return {}
    parsed: dict[str, CrewInputs] = {}
    for crew_id, facts in value.items():
        if not isinstance(crew_id, str) or not isinstance(facts, dict):
            continue
        names = facts.get("placeholders")
        defaults = facts.get("defaults")
        if not isinstance(names, list) or not isinstance(defaults, bool):
            continue
        kept = sorted({n for n in names if isinstance(n, str) and 0 < len(n) <= MAX_PLACEHOLDER_CHARS})
        domains = facts.get("memory_domains")
        known = (
            tuple(d for d in MEMORY_DOMAINS if d in domains)
            if isinstance(domains, list) and all(isinstance(d, str) for d in domains)
            else None
        )
        parsed[crew_id] = CrewInputs(tuple(kept[:MAX_PLACEHOLDERS]), defaults, known)
    return parsed


def check_crew_inputs(operation: str, input: Any, facts: CrewInputs | None) -> None:
    """Refuse an input that lacks a placeholder its crew requires.

    Args:
        operation: the operation name.
        input: the action input as received (not yet converted).
        facts: the crew's reported inputs, or None (nothing is checked).

    Raises:
        InvalidInput: ``$.<name>`` (run), ``$.inputs[<i>].<name>`` (batch_run)
            or ``$.inputs.<name>`` (train, test): the first missing name;
            ``$.command_type`` (memory_reset): a domain the crew does not have.
    """
    if operation == "memory_reset" and facts is not None and facts.memory_domains is not None:
        target = input.get("command_type") if isinstance(input, dict) else None
        if isinstance(target, str) and target in MEMORY_DOMAINS and target not in facts.memory_domains:
            have = ", ".join(facts.memory_domains) or "none"
            raise InvalidInput(
                "$.command_type",
                f"this crew has no {target} to reset (its memory domains: {have}; or all); nothing was "
                "started and no approval was requested",
            )
        return
    if facts is None or not facts.required:
        return
    for path, inputs in _kickoff_objects(operation, input):
        for name in facts.required:
            if name not in inputs:
                raise InvalidInput(f"{path}.{name}", f"required: the crew's texts use the placeholder {{{name}}}")


def left_to_crew(operation: str, input: Any, facts: CrewInputs | None) -> tuple[str, ...] | None:
    """What a crew's own code may do to an action's kickoff inputs before it runs, for its approver.

    A crew that fills defaults (``facts.defaults``: its ``before_kickoff`` callbacks) receives the kickoff
    inputs when it runs and may fill those missing or change any of them, with values known only then.

    Returns:
        None when its code touches no kickoff input of ``operation`` (no such callbacks, an operation without
        kickoff inputs such as ``replay``) or the crew's sidecar reported nothing; else the placeholders
        missing from any kickoff-input object of ``input``, sorted (possibly none). Pure; docs/approvals.md
        "Inputs the crew fills itself".
    """
    if facts is None or not facts.defaults or operation not in KICKOFF_INPUTS:
        return None
    objects = _kickoff_objects(operation, input)
    return tuple(name for name in facts.placeholders if any(name not in inputs for _path, inputs in objects))


def _kickoff_objects(operation: str, input: Any) -> list[tuple[str, dict[str, Any]]]:
    """The kickoff-input objects of an action input (:data:`KICKOFF_INPUTS`), each with its JSON path: the
    input itself (``$``), each item of ``inputs`` (``$.inputs[i]``), or ``inputs`` (``$.inputs``; absent or
    null: an empty object). Anything not an object is left out (the input type check names it). Pure."""
    where = KICKOFF_INPUTS.get(operation)
    if where is None or not isinstance(input, dict):
        return []
    if where == "input":
        targets: list[tuple[str, Any]] = [("$", input)]
    elif where == "list":
        items = input.get("inputs")
        targets = [(f"$.inputs[{i}]", item) for i, item in enumerate(items)] if isinstance(items, list) else []
    else:
        targets = [("$.inputs", input.get("inputs") or {})]
    return [(path, inputs) for path, inputs in targets if isinstance(inputs, dict)]


def project_input_schema(schema: Mapping[str, Any], operation: str, facts: CrewInputs | None) -> dict[str, Any]:
    """The input schema of ``operation`` with the crew's placeholders as kickoff-input properties.

    Args:
        schema: the operation's generic input schema (``contracts.artifacts.input_schema``).
        operation: the operation name.
        facts: the crew's reported inputs, or None (the schema is returned unchanged).

    Returns:
        A new schema: the kickoff-inputs object gains ``properties`` (one
        string-or-any entry per placeholder) and ``required`` (unless the crew
        fills defaults); for ``train``/``test`` with required names, ``inputs``
        becomes required and non-null.
    """
    projected = copy.deepcopy(dict(schema))
    where = KICKOFF_INPUTS.get(operation)
    if facts is None or where is None or not facts.placeholders:
        return projected
    properties = {
        name: {"description": f"fills the placeholder {{{name}}} of the crew's texts"} for name in facts.placeholders
    }

    def describe(obj: dict[str, Any]) -> dict[str, Any]:
        obj["properties"] = properties
        if facts.required:
            obj["required"] = list(facts.required)
        return obj

    if where == "input":
        return describe(projected)
    holder = projected.get("properties", {}).get("inputs")
    if where == "list" and isinstance(holder, dict) and isinstance(holder.get("items"), dict):
        describe(holder["items"])
    elif where == "field" and isinstance(holder, dict):
        options = holder.get("anyOf") or []
        obj = next((o for o in options if isinstance(o, dict) and o.get("type") == "object"), None)
        if obj is not None:
            describe(obj)
            if facts.required:
                projected["properties"]["inputs"] = obj
                projected["required"] = sorted({*projected.get("required", []), "inputs"})
    return projected
