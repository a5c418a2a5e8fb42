"""Human output of the ``aip-crewai`` client commands (pure: values in, lines out).

Every text a person reads goes through :mod:`aip_crewai.contracts.display`:
code points one would misread are written as ``\\u`` escapes, under a warning
line. ``--json`` prints the AIP values themselves instead (docs/reference/cli.md "Command line").

Source: docs/reference/cli.md "Command line".
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from typing import Any

from .contracts import display

#: Longest value a table cell shows, characters (the rest is cut with ``…``).
CELL_CHARS = 40


def text(value: Any) -> str:
    """One value as a person reads it: a string escaped (:func:`display.escape`), anything else as compact JSON."""
    if isinstance(value, str):
        return display.escape(value)
    return display.dumps(value, indent=None)


def command(*words: Any) -> str:
    """A suggested ``aip-crewai`` command line, to paste into a POSIX shell: each word shown as :func:`text`
    shows it, then quoted for the shell (``shlex.quote``) unless it holds only letters, digits and ``@%+=:,./-``.
    A valid action id may hold ``;``, ``$`` or a quote (docs/reference/cli.md "Command line"): pasted, it stays
    one word of this command, never a second command."""
    return shlex.join(["aip-crewai", *(text(word) for word in words)])


def json_block(value: Any, indent: str = "  ") -> list[str]:
    """A JSON value as indented lines, findings escaped, after a warning line when there are any."""
    warning = display.banner(display.findings(value))
    lines = [warning] if warning else []
    return lines + [indent + line for line in display.dumps(value).splitlines()]


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    """Left-aligned columns, two spaces apart; cells already escaped, cut at :data:`CELL_CHARS`."""
    cut = [[c if len(c) <= CELL_CHARS else c[: CELL_CHARS - 1] + "…" for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cut) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cut]


def _error_text(error: dict[str, Any]) -> str:
    retry = ", retryable" if error.get("retryable") else ""
    return f"{text(error.get('code', '?'))}{retry}: {text(error.get('message', ''))}"


def envelope_lines(envelope: dict[str, Any], *, in_stream: bool = False) -> list[str]:
    """An ``action_result``, ``ack`` or ``error`` envelope as lines, with the next command where there is one.
    ``in_stream``: an ``error`` envelope is a stream's ``aip_error`` frame, the failure of the action it follows
    (``error: <code>``, as a failed result says it), not the refusal of a request (``refused: <code>``)."""
    body = envelope.get("body") or {}
    result, ack, error = body.get("action_result"), body.get("ack"), (body.get("error") or {}).get("error")
    raw_id = (result or ack or {}).get("action_id") or envelope.get("correlation_id") or "?"
    action_id = text(raw_id)
    if isinstance(result, dict):
        status = result.get("status")
        output = result.get("output")
        if status == "pending_approval" and isinstance(output, dict):
            return [
                f"pending approval  action {action_id}  approval {text(output.get('approval_id', '?'))}"
                f"  expires {text(output.get('expires_at', '?'))}",
                f"next: an approver decides ({command('approvals', 'show', output.get('approval_id', '?'))}); "
                f"then: {command('actions', 'result', raw_id)}  (or: {command('actions', 'follow', raw_id)})",
            ]
        lines = [f"{text(status)}  action {action_id}"]
        if isinstance(result.get("error"), dict):
            lines.append(f"error: {_error_text(result['error'])}")
            details = result["error"].get("details")
            if details:
                lines.append(f"details: {text(details)}")
        if output is not None:
            lines.append("output:")
            lines += json_block(output)
        return lines
    if isinstance(ack, dict):
        if ack.get("reason") == "pending_approval":
            return [
                f"pending approval  action {action_id}",
                f"next: an approver decides (its approval: {command('approvals', 'list')}); "
                f"then: {command('actions', 'follow', raw_id)}",
            ]
        if ack.get("status") == "cached":  # the action had ended: its stored result follows (or is answered)
            return [f"cached  action {action_id}  (already ended: {text(ack.get('reason', '?'))})"]
        return [
            f"{text(ack.get('status', '?'))}  action {action_id}  (still running)",
            f"next: {command('actions', 'follow', raw_id)}  (or: {command('actions', 'result', raw_id)})",
        ]
    if isinstance(error, dict):
        return [f"{'error' if in_stream else 'refused'}: {_error_text(error)}"]
    return json_block(envelope)


def status_lines(status: dict[str, Any]) -> list[str]:
    """An ``ActionStatus`` as ``field: value`` lines, its result (when final) below."""
    lines = [
        f"action      {text(status.get('action_id', '?'))}",
        f"capability  {text(status.get('capability_id', '?'))}",
        f"state       {text(status.get('state', '?'))}",
        f"updated     {text(status.get('updated_at', '?'))}",
    ]
    if status.get("approval_id"):
        lines.append(f"approval    {text(status['approval_id'])}")
    result = status.get("result")
    if isinstance(result, dict):
        lines += envelope_lines({"body": {"action_result": result}})[1:]
    elif status.get("state") == "pending_approval":
        lines.append(f"next: an approver decides; then: {command('actions', 'follow', status.get('action_id'))}")
    elif status.get("state") in ("queued", "running"):
        lines.append(f"next: {command('actions', 'follow', status.get('action_id'))}")
    return lines


def approvals_table(listing: dict[str, Any]) -> list[str]:
    """An ``ApprovalList`` page as a table (one row per approval), the next page's command below."""
    rows = []
    for view in listing.get("approvals") or []:
        request = view.get("request") or {}
        decision = view.get("decision") or {}
        rows.append(
            [
                text(request.get("id", "?")),
                text(view.get("status", "?")),
                text(request.get("action_id", "?")),
                text(request.get("capability_id", "?")),
                text((request.get("requester") or {}).get("id", "?")),
                text(request.get("risk") or "-"),
                text(request.get("expires_at", "?") if not decision else decision.get("decided_at", "?")),
            ]
        )
    if not rows:
        return ["no approvals"]
    lines = table(rows, ["APPROVAL", "STATUS", "ACTION", "CAPABILITY", "REQUESTER", "RISK", "EXPIRES/DECIDED"])
    if listing.get("cursor"):
        lines.append(f"more: {command('approvals', 'list', '--cursor', listing['cursor'])}")
    return lines


