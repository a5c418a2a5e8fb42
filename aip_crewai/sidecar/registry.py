"""The crew registry: ``module:attribute`` → crew id → a source of fresh crews.

The attribute is a non-empty mapping (or a zero-argument callable returning
one) from crew id to either

- a zero-argument **factory** (any callable), called once per job; or
- a pristine **template** crew instance (duck-typed: has ``copy`` and
  ``kickoff``); each job gets ``template.copy()`` and the template itself is
  never kicked off (``Crew.copy()`` of a crew that already ran keeps its
  interpolated texts, and ``copy.deepcopy`` fails on CrewAI's locks).

This module does not import CrewAI (only the operations package does).

Source: ARCHITECTURE.md §1 (crew registry ``module:attribute``), §5 (each job runs
on a fresh crew), §11 (``--registry``).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_CREW_ID_CHARS = 256
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RegistryError(ValueError):
    """The registry spec, its attribute or one of its entries is unusable."""


@dataclass(frozen=True, slots=True)
class CrewSource:
    """Where one crew id gets its per-job crews from.

    Attributes:
        crew_id: the registry key.
        factory: zero-argument callable returning a new crew, or None.
        template: a pristine crew instance cloned per job, or None.
        (Exactly one of ``factory`` and ``template`` is set.)
    """

    crew_id: str
    factory: Callable[[], Any] | None = None
    template: Any = None

    @property
    def kind(self) -> str:
        """``"factory"`` or ``"template"``."""
        return "factory" if self.factory is not None else "template"

    def new_crew(self) -> Any:
        """Return a crew that no other job has used.

        Returns:
            ``factory()``, or ``template.copy()`` with each agent's LLM given
            its own zeroed token counters (``Crew.copy()`` shallow-copies the
            LLM objects, whose usage dict would otherwise be shared by every
            copy: CrewAI reports token usage cumulatively per LLM object).

        Raises:
            RegistryError: the factory returned something that is not a crew.
        """
        if self.factory is not None:
            crew = self.factory()
            if not _is_crew(crew):
                raise RegistryError(f"factory for crew {self.crew_id!r} returned {type(crew).__name__}, not a crew")
            return crew
        crew = self.template.copy()
        _detach_token_usage(crew)
        return crew

    def job_crew(self) -> Any:
        """:meth:`new_crew` for a job: a factory that raises, or returns no crew, fails the job typed at its
        start (``CrewBuildFailed``, ``uncertain_outcome: false``: nothing of the job ran), its message naming
        only the exception's type (a factory's text may quote a key). docs/security.md (``build_failed``).

        Raises:
            SafeJobError: ``CrewBuildFailed``.
        """
        from aip_crewai.sidecar.jobs.context import SafeJobError

        try:
            return self.new_crew()
        except Exception as exc:
            raise SafeJobError(
                f"crew {self.crew_id!r} could not be built: "
                + (
                    str(exc)
                    if isinstance(exc, RegistryError)
                    else f"its factory raised {type(exc).__name__} (text withheld)"
                ),
                error_type="CrewBuildFailed",
                before_any_effect=True,
            ) from None


def locate_registry(spec: str) -> str:
    """Check, without importing anything, that ``spec`` is well formed and its module exists on the path.

    Run before the CrewAI import (tens of seconds), so a mistyped ``--registry`` is refused at once.
    The top-level name is found through every finder (``importlib.util.find_spec``:
    editable installs too, nothing imported), each further dotted part with
    ``importlib.machinery.PathFinder`` in its parent's directories, so no
    package ``__init__`` runs. A module already imported counts as found.

    Args:
        spec: ``"package.module:attribute"``.

    Returns:
        The module's file (or ``"namespace package"``, ``"built-in"``).

    Raises:
        RegistryError: malformed spec, or no module of that name on ``sys.path``.
    """
    import importlib.machinery
    import sys

    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise RegistryError(f"registry spec {spec!r} must look like 'package.module:attribute'")
    module_name = spec.split(":", 1)[0]
    if module_name in sys.modules:
        return str(getattr(sys.modules[module_name], "__file__", None) or "already imported")
    path: list[str] | None = None
    found: Any = None
    parts = module_name.split(".")
    for index, part in enumerate(parts):
        # the top level through every finder (editable installs, built-ins; nothing is imported),
        # below it the parent's directories only (importlib.util.find_spec would import the parent)
        found = importlib.util.find_spec(part) if path is None else importlib.machinery.PathFinder.find_spec(part, path)
        if found is None:
            where = ".".join(parts[: index + 1])
            raise RegistryError(
                f"registry {spec!r}: no module {where!r} on the Python path (check the name and PYTHONPATH)"
            )
        path = list(found.submodule_search_locations or [])
        if index < len(parts) - 1 and not path:
            raise RegistryError(f"registry {spec!r}: {'.'.join(parts[: index + 1])!r} is a module, not a package")
    return str(found.origin or "namespace package")


def load_registry(spec: str) -> dict[str, CrewSource]:
    """Import ``module:attribute`` and build the crew sources.

    Args:
        spec: ``"package.module:ATTRIBUTE"`` (the attribute may be a dotted
            path inside the module).

    Returns:
        ``{crew_id: CrewSource}`` in the mapping's order.

    Raises:
        RegistryError: malformed spec; module not importable, or its import
            (or the registry callable) raised (the message names the exception
            type and the file and line, not its text); attribute
            missing; attribute neither a mapping nor a callable returning one;
            empty mapping; a key that is not a non-empty string (at most 256
            characters, no control characters); a value that is neither a
            callable nor a crew instance.

    Source: ARCHITECTURE.md §11 (``--registry`` / ``AIP_CREWAI_REGISTRY``).
    """
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise RegistryError(f"registry spec {spec!r} must look like 'package.module:attribute'")
    module_name, attribute = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"registry {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    except Exception as exc:  # the module's own code failed: its type and place, never its text
        raise RegistryError(f"registry {spec!r}: importing module {module_name!r} raised {_raised(exc)}") from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise RegistryError(f"registry {spec!r}: module {module_name!r} has no attribute {attribute!r}") from exc
    entries = _as_mapping(spec, target)
    if not entries:
        raise RegistryError(f"registry {spec!r}: the crew mapping is empty")
    return {key: _source(spec, key, value) for key, value in _checked_items(spec, entries)}


def _raised(exc: Exception) -> str:
    """``RuntimeError at crews.py:12`` (a syntax error: its own file and line): what failed and where, without
    the exception's text, which can hold secrets."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{type(exc).__name__} at {Path(exc.filename).name}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        f"{type(exc).__name__} at {Path(frames[-1].filename).name}:{frames[-1].lineno}"
        if frames
        else type(exc).__name__
    )


