"""An example webhook receiver: verifies every delivery with the ``standardwebhooks`` package and prints one
line per event (docs/webhooks.md "Verifying a delivery"; ``make run WEBHOOKS=1`` starts it).

    python -m aip_crewai.examples.webhook_receiver --secret-file acme.whsec --port 8787

It listens on ``http://127.0.0.1:<port>/hook`` (``--port 0``: a free port; the first line printed is
``listening on <url>``), and for each POST:

- reads the body, at most :data:`MAX_BODY_BYTES` (no ``Content-Length``: 411; more: 413);
- verifies the Standard Webhooks headers and signature over the raw bytes before parsing them (a bad or
  stale signature: 400, and a ``rejected`` line naming why, never the secret);
- answers 204 and prints ``<type> approval=<id> action=<id> verified webhook-id=<id>`` once per
  ``webhook-id`` (a retry of a delivery already printed is answered 204 and not printed again: delivery is
  at least once).

The secret file is read as the host reads it: a regular file, mode 0600, holding ``whsec_<base64>``. Only
the standard library and ``standardwebhooks``: copy it as the start of a real receiver, which would keep
the seen ids durably and do its slow work after answering.

Source: docs/webhooks.md; the Standard Webhooks specification.
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import sys
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from aip_crewai import cli_args
from aip_crewai.plumbing.keys import SecretFileError, read_private

#: The largest body read, bytes (the host's bodies are far smaller: an event without input or output).
MAX_BODY_BYTES = 1 << 20
#: How many delivered ``webhook-id`` values are remembered to print each event once.
REMEMBERED_IDS = 10_000
PATH = "/hook"
#: One entry of a ``webhook-signature`` header: ``v<n>,<base64>`` (``v<n>a`` for an asymmetric one).
_SIGNATURE_ENTRY = re.compile(r"v[0-9]+a?,[A-Za-z0-9+/]+={0,2}")


def read_secret(path: Path) -> str:
    """The ``whsec_…`` secret of ``path`` (regular file, mode 0600).

    Raises:
        SecretFileError: the file is missing, not private, or does not hold a ``whsec_`` secret.
    """
    secret = read_private(path, what="webhook secret file").decode("ascii", "replace").strip()
    if not secret.startswith("whsec_"):
        raise SecretFileError(f"{path}: not a Standard Webhooks secret (whsec_...)")
    return secret


def malformed_signature(value: str | None) -> bool:
    """Whether a ``webhook-signature`` header holds no entry of the Standard Webhooks form (space-separated
    ``v1,<base64>`` entries), pure. A missing header is not malformed: verification refuses it. Checked
    here, not left to ``standardwebhooks``, whose releases tell such a header apart differently (1.1 raises
    ``ValueError``, 1.3 finds no matching signature), so the ``rejected`` line names the same cause."""
    return value is not None and not any(_SIGNATURE_ENTRY.fullmatch(entry) for entry in value.split(" "))


def describe(event: Mapping[str, Any]) -> str:
    """One event as printed: its ``type``, then the approval and action it is about (pure).

    ``event`` is a verified body: ``{"type", "timestamp", "data"}``, ``data`` an ApprovalRecordView
    (``approval.*``) or an ActionResult (``action.*``)."""
    found = event.get("data")
    data: Mapping[str, Any] = found if isinstance(found, dict) else {}
    inner = data.get("request")
    request: Mapping[str, Any] = inner if isinstance(inner, dict) else {}
    parts = [str(event.get("type", "?"))]
    if request:
        parts += [f"approval={request.get('id')}", f"action={request.get('action_id')}"]
        if data.get("status") != "pending":
            parts.append(f"status={data.get('status')}")
    else:
        parts += [f"action={data.get('action_id')}", f"status={data.get('status')}"]
    return " ".join(parts)


class Receipts:
    """What the receiver printed: one line per verified event, ``rejected`` lines, in order (thread-safe)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def verified(self, webhook_id: str, event: Mapping[str, Any]) -> None:
        """Print ``event`` unless ``webhook_id`` was printed already."""
        with self._lock:
            if webhook_id in self._seen:
                return
            self._seen[webhook_id] = None
            if len(self._seen) > REMEMBERED_IDS:
                self._seen.popitem(last=False)
            self._say(f"{describe(event)} verified webhook-id={webhook_id}")

    def rejected(self, why: str) -> None:
        """Print a refused delivery's reason."""
        with self._lock:
            self._say(f"rejected: {why}")

    def _say(self, line: str) -> None:
        print(line, file=self._out, flush=True)


def handler(hook: Webhook, receipts: Receipts) -> type[BaseHTTPRequestHandler]:
    """The request handler class verifying with ``hook`` and printing through ``receipts``."""

    class Receiver(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != PATH:
                return self._answer(404)
            length = self.headers.get("content-length")
            if length is None or not length.isdigit():
                return self._answer(411)
            if int(length) > MAX_BODY_BYTES:
                receipts.rejected(f"a body of {length} bytes (at most {MAX_BODY_BYTES})")
                self.close_connection = True
                return self._answer(413)
            body = self.rfile.read(int(length))
            headers = {name.lower(): value for name, value in self.headers.items()}
            if malformed_signature(headers.get("webhook-signature")):
                receipts.rejected("a malformed signature header")
                return self._answer(400)
            try:
                event = hook.verify(body, headers)  # the raw bytes, before any parsing
            except WebhookVerificationError as exc:
                receipts.rejected(f"not verified ({exc})")
                return self._answer(400)
            except ValueError:  # a verified body that is not JSON (or a header this package cannot read)
                receipts.rejected("a malformed signature header or body")
                return self._answer(400)
            receipts.verified(headers["webhook-id"], event if isinstance(event, dict) else {})
            self._answer(204)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            pass  # one line per event is printed instead

    return Receiver


def serve(secret: str, *, port: int = 0, bind: str = "127.0.0.1", out: TextIO = sys.stdout) -> ThreadingHTTPServer:
    """A receiver bound to ``bind:port`` (0: a free port), not yet serving: call ``serve_forever()``."""
    server = ThreadingHTTPServer((bind, port), handler(Webhook(secret), Receipts(out)))
    server.daemon_threads = True
    return server


def url_of(server: ThreadingHTTPServer) -> str:
    """The URL deliveries go to."""
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}{PATH}"


def main(argv: list[str] | None = None) -> int:
    """`python -m aip_crewai.examples.webhook_receiver`: the module docstring; exit 2 for an unusable secret file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--secret-file", type=Path, required=True, help="the whsec_ secret (mode 0600)")
    parser.add_argument(
        "--port", type=cli_args.integer(0, 65535), default=8787, help="0: a free port (default %(default)s)"
    )
    parser.add_argument("--bind", default="127.0.0.1", help="the address to listen on (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        secret = read_secret(args.secret_file)
    except SecretFileError as exc:
        print(f"webhook_receiver: {exc}", file=sys.stderr)
        return 2
    server = serve(secret, port=args.port, bind=args.bind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the demo stops it with SIGTERM
    print(f"listening on {url_of(server)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