def approval_lines(view: dict[str, Any]) -> list[str]:
    """An ``ApprovalRecordView``: its request and decision, then its exact input (escaped, with a warning)."""
    request = view.get("request") or {}
    lines = [
        f"approval    {text(request.get('id', '?'))}  ({text(view.get('status', '?'))})",
        f"action      {text(request.get('action_id', '?'))}",
        f"capability  {text(request.get('capability_id', '?'))}  risk {text(request.get('risk') or '-')}",
        f"requester   {text((request.get('requester') or {}).get('id', '?'))}",
        f"why         {text(request.get('reason') or '-')}",
        f"expires     {text(request.get('expires_at', '?'))}",
        f"policy      {text(request.get('policy_hash', '?'))}",
    ]
    decision = view.get("decision")
    if isinstance(decision, dict):
        reason = f": {text(decision['reason'])}" if decision.get("reason") else ""
        lines.append(
            f"decision    {text(decision.get('decision', '?'))} by "
            f"{text((decision.get('approver') or {}).get('id', '?'))} at {text(decision.get('decided_at', '?'))}{reason}"
        )
    payload = view.get("evidence_payload")
    if isinstance(payload, dict):
        lines.append("input:")
        lines += json_block(payload.get("input"))
    else:
        lines.append("input: (not shown to this principal)")
    if view.get("status") == "pending":
        lines.append(f"next: {command('approvals', 'decide', request.get('id', '?'))} approved|denied --reason TEXT")
    return lines