def _as_mapping(spec: str, target: Any) -> Mapping[Any, Any]:
    if isinstance(target, Mapping):
        return target
    if callable(target):
        try:
            result = target()
        except Exception as exc:  # the registry's callable failed: its type and place, never its text
            raise RegistryError(f"registry {spec!r}: calling the registry callable raised {_raised(exc)}") from exc
        if isinstance(result, Mapping):
            return result
        raise RegistryError(
            f"registry {spec!r}: the callable returned {type(result).__name__}, "
            "not a mapping of crew id to crew factory"
        )
    raise RegistryError(
        f"registry {spec!r}: attribute is {type(target).__name__}, not a mapping or a callable returning one"
    )


def _checked_items(spec: str, entries: Mapping[Any, Any]) -> list[tuple[str, Any]]:
    items = []
    for key, value in entries.items():
        if not isinstance(key, str) or not key:
            raise RegistryError(f"registry {spec!r}: crew id {key!r} must be a non-empty string")
        if len(key) > MAX_CREW_ID_CHARS or _CONTROL.search(key):
            raise RegistryError(
                f"registry {spec!r}: crew id {key!r} must be at most "
                f"{MAX_CREW_ID_CHARS} characters without control characters"
            )
        items.append((key, value))
    return items


def _source(spec: str, key: str, value: Any) -> CrewSource:
    if not (callable(value) or _is_crew(value)):
        raise RegistryError(
            f"registry {spec!r}: crew {key!r} is {type(value).__name__}, not a zero-argument factory or a crew instance"
        )
    if callable(value):
        return CrewSource(crew_id=key, factory=value)
    return CrewSource(crew_id=key, template=value)


def _is_crew(value: Any) -> bool:
    return callable(getattr(value, "copy", None)) and callable(getattr(value, "kickoff", None))


def _detach_token_usage(crew: Any) -> None:
    """Give every agent LLM of a cloned crew its own zeroed token counters."""
    seen: set[int] = set()
    for agent in getattr(crew, "agents", None) or []:
        llm = getattr(agent, "llm", None)
        private = getattr(llm, "__pydantic_private__", None)
        if id(llm) in seen or not isinstance(private, dict):
            continue
        seen.add(id(llm))
        usage = private.get("_token_usage")
        if isinstance(usage, dict):
            private["_token_usage"] = dict.fromkeys(usage, 0)
