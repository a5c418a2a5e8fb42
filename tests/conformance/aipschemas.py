"""The official AIP 1.0 JSON Schemas, loaded for validation, and a checker
that names the route, schema, JSON path and message of the first violation.

The schemas live outside the repository (``../shared/aip-schemas`` from the
project root, or ``$AIP_SCHEMAS_DIR``); :data:`SCHEMAS_DIR` is None when they
are absent, and the conformance suite then skips with one line, or fails when
``AIP_CREWAI_REQUIRE_SCHEMAS=1`` (CI sets it: :func:`require`; docs/reference/http-api.md "AIP 1.0 conformance").
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

BASE = "https://getaip.org/schemas/aip/"
_ROOT = Path(__file__).resolve().parents[2]


def _find() -> Path | None:
    configured = os.environ.get("AIP_SCHEMAS_DIR")
    candidates = [Path(configured)] if configured else []
    candidates.append(_ROOT.parent / "shared" / "aip-schemas")
    return next((path for path in candidates if (path / "envelope.schema.json").is_file()), None)


SCHEMAS_DIR = _find()

#: Set to ``1`` (``.ci/run`` does): absent schemas fail the conformance suite instead of skipping it.
REQUIRE_ENV = "AIP_CREWAI_REQUIRE_SCHEMAS"
MISSING = "AIP 1.0 schemas not found (../shared/aip-schemas or $AIP_SCHEMAS_DIR)"


def require(directory: Path | None, environ: Mapping[str, str]) -> None:
    """Return when the schemas are in ``directory``; without them, skip the conformance suite (one line), or
    fail it when ``environ`` sets :data:`REQUIRE_ENV` to ``1``.

    Raises:
        pytest.fail.Exception: absent and required.
        pytest.skip.Exception: absent and not required (module level: the whole directory is skipped).
    """
    if directory is not None:
        return
    if environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{MISSING} and {REQUIRE_ENV}=1: the conformance suite cannot run", pytrace=False)
    pytest.skip(f"{MISSING}: conformance suite skipped", allow_module_level=True)


class Violation(AssertionError):
    """A body that does not match its AIP schema."""


class Schemas:
    """Validators for every schema file, keyed by name (``envelope``, ``action_status``, ...)."""

    def __init__(self, directory: Path) -> None:
        contents = {
            p.name.removesuffix(".schema.json"): json.loads(p.read_text())
            for p in sorted(directory.glob("*.schema.json"))
        }
        registry: Registry = Registry().with_resources(
            (schema["$id"], Resource.from_contents(schema)) for schema in contents.values()
        )
        self.validators = {name: Draft202012Validator(schema, registry=registry) for name, schema in contents.items()}
        self.checked = 0

    def check(self, route: str, name: str, instance: Any) -> None:
        """Raise :class:`Violation` on the first error (the shallowest, then in document order)."""
        self.checked += 1
        errors = sorted(
            self.validators[name].iter_errors(instance),
            key=lambda e: (len(e.absolute_path), [str(p) for p in e.absolute_path]),
        )
        if errors:
            first = errors[0]
            detail = "; ".join(f"{c.json_path}: {c.message[:160]}" for c in (first.context or [])[:4])
            raise Violation(
                f"{route}: {name}.schema.json at {first.json_path}: {first.message[:300]}"
                + (f" [{detail}]" if detail else "")
            )


#: message_type -> the body key the AIP registry gives it (the schema's MessageBody
#: does not tie the two together; a client does).
BODY_KEYS = {
    "aip.core.v1.action": "action",
    "aip.core.v1.cancel": "cancel",
    "aip.core.v1.ack": "ack",
    "aip.core.v1.stream_chunk": "stream_chunk",
    "aip.core.v1.action_result": "action_result",
    "aip.core.v1.error": "error",
}


def check_envelope(schemas: Schemas, route: str, envelope: Any) -> None:
    """An envelope: schema-valid, and its body key is the one of its message type."""
    schemas.check(route, "envelope", envelope)
    expected = BODY_KEYS.get(envelope["message_type"])
    if expected is None or list(envelope["body"]) != [expected]:
        raise Violation(
            f"{route}: envelope.schema.json at $.body: message_type {envelope['message_type']} "
            f"carries body key(s) {list(envelope['body'])}, expected {expected!r}"
        )
