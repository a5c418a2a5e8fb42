"""``[[webhooks]]`` and ``[host] webhook_allow_cidrs`` in host.toml (docs/webhooks.md): shapes, every
bound at its edge, keyed errors, and the secret never in an error."""

from __future__ import annotations

import base64
import datetime
import ipaddress

import pytest
import structlog.testing
from kits.hostapp import HostFiles, base_document
from standardwebhooks.webhooks import Webhook

from aip_crewai.host.config import HostConfigError, load_settings
from aip_crewai.host.webhooks.config import EVENT_TYPES, endpoint_id

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def write_secret(files: HostFiles, text: str = SECRET, mode: int = 0o600, name: str = "hook.secret") -> str:
    path = files.root / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return name


def doc_with(files: HostFiles, **entry) -> dict:
    doc = base_document()
    hook = {
        "tenant": "acme",
        "url": "http://127.0.0.1:9/hook",
        "secret_file": write_secret(files),
        "events": ["action.completed"],
    }
    hook.update(entry)
    doc["webhooks"] = [{k: v for k, v in hook.items() if v is not None}]
    return doc


def load(files: HostFiles, doc: dict):
    files.write(doc)
    return load_settings(files.config, environ={})


def error_of(files: HostFiles, doc: dict) -> HostConfigError:
    with pytest.raises(HostConfigError) as info:
        load(files, doc)
    return info.value


def test_no_webhooks_by_default(host_files: HostFiles):
    settings = load(host_files, base_document())
    assert settings.webhooks.endpoints == () and settings.webhooks.allow_cidrs == ()


def test_an_entry_loads_with_its_defaults_and_signs_like_the_package(host_files: HostFiles):
    settings = load(host_files, doc_with(host_files, events=list(EVENT_TYPES)))
    (endpoint,) = settings.webhooks.endpoints
    assert endpoint.tenant == "acme" and endpoint.events == frozenset(EVENT_TYPES)
    assert (endpoint.timeout_s, endpoint.deadline_s, endpoint.retry_initial_s, endpoint.retry_max_s) == (
        10.0,
        86_400.0,
        5.0,
        300.0,
    )
    assert endpoint.include_output is False
    assert endpoint.endpoint_id == endpoint_id("acme", "http://127.0.0.1:9/hook")
    when = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    assert endpoint.signer.sign("msg_1", when, "{}") == Webhook(SECRET).sign("msg_1", when, "{}")
    assert settings.webhooks.subscribed("acme", "action.failed") == [endpoint]
    assert settings.webhooks.subscribed("globex", "action.failed") == []
    assert SECRET not in repr(settings) and "whsec_" not in repr(endpoint)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout_seconds", 0.1),
        ("timeout_seconds", 60),
        ("deadline_seconds", 1),
        ("deadline_seconds", 604_800),
        ("retry_initial_seconds", 0.01),
        ("retry_initial_seconds", 3600),
        ("retry_max_seconds", 86_400),
    ],
)
def test_bounds_at_their_edges_load(host_files: HostFiles, key, value):
    extra = {"retry_max_seconds": 3600} if (key, value) == ("retry_initial_seconds", 3600) else {}
    (endpoint,) = load(host_files, doc_with(host_files, **{key: value, **extra})).webhooks.endpoints
    attr = {"timeout_seconds": "timeout_s", "deadline_seconds": "deadline_s"}.get(key, key.replace("seconds", "s"))
    assert getattr(endpoint, attr) == value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout_seconds", 0.09),
        ("timeout_seconds", 60.01),
        ("deadline_seconds", 0.99),
        ("deadline_seconds", 604_801),
        ("retry_initial_seconds", 0.009),
        ("retry_initial_seconds", 3600.01),
        ("retry_max_seconds", 86_400.01),
    ],
)
def test_bounds_past_their_edges_are_refused_by_key(host_files: HostFiles, key, value):
    assert error_of(host_files, doc_with(host_files, **{key: value})).key == f"webhooks[0].{key}"


@pytest.mark.parametrize(
    ("entry", "key", "words"),
    [
        ({"tenant": "nobody"}, "webhooks[0].tenant", "unknown tenant"),
        ({"url": "http://example.com/hook"}, "webhooks[0].url", "loopback"),
        ({"url": "ftp://127.0.0.1/hook"}, "webhooks[0].url", "http"),
        ({"url": "https://user:pw@example.com/hook"}, "webhooks[0].url", "credentials"),
        ({"url": "https://example.com/hook#x"}, "webhooks[0].url", "fragment"),
        ({"events": []}, "webhooks[0].events", ""),
        ({"events": ["action.started"]}, "webhooks[0].events[0]", ""),
        ({"events": ["action.failed", "action.failed"]}, "webhooks[0].events", "twice"),
        ({"retry_initial_seconds": 10, "retry_max_seconds": 5}, "webhooks[0].retry_max_seconds", "at least"),
        ({"colour": "red"}, "webhooks[0].colour", "unknown key"),
        ({"secret_file": None}, "webhooks[0].secret_file", "required"),
        ({"secret_file": "missing.secret"}, "webhooks[0].secret_file", "does not exist"),
    ],
)
def test_bad_entries_name_the_key(host_files: HostFiles, entry, key, words):
    error = error_of(host_files, doc_with(host_files, **entry))
    assert error.key == key and words in error.reason


