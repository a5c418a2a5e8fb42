"""``aip-crewai``: the command line.

Subcommands: ``host``, ``sidecar``, ``call``, ``actions``, ``manifest``,
``approvals``, ``journal``, ``keys``, ``contracts``. Each subcommand module is
imported lazily so that ``aip-crewai host`` never imports CrewAI
(ARCHITECTURE.md §1). Exit codes: :class:`aip_crewai.exit_codes.Exit`
(docs/reference/cli.md "Exit codes").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from . import cli_args, ledger_cli, package_version, webhooks_cli
from .exit_codes import Exit, of_envelope, of_error
from .plumbing.log import configure_logging
from .stream_cli import follow as _follow
from .stream_cli import show_stream as _show_stream

if TYPE_CHECKING:
    from .client import AipClient

T = TypeVar("T")

DEFAULT_CONTRACTS_DIR = Path(__file__).resolve().parent.parent / "contracts"


def _contracts(args: argparse.Namespace) -> int:
    from .contracts import artifacts
    from .host.http.openapi import artifact as openapi_artifact

    root = Path(args.dir)
    extra = dict([openapi_artifact()])
    if args.write:
        for rel in artifacts.write(root, extra=extra):
            print(f"wrote {root / rel}")
        return 0
    drift = artifacts.check(root, extra=extra)
    for rel in drift:
        print(f"drift: {root / rel} differs from the code; run `aip-crewai contracts --write`", file=sys.stderr)
    return 1 if drift else 0


class UsageError(Exception):
    """A usage or configuration problem of the command line (exit 2, one line on stderr)."""


def _client(args: argparse.Namespace, *, timeout_s: float | None = 660.0) -> AipClient:
    from .client import AipClient
    from .plumbing.keys import load_ed25519, read_private

    if args.signing_key and not args.key_id:  # never a silently unsigned request
        raise UsageError("--signing-key needs --key-id (the principal id the key belongs to; env AIP_CREWAI_KEY_ID)")
    token = read_private(Path(args.token_file), what="token file").decode() if args.token_file else None
    key = load_ed25519(Path(args.signing_key)) if args.signing_key else None
    if token is None and key is None:
        raise UsageError("give --token-file or --signing-key (or AIP_CREWAI_TOKEN_FILE)")
    return AipClient(args.url, token=token, signing_key=key, key_id=args.key_id, timeout_s=timeout_s)


def _print(value: object, as_json: bool) -> None:
    """Print a JSON value: one compact line with ``--json`` (non-ASCII escaped), else indented for a person
    with every code point one would misread as its ``\\u`` escape, after a warning line naming them
    (:mod:`aip_crewai.contracts.display`)."""
    if as_json:
        print(json.dumps(value, separators=(",", ":")))
        return
    from . import render

    for line in render.json_block(value, indent=""):
        print(line)


def _show(value: Any, as_json: bool, lines: Callable[[Any], Iterable[str]]) -> None:
    """``--json``: the whole value on one line; else the human ``lines`` of it (:mod:`aip_crewai.render`)."""
    if as_json:
        _print(value, True)
        return
    for line in lines(value):
        print(line)


def _with_progress(work: Callable[[], T], quiet: bool) -> T:
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
            print(
                f"\r  waiting for the result… {time.monotonic() - started:.0f} s", end="", file=sys.stderr, flush=True
            )

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        return work()
    finally:
        done.set()
        thread.join()
        if time.monotonic() - started >= 2.0:
            print(file=sys.stderr)


def _outcome(envelope: Any) -> Exit:
    code = of_envelope(envelope)
    return Exit.OK if code is None else code


def _refused(exc: Any, as_json: bool) -> Exit:
    """Report a host refusal (an ``AipClientError``) and return its exit code."""
    print(f"aip-crewai: {exc}", file=sys.stderr)
    if as_json:
        _print(exc.body, True)
    return of_error(exc.code, exc.status)


def _call(args: argparse.Namespace) -> int:
    from . import render
    from .client import AipClientError

    try:
        value = json.loads(args.input)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--input is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError("--input must be a JSON object")
    kwargs = {"action_id": args.action_id, "idempotency_key": args.idempotency_key}
    try:
        with _client(args) as client:
            if args.stream:
                return _show_stream(client.stream(args.capability_id, value, **kwargs), args.json)
            answer = _with_progress(lambda: client.call(args.capability_id, value, **kwargs), args.json)
            _show(answer, args.json, render.envelope_lines)
            return _outcome(answer)
    except AipClientError as exc:
        return _refused(exc, args.json)


def _actions(args: argparse.Namespace) -> int:
    from . import render
    from .client import AipClientError

    try:
        with _client(args) as client:
            if args.actions_command == "show":
                _show(client.action(args.action_id), args.json, render.status_lines)
                return Exit.OK
            if args.actions_command in ("result", "cancel"):
                if args.actions_command == "result":
                    answer = client.result(args.action_id)
                else:  # the runtime cancel route: no approval (docs/reference/http-api.md "AIP 1.0 conformance")
                    answer = client.cancel(args.action_id)
                _show(answer, args.json, render.envelope_lines)
                return _outcome(answer)
            return _follow(client, args.action_id, args.last_event_id, args.json)
    except AipClientError as exc:
        return _refused(exc, args.json)


def _manifest(args: argparse.Namespace) -> int:
    from .client import AipClientError

    try:
        with _client(args) as client:
            manifest = client.manifest()
    except AipClientError as exc:
        return _refused(exc, args.json)
    from . import render

    _show(manifest, args.json, render.manifest_lines)
    return Exit.OK


def _watch(client: AipClient, args: argparse.Namespace) -> int:
    """``approvals watch``: print the queue, then each approval event as it
    arrives, until Ctrl-C (exit 0), ``--count`` pending approvals (exit 0), or
    the host ends the stream (exit 1, with the command that resumes it)."""
    from . import render

    pending, last_id = 0, args.last_event_id
    try:
        for event, data in client.approval_events(last_event_id=args.last_event_id):
            sse_id = data.pop("_sse_id", None)  # None: an entry of the pending snapshot
            last_id = sse_id or last_id
            if args.json:
                print(json.dumps({"event": event, "id": sse_id, "data": data}, separators=(",", ":")), flush=True)
            elif event != "ready":
                print(render.approval_event_line(event, data), flush=True)
            if event == "pending":
                pending += 1
                if args.count is not None and pending >= args.count:
                    return Exit.OK
    except KeyboardInterrupt:
        return Exit.OK
    resume = ("--last-event-id", last_id) if last_id else ()
    print(
        f"aip-crewai: the approval stream ended (the host may be shutting down); resume with: "
        f"{render.command('approvals', 'watch', *resume)}",
        file=sys.stderr,
    )
    return Exit.FAILED


def _approvals(args: argparse.Namespace) -> int:
    from . import render
    from .client import AipClientError

    try:
        with _client(args, timeout_s=None if args.approvals_command == "watch" else 660.0) as client:
            if args.approvals_command == "watch":
                return _watch(client, args)
            if args.approvals_command == "list":
                _show(client.approvals(status=args.status, cursor=args.cursor), args.json, render.approvals_table)
            elif args.approvals_command == "show":
                _show(client.approval(args.approval_id), args.json, render.approval_lines)
            else:
                _show(client.decide(args.approval_id, args.decision, args.reason), args.json, render.decision_lines)
        return 0
    except AipClientError as exc:
        return _refused(exc, args.json)


def _keys(args: argparse.Namespace) -> int:
    from .host.ledger.receipts import key_id, parse_public_key
    from .plumbing.keys import generate_ed25519, generate_token

    def receipt_key_id(public: str) -> str:
        return key_id(parse_public_key(public))

    path = Path(args.out)
    try:
        if args.kind == "token":
            print(json.dumps({"file": str(path), "token_sha256": generate_token(path)}))
        elif args.kind == "ed25519":
            print(json.dumps({"file": str(path), "ed25519_public_key": generate_ed25519(path)}))
        else:  # an Ed25519 key for [host] receipt_key_file: its public key and key id (docs/observing.md "Observing actions")
            public = generate_ed25519(path)
            print(json.dumps({"file": str(path), "receipt_public_key": public, "key_id": receipt_key_id(public)}))
    except FileExistsError:
        raise UsageError(f"{path} exists; refusing to overwrite a secret") from None
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from .sidecar.doctor import main as doctor_main

    return doctor_main(args)


def _journal(args: argparse.Namespace) -> int:
    if args.journal_command == "import":
        from .sidecar.journal.importer import main as import_main

        return import_main(args)
    from .sidecar.journal.inspect import main as inspect_main

    return inspect_main(args)


def _add_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        type=cli_args.host_url,
        default=os.environ.get("AIP_CREWAI_HOST_URL", "http://127.0.0.1:8081"),
        help="host base URL with its scheme, http(s)://HOST:PORT (env AIP_CREWAI_HOST_URL; default %(default)s)",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("AIP_CREWAI_TOKEN_FILE"),
        help="0600 file holding the principal's bearer token (env AIP_CREWAI_TOKEN_FILE)",
    )
    p.add_argument(
        "--signing-key",
        default=os.environ.get("AIP_CREWAI_SIGNING_KEY"),
        help="0600 Ed25519 private key (PEM): every request is signed (RFC 9421 HTTP Message "
        "Signature) and so is an action envelope; needs --key-id (env AIP_CREWAI_SIGNING_KEY)",
    )
    p.add_argument(
        "--key-id",
        default=os.environ.get("AIP_CREWAI_KEY_ID"),
        help="principal id of the signing key, as host.toml names it (env AIP_CREWAI_KEY_ID)",
    )
    p.add_argument(
        "--json", action="store_true", help="machine-readable output: the whole AIP value, one JSON value per line"
    )


EXIT_CODES_HELP = (
    "exit codes: 0 completed (or success), 1 failed, 2 usage or configuration error, 3 cancelled, "
    "4 denied (approval denied or expired, policy, 401/403), 5 pending approval, 6 accepted and still "
    'running, 7 host unreachable, 141 output pipe closed (docs/reference/cli.md "Exit codes")'
)


def build_parser() -> argparse.ArgumentParser:
    """The ``aip-crewai`` parser (``host`` and ``sidecar`` parse their own arguments)."""
    parser = argparse.ArgumentParser(
        prog="aip-crewai", description="Governed AIP gateway for CrewAI crews.", epilog=EXIT_CODES_HELP
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("host", help="run the AIP host (aip-crewai host --config host.toml; see --help)")
    sub.add_parser("sidecar", help="run the CrewAI sidecar (aip-crewai sidecar --help)")
    p = sub.add_parser("contracts", help="check or write the generated contract artifacts")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when contracts/ differs from the code")
    mode.add_argument("--write", action="store_true", help="regenerate contracts/")
    p.add_argument("--dir", default=str(DEFAULT_CONTRACTS_DIR), help="artifact folder (default: %(default)s)")
    p.set_defaults(func=_contracts)

    p = sub.add_parser("call", help="invoke a capability as a tenant", epilog=EXIT_CODES_HELP)
    p.add_argument(
        "capability_id", help="capability id from the manifest, e.g. cap:crewai:CREW or cap:crewai:CREW:OPERATION"
    )
    p.add_argument("--input", required=True, help="the action input, a JSON object")
    p.add_argument("--action-id", type=cli_args.action_id, help="action id (default: a new random id)")
    p.add_argument("--idempotency-key", help="idempotency key (required by mutations and knowledge_query)")
    p.add_argument("--stream", action="store_true", help="stream chunks as they arrive (SSE)")
    _add_client_flags(p)
    p.set_defaults(func=_call)

    p = sub.add_parser("actions", help="an action you submitted: its status, its result, its stream, or cancel it")
    asub = p.add_subparsers(dest="actions_command", required=True)
    for name, text in (
        ("show", "the ActionStatus (state, result status, links)"),
        ("result", "the stored action_result (an ack while running); exit code as for call"),
        ("follow", "the action's stream from the start, or after --last-event-id; exit code as for call"),
        ("cancel", "stop your action now (the runtime cancel route, no approval); exit code as for call"),
    ):
        q = asub.add_parser(name, help=text, epilog=EXIT_CODES_HELP)
        q.add_argument("action_id", type=cli_args.action_id, help="the action id given to (or printed by) call")
        if name == "follow":
            q.add_argument(
                "--last-event-id",
                type=cli_args.not_blank,
                help="resume after this stream position (the id sent: sse_<n> or sse_<n>.<k>)",
            )
        _add_client_flags(q)
    p.set_defaults(func=_actions)

    p = sub.add_parser("manifest", help="what this principal may call, and with what input")
    _add_client_flags(p)
    p.set_defaults(func=_manifest)

    p = sub.add_parser("approvals", help="list, show or decide approvals")
    asub = p.add_subparsers(dest="approvals_command", required=True)
    q = asub.add_parser("list", help="one page of the tenant's approvals")
    q.add_argument("--status", default="pending", help="pending|approved|denied|expired (default %(default)s)")
    q.add_argument("--cursor", type=cli_args.not_blank, help="the next_cursor of the previous page")
    _add_client_flags(q)
    q = asub.add_parser("show", help="one approval with its input snapshot")
    q.add_argument(
        "approval_id", type=cli_args.approval_id, help="approval id (from approvals list, or the pending call's output)"
    )
    _add_client_flags(q)
    q = asub.add_parser(
        "watch",
        help="print the pending approvals, then every approval event live (SSE), until Ctrl-C",
        epilog="exit codes: 0 stopped by Ctrl-C or --count reached, 1 the host ended the "
        "stream (the resume command is printed), 2 usage, 4 credential refused, 7 host unreachable",
    )
    q.add_argument(
        "--last-event-id",
        type=cli_args.not_blank,
        help="resume after this position (apv_<n>) instead of starting with the pending queue",
    )
    q.add_argument(
        "--count", type=cli_args.integer(1, 1_000_000), help="exit 0 once this many pending approvals were printed"
    )
    _add_client_flags(q)
    q = asub.add_parser("decide", help="approve or deny (as the authenticated approver)")
    q.add_argument("approval_id", type=cli_args.approval_id, help="approval id (from approvals list)")
    q.add_argument("decision", choices=["approved", "denied"], help="approved or denied")
    q.add_argument("--reason", required=True, help="why (recorded with the decision)")
    _add_client_flags(q)
    p.set_defaults(func=_approvals)

    p = sub.add_parser("keys", help="generate secrets (written 0600)")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    q = ksub.add_parser(
        "generate", help="a bearer token (prints its SHA-256) or an Ed25519 key (prints the public key)"
    )
    q.add_argument(
        "kind", choices=["token", "ed25519", "receipt"], help="token (bearer), ed25519 or receipt (signing keys)"
    )
    q.add_argument("--out", required=True, help="file to create (refuses to overwrite)")
    p.set_defaults(func=_keys)
    ledger_cli.add_parsers(sub, _add_client_flags, _client, _refused)
    webhooks_cli.add_parsers(sub, _add_client_flags, _client, _refused)

    p = sub.add_parser(
        "doctor",
        help="check every crew of a registry as the sidecar does at start-up (model keys, "
        "knowledge, human input) and list its inputs; exit 1 when a crew has a problem "
        "or the check gives no answer, 2 when the registry cannot be loaded",
    )
    p.add_argument("--registry", help="module:attribute of the crew registry (default: $AIP_CREWAI_REGISTRY)")
    p.add_argument(
        "--timeout",
        type=cli_args.integer(1, 3600),
        help="seconds the check may take, CrewAI's import included (default 300, the sidecar's bound); exit 1 after",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("journal", help="sidecar journal files: read-only views, and import of a reference journal")
    jsub = p.add_subparsers(dest="journal_command", required=True)
    q = jsub.add_parser("list", help="jobs, newest first")
    q.add_argument("journal", help="the sidecar's SQLite journal file (--journal)")
    q.add_argument(
        "--limit", type=cli_args.integer(1, 1_000_000), default=50, help="at most this many jobs (default %(default)s)"
    )
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = jsub.add_parser("inspect", help="one job with its events")
    q.add_argument("journal", help="the sidecar's SQLite journal file (--journal)")
    q.add_argument(
        "action_id",
        type=cli_args.not_blank,
        help="the sidecar job id, <tenant>:<action id>, or the action id alone when one tenant has it",
    )
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q = jsub.add_parser(
        "import",
        help="migrate a reference sidecar's JSON journal (runs and events) into a "
        "SQLite journal; importing twice changes nothing",
    )
    q.add_argument("source", help="the reference sidecar's JSON journal (its AIP_CREWAI_STATE_FILE, e.g. runs.json)")
    from .sidecar.options import MAX_EVENT_BYTES, MIN_EVENT_BYTES

    q.add_argument(
        "--max-events-per-run",
        type=cli_args.integer(2, 100_000),
        default=1000,
        help="refuse a run with more events, its terminal one included: the sidecar's --max-events-per-run (default 1000)",
    )
    q.add_argument(
        "--max-event-bytes",
        type=cli_args.integer(MIN_EVENT_BYTES, MAX_EVENT_BYTES),
        default=262_144,
        help="refuse a run with a larger event, bytes: the sidecar's --max-event-bytes (default 262144)",
    )
    q.add_argument(
        "--journal",
        dest="target",
        help="the SQLite journal to create or add to (default: the "
        "source with suffix .db); the sidecar must not be running on it",
    )
    q.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_journal)
    return parser


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``| head``): no message, and no second error at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return Exit.BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aip-crewai`` console script; returns the exit code (docs/reference/cli.md "Exit codes")."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Long-running processes own their own argument parsing.
    if argv and argv[0] == "sidecar":
        from .sidecar.main import main as sidecar_main

        return sidecar_main(argv[1:])
    if argv and argv[0] == "host":
        from .host.main import main as host_main

        return host_main(argv[1:])
    # Client commands: any log line of a module they use goes to stderr, warnings and worse only, so a
    # command's stdout (its JSON, its stream) is never interleaved with log lines.
    configure_logging(json=False, level="warning", cache=False)
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:  # Ctrl-C: no traceback; 128 + SIGINT, as a shell reports it
        print(file=sys.stderr)
        return Exit.INTERRUPTED


def _dispatch(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    import httpx2

    from .plumbing.keys import SecretFileError
    from .sse import SSEFrameTooLarge

    try:
        return int(args.func(args))
    except (UsageError, SecretFileError) as exc:
        print(f"aip-crewai: {exc}", file=sys.stderr)
        return Exit.USAGE
    except httpx2.TransportError as exc:
        print(f"aip-crewai: cannot reach {getattr(args, 'url', 'the host')}: {type(exc).__name__}", file=sys.stderr)
        return Exit.UNREACHABLE
    except SSEFrameTooLarge as exc:  # a host never sends one (client.MAX_FRAME_BYTES): not an aip-crewai host
        print(f"aip-crewai: the host's stream broke its bounds ({exc})", file=sys.stderr)
        return Exit.FAILED
    except BrokenPipeError:
        raise
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"aip-crewai: {where}{exc.strerror or exc}", file=sys.stderr)
        return Exit.USAGE


if __name__ == "__main__":
    sys.exit(main())
