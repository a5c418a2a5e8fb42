"""Generated, committed artifacts under the top-level ``contracts/`` folder.

``capabilities.json`` (aggregate counts, then one ordered record per
operation) and one JSON Schema per operation input, all generated from the
catalogue and the input types. A test fails when the committed files drift.

Source: issue "Foundation" item 4; docs/reference/http-api.md "Capabilities" ("Use the
machine snapshot").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

from . import operations
from .operations import CATALOGUE, OperationSpec


def input_schema(spec: OperationSpec) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of an operation's input, from its type.

    The root is always the input object itself (``"type": "object"`` at the
    top, see :func:`inline_root`): clients that turn capabilities into LLM
    tools reject a top-level ``$ref``. Its descriptions are plain text
    (:func:`plain_schema`: the types' docstrings hold doc markup).
    """
    schema = plain_schema(inline_root(msgspec.json.schema(spec.input_type)))
    schema.setdefault("$schema", "https://json-schema.org/draft/2020-12/schema")
    schema.setdefault("title", f"{spec.name} input")
    return schema


def inline_root(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace a root ``{"$ref": "#/$defs/X", "$defs": {...}}`` by X's definition.

    Args:
        schema: a JSON Schema as msgspec generates it.

    Returns:
        A new schema whose root holds X's keywords; ``$defs`` keeps the other
        definitions, and X too when something still refers to it (a recursive
        type). A schema without a root ``$ref`` is returned as a copy.
    """
    ref = schema.get("$ref")
    defs = dict(schema.get("$defs") or {})
    prefix = "#/$defs/"
    if not isinstance(ref, str) or not ref.startswith(prefix) or ref[len(prefix) :] not in defs:
        return dict(schema)
    name = ref[len(prefix) :]
    root = {key: value for key, value in schema.items() if key not in ("$ref", "$defs")}
    root.update(defs[name])
    if f'"{ref}"' not in json.dumps(defs):
        del defs[name]
    if defs:
        root["$defs"] = defs
    return root


#: A Sphinx role with its text: ``:class:`x```, ``:py:func:`~a.b``, ``:ref:`title <target>```.
_ROLE = re.compile(r":(?:[A-Za-z][\w+.-]*:)+`([^`]*)`")
#: Keywords whose value maps names to subschemas (a property named ``description`` is no description).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
#: Keywords whose value is data, never a schema: left exactly as they are.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required", "dependentRequired", "pattern"})


def _role_text(match: re.Match[str]) -> str:
    content = match.group(1)
    titled = re.fullmatch(r"(.*\S)\s*<[^<>]*>", content, flags=re.DOTALL)
    if titled:  # :ref:`the title <target>` reads as its title
        return titled.group(1)
    if content.startswith("~"):  # :class:`~a.b.C` reads as C
        return content[1:].rsplit(".", 1)[-1]
    return content.lstrip("!")


def plain_text(text: str) -> str:
    """``text`` without doc markup, as a person reads it: Sphinx roles (``:class:`x``` → ``x``,
    ``:func:`~a.b``` → ``b``, ``:ref:`t <target>``` → ``t``), then every backtick is dropped
    (````x```` and ```x``` → ``x``). The result holds no backtick, so cleaning twice changes
    nothing; text without a backtick is returned as it is.

    Source: docs/reference/http-api.md "Capabilities" (schema text in the manifest is plain text).
    """
    if "`" not in text:
        return text
    return _ROLE.sub(_role_text, text).replace("`", "")


def plain_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of the JSON Schema ``schema`` whose ``description`` and ``title`` keywords are
    :func:`plain_text`; property names and data keywords (``const``, ``enum``, ``default``,
    ``examples``, ``pattern``...) are left as they are."""
    return {key: _plain_keyword(key, value) for key, value in schema.items()}


def _plain_keyword(key: str, value: Any) -> Any:
    if key in ("description", "title") and isinstance(value, str):
        return plain_text(value)
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: _plain_subschema(sub) for name, sub in value.items()}
    if key in _DATA_KEYWORDS:
        return value
    return _plain_subschema(value)


def _plain_subschema(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain_subschema(item) for item in value]
    return plain_schema(value) if isinstance(value, dict) else value


def _record(spec: OperationSpec) -> dict[str, Any]:
    return {
        "operation": spec.name,
        "capability_template": operations.capability_id("<crew_id>", spec.name),
        "display_name": spec.display_name,
        "description_template": spec.describe("<crew_id>"),
        "family": spec.family,
        "method": spec.method,
        "route": spec.path,
        "stream_route": spec.stream_path,
        "kind": spec.kind.value,
        "risk": spec.risk.value,
        "mutation": spec.mutation,
        "approval": {"required": spec.approval, "ttl_ms": 900_000 if spec.approval else None},
        "idempotency": {
            "requirement": spec.key.value,
            "collision_behavior": "revalidate_input_hash",
            "key_scope": "tenant",
            "ttl_ms": 86_400_000,
        },
        "execution": {"streaming": spec.stream, "cancellable": spec.cancel, "retry_safe": spec.retry},
        "input_summary": spec.input_summary,
        "side_effects": list(spec.side_effects),
        "compensation": "rollback_not_supported" if spec.mutation else None,
    }


def capabilities_document() -> dict[str, Any]:
    """The machine snapshot: counts first, then the ordered records."""
    return {
        "connector_profile": "aip.connector.crewai.v1",
        "crewai_package": "1.15.5",
        "counts": operations.aggregate_counts(),
        "operations": [_record(spec) for spec in CATALOGUE],
    }


def _dump(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def generated_files() -> dict[str, str]:
    """Relative path (under ``contracts/``) -> file text."""
    files = {"capabilities.json": _dump(capabilities_document())}
    for spec in CATALOGUE:
        files[f"schemas/{spec.name}.input.schema.json"] = _dump(input_schema(spec))
    return files


def check(root: Path, *, extra: dict[str, str] | None = None) -> list[str]:
    """Return the relative paths under ``root`` that differ from the code
    (``extra``: more generated files, relative path -> text, e.g. the host's OpenAPI document)."""
    drift = []
    for rel, text in {**generated_files(), **(extra or {})}.items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            drift.append(rel)
    return drift


def write(root: Path, *, extra: dict[str, str] | None = None) -> list[str]:
    """Write every generated file (and ``extra``) under ``root``; return the paths written."""
    written = []
    for rel, text in {**generated_files(), **(extra or {})}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(rel)
    return written
