"""``aip-crewai doctor``: the sidecar's start-up crew preflight, run by hand.

Builds every crew of the registry once, in a throwaway CrewAI state
directory (nothing of the sidecar's state is touched), and prints per crew
the problems the sidecar would publish in ``/health`` (``crew_problems``:
``llm_unconfigured``, ``knowledge_unavailable``, ``memory_unavailable``, ``human_input``,
``build_failed``) and its inputs (``crew_inputs``). CrewAI's own prints are
swallowed (they can quote provider errors).

Exit codes (docs/reference/cli.md "Exit codes"): 0 no problem, 1 at least one crew has a
problem, 2 the registry cannot be loaded. It also says which worker sandbox a sidecar started
here would have (docs/security.md "Security": worker sandbox), and what is missing.

Source: docs/security.md ("Tenant-scoped crew state": start-up preflight).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from aip_crewai.exit_codes import Exit


def main(args: argparse.Namespace) -> int:
    """Run the preflight for ``args.registry`` (or ``AIP_CREWAI_REGISTRY``); print it; return the exit code."""
    spec = args.registry or os.environ.get("AIP_CREWAI_REGISTRY", "")
    if not spec:
        print("aip-crewai: doctor needs --registry module:attribute (or AIP_CREWAI_REGISTRY)", file=sys.stderr)
        return Exit.USAGE
    state = Path(tempfile.mkdtemp(prefix="aip-crewai-doctor-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # CrewAI prints; its text can quote provider errors
            from aip_crewai.sidecar.crewai_env import import_crewai, prepare_crewai_environment

            prepare_crewai_environment(state)  # before anything imports crewai
            import_crewai()
            from aip_crewai.sidecar.operations.startup.preflight import preflight
            from aip_crewai.sidecar.registry import RegistryError, load_registry

            try:
                registry = load_registry(spec)
            except (RegistryError, ImportError) as exc:
                error: str | None = f"--registry: {exc}"
            else:
                error = None
                found = preflight(registry)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if error is not None:
        print(f"aip-crewai: {error}", file=sys.stderr)
        return Exit.USAGE
    sandbox = _worker_sandbox()
    if args.json:
        print(
            json.dumps(
                {"crew_problems": found.problems, "crew_inputs": found.inputs, "worker_sandbox": sandbox}, indent=2
            )
        )
    else:
        for crew_id in sorted(registry):
            problems = found.problems.get(crew_id, [])
            inputs = found.inputs.get(crew_id, {})
            names = ", ".join(inputs.get("placeholders", [])) or "(none)"
            defaults = " (the crew fills defaults)" if inputs.get("defaults") else ""
            print(f"{crew_id}: {'problems: ' + ', '.join(problems) if problems else 'ok'}; inputs: {names}{defaults}")
        missing = f"; missing: {sandbox['message']}" if sandbox["missing"] else ""
        print(f"worker sandbox: {sandbox['mode']}{missing}")
    return Exit.FAILED if found.problems else Exit.OK


def _worker_sandbox() -> dict[str, object]:
    """The worker sandbox a sidecar started here with this environment would have (``/health``
    ``worker_sandbox`` plus a ``message`` naming what is missing): ``AIP_CREWAI_ISOLATION`` and
    ``AIP_CREWAI_WORKER_USER``, this user, this kernel's Landlock.

    Source: docs/security.md "Security" (worker sandbox).
    """
    import msgspec

    from aip_crewai.sidecar.isolation import sandbox

    isolation = (os.environ.get("AIP_CREWAI_ISOLATION") or "process").strip().lower()
    user = os.environ.get("AIP_CREWAI_WORKER_USER") or None
    abi = sandbox.landlock_abi()
    found = sandbox.report(
        isolation=isolation,
        sandbox=sandbox.SandboxPlan(abi, None, None, user, None, [], "/", None),
        euid=os.geteuid(),
    )
    return {**msgspec.to_builtins(found), "message": sandbox.describe_missing(found)}