def test_https_urls_to_any_host_are_accepted(host_files: HostFiles):
    (endpoint,) = load(host_files, doc_with(host_files, url="https://hooks.example/aip?token=1")).webhooks.endpoints
    assert endpoint.url == "https://hooks.example/aip?token=1"


def test_the_same_url_twice_for_a_tenant_is_refused(host_files: HostFiles):
    doc = doc_with(host_files)
    doc["webhooks"].append(dict(doc["webhooks"][0]))
    assert error_of(host_files, doc).key == "webhooks[1].url"


@pytest.mark.parametrize(
    ("text", "mode", "words"),
    [
        (SECRET, 0o644, "0600"),
        ("k" * 40, 0o600, "whsec_"),
        ("whsec_not*base64", 0o600, "whsec_"),
        ("whsec_" + base64.b64encode(b"k" * 23).decode(), 0o600, "24..64"),
        ("whsec_" + base64.b64encode(b"k" * 65).decode(), 0o600, "24..64"),
    ],
)
def test_bad_secrets_are_refused_without_showing_them(host_files: HostFiles, text, mode, words):
    doc = doc_with(host_files, secret_file=write_secret(host_files, text, mode, name="bad.secret"))
    error = error_of(host_files, doc)
    assert error.key == "webhooks[0].secret_file" and words in error.reason
    assert text not in str(error) and text[6:] not in str(error)


@pytest.mark.parametrize("size", [24, 64])
def test_secret_sizes_at_the_edges_load(host_files: HostFiles, size):
    text = "whsec_" + base64.b64encode(b"k" * size).decode()
    doc = doc_with(host_files, secret_file=write_secret(host_files, text, name="edge.secret"))
    assert len(load(host_files, doc).webhooks.endpoints) == 1


def test_allow_cidrs_load_and_bad_ones_are_keyed(host_files: HostFiles):
    doc = doc_with(host_files)
    doc["host"]["webhook_allow_cidrs"] = ["10.20.0.0/16", "fd00::/8"]
    assert load(host_files, doc).webhooks.allow_cidrs == (
        ipaddress.ip_network("10.20.0.0/16"),
        ipaddress.ip_network("fd00::/8"),
    )
    doc["host"]["webhook_allow_cidrs"] = ["10.20.0.0/16", "10.0.0.1/8"]
    assert error_of(host_files, doc).key == "host.webhook_allow_cidrs[1]"


def test_an_allow_entry_covering_a_metadata_address_is_kept_with_a_start_up_warning_naming_it(
    host_files: HostFiles, make_app
):
    """``0.0.0.0/0`` or ``::/0`` turns the destination filter off (metadata addresses included): accepted, as
    an operator may mean it, but no longer silently (docs/webhooks.md "Safety")."""
    doc = doc_with(host_files)
    doc["host"]["webhook_allow_cidrs"] = ["10.20.0.0/16", "0.0.0.0/0", "fd00::/8", "169.254.0.0/16", "::/0"]
    settings = load(host_files, doc)
    assert len(settings.webhooks.allow_cidrs) == 5
    with structlog.testing.capture_logs() as logs:
        make_app(settings)
    warned = [
        (e["key"], e["entry"], e["address"], e["log_level"])
        for e in logs
        if e["event"] == "webhook_allow_cidr_covers_metadata"
    ]
    assert warned == [
        ("host.webhook_allow_cidrs[1]", "0.0.0.0/0", "169.254.169.254", "warning"),
        ("host.webhook_allow_cidrs[2]", "fd00::/8", "fd00:ec2::254", "warning"),
        ("host.webhook_allow_cidrs[3]", "169.254.0.0/16", "169.254.169.254", "warning"),
        ("host.webhook_allow_cidrs[4]", "::/0", "fd00:ec2::254", "warning"),
    ]
    doc["host"]["webhook_allow_cidrs"] = ["10.20.0.0/16", "fd00:1::/32"]
    with structlog.testing.capture_logs() as logs:
        make_app(load(host_files, doc))
    assert not [e for e in logs if e["event"] == "webhook_allow_cidr_covers_metadata"]


def test_allow_cidrs_at_their_count_bound(host_files: HostFiles):
    doc = doc_with(host_files)
    doc["host"]["webhook_allow_cidrs"] = [f"10.{i}.0.0/16" for i in range(64)]
    assert len(load(host_files, doc).webhooks.allow_cidrs) == 64
    doc["host"]["webhook_allow_cidrs"].append("10.200.0.0/16")
    assert error_of(host_files, doc).key == "host.webhook_allow_cidrs"


def test_webhook_entries_at_their_count_bound(host_files: HostFiles):
    doc = doc_with(host_files)
    entry = doc["webhooks"][0]
    doc["webhooks"] = [dict(entry, url=f"http://127.0.0.1:9/hook/{i}") for i in range(64)]
    assert len(load(host_files, doc).webhooks.endpoints) == 64
    doc["webhooks"].append(dict(entry, url="http://127.0.0.1:9/hook/64"))
    assert error_of(host_files, doc).key == "webhooks"
