"""Security: credentials on every route of both processes, tenant isolation, secrets, and start-up
refusals of unsafe files and URLs (ARCHITECTURE.md §4, §7; secrets never in logs)."""

from __future__ import annotations

import pytest
import securitykit

from aip_crewai.exit_codes import Exit
from aip_crewai.host.config import HostConfigError, check_sidecar_url
from aip_crewai.host.sidecars.client import sidecar_job_id

pytestmark = [pytest.mark.integration, pytest.mark.host_processes]


def _failures(results):
    return [f"{name}: {detail}" for name, ok, detail in results if not ok]


@pytest.mark.timeout(120)
def test_rel_host_routes_refuse_missing_wrong_tampered_expired_and_replayed_credentials(shared_pair):
    """12 routes x 11 bearer variants, and 10 forged signed envelopes: all 401, with no effect."""
    results = securitykit.host_credentials(shared_pair[2])
    assert len(results) > 140 and _failures(results) == []


@pytest.mark.timeout(120)
def test_rel_sidecar_routes_refuse_missing_wrong_and_tampered_tokens(shared_pair):
    """10 sidecar routes x 12 token variants (tokens in the query string too): all 401, nothing admitted."""
    results = securitykit.sidecar_credentials(shared_pair[1])
    assert len(results) > 100 and _failures(results) == []


@pytest.mark.timeout(120)
def test_rel_tenants_never_see_or_touch_each_other(shared_pair):
    """Another tenant's actions, approvals, crews and runs are 404; one action id in two tenants is two jobs."""
    _, sidecar, host = shared_pair
    assert _failures(securitykit.cross_tenant(sidecar, host)) == []


@pytest.mark.timeout(120)
def test_rel_secrets_tokens_and_inputs_stay_out_of_logs_bodies_and_the_journal(shared_pair):
    """The provider secret the failing crew raises, every token, and an input marker are absent from both
    processes' stdout and stderr, every error body, the journal and CrewAI's storage; the host store holds
    no secret or token (it keeps inputs by design: the approver's input snapshot)."""
    assert _failures(securitykit.secrets_absent(*shared_pair)) == []


@pytest.mark.timeout(180)
def test_rel_unsafe_files_and_urls_refuse_start_up_with_a_clear_message(tmp_path):
    """Loose token, journal and store modes, symlinks, open directories, foreign or non-SQLite stores,
    plain http to a non-loopback sidecar: exit 2, one clear line, no traceback."""
    results = securitykit.startup_refusals(tmp_path / "refusals")
    assert len(results) >= 18 and _failures(results) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "store",
    [
        "postgresql://aip@127.0.0.1:5/aip?sslmode=require&sslpassword=hunter2-zq9",
        "postgresql://aip@127.0.0.1:5/aip?ssl%70assword=hunter2-zq9",  # a percent-encoded name
    ],
)
def test_rel_a_client_key_passphrase_in_the_store_url_refuses_start_up_without_echoing_it(tmp_path, store):
    """Regression (second review): `?sslpassword=` in a PostgreSQL store URL was accepted. The
    host process exits 2 (a configuration error) before connecting anywhere, with one line naming the key and
    the parameter and never the passphrase, on stderr only, and no traceback."""
    import subprocess
    import sys

    from kits.host import free_port
    from relkit import write_host_config

    config = write_host_config(tmp_path / "host", "http://127.0.0.1:9", free_port(), store=store)
    done = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(config)],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    err = done.stderr.decode(errors="replace")
    assert done.returncode == Exit.USAGE and done.stdout == b"", (done.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "host.store" in err and "keep credentials out of the URL" in err and "sslpassword" in err, err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    "url",
    [
        "http://10.1.2.3:8090",
        "http://sidecar:8090",
        "http://127.0.0.1.nip.io",
        "http://[::ffff:127.0.0.1]",
        "http://127.1",
        "http://2130706433",
        "http://localhost.:8090",
        "http://10.0.0.1#@127.0.0.1",
        "http://10.0.0.1\\\\@127.0.0.1",
        "ftp://127.0.0.1",
        "http://u@127.0.0.1",
    ],
)
def test_rel_plain_http_sidecar_urls_off_loopback_are_refused(url):
    with pytest.raises(HostConfigError):
        check_sidecar_url(url)


def test_rel_sidecar_job_ids_never_collide_across_tenants():
    """Regression: tenant names could hold ':', so tenant "a" with action "b:c" and tenant "a:b" with action
    "c" shared the sidecar job "a:b:c" (one tenant's status read returned the other's job). Tenant names
    no longer take ':' (start-up refuses them, see above); and a plain id never looks like a hashed one."""
    assert sidecar_job_id("acme", "sha256:" + "0" * 64) != "acme:sha256:" + "0" * 64
    long_id = "x" * 300
    assert sidecar_job_id("acme", long_id) != sidecar_job_id("acme", sidecar_job_id("acme", long_id)[5:])


@pytest.mark.timeout(60)
def test_rel_an_early_401_closes_the_connection_instead_of_poisoning_keep_alive(shared_pair):
    """Regression: a 401 answered before the request body was read left the body on a keep-alive
    connection the server then dropped without `Connection: close`; the client's next request on it
    failed with "server disconnected" (for the host's sidecar client: a transport error, an uncertain
    dispatch). Both processes now close such connections explicitly."""
    import httpx2

    _, sidecar, host = shared_pair
    targets = [
        (sidecar.base_url, "/jobs", {"Idempotency-Key": "k"}, sidecar.headers, "/health"),
        (
            host.base_url,
            "/aip/v1/approvals/apr_x/decision",
            {},
            {"Authorization": "Bearer tok-acme-approver-1"},
            "/aip/v1/approvals",
        ),
    ]
    for base_url, path, extra, good, follow_up in targets:
        with httpx2.Client(base_url=base_url, timeout=30) as http:  # one keep-alive connection pool
            for _ in range(25):
                rejected = http.post(
                    path,
                    json={"crew_id": "echo", "action_id": "x", "input": {"p": "y" * 2000}},
                    headers={**extra, "Authorization": "Bearer nope"},
                )
                assert rejected.status_code == 401 and rejected.headers.get("connection") == "close"
                assert http.get(follow_up, headers=good).status_code == 200
