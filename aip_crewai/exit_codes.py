"""The exit codes of every ``aip-crewai`` command, and how a CLI answer maps to one.

One convention for the host, the sidecar and the client commands (docs/reference/cli.md
"Exit codes"): 0 success, 1 a failure at run time, 2 a usage or
configuration error (bad arguments, an unusable file, a taken port). The
client commands that report an action's outcome (``call``, ``actions
result|follow``) add one code per outcome, so a script can tell them apart
without parsing the output.

Source: docs/reference/cli.md "Exit codes"; AIP shapes: docs/reference/http-api.md "AIP 1.0 conformance".
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    """Process exit codes (docs/reference/cli.md "Exit codes")."""

    OK = 0  #: success; for an action: completed
    FAILED = 1  #: the action failed, or the host refused the request (an AIP error)
    USAGE = 2  #: usage or configuration error (arguments, files, URL, taken port)
    CANCELLED = 3  #: the action was cancelled
    DENIED = 4  #: the approval was denied or expired, a policy refused it, or 401/403
    PENDING_APPROVAL = 5  #: the action waits for an approver's decision
    RUNNING = 6  #: the action was accepted and has no result yet (follow it)
    UNREACHABLE = 7  #: the host could not be reached (connection refused, DNS, timeout)
    HANGUP = 129  #: ``host``/``sidecar``: stopped by SIGHUP (a closed terminal), as SIGTERM stops: 128 + SIGHUP
    INTERRUPTED = 130  #: Ctrl-C (SIGINT): a client command stopped (a stream: with its resume command); ``host``/``sidecar``: a second one during the shutdown, no drain; 128 + SIGINT
    BROKEN_PIPE = 141  #: stdout was closed by its reader (``| head``): 128 + SIGPIPE, as a shell reports it


#: Error codes that mean "a policy said no" rather than "it failed".
_DENIED_CODES = frozenset({"policy.approval_denied", "policy.approval_expired"})


def _denied(code: object, http_status: int | None = None) -> bool:
    if http_status in (401, 403):
        return True
    return isinstance(code, str) and (code in _DENIED_CODES or code.startswith(("policy.", "auth.")))


def of_error(code: object, http_status: int | None = None) -> Exit:
    """The exit code of an AIP error (``ProtocolError.code``, the HTTP status when the host refused)."""
    return Exit.DENIED if _denied(code, http_status) else Exit.FAILED


def of_envelope(envelope: Any) -> Exit | None:
    """The exit code an AIP envelope stands for, or None when it carries no outcome (a chunk).

    Args:
        envelope: an ``aip.core.v1.action_result``, ``aip.core.v1.ack`` or
            ``aip.core.v1.error`` envelope (decoded JSON).

    Returns:
        ``action_result``: completed 0, failed 1 (4 when its error is a
        denial), cancelled 3, pending_approval 5, anything else 6; ``ack``:
        5 when its reason is ``pending_approval``, else 6; ``error``: 1 or 4.
    """
    body = envelope.get("body") if isinstance(envelope, dict) else None
    if not isinstance(body, dict):
        return None
    result = body.get("action_result")
    if isinstance(result, dict):
        status = result.get("status")
        if status == "completed":
            return Exit.OK
        if status == "cancelled":
            return Exit.CANCELLED
        if status == "pending_approval":
            return Exit.PENDING_APPROVAL
        if status == "failed":
            return of_error((result.get("error") or {}).get("code"))
        return Exit.RUNNING
    ack = body.get("ack")
    if isinstance(ack, dict):
        return Exit.PENDING_APPROVAL if ack.get("reason") == "pending_approval" else Exit.RUNNING
    error = body.get("error")
    if isinstance(error, dict):
        inner = error.get("error")
        return of_error((inner if isinstance(inner, dict) else error).get("code"))
    return None
