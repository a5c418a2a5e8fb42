"""``aip-crewai``: the command line.

Subcommands: ``host``, ``sidecar``, ``call``, ``approvals``, ``journal``,
``keys``, ``contracts``. Each subcommand module is imported lazily so that
``aip-crewai host`` never imports CrewAI (ARCHITECTURE.md §1).
"""

from __future__ import annotations

import argparse
import json
import os
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


def _client(args: argparse.Namespace):
    from .client import AipClient
    from .keys import load_ed25519, read_private

    token = read_private(Path(args.token_file), what="token file").decode() if args.token_file else None
    key = load_ed25519(Path(args.signing_key)) if args.signing_key else None
    if token is None and key is None:
        raise SystemExit("aip-crewai: give --token-file or --signing-key (or AIP_CREWAI_TOKEN_FILE)")
    return AipClient(args.url, token=token, signing_key=key, key_id=args.key_id)


def _print(value: object, as_json: bool) -> None:
    if as_json:
        print(json.dumps(value, separators=(",", ":")))
    else:
        print(json.dumps(value, indent=2, ensure_ascii=False))


def _chunk_text(envelope: dict) -> str | None:
    chunk = (envelope.get("body") or {}).get("stream_chunk") or {}
    part = chunk.get("part") or {}
    return part.get("text") if isinstance(part, dict) else None


