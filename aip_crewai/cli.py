"""``aip-crewai``: the command line.

Subcommands: ``host``, ``sidecar``, ``call``, ``approvals``, ``journal``,
``keys``, ``contracts``. Each subcommand module is imported lazily so that
``aip-crewai host`` never imports CrewAI (DESIGN.md §1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"


def _contracts(args: argparse.Namespace) -> int:
    from .contracts import artifacts

    root = Path(args.dir)
    if args.write:
        for rel in artifacts.write(root):
            print(f"wrote {root / rel}")
        return 0
    drift = artifacts.check(root)
    for rel in drift:
        print(f"drift: {root / rel} differs from the code; run `aip-crewai contracts --write`", file=sys.stderr)
    return 1 if drift else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aip-crewai", description="Governed AIP gateway for CrewAI crews.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("contracts", help="check or write the generated contract artifacts")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when contracts/ differs from the code")
    mode.add_argument("--write", action="store_true", help="regenerate contracts/")
    p.add_argument("--dir", default=str(DEFAULT_CONTRACTS_DIR), help="artifact folder (default: %(default)s)")
    p.set_defaults(func=_contracts)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aip-crewai`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Long-running processes own their own argument parsing.
    if argv and argv[0] == "sidecar":
        from .sidecar.main import main as sidecar_main

        return sidecar_main(argv[1:])
    if argv and argv[0] == "host":
        from .host.main import main as host_main

        return host_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
