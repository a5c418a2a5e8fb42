"""``aip-crewai doctor``: the sidecar's start-up crew preflight, run by hand.

Builds every crew of the registry once, in a throwaway CrewAI state
directory (nothing of the sidecar's state is touched), and prints per crew
the problems the sidecar would publish in ``/health`` (``crew_problems``:
``llm_unconfigured``, ``knowledge_unavailable``, ``memory_unavailable``, ``human_input``,
``build_failed``) and its inputs (``crew_inputs``). CrewAI's own prints are
swallowed (they can quote provider errors).

The check runs in a child process, as the sidecar's start-up registry check does
(``isolation.fork_server.describe_registry``), within the same bound (:data:`CHECK_TIMEOUT_SECONDS`,
``--timeout``): a registry that ends the process at import (``os._exit``) or hangs is reported in one
line, never as the doctor's own exit status or a wait without end.

Exit codes (docs/reference/cli.md "Exit codes"): 0 no problem, 1 at least one crew has a
problem, or the check gave no answer (its process ended without one, or did not answer within the
bound), or CrewAI cannot be imported; 2 the registry cannot be loaded. It also says which worker
sandbox a sidecar started here would have (docs/security.md "Security": worker sandbox), and what is missing.

Source: docs/security.md ("Tenant-scoped crew state": start-up preflight); docs/reference/cli.md (``doctor``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aip_crewai.exit_codes import Exit
from aip_crewai.sidecar.isolation.fork_server import BOOT_TIMEOUT_SECONDS, REAP_SECONDS, describe_exit

#: How long the check may take (s) unless ``--timeout`` says otherwise: the sidecar's bound on its start-up
#: registry check (``fork_server.BOOT_TIMEOUT_SECONDS``), CrewAI's import and each crew's build included.
CHECK_TIMEOUT_SECONDS = BOOT_TIMEOUT_SECONDS


def main(args: argparse.Namespace) -> int:
    """Run the preflight for ``args.registry`` (or ``AIP_CREWAI_REGISTRY``); print it; return the exit code."""
    spec = args.registry or os.environ.get("AIP_CREWAI_REGISTRY", "")
    if not spec:
        print("aip-crewai: doctor needs --registry module:attribute (or AIP_CREWAI_REGISTRY)", file=sys.stderr)
        return Exit.USAGE
    timeout = args.timeout or CHECK_TIMEOUT_SECONDS
    state = Path(tempfile.mkdtemp(prefix="aip-crewai-doctor-"))
    try:
        answer = _check_in_child(spec, state, timeout)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if isinstance(answer, str):
        print(f"aip-crewai: cannot check the crew registry: {answer}", file=sys.stderr)
        return Exit.FAILED
    if answer.get("import_failed"):
        print(f"aip-crewai: cannot import CrewAI ({answer['import_failed']})", file=sys.stderr)
        return Exit.FAILED
    if answer.get("refused") is not None:
        print(f"aip-crewai: --registry: {answer['refused']}", file=sys.stderr)
        return Exit.USAGE
    problems: dict[str, list[str]] = answer["problems"]
    crew_inputs: dict[str, dict[str, Any]] = answer["inputs"]
    sandbox = _worker_sandbox()
    if args.json:
        print(json.dumps({"crew_problems": problems, "crew_inputs": crew_inputs, "worker_sandbox": sandbox}, indent=2))
    else:
        for crew_id in sorted(answer["crews"]):
            found = problems.get(crew_id, [])
            inputs = crew_inputs.get(crew_id, {})
            names = ", ".join(inputs.get("placeholders", [])) or "(none)"
            defaults = " (the crew fills defaults)" if inputs.get("defaults") else ""
            print(f"{crew_id}: {'problems: ' + ', '.join(found) if found else 'ok'}; inputs: {names}{defaults}")
        missing = f"; missing: {sandbox['message']}" if sandbox["missing"] else ""
        print(f"worker sandbox: {sandbox['mode']}{missing}")
    return Exit.FAILED if problems else Exit.OK


def _check_in_child(spec: str, state: Path, timeout: float) -> dict[str, Any] | str:
    """Run :func:`_check` in a forked child; its answer, or why there is none (a line for a person).

    The child is reaped, killed when it does not answer within ``timeout`` seconds or lingers
    after its answer (as ``fork_server.describe_registry`` reaps the sidecar's check)."""
    context = multiprocessing.get_context("fork")  # nothing imported yet worth sharing: a plain fork
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_check, args=(spec, state, writer), name="aip-crewai-doctor-check")
    process.start()
    writer.close()
    answer: dict[str, Any] | None = None
    timed_out = False
    try:
        if reader.poll(timeout):
            answer = reader.recv()
        else:
            timed_out = True
    except (EOFError, OSError):
        answer = None
    finally:
        reader.close()
        process.join(0 if timed_out else REAP_SECONDS)
        if process.exitcode is None:
            process.kill()
            process.join(REAP_SECONDS)
    if timed_out:
        return (
            f"the registry check process did not answer within {timeout:g} s "
            "(killed: does the registry's import or a crew's build hang?)"
        )
    if answer is None:
        return f"the registry check process ended without an answer ({describe_exit(process.exitcode)})"
    return answer


def _check(spec: str, state: Path, answer: Connection) -> None:
    """The child's part: CrewAI's environment in ``state``, ``import crewai``, the registry, the preflight;
    one answer on ``answer`` (``refused``: the registry cannot be loaded; ``import_failed``: the exception
    class of a failed CrewAI import). Anything else ends the child without an answer."""
    with contextlib.redirect_stdout(io.StringIO()):  # CrewAI prints; its text can quote provider errors
        from aip_crewai.sidecar.crewai_env import import_crewai, prepare_crewai_environment

        prepare_crewai_environment(state)  # before anything imports crewai
        try:
            import_crewai()
        except Exception as exc:  # noqa: BLE001 - a broken install: only its class is said, as the sidecar says it
            answer.send({"import_failed": type(exc).__name__})
            return
        from aip_crewai.sidecar.operations.startup.preflight import preflight
        from aip_crewai.sidecar.registry import RegistryError, load_registry

        try:
            registry = load_registry(spec)
        except (RegistryError, ImportError) as exc:
            answer.send({"refused": str(exc)})
            return
        found = preflight(registry)
    answer.send(
        {
            "crews": list(registry),
            "problems": {k: list(v) for k, v in found.problems.items()},
            "inputs": {k: dict(v) for k, v in found.inputs.items()},
        }
    )


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