def _with_progress(work, quiet: bool):
    """Run a blocking call; on a terminal (and without --json) show the
    elapsed time on stderr every 2 s while it waits."""
    import threading
    import time

    if quiet or not sys.stderr.isatty():
        return work()
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(2.0):
            print(f"\r  waiting for the result… {time.monotonic() - started:.0f} s", end="", file=sys.stderr,
                  flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        return work()
    finally:
        done.set()
        thread.join()
        if time.monotonic() - started >= 2.0:
            print(file=sys.stderr)


def _call(args: argparse.Namespace) -> int:
    from .client import AipClientError

    try:
        value = json.loads(args.input)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"aip-crewai: --input is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit("aip-crewai: --input must be a JSON object")
    kwargs = {"action_id": args.action_id, "idempotency_key": args.idempotency_key}
    try:
        with _client(args) as client:
            if not args.stream:
                _print(_with_progress(lambda: client.call(args.capability_id, value, **kwargs), args.json),
                       args.json)
                return 0
            for event, envelope in client.stream(args.capability_id, value, **kwargs):
                if args.json:
                    print(json.dumps({"event": event, "envelope": envelope}, separators=(",", ":")), flush=True)
                elif event in ("chunk", "done") and _chunk_text(envelope):
                    print(_chunk_text(envelope), end="", flush=True)
                elif event in ("result", "aip_error", "ack"):
                    print(f"\n[{event}]", flush=True)
                    _print(envelope.get("body"), False)
            return 0
    except AipClientError as exc:
        print(f"aip-crewai: {exc}", file=sys.stderr)
        if args.json:
            _print(exc.body, True)
        return 1


def _approvals(args: argparse.Namespace) -> int:
    from .client import AipClientError

    try:
        with _client(args) as client:
            if args.approvals_command == "list":
                _print(client.approvals(status=args.status, cursor=args.cursor), args.json)
            elif args.approvals_command == "show":
                _print(client.approval(args.approval_id), args.json)
            else:
                _print(client.decide(args.approval_id, args.decision, args.reason), args.json)
        return 0
    except AipClientError as exc:
        print(f"aip-crewai: {exc}", file=sys.stderr)
        return 1


def _keys(args: argparse.Namespace) -> int:
    from .keys import generate_ed25519, generate_token

    path = Path(args.out)
    try:
        if args.kind == "token":
            print(json.dumps({"file": str(path), "token_sha256": generate_token(path)}))
        else:
            print(json.dumps({"file": str(path), "ed25519_public_key": generate_ed25519(path)}))
    except FileExistsError:
        raise SystemExit(f"aip-crewai: {path} exists; refusing to overwrite a secret") from None
    return 0


def _journal(args: argparse.Namespace) -> int:
    from .sidecar.inspect import main as inspect_main

    return inspect_main(args)


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("AIP_CREWAI_HOST_URL", "http://127.0.0.1:8081"),
                   help="host base URL (env AIP_CREWAI_HOST_URL; default %(default)s)")
    p.add_argument("--token-file", default=os.environ.get("AIP_CREWAI_TOKEN_FILE"),
                   help="0600 file holding the principal's bearer token (env AIP_CREWAI_TOKEN_FILE)")
    p.add_argument("--signing-key", default=os.environ.get("AIP_CREWAI_SIGNING_KEY"),
                   help="0600 Ed25519 private key (PEM) to sign envelopes instead (env AIP_CREWAI_SIGNING_KEY)")
    p.add_argument("--key-id", default=os.environ.get("AIP_CREWAI_KEY_ID"), help="principal id of the signing key")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aip-crewai", description="Governed AIP gateway for CrewAI crews.")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("host", help="run the AIP host (aip-crewai host --config host.toml; see --help)")
    sub.add_parser("sidecar", help="run the CrewAI sidecar (aip-crewai sidecar --help)")
    p = sub.add_parser("contracts", help="check or write the generated contract artifacts")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when contracts/ differs from the code")
    mode.add_argument("--write", action="store_true", help="regenerate contracts/")
    p.add_argument("--dir", default=str(DEFAULT_CONTRACTS_DIR), help="artifact folder (default: %(default)s)")
    p.set_defaults(func=_contracts)

    p = sub.add_parser("call", help="invoke a capability as a tenant")
    p.add_argument("capability_id")
    p.add_argument("--input", required=True, help="the action input, a JSON object")
    p.add_argument("--action-id", help="action id (default: a new random id)")
    p.add_argument("--idempotency-key", help="idempotency key (required by mutations and knowledge_query)")
    p.add_argument("--stream", action="store_true", help="stream chunks as they arrive (SSE)")
    _add_client_flags(p)
    p.set_defaults(func=_call)

    p = sub.add_parser("approvals", help="list, show or decide approvals")
    asub = p.add_subparsers(dest="approvals_command", required=True)
    q = asub.add_parser("list", help="one page of the tenant's approvals")
    q.add_argument("--status", default="pending", help="pending|approved|denied|expired (default %(default)s)")
    q.add_argument("--cursor")
    _add_client_flags(q)
    q = asub.add_parser("show", help="one approval with its input snapshot")
    q.add_argument("approval_id")
    _add_client_flags(q)
    q = asub.add_parser("decide", help="approve or deny (as the authenticated approver)")
    q.add_argument("approval_id")
    q.add_argument("decision", choices=["approved", "denied"])
    q.add_argument("--reason", required=True)
    _add_client_flags(q)
    p.set_defaults(func=_approvals)

    p = sub.add_parser("keys", help="generate secrets (written 0600)")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    q = ksub.add_parser("generate", help="a bearer token (prints its SHA-256) or an Ed25519 key (prints the public key)")
    q.add_argument("kind", choices=["token", "ed25519"])
    q.add_argument("--out", required=True, help="file to create (refuses to overwrite)")
    p.set_defaults(func=_keys)

    p = sub.add_parser("journal", help="read-only views of a sidecar journal file")
    jsub = p.add_subparsers(dest="journal_command", required=True)
    q = jsub.add_parser("list", help="jobs, newest first")
    q.add_argument("journal")
    q.add_argument("--limit", type=int, default=50)
    q.add_argument("--json", action="store_true")
    q = jsub.add_parser("inspect", help="one job with its events")
    q.add_argument("journal")
    q.add_argument("action_id")
    q.add_argument("--json", action="store_true")
    p.set_defaults(func=_journal)
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
    import httpx

    from .keys import SecretFileError

    try:
        return int(args.func(args))
    except SecretFileError as exc:
        print(f"aip-crewai: {exc}", file=sys.stderr)
    except httpx.TransportError as exc:
        print(f"aip-crewai: cannot reach {getattr(args, 'url', 'the host')}: {type(exc).__name__}", file=sys.stderr)
    except OSError as exc:
        print(f"aip-crewai: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
