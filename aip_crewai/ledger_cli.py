"""The ``aip-crewai receipts verify`` and ``aip-crewai usage`` commands (docs/observing.md "Observing actions").

``receipts verify FILE --public-key KEY [--public-key KEY ...]`` checks a receipt document offline (no
host needed): exactly its canonical form, its hash, its Ed25519 signature by one of the given public keys
(base64, as ``aip-crewai keys generate receipt`` prints them and ``/.well-known/aip-receipt-keys``
publishes them). Exit 0 with the claims printed, 1 with the reason on stderr when refused, 2 for a file
that cannot be read or a key that is not one. ``usage [--from T] [--to T]`` asks the host for the caller's
tenant's usage (an empty or blank ``--from``/``--to`` is a usage error, exit 2, as the host answers
``from=`` with 400; a refusal: the exit code of every client command, 4 for a 401 or 403).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import cli_args
from .exit_codes import Exit


def _verify(args: argparse.Namespace) -> int:
    from .host.ledger.receipts import MAX_RECEIPT_BYTES, ReceiptInvalid, parse_public_key, verify
    from .plumbing.files import FileTooLarge, NotRegularFile, read_regular

    keys = []
    for text in args.public_key:
        try:
            keys.append(parse_public_key(text))
        except ValueError as exc:
            print(f"aip-crewai: --public-key {text!r}: {exc}", file=sys.stderr)
            return Exit.USAGE
    try:
        document = read_regular(Path(args.file), MAX_RECEIPT_BYTES + 1)
    except (OSError, NotRegularFile, FileTooLarge) as exc:
        print(f"aip-crewai: {args.file}: {exc}", file=sys.stderr)
        return Exit.USAGE
    try:
        claims = verify(document, keys)
    except ReceiptInvalid as exc:
        print(f"aip-crewai: receipt refused: {exc.reason}", file=sys.stderr)
        return Exit.FAILED
    print(json.dumps({"verified": True, "receipt": claims}, indent=None if args.json else 2, sort_keys=True))
    return Exit.OK


def _usage(
    args: argparse.Namespace,
    client_of: Callable[[argparse.Namespace], Any],
    refused: Callable[[Any, bool], Exit],
) -> int:
    from .client import AipClientError

    try:
        with client_of(args) as client:
            report = client.usage(from_=args.from_, to=args.to)
    except AipClientError as exc:
        return refused(exc, args.json)
    print(json.dumps(report, indent=None if args.json else 2))
    return Exit.OK


def add_parsers(
    sub: Any,
    add_client_flags: Callable[[argparse.ArgumentParser], None],
    client_of: Callable[[argparse.Namespace], Any],
    refused: Callable[[Any, bool], Exit],
) -> None:
    """Add ``receipts`` and ``usage`` to the ``aip-crewai`` command's subparsers; ``refused`` reports a host's
    refusal and gives its exit code, as for every other client command (docs/reference/cli.md "Exit codes")."""
    p = sub.add_parser("receipts", help="signed result receipts")
    rsub = p.add_subparsers(dest="receipts_command", required=True)
    q = rsub.add_parser("verify", help="verify a receipt offline (exit 0: valid; 1: refused, with the reason)")
    q.add_argument("file", help="the receipt as GET /aip/v1/receipts/{id} returned it, byte for byte")
    q.add_argument(
        "--public-key",
        action="append",
        required=True,
        help="a receipt public key (base64); repeat for previous keys after a rotation",
    )
    q.add_argument("--json", action="store_true", help="one line of JSON")
    q.set_defaults(func=_verify)
    p = sub.add_parser("usage", help="your tenant's token usage and cost per crew (operator role)")
    add_client_flags(p)
    p.add_argument("--from", dest="from_", type=cli_args.not_blank, help="RFC 3339, inclusive (default: the start)")
    p.add_argument("--to", type=cli_args.not_blank, help="RFC 3339, exclusive (default: now)")
    p.set_defaults(func=lambda args: _usage(args, client_of, refused))
