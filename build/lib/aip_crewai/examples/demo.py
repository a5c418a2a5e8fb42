"""`make run`: the whole governed flow on the offline demo crew.

Generates throwaway credentials (0600) under ``.run/``, starts the sidecar
and the host on free loopback ports (SQLite journal and host store, the
offline ``support-triage`` crew), waits for ``/ready``, then as a tenant:
calls the crew, shows the ``pending_approval``, approves it as the approver,
streams the chunks as they arrive, prints the result, the ``:status`` and
``:events`` views, runs a ``:knowledge_query``, and shuts both processes
down. Process logs go to ``.run/*.log``. No network beyond loopback.

Run it with ``make run`` (or ``python -m aip_crewai.examples.demo [--run-dir DIR]``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from aip_crewai.client import AipClient, new_id
from aip_crewai.plumbing.keys import generate_ed25519, generate_token, load_ed25519

CREW = "support-triage"
APPROVER = "human:acme-approver"
TICKET = {
    "customer": "Dana Whitfield",
    "ticket": "I was charged twice for my annual plan this month and I'd like a refund of the duplicate charge.",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def say(text: str = "") -> None:
    print(text, flush=True)


def say_json(label: str, value: dict[str, Any]) -> None:
    """One ``label:`` line per field of ``value``, each wrapped at :data:`WIDTH` columns."""
    say(f"   {label}:")
    for name, item in value.items():
        say(textwrap.fill(f"{name} = {json.dumps(item)}", WIDTH, initial_indent="     ", subsequent_indent="       "))


def step(number: int, text: str) -> None:
    say(f"\n== {number}. {text}")


def write_config(run: Path) -> dict[str, int]:
    """Credentials and configuration for both processes; returns paths and ports."""
    for sub in ("sidecar", "host", "secrets"):
        (run / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    secrets = run / "secrets"
    generate_token(secrets / "sidecar.token")
    invoker_sha = generate_token(secrets / "invoker.token")
    approver_key = generate_ed25519(
        secrets / "approver.pem"
    )  # the approver holds only a key (docs/approvals.md "Signed requests")
    crews = [
        {
            "id": CREW,
            "name": "Support triage",
            "description": "Classifies a ticket and drafts a policy-based reply.",
            "allowed_operations": ["run", "status", "events", "cancel", "knowledge_query"],
        }
    ]
    (run / "host" / "crews.json").write_text(json.dumps(crews, indent=2))
    sidecar_port, host_port = free_port(), free_port()
    (run / "host" / "host.toml").write_text(
        textwrap.dedent(f"""\
        [host]
        bind = "127.0.0.1:{host_port}"
        store = "host.db"

        [sidecar]
        url = "http://127.0.0.1:{sidecar_port}"
        token_file = "../secrets/sidecar.token"

        [crews]
        file = "crews.json"

        [tenants.acme]
        crews = ["{CREW}"]

        [[principals]]
        id = "svc:acme-app"
        tenant = "acme"
        roles = ["invoker"]
        token_sha256 = "{invoker_sha}"

        [[principals]]
        id = "{APPROVER}"
        tenant = "acme"
        roles = ["approver"]
        ed25519_public_key = "{approver_key}"
        """)
    )
    return {"sidecar_port": sidecar_port, "host_port": host_port}


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "aip_crewai.cli", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )


WIDTH = 96
#: ``start_both`` tries again with new ports when a process exits before ``/ready`` (another
#: program took a free port between the pick and the bind).
START_ATTEMPTS = 3


def start_both(run: Path) -> tuple[dict[str, int], subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Write the configuration, start the sidecar and the host, wait for the host's ``/ready``.

    Returns ``(ports, sidecar, host)``. A process that exits while waiting (for
    example a port taken between the pick and the bind) is retried with new
    ports, at most :data:`START_ATTEMPTS` times. Raises ``RuntimeError`` when
    every attempt failed and ``TimeoutError`` after 120 s without ``/ready``.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        ports = write_config(run)
        step(
            1, f"starting the sidecar (127.0.0.1:{ports['sidecar_port']}) and the host (127.0.0.1:{ports['host_port']})"
        )
        sidecar = start(
            [
                "sidecar",
                "--registry",
                "aip_crewai.examples.support_triage:CREWS",
                "--port",
                str(ports["sidecar_port"]),
                "--journal",
                str(run / "sidecar" / "journal.db"),
                "--token-file",
                str(run / "secrets" / "sidecar.token"),
                "--allowed-operations",
                "run,knowledge_query",
            ],
            run / "sidecar.log",
        )
        host = start(["host", "--config", str(run / "host" / "host.toml")], run / "host.log")
        probe = AipClient(f"http://127.0.0.1:{ports['host_port']}")
        started, end = time.monotonic(), time.monotonic() + 120
        try:
            while not probe.ready_now():
                exited = [name for name, proc in (("sidecar", sidecar), ("host", host)) if proc.poll() is not None]
                if exited:
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"the host was not ready after 120 s (logs: {run}/sidecar.log, {run}/host.log)")
                time.sleep(0.2)
            else:
                say(f"   both ready after {time.monotonic() - started:.1f} s; their logs:")
                say(f"   {run}/sidecar.log and host.log")
                return ports, sidecar, host
        finally:
            probe.close()
        say(f"   the {' and the '.join(exited)} exited before it was ready (attempt {attempt} of {START_ATTEMPTS})")
        stop(host, "host")
        stop(sidecar, "sidecar")
    raise RuntimeError(f"the processes did not start; see {run}/sidecar.log and {run}/host.log")


def speaker_of(envelope: dict[str, Any]) -> str:
    """Who produced a chunk: its agent's role; a chunk without one (CrewAI streams each task's
    text before the agent answers) is the ``task``, a tool chunk is ``tool``."""
    chunk = (envelope.get("body") or {}).get("stream_chunk") or {}
    data = chunk.get("data") or {}
    if data.get("agent_role"):
        return str(data["agent_role"])
    return "tool" if chunk.get("kind") == "tool" else "task"


class ChunkPrinter:
    """Prints streamed text as it arrives, wrapped at :data:`WIDTH` columns, one block per speaker.

    Chunks split words anywhere, so text is held until the next blank; a new
    speaker (agent role) starts a new block with a header line.
    """

    def __init__(self) -> None:
        self.speaker: str | None = None
        self.column = 0
        self.pending = ""

    def feed(self, speaker: str, text: str) -> None:
        """Add one chunk's ``text``, said by ``speaker``."""
        if speaker != self.speaker:
            self._flush()
            self._end_line()
            say(f"   [{speaker}]")
            self.speaker = speaker
        for char in text:
            if char.isspace():
                self._flush()
                if char == "\n":
                    self._end_line()
            else:
                self.pending += char

    def close(self) -> None:
        """Print what is held and end the line."""
        self._flush()
        self._end_line()

    def _flush(self) -> None:
        if not self.pending:
            return
        if self.column and self.column + 1 + len(self.pending) > WIDTH:
            self._end_line()
        prefix = "     " if self.column == 0 else " "
        print(prefix + self.pending, end="", flush=True)
        self.column += len(prefix) + len(self.pending)
        self.pending = ""

    def _end_line(self) -> None:
        if self.column:
            print(flush=True)
            self.column = 0


