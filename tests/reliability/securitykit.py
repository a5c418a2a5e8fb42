"""Security checks against real processes (ARCHITECTURE.md §4 sidecar bearer, §7 principals and tenants).

Each function performs many independent checks and returns ``[(check, ok,
detail)]`` instead of stopping at the first failure, so ``make chaos`` can
count them and a test can list every failure at once.

- :func:`host_credentials`: every authenticated host route with a missing,
  wrong, tampered or malformed bearer token, and signed envelopes that are
  tampered, expired, from the future, replayed, or signed with another key:
  all 401, none with an effect;
- :func:`sidecar_credentials`: every sidecar route likewise (401, nothing admitted);
- :func:`cross_tenant`: another tenant's actions, approvals and runs are
  invisible (404), even under the same action id;
- :func:`secrets_absent`: provider secrets, tokens and an input marker never
  reach process output, error bodies or the journal (the host store holds
  inputs by design: approval snapshots);
- :func:`startup_refusals`: unsafe files and URLs stop both processes at
  start-up with a clear message, exit status 2 and no traceback.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx2
import storebackend
from chaoslib import uid
from kits.aip import action, envelope
from kits.host import TOKENS
from relkit import (
    FAKE_SECRET,
    MARKER,
    SIGNER,
    TOKEN,
    Host,
    Processes,
    Sidecar,
    approve,
    free_port,
    post_action,
    scan,
    signer_key,
    wait_action,
    write_host_config,
)

Result = tuple[str, bool, str]


def _check(results: list[Result], name: str, ok: bool, detail: Any = "") -> None:
    results.append((name, bool(ok), "" if ok else str(detail)[:300]))


def _tampered(token: str) -> list[tuple[str, str | None]]:
    flipped = token[:-1] + ("0" if token[-1] != "0" else "1")
    return [
        ("missing", None),
        ("wrong", "Bearer tok-not-a-principal"),
        ("tampered_last_char", f"Bearer {flipped}"),
        ("tampered_suffix", f"Bearer {token}x"),
        ("tampered_prefix", f"Bearer {token[:-1]}"),
        ("tampered_case", f"Bearer {token.upper()}"),
        ("basic_scheme", f"Basic {token}"),
        ("no_token", "Bearer"),
        ("empty", ""),
        ("token_without_scheme", token),
        ("two_tokens", f"Bearer {token} {token}"),
    ]


def _sign(env: dict[str, Any], key: Any = None, key_id: str = SIGNER) -> dict[str, Any]:
    from aip_crewai.client import sign_envelope

    return sign_envelope(env, key or signer_key(), key_id)


def _rfc3339(delta_s: float) -> str:
    moment = datetime.now(timezone.utc) + timedelta(seconds=delta_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def host_credentials(host: Host) -> list[Result]:
    results: list[Result] = []
    token = TOKENS["acme-app"]
    with host.http("acme-app") as app:
        target = uid("sec")
        pending = post_action(app, "cap:crewai:echo", {"topic": "creds"}, target, target)
        approval_id = pending.json()["body"]["action_result"]["output"]["approval_id"]
    routes = [
        ("GET", "/aip/v1/manifest"),
        ("GET", "/aip/v1/capabilities"),
        ("POST", "/aip/v1/messages"),
        ("GET", f"/aip/v1/actions/{target}"),
        ("GET", f"/aip/v1/actions/{target}/result"),
        ("GET", f"/aip/v1/actions/{target}/events"),
        ("GET", f"/aip/v1/actions/{target}/chunks"),
        ("POST", f"/aip/v1/actions/{target}/cancel"),
        ("GET", "/aip/v1/approvals"),
        ("GET", f"/aip/v1/approvals/{approval_id}"),
        ("POST", f"/aip/v1/approvals/{approval_id}/decision"),
        ("GET", "/metrics"),
        ("POST", f"/aip/v1/actions/{target}/stream-token"),
        ("POST", "/aip/v1/approvals/stream-token"),
        ("GET", "/aip/v1/approvals/events"),
        ("GET", f"/aip/v1/approvals/{approval_id}/proof"),
    ]
    attempted: list[str] = []
    with httpx2.Client(base_url=host.base_url, timeout=30) as http:
        for method, path in routes:
            for case, authorization in _tampered(token):
                headers = {} if authorization is None else {"Authorization": authorization}
                kwargs: dict[str, Any] = {"headers": headers}
                if path == "/aip/v1/messages":
                    attempted.append(uid("sec-rejected"))
                    kwargs["json"] = envelope(action(attempted[-1], "cap:crewai:echo", {"topic": "x"}, attempted[-1]))
                elif path.endswith("/decision"):
                    kwargs["json"] = {"decision": "approved", "reason": "forged"}
                answer = http.request(method, path, **kwargs)
                ok = (
                    answer.status_code == 401
                    and answer.headers.get("www-authenticate") == "Bearer"
                    and answer.json()["body"]["error"]["error"]["code"] == "auth.unauthenticated"
                )
                _check(
                    results,
                    f"host {method} {path.split('/')[-1] or path} {case}",
                    ok,
                    f"{answer.status_code} {answer.text[:200]}",
                )
        # signed envelopes (the messages route): only a fresh, intact, first-time signature is accepted
        base = envelope(action(uid("sig"), "cap:crewai:echo", {"topic": "signed"}, None))
        base["body"]["action"]["idempotency_key"] = base["body"]["action"]["id"]
        valid = _sign(base)
        first = http.post("/aip/v1/messages", json=valid)
        _check(results, "host signed envelope accepted", first.status_code == 202, first.text)
        forged: dict[str, dict[str, Any]] = {}
        forged["replayed"] = valid
        tampered = copy.deepcopy(valid)
        tampered["body"]["action"]["input"]["topic"] = "changed after signing"
        forged["tampered_input"] = tampered
        for case, delta in (("expired", -600), ("from_the_future", 600)):
            stale = copy.deepcopy(base)
            stale["message_id"], stale["sent_at"] = f"msg_{uid('s')}", _rfc3339(delta)
            forged[case] = _sign(stale)
        other = copy.deepcopy(base)
        other["message_id"] = f"msg_{uid('o')}"
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        forged["another_key"] = _sign(other, Ed25519PrivateKey.generate())
        forged["unknown_key_id"] = _sign(other, key_id="nobody")
        forged["bearer_principal_key_id"] = _sign(other, key_id="acme-app")
        no_signature = copy.deepcopy(_sign(other))
        no_signature["security"].pop("signature")
        forged["signature_removed"] = no_signature
        truncated = copy.deepcopy(_sign(other))
        truncated["security"]["signature"] = truncated["security"]["signature"][:-2]
        forged["signature_truncated"] = truncated
        for case, env in forged.items():
            answer = http.post("/aip/v1/messages", json=env)
            ok = answer.status_code == 401 and answer.json()["body"]["error"]["error"]["code"] == "auth.unauthenticated"
            _check(results, f"host signed envelope {case}", ok, f"{answer.status_code} {answer.text[:200]}")
    with host.http("acme-app") as app, host.http("acme-approver") as approver:
        _check(
            results,
            "host rejected messages created nothing",
            all(app.get(f"/aip/v1/actions/{a}").status_code == 404 for a in attempted),
            attempted[:3],
        )
        still = approver.get(f"/aip/v1/approvals/{approval_id}").json()
        _check(results, "host forged decisions changed nothing", still["status"] == "pending", still)
        _check(
            results,
            "host forged cancels changed nothing",
            app.get(f"/aip/v1/actions/{target}").json()["state"] == "pending_approval",
        )
    return results


def sidecar_credentials(sidecar: Sidecar) -> list[Result]:
    results: list[Result] = []
    job = uid("sec-job")
    body = {"crew_id": "echo", "action_id": job, "operation": "run", "input": {}}
    routes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/health", {}),
        ("GET", "/metrics", {}),
        ("POST", "/jobs", {"json": body, "headers": {"Idempotency-Key": job}}),
        ("POST", "/jobs/stream", {"json": body, "headers": {"Idempotency-Key": job}}),
        ("GET", f"/jobs/{job}", {}),
        ("GET", f"/jobs/{job}/events", {}),
        ("GET", f"/jobs/{job}/events", {"headers": {"Accept": "text/event-stream"}}),
        ("POST", f"/jobs/{job}/cancel", {"json": {"crew_id": "echo", "action_id": job}}),
        ("DELETE", f"/jobs/{job}", {"headers": {"X-AIP-Archive-Confirmation": job}}),
        ("GET", "/nowhere", {}),
    ]
    with httpx2.Client(base_url=sidecar.base_url, timeout=30) as http:
        for method, path, kwargs in routes:
            for case, authorization in [*_tampered(TOKEN), ("query_token", None)]:
                headers = dict(kwargs.get("headers", {}))
                if authorization is not None:
                    headers["Authorization"] = authorization
                params = {"access_token": TOKEN, "token": TOKEN} if case == "query_token" else None
                answer = http.request(method, path, params=params, **{**kwargs, "headers": headers})
                ok = (
                    answer.status_code == 401
                    and answer.headers.get("www-authenticate") == "Bearer"
                    and answer.json() == {"detail": "missing or invalid bearer token"}
                )
                _check(
                    results,
                    f"sidecar {method} {path.replace(job, '{id}')} {case}",
                    ok,
                    f"{answer.status_code} {answer.text[:200]}",
                )
        seen = http.get(f"/jobs/{job}", headers=sidecar.headers)
        _check(results, "sidecar rejected requests admitted nothing", seen.status_code == 404, seen.text)
    return results


def cross_tenant(sidecar: Sidecar, host: Host) -> list[Result]:
    results: list[Result] = []
    shared = uid("shared")  # both tenants use this action id for their own runs
    with host.http("acme-app") as app:
        pending = post_action(app, "cap:crewai:echo", {"topic": "acme private"}, uid("acme-pending"), uid("k"))
        acme_pending = pending.json()["body"]["action_result"]
        done = post_action(app, "cap:crewai:echo", {"topic": "acme volcano"}, shared, uid("k"))
        approve(host, done)
        wait_action(app, shared)
    with host.http("beta-app") as beta, host.http("beta-approver") as beta_approver:
        hidden = acme_pending["action_id"]
        for suffix in ("", "/result", "/events", "/chunks"):
            answer = beta.get(f"/aip/v1/actions/{hidden}{suffix}")
            _check(results, f"tenant read actions/{{id}}{suffix}", answer.status_code == 404, answer.text)
        answer = beta.post(f"/aip/v1/actions/{hidden}/cancel")
        _check(results, "tenant cancel of another tenant's action", answer.status_code == 404, answer.text)
        answer = beta.post(f"/aip/v1/actions/{hidden}/stream-token")
        _check(results, "tenant stream token for another tenant's action", answer.status_code == 404, answer.text)
        for cap, inp in (
            ("cap:crewai:slow", {"topic": "x"}),
            ("cap:crewai:knowledge_a:knowledge_query", {"query": ["lighthouse"]}),
        ):
            answer = post_action(beta, cap, inp, uid("b"), uid("k"))
            ok = answer.status_code == 404 and answer.json()["body"]["error"]["error"]["code"] == "capability.not_found"
            _check(results, f"tenant call of another tenant's crew {cap}", ok, answer.text)
        for op in ("status", "events", "cancel"):  # beta's own crew, acme's run ids: not resolvable
            for run in (shared, hidden):
                answer = post_action(beta, f"cap:crewai:echo:{op}", {"run_action_id": run}, uid("b"), uid("k"))
                ok = answer.status_code == 404 and answer.json()["body"]["error"]["error"]["code"] == "action.not_found"
                _check(results, f"tenant {op} of another tenant's run", ok, answer.text[:200])
        approvals = beta_approver.get("/aip/v1/approvals", params={"status": "pending"}).json()["approvals"]
        approval_id = acme_pending["output"]["approval_id"]
        _check(
            results, "tenant approval queue", all(a["request"]["id"] != approval_id for a in approvals), approvals[:2]
        )
        answer = beta_approver.get(f"/aip/v1/approvals/{approval_id}")
        _check(results, "tenant read of another tenant's approval", answer.status_code == 404, answer.text)
        answer = beta_approver.get(f"/aip/v1/approvals/{approval_id}/proof")
        _check(results, "tenant read of another tenant's decision proof", answer.status_code == 404, answer.text)
        answer = beta_approver.post(
            f"/aip/v1/approvals/{approval_id}/decision", json={"decision": "approved", "reason": "not mine"}
        )
        _check(results, "tenant decision on another tenant's approval", answer.status_code == 404, answer.text)
        # the same action id in tenant beta is a different action and a different sidecar job
        own = post_action(beta, "cap:crewai:echo", {"topic": "beta lagoon"}, shared, uid("k"))
        approval = own.json()["body"]["action_result"]["output"]["approval_id"]
        beta_approver.post(f"/aip/v1/approvals/{approval}/decision", json={"decision": "approved", "reason": "ok"})
        wait_action(beta, shared)
        view = post_action(beta, "cap:crewai:echo:status", {"run_action_id": shared}, uid("b"), None)
        output = json.dumps(view.json()["body"]["action_result"].get("output"))
        _check(results, "same action id, own job", "lagoon" in output and "volcano" not in output, output[:200])
    with host.http("acme-approver") as approver:
        still = approver.get(f"/aip/v1/approvals/{acme_pending['output']['approval_id']}").json()
        _check(results, "another tenant's decision changed nothing", still["status"] == "pending", still)
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=30) as http:
        acme_job, beta_job = http.get(f"/jobs/acme:{shared}").json(), http.get(f"/jobs/beta:{shared}").json()
        _check(
            results,
            "one sidecar job per tenant",
            "volcano" in json.dumps(acme_job) and "lagoon" in json.dumps(beta_job),
            (acme_job, beta_job),
        )
    return results


def secrets_absent(procs: Processes, sidecar: Sidecar, host: Host) -> list[Result]:
    """Run the failing crew (its provider raises with ``FAKE_SECRET``) and inputs carrying ``MARKER``
    through both processes, then scan every output, error body and database file."""
    results: list[Result] = []
    bodies: list[bytes] = []
    with host.http("acme-app") as app:
        failing = uid("secret")
        pending = post_action(app, "cap:crewai:failing", {"topic": "t", "note": MARKER}, failing, failing)
        bodies.append(pending.content)
        approve(host, pending)
        wait_action(app, failing)
        for suffix in ("", "/result", "/events", "/chunks"):
            bodies.append(app.get(f"/aip/v1/actions/{failing}{suffix}").content)
        result = json.loads(bodies[2])["body"]["action_result"]
        _check(results, "failing crew reported as failed", result["status"] == "failed", result)
        echo = uid("marker")
        pending = post_action(app, "cap:crewai:echo", {"topic": "t", "note": MARKER}, echo, echo)
        approve(host, pending)
        wait_action(app, echo)
        bodies.append(app.get(f"/aip/v1/actions/{echo}/result").content)
        for inp in (
            {"query": [MARKER], "results_limit": MARKER},
            {"query": [MARKER], "score_threshold": 7},
            {"query": [MARKER + "\u0007"]},
        ):  # invalid crew inputs: the errors name the field, not the value
            answer = post_action(app, "cap:crewai:knowledge_a:knowledge_query", inp, uid("bad"), uid("k"))
            _check(results, "invalid input refused", answer.status_code == 400, answer.text[:200])
            bodies.append(answer.content)
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=60) as http:
        direct = uid("direct")
        answer = http.post(
            "/jobs",
            json={"crew_id": "failing", "action_id": direct, "input": {"note": MARKER}},
            headers={"Idempotency-Key": direct},
        )
        _check(results, "failing job answered 502", answer.status_code == 502, answer.text)
        bodies.append(answer.content)
        bodies.append(http.get(f"/jobs/{direct}/events").content)
    secrets = [FAKE_SECRET.encode(), b"sk-test-SECRET", TOKEN.encode(), *(t.encode() for t in TOKENS.values())]
    output = procs.all_output()
    for needle in [*secrets, MARKER.encode()]:
        _check(results, f"process output free of {needle[:12]!r}", needle not in output, "found in stdout/stderr")
        _check(
            results,
            f"error bodies free of {needle[:12]!r}",
            not any(needle in b for b in bodies),
            [b[:200] for b in bodies if needle in b][:1],
        )
    _check(
        results,
        "journal free of secrets and inputs",
        not scan([sidecar.journal], [*secrets, MARKER.encode()]),
        scan([sidecar.journal], [*secrets, MARKER.encode()]),
    )
    stored = storebackend.store_text(host.workdir)  # the SQLite file and WAL, or the PostgreSQL rows
    _check(
        results,
        "host store free of secrets and tokens",
        bool(stored) and not any(n in stored for n in secrets),
        [n[:12] for n in secrets if n in stored] or "nothing stored",
    )
    hosts = {p.parent for p in sidecar.state_dir.rglob("host.toml")}
    # Crew inputs are kept on purpose in one place only: the replay-inputs files (docs/security.md, "Tenant-scoped
    # crew state"), each 0600 in a 0700 directory; they never hold secrets and nothing else holds inputs.
    kept = sidecar.state_dir / "replay-inputs"
    kept_files = [p for p in kept.rglob("*") if p.is_file()] if kept.is_dir() else []
    state = [
        p
        for p in sidecar.state_dir.rglob("*")
        if p.is_file()
        and p.name not in ("token", "calls.log")
        and not p.name.startswith("sidecar")
        and not hosts.intersection(p.parents)
        and kept not in p.parents
    ]
    _check(
        results,
        "sidecar state (CrewAI storage) free of secrets and inputs",
        not scan(state, [*secrets, MARKER.encode()]),
        scan(state, [*secrets, MARKER.encode()]),
    )
    _check(results, "kept replay inputs free of secrets", not scan(kept_files, secrets), scan(kept_files, secrets))
    loose = [str(p) for p in [kept, *kept_files] if p.exists() and p.stat().st_mode & 0o077]
    _check(results, "kept replay inputs private (0600 files in a 0700 directory)", not loose, loose)
    return results


# ------------------------------------------------------------ start-up


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, capture_output=True, timeout=60, env=env, stdin=subprocess.DEVNULL, check=False)


def _refused(results: list[Result], name: str, done: subprocess.CompletedProcess[bytes], needle: str) -> None:
    err = done.stderr.decode(errors="replace")
    ok = done.returncode == 2 and needle in err and "Traceback" not in err and done.stdout == b""
    _check(results, name, ok, f"exit {done.returncode}: {err[-300:]}")


def startup_refusals(workdir: Path) -> list[Result]:
    """Unsafe token/journal/store files and a plain-http remote sidecar URL refuse start-up (exit 2)."""
    from kits.sidecar import ALLOWED, REGISTRY, child_env, sidecar_command

    results: list[Result] = []
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o700)
    py = sys.executable

    def host_case(name: str, prepare: Callable[[Path, Path], None], needle: str) -> None:
        d = workdir / f"host-{name}"
        # A SQLite store whatever the suite's backend: these cases are about files (and are all refused
        # before a store is opened).
        config = write_host_config(d, "http://127.0.0.1:9", free_port(), store=storebackend.SQLITE_STORE)
        prepare(d, config)
        _refused(
            results, f"host refuses {name}", _run([py, "-m", "aip_crewai.cli", "host", "--config", str(config)]), needle
        )

    def chmod(rel: str, mode: int) -> Callable[[Path, Path], None]:
        def prepare(d: Path, _config: Path) -> None:
            target = d / rel
            if not target.exists():
                target.write_bytes(b"")
            target.chmod(mode)

        return prepare

    def rewrite(old: str, new: str) -> Callable[[Path, Path], None]:
        def prepare(_d: Path, config: Path) -> None:
            config.write_text(config.read_text().replace(old, new))

        return prepare

    host_case("a sidecar token readable by others", chmod("sidecar.token", 0o644), "0600")
    host_case("a store readable by others", chmod("host.db", 0o644), "must be 0600")
    host_case("a store WAL readable by others", chmod("host.db-wal", 0o640), "must be 0600")
    host_case("a world-writable store directory", lambda d, c: d.chmod(0o777), "group- or world-writable")
    for url in (
        "http://10.1.2.3:8090",
        "http://sidecar.internal:8090",
        "http://127.0.0.1.nip.io:8090",
        "http://[::ffff:10.0.0.1]:8090",
        "http://0x7f000001:8090",
        "http://user:pw@127.0.0.1:8090",
    ):
        host_case(f"sidecar url {url}", rewrite("http://127.0.0.1:9", url), "sidecar.url")
    host_case("a tenant name with a colon", rewrite('[tenants."beta"]', '[tenants."acme:beta"]'), "no colon")
    host_case("a non-SQLite store", lambda d, c: _private(d / "host.db", b"not a database" * 64), "not a SQLite")
    host_case(
        "another application's SQLite store",
        lambda d, c: _foreign_sqlite(d / "host.db"),
        "not an aip-crewai host store",
    )

    token = workdir / "sidecar.token"
    _private(token, (TOKEN + "\n").encode())
    env = child_env(workdir / "calls.log")

    def sidecar_case(name: str, prepare: Callable[[Path], list[str]], needle: str) -> None:
        d = workdir / f"sidecar-{name.replace(' ', '-')}"
        d.mkdir(mode=0o700)
        extra = prepare(d)
        argv = [
            *sidecar_command("--registry", REGISTRY),
            "--journal",
            str(d / "journal.db"),
            "--token-file",
            str(token),
            "--port",
            "0",
            "--allowed-operations",
            ALLOWED,
            *extra,
        ]
        _refused(results, f"sidecar refuses {name}", _run(argv, env), needle)

    def loose_token(d: Path) -> list[str]:
        _private(d / "t", (TOKEN + "\n").encode(), 0o644)
        return ["--token-file", str(d / "t")]

    def linked_token(d: Path) -> list[str]:
        (d / "t").symlink_to(token)
        return ["--token-file", str(d / "t")]

    def journal_file(rel: str, mode: int, data: bytes = b"") -> Callable[[Path], list[str]]:
        def prepare(d: Path) -> list[str]:
            _private(d / rel, data, mode)
            return []

        return prepare

    def open_dir(d: Path) -> list[str]:
        d.chmod(0o770)
        return []

    sidecar_case("a token readable by others", loose_token, "must be 0600")
    sidecar_case("a symlinked token", linked_token, "symlink")
    sidecar_case("a journal readable by group", journal_file("journal.db", 0o640), "must be 0600")
    sidecar_case("a journal WAL readable by others", journal_file("journal.db-wal", 0o644), "must be 0600")
    sidecar_case("a group-writable journal directory", open_dir, "group- or world-writable")
    return results


def _private(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.write_bytes(data)
    path.chmod(mode)


def _foreign_sqlite(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        db.execute("INSERT INTO notes (body) VALUES ('an operator''s data')")
    path.chmod(0o600)
