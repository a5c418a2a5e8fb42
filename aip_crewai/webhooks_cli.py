"""The ``aip-crewai webhooks deliveries`` command (docs/webhooks.md "Listing deliveries").

``webhooks deliveries [--endpoint ID] [--event-type T] [--status S] [--action-id ID] [--limit N]
[--cursor C] [--json]`` asks the host for one page of the caller's tenant's webhook deliveries, newest first
(operator role): one line each (created, status, event type, action, attempts, last outcome, delivery id),
then the command that lists the next page when there is one; ``--json``: the page as the host answered it,
on one line. ``--action-id``, ``--cursor`` and ``--limit`` are checked before anything is sent, as every
command checks them (:mod:`.cli_args`: a bad one is a usage error, exit 2); the other filters are checked by
the host (a bad one: its 400, exit 1). Exit 0, or with the host's error on stderr the exit code of every
client command (1; 4 for a 401 or 403).
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Callable
from typing import Any

from . import cli_args
from .exit_codes import Exit


def delivery_lines(page: dict[str, Any]) -> list[str]:
    """The human lines of one page (pure): a delivery per line, a hint for the next page."""
    lines = [
        f"{d['created_at']}  {d['status']:<9}  {d['event_type']:<18}  {d['action_id']}  "
        f"attempts={d['attempts']}  last={d['last_outcome'] or '-'}  {d['delivery_id']}"
        for d in page.get("deliveries", [])
    ]
    if not lines:
        lines.append("no deliveries")
    if not page.get("done", True) and page.get("cursor"):
        lines.append(f"more: add --cursor {shlex.quote(page['cursor'])}")
    return lines


def _deliveries(
    args: argparse.Namespace,
    client_of: Callable[[argparse.Namespace], Any],
    refused: Callable[[Any, bool], Exit],
) -> int:
    from .client import AipClientError

    try:
        with client_of(args) as client:
            page = client.webhook_deliveries(
                endpoint=args.endpoint,
                event_type=args.event_type,
                status=args.status,
                action_id=args.action_id,
                cursor=args.cursor,
                limit=args.limit,
            )
    except AipClientError as exc:
        return refused(exc, args.json)
    print(json.dumps(page) if args.json else "\n".join(delivery_lines(page)))
    return Exit.OK


def add_parsers(
    sub: Any,
    add_client_flags: Callable[[argparse.ArgumentParser], None],
    client_of: Callable[[argparse.Namespace], Any],
    refused: Callable[[Any, bool], Exit],
) -> None:
    """Add ``webhooks`` to the ``aip-crewai`` command's subparsers; ``refused`` reports a host's refusal and
    gives its exit code, as for every other client command (docs/reference/cli.md "Exit codes")."""
    p = sub.add_parser("webhooks", help="webhook deliveries of your tenant (operator role)")
    wsub = p.add_subparsers(dest="webhooks_command", required=True)
    q = wsub.add_parser("deliveries", help="one page of deliveries and their attempts, newest first")
    add_client_flags(q)
    q.add_argument("--endpoint", help="an endpoint id (whe_...)")
    q.add_argument("--event-type", help="approval.requested, approval.decided, action.completed, ...")
    q.add_argument("--status", help="pending, delivered or expired")
    q.add_argument("--action-id", type=cli_args.action_id, help="only the events of this action")
    q.add_argument("--limit", type=cli_args.integer(1, 200), help="1..200 (default 50)")
    q.add_argument("--cursor", type=cli_args.not_blank, help="the next page (as a previous page printed it)")
    q.set_defaults(func=lambda args: _deliveries(args, client_of, refused))