def decision_lines(decision: dict[str, Any]) -> list[str]:
    """An ``ApprovalDecision`` in one line."""
    return [
        f"{text(decision.get('decision', '?'))}  approval {text(decision.get('approval_id', '?'))} by "
        f"{text((decision.get('approver') or {}).get('id', '?'))} at {text(decision.get('decided_at', '?'))}"
    ]


def chunk_text(envelope: dict[str, Any]) -> str | None:
    """The text part of a ``stream_chunk`` envelope, or None."""
    chunk = (envelope.get("body") or {}).get("stream_chunk") or {}
    part = chunk.get("part") or {}
    return part.get("text") if isinstance(part, dict) else None


def batch_item(envelope: dict[str, Any]) -> int | None:
    """The ``batch_run`` item a chunk belongs to (its data's ``batch_item``), or None."""
    data = ((envelope.get("body") or {}).get("stream_chunk") or {}).get("data")
    item = data.get("batch_item") if isinstance(data, dict) else None
    return item if isinstance(item, int) and not isinstance(item, bool) else None


def field_type(schema: Any, depth: int = 0) -> str:
    """A JSON Schema's type in a few characters, for one manifest line: ``string``, ``integer``, ``string[]``
    (an array of strings), ``string|null``, ``"memory"|"knowledge"`` (an enum), ``any`` when it says none. Pure."""
    if not isinstance(schema, dict) or depth > 3:
        return "any"
    if isinstance(schema.get("enum"), list):
        return "|".join(json.dumps(value) for value in schema["enum"][:8]) or "any"
    choices = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(choices, list) and choices:
        return "|".join(field_type(choice, depth + 1) for choice in choices[:8])
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(text(str(k)) for k in kind[:8]) or "any"
    if kind == "array":
        return field_type(schema.get("items"), depth + 1) + "[]"
    return text(kind) if isinstance(kind, str) else "any"


def manifest_lines(manifest: dict[str, Any]) -> Iterator[str]:
    """One block per capability: id, kind, whether it needs approval, its input's required and optional fields."""
    for cap in manifest.get("capabilities") or []:
        if not isinstance(cap, dict):
            continue
        schema = cap.get("input_schema") or {}
        root = schema
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if isinstance(ref, str):
            root = (schema.get("$defs") or {}).get(ref.rsplit("/", 1)[-1], schema)
        props = sorted((root.get("properties") or {}) if isinstance(root, dict) else {})
        required = set(root.get("required") or []) if isinstance(root, dict) else set()
        shapes = (root.get("properties") or {}) if isinstance(root, dict) else {}
        fields = (
            ", ".join(f"{text(name)}{'' if name in required else '?'}: {field_type(shapes[name])}" for name in props)
            or "(any object)"
        )
        approval = "  needs approval" if cap.get("requires_human_approval") else ""
        summary = text(cap.get("description") or cap.get("name") or "")
        yield f"{text(cap.get('id'))}  [{text(cap.get('kind', ''))}]{approval} {summary}".rstrip()
        yield f"    input: {fields}"


def approval_event_line(event: str, data: dict[str, Any]) -> str:
    """One line of ``approvals watch`` for an approval event (its ``data`` is an AIP Event)."""
    view = data.get("data") or {}
    request = view.get("request") or {}
    approval_id = text(request.get("id", "?"))
    if event == "pending":
        requester = text((request.get("requester") or {}).get("id", "?"))
        return (
            f"pending    {approval_id}  {text(request.get('capability_id', '?'))}  action "
            f"{text(request.get('action_id', '?'))}  by {requester}  expires {text(request.get('expires_at', '?'))}"
            f"  policy {text(request.get('policy_hash', '?'))}"
        )
    if event == "decided":
        decision = view.get("decision") or {}
        return (
            f"decided    {approval_id}  {text(decision.get('decision', view.get('status', '?')))} by "
            f"{text((decision.get('approver') or {}).get('id', '?'))}"
        )
    return f"{text(event):<10} {approval_id}"