def excerpt(text: str, limit: int = 240) -> str:
    """``text`` cut at the last sentence end within ``limit`` characters (else at a word, with "...")."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = max(text.rfind(". ", 0, limit), text.rfind("! ", 0, limit), text.rfind("? ", 0, limit))
    if cut > 0:
        return text[: cut + 1]
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def stop(process: subprocess.Popen[bytes], name: str) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    say(f"   {name} stopped (exit status {process.returncode})")


def text_of(envelope: dict[str, Any]) -> str:
    chunk = (envelope.get("body") or {}).get("stream_chunk") or {}
    part = chunk.get("part") or {}
    return str(part.get("text") or "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=".run", help="scratch directory (recreated; default %(default)s)")
    args = parser.parse_args(argv)
    run = Path(args.run_dir).resolve()
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(mode=0o700, parents=True)
    say("aip-crewai demo: a governed CrewAI run through the AIP host (offline crew, no network)")
    ports, sidecar, host = start_both(run)
    base = f"http://127.0.0.1:{ports['host_port']}"
    tenant = AipClient(base, token=(run / "secrets" / "invoker.token").read_text().strip())
    approver = AipClient(base, signing_key=load_ed25519(run / "secrets" / "approver.pem"), key_id=APPROVER)
    try:
        manifest = tenant.manifest()
        step(2, f"the tenant's manifest lists {len(manifest['capabilities'])} capabilities")
        for cap in manifest["capabilities"]:
            say(f"   {cap['id']:<45} risk={cap['risk']:<6} approval={cap['requires_human_approval']}")

        action_id, key = new_id("act"), new_id("idem")
        step(3, f"the tenant calls cap:crewai:{CREW} (a mutation: it needs an approval)")
        say_json("input", TICKET)
        pending = tenant.call(f"cap:crewai:{CREW}", TICKET, action_id=action_id, idempotency_key=key)
        result = pending["body"]["action_result"]
        say(
            f"   -> {result['status']}; approval {result['output']['approval_id']} "
            f"expires {result['output']['expires_at']};"
        )
        say("      nothing was sent to the sidecar")

        step(4, "the approver (only an Ed25519 key: its requests are signed) reviews and approves")
        queue = approver.approvals()
        approval = approver.approval(queue["approvals"][0]["request"]["id"])
        request = approval["request"]
        say(f"   requested by {request['requester']['id']}; the input snapshot the approval is bound to:")
        say_json("input", approval["evidence_payload"]["input"])
        decision = approver.decide(request["id"], "approved", "duplicate charge confirmed in billing")
        say(f"   -> {decision['decision']} by {decision['approver']['id']}")
        say(f"   signed decision; its proof: {decision['evidence'][0]['uri']}")

        step(5, "the tenant streams the run as it happens")
        final, count, printer = None, 0, ChunkPrinter()
        for event, envelope in tenant.follow(action_id):
            if event in ("chunk", "done") and text_of(envelope):
                count += 1
                printer.feed(speaker_of(envelope), text_of(envelope))
            elif event == "result":
                final = envelope["body"]["action_result"]
        printer.close()
        say(f"   ({count} chunks streamed; each one is journaled by the sidecar and stored by the host)")
        if final is None or final["status"] != "completed":
            say(f"   the run did not complete: {json.dumps(final)}")
            return 1
        step(6, "the final result")
        say(textwrap.indent(textwrap.fill(final["output"]["raw"], 96), "   "))
        again = tenant.call(f"cap:crewai:{CREW}", TICKET, action_id=action_id, idempotency_key=key)
        say(
            f"   calling again with the same action id and key returns the stored result: "
            f"{again['body']['action_result']['status']}"
        )

        step(7, f"cap:crewai:{CREW}:status and :events")
        status = tenant.call(f"cap:crewai:{CREW}:status", {"run_action_id": action_id})
        view = status["body"]["action_result"]["output"]
        say(f"   status: {view['status']}, {view['event_count']} journaled events")
        events = tenant.call(f"cap:crewai:{CREW}:events", {"run_action_id": action_id, "cursor": 0})
        page = events["body"]["action_result"]["output"]
        kinds: dict[str, int] = {}
        for item in page["events"]:
            kinds[item["event"]] = kinds.get(item["event"], 0) + 1
        say(f"   events: {', '.join(f'{k}×{v}' for k, v in kinds.items())}")

        step(8, f"cap:crewai:{CREW}:knowledge_query (read-only: no approval, but a key)")
        answer = tenant.call(
            f"cap:crewai:{CREW}:knowledge_query",
            {"query": ["refund for a duplicate charge"]},
            idempotency_key=new_id("idem"),
        )
        results = answer["body"]["action_result"]["output"]["results"]
        for item in results:
            content = str(item.get("content", item)) if isinstance(item, dict) else str(item)
            say(textwrap.fill(excerpt(content), WIDTH, initial_indent="   match: ", subsequent_indent="          "))
        if not results:
            say("   no match above the score threshold")
    finally:
        tenant.close()
        approver.close()
        step(9, "shutting down")
        stop(host, "host")
        stop(sidecar, "sidecar")
    say("\nDone: one approval, one execution, every chunk journaled and replayable.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
