"""Crew descriptor admission (pure: bytes in, descriptors out).

The crews file is the peer's descriptor format, a JSON array::

    [{"id": "support-primary", "name": "Support", "description": "…",
      "allowed_operations": ["run", "status", "events", "cancel"]}]

Rules (each failure names the descriptor by index and id):

- 1..1000 descriptors; ids unique.
- ``id``: 1..256 characters from ``A-Z a-z 0-9 . _ - :``, starting with a
  letter or digit; ``:`` separates non-empty segments (no leading, trailing
  or doubled ``:``), and the last segment is never an operation name. Crew ids
  may therefore contain ``:`` (``resolve_capability`` takes the longest crew
  id) while ``cap:crewai:<crew>[:<op>]`` stays unambiguous: no crew id can
  equal another crew id plus ``:<operation>``, and no id looks like an
  appended ``:run``. No ``/``, spaces or control characters (ids appear in
  URLs, logs and capability ids).
- ``name``: 1..512 characters, no control characters.
- ``description``: optional, at most 16 KiB of UTF-8.
- ``allowed_operations``: missing means :data:`LEGACY_DEFAULT_OPERATIONS`
  (run, status, events, cancel); otherwise a non-empty list of catalogue
  operation names without duplicates, published in catalogue order. Empty or
  unknown fails startup.
- Unknown descriptor fields are rejected: the file is operator-authored, and a
  misspelt ``allowed_operations`` would otherwise silently fall back to the
  legacy default and publish operations nobody meant to allow (fail closed).

Source: ARCHITECTURE.md §3 (capability-id resolution), §7 (descriptors);
docs/reference/http-api.md "Capabilities" ("Understand discovery projection").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from ...contracts.errors import AipError, Category
from ...contracts.inputs import has_control_characters
from ...contracts.operations import CATALOGUE, LEGACY_DEFAULT_OPERATIONS, OPERATIONS

MAX_CREWS = 1000
MAX_ID_CHARS = 256
MAX_NAME_CHARS = 512
MAX_DESCRIPTION_BYTES = 16 * 1024
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?::[A-Za-z0-9._-]+)*\Z")


class AdmissionError(AipError):
    """A descriptor (or the file) breaks an admission rule.

    ``index`` and ``crew_id`` locate the descriptor (None for file-level
    problems); ``field`` names the descriptor field.
    """

    code = "config.invalid_descriptor"
    category = Category.PERMANENT
    http_status = 500
    default_message = "invalid crew descriptor"

    def __init__(
        self, reason: str, *, index: int | None = None, crew_id: str | None = None, field: str | None = None
    ) -> None:
        self.index = index
        self.crew_id = crew_id
        self.field = field
        self.reason = reason
        where = ""
        if index is not None:
            where = f"[{index}]" + (f" (id {crew_id!r})" if crew_id is not None else "")
            where += f".{field}" if field else ""
            where += ": "
        super().__init__(where + reason, details={"index": index, "crew_id": crew_id, "field": field})


@dataclass(frozen=True)
class CrewDescriptor:
    """An admitted crew. ``allowed_operations`` is in catalogue order;
    ``legacy`` records that the field was missing."""

    id: str
    name: str
    description: str | None
    allowed_operations: tuple[str, ...]
    legacy: bool = False


class _DescriptorIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    name: str
    description: str | None = None
    allowed_operations: list[str] | None = None


def check_crew_id(crew_id: str) -> str | None:
    """Return why ``crew_id`` is not admissible, or None when it is."""
    if not 1 <= len(crew_id) <= MAX_ID_CHARS:
        return f"must be 1..{MAX_ID_CHARS} characters"
    if has_control_characters(crew_id) or not _ID_RE.match(crew_id):
        return "may hold only A-Z a-z 0-9 . _ - and ':' between non-empty segments, starting with a letter or digit"
    last = crew_id.rpartition(":")[2]
    if ":" in crew_id and last in OPERATIONS:
        return f"must not end with ':{last}' (it would read as an operation suffix of another crew id)"
    return None


def admit(index: int, raw: Any) -> CrewDescriptor:
    """Validate one decoded descriptor.

    Raises:
        AdmissionError: naming ``index``, the id when readable, and the field.
    """
    crew_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
    try:
        item = msgspec.convert(raw, _DescriptorIn, strict=True)
    except msgspec.ValidationError as exc:
        rule, sep, where = str(exc).rpartition(" - at `")
        field = where.rstrip("`").lstrip("$.") if sep else None
        unknown = re.match(r"Object contains unknown field `(.+)`\Z", rule if sep else str(exc))
        if unknown:
            raise AdmissionError(
                "unknown field (descriptor fields: id, name, description, allowed_operations)",
                index=index,
                crew_id=crew_id,
                field=unknown.group(1),
            ) from exc
        raise AdmissionError(rule if sep else str(exc), index=index, crew_id=crew_id, field=field or None) from exc

    def fail(field: str, reason: str) -> AdmissionError:
        return AdmissionError(reason, index=index, crew_id=item.id, field=field)

    problem = check_crew_id(item.id)
    if problem is not None:
        raise fail("id", problem)
    if not 1 <= len(item.name) <= MAX_NAME_CHARS or has_control_characters(item.name):
        raise fail("name", f"must be 1..{MAX_NAME_CHARS} characters without control characters")
    if item.description is not None and len(item.description.encode("utf-8")) > MAX_DESCRIPTION_BYTES:
        raise fail("description", f"must be at most {MAX_DESCRIPTION_BYTES} UTF-8 bytes")
    if item.allowed_operations is None:
        return CrewDescriptor(item.id, item.name, item.description, LEGACY_DEFAULT_OPERATIONS, legacy=True)
    if not item.allowed_operations:
        raise fail("allowed_operations", "must not be empty (omit the field for the legacy default)")
    for position, name in enumerate(item.allowed_operations):
        if name not in OPERATIONS:
            raise fail(f"allowed_operations[{position}]", f"unknown operation {name!r}; known: {', '.join(OPERATIONS)}")
        if name in item.allowed_operations[:position]:
            raise fail(f"allowed_operations[{position}]", f"operation {name!r} is listed twice")
    allowed = set(item.allowed_operations)
    ordered = tuple(spec.name for spec in CATALOGUE if spec.name in allowed)
    return CrewDescriptor(item.id, item.name, item.description, ordered)


def load_descriptors(data: bytes) -> tuple[CrewDescriptor, ...]:
    """Decode and admit the crews file.

    Args:
        data: the file's bytes (UTF-8 JSON array).

    Returns:
        The descriptors, in file order.

    Raises:
        AdmissionError: not a JSON array, 0 or more than 1000 entries, any
            descriptor rule, or a duplicate id (naming index and id).

    Source: ARCHITECTURE.md §7.
    """
    try:
        items = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise AdmissionError(f"not valid JSON: {exc}") from exc
    if not isinstance(items, list):
        raise AdmissionError("must be a JSON array of crew descriptors")
    if not 1 <= len(items) <= MAX_CREWS:
        raise AdmissionError(f"must hold 1..{MAX_CREWS} crew descriptors, not {len(items)}")
    crews: list[CrewDescriptor] = []
    first_index: dict[str, int] = {}
    for index, raw in enumerate(items):
        crew = admit(index, raw)
        if crew.id in first_index:
            raise AdmissionError(
                f"duplicate id (first used by [{first_index[crew.id]}])", index=index, crew_id=crew.id, field="id"
            )
        first_index[crew.id] = index
        crews.append(crew)
    return tuple(crews)
