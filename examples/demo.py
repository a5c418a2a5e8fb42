"""`make run`: the whole governed flow on the offline demo crew.

Generates throwaway credentials (0600) under ``.run/``, starts the sidecar
and the host on free loopback ports (SQLite journal and host store, the
offline ``support-triage`` crew), waits for ``/ready``, then as a tenant:
calls the crew, shows the ``pending_approval``, approves it as the approver,
streams the chunks as they arrive, prints the result, the ``:status`` and
``:events`` views, runs a ``:knowledge_query``, and shuts both processes
down. Process logs go to ``.run/*.log``. No network beyond loopback.

Run it with ``make run`` (or ``python -m examples.demo [--run-dir DIR]``).
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

from aip_crewai.client import AipClient, new_id
from aip_crewai.keys import generate_ed25519, generate_token, load_ed25519

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


def step(number: int, text: str) -> None:
    say(f"\n== {number}. {text}")


def write_config(run: Path) -> dict[str, Path | int]:
    """Credentials and configuration for both processes; returns paths and ports."""
    for sub in ("sidecar", "host", "secrets"):
        (run / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    secrets = run / "secrets"
    generate_token(secrets / "sidecar.token")
    invoker_sha = generate_token(secrets / "invoker.token")
    approver_key = generate_ed25519(secrets / "approver.pem")  # the approver holds only a key (README "Signed requests")
    crews = [{"id": CREW, "name": "Support triage", "description": "Classifies a ticket and drafts a policy-based reply.",
              "allowed_operations": ["run", "status", "events", "cancel", "knowledge_query"]}]
    (run / "host" / "crews.json").write_text(json.dumps(crews, indent=2))
    sidecar_port, host_port = free_port(), free_port()
    (run / "host" / "host.toml").write_text(textwrap.dedent(f"""\
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
        """))
    return {"sidecar_port": sidecar_port, "host_port": host_port}


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "aip_crewai.cli", *args], stdout=handle, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)


def stop(process: subprocess.Popen[bytes], name: str) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    say(f"   {name} stopped (exit status {process.returncode})")


def text_of(envelope: dict) -> str:  # type: ignore[type-arg]
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
    ports = write_config(run)
    say("aip-crewai demo: a governed CrewAI run through the AIP host (offline crew, no network)")
    step(1, f"starting the sidecar (127.0.0.1:{ports['sidecar_port']}) and the host (127.0.0.1:{ports['host_port']})")
    sidecar = start(["sidecar", "--registry", "examples.support_triage:CREWS", "--port", str(ports["sidecar_port"]),
                     "--journal", str(run / "sidecar" / "journal.db"), "--token-file",
                     str(run / "secrets" / "sidecar.token"), "--allowed-operations", "run,knowledge_query"],
                    run / "sidecar.log")
    host = start(["host", "--config", str(run / "host" / "host.toml")], run / "host.log")
    base = f"http://127.0.0.1:{ports['host_port']}"
    tenant = AipClient(base, token=(run / "secrets" / "invoker.token").read_text().strip())
    approver = AipClient(base, signing_key=load_ed25519(run / "secrets" / "approver.pem"), key_id=APPROVER)
    try:
        started = time.monotonic()
        tenant.wait_ready(120)
        say(f"   both ready after {time.monotonic() - started:.1f} s (logs: {run}/sidecar.log, {run}/host.log)")

        manifest = tenant.manifest()
        step(2, f"the tenant's manifest lists {len(manifest['capabilities'])} capabilities")
        for cap in manifest["capabilities"]:
            say(f"   {cap['id']:<45} risk={cap['risk']:<6} approval={cap['requires_human_approval']}")

        action_id, key = new_id("act"), new_id("idem")
        step(3, f"the tenant calls cap:crewai:{CREW} (a mutation: it needs an approval)")
        say(f"   input: {json.dumps(TICKET)}")
        pending = tenant.call(f"cap:crewai:{CREW}", TICKET, action_id=action_id, idempotency_key=key)
        result = pending["body"]["action_result"]
        say(f"   -> {result['status']}; approval {result['output']['approval_id']} "
            f"expires {result['output']['expires_at']}; nothing was sent to the sidecar")

        step(4, "the approver (who holds only an Ed25519 key: every request is signed) reviews the input and approves")
        queue = approver.approvals()
        approval = approver.approval(queue["approvals"][0]["request"]["id"])
        request = approval["request"]
        say(f"   requested by {request['requester']['id']}; input {json.dumps(approval['evidence_payload']['input'])}")
        decision = approver.decide(request["id"], "approved", "duplicate charge confirmed in billing")
        say(f"   -> {decision['decision']} by {decision['approver']['id']}; the signed decision's proof: "
            f"{decision['evidence'][0]['uri']}")

        step(5, "the tenant streams the run as it happens")
        final, count = None, 0
        print("   ", end="", flush=True)
        for event, envelope in tenant.follow(action_id):
            if event in ("chunk", "done") and text_of(envelope):
                count += 1
                print(text_of(envelope).replace("\n", "\n   "), end="", flush=True)
            elif event == "result":
                final = envelope["body"]["action_result"]
        say(f"\n   ({count} chunks streamed; each one is journaled by the sidecar and stored by the host)")
        if final is None or final["status"] != "completed":
            say(f"   the run did not complete: {json.dumps(final)}")
            return 1
        step(6, "the final result")
        say(textwrap.indent(textwrap.fill(final["output"]["raw"], 96), "   "))
        again = tenant.call(f"cap:crewai:{CREW}", TICKET, action_id=action_id, idempotency_key=key)
        say(f"   calling again with the same action id and key returns the stored result: "
            f"{again['body']['action_result']['status']}")

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
        answer = tenant.call(f"cap:crewai:{CREW}:knowledge_query", {"query": ["refund for a duplicate charge"]},
                             idempotency_key=new_id("idem"))
        results = answer["body"]["action_result"]["output"]["results"]
        for item in results:
            content = str(item.get("content", item))[:110] if isinstance(item, dict) else str(item)[:110]
            say(f"   match: {content}")
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
