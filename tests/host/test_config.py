"""host.toml: the ARCHITECTURE.md §11 shape, keyed errors, file rules, exit code 2."""

from __future__ import annotations

import copy
import enum
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import msgspec
import pytest
import structlog
from kits.hostapp import SIDECAR_TOKEN, HostFiles, base_document, os_mode

from aip_crewai.host.config import HostConfigError, check_sidecar_proxy, check_sidecar_url, load_settings
from aip_crewai.host.config_values import allowed_values, table_hint
from aip_crewai.host.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_logging():
    """main() configures structlog for the process (stderr captured by capsys here): undo it."""
    yield
    structlog.reset_defaults()


def load(files: HostFiles, doc: dict | None = None):
    files.write(doc)
    return load_settings(files.config, environ={})


def error_of(files: HostFiles, doc: dict) -> HostConfigError:
    with pytest.raises(HostConfigError) as info:
        load(files, doc)
    return info.value


def test_valid_config_loads_with_defaults_and_relative_paths(host_files: HostFiles):
    settings = load(host_files)
    assert settings.bind == "127.0.0.1:0"
    assert settings.max_response_bytes == 67_108_864
    assert settings.readiness_interval_s == 5.0
    assert settings.store_path == host_files.root / "state" / "host.db"  # relative to the config file
    assert settings.crews_file == host_files.root / "crews.json"
    assert settings.sidecar_token == SIDECAR_TOKEN  # trailing newline stripped
    assert SIDECAR_TOKEN not in repr(settings)
    assert [c.id for c in settings.crews] == ["alpha", "beta", "gamma"]
    assert dict(settings.tenants) == {"acme": ("alpha", "beta"), "globex": ("gamma",), "closed": ()}
    invoker = settings.principals[0]
    assert invoker.roles == frozenset({"invoker"}) and len(invoker.token_sha256) == 32
    assert settings.notify_socket is None
    assert settings.dispatch_deadline_s == 600.0 and settings.sidecar_keepalive_s == 15.0


def test_dispatch_deadline_and_keepalive_are_read(host_files: HostFiles):
    doc = mutate("host.dispatch_deadline_seconds", 2)
    doc["sidecar"]["keepalive_seconds"] = 0.5
    settings = load(host_files, doc)
    assert settings.dispatch_deadline_s == 2.0 and settings.sidecar_keepalive_s == 0.5


@pytest.mark.parametrize("ttl", [10, 3600])
def test_stream_token_ttl_at_its_bounds_is_read(host_files: HostFiles, ttl):
    assert load(host_files, mutate("host.stream_token_ttl_seconds", ttl)).stream_token_ttl_s == ttl


@pytest.mark.parametrize("size", [1, 64])
def test_store_pool_size_at_its_bounds_is_read(host_files: HostFiles, size):
    assert load(host_files, mutate("host.store_pool_size", size)).store_pool_size == size


@pytest.mark.parametrize("ms", [100, 60_000])
@pytest.mark.parametrize(
    "key", ["store_statement_timeout_ms", "store_lock_timeout_ms", "store_idle_in_transaction_timeout_ms"]
)
def test_store_timeouts_at_their_bounds_are_read(host_files: HostFiles, key, ms):
    timeouts = load(host_files, mutate(f"host.{key}", ms)).store_timeouts
    field = {"store_statement_timeout_ms": "statement_ms", "store_lock_timeout_ms": "lock_ms"}.get(
        key, "idle_in_transaction_ms"
    )
    assert getattr(timeouts, field) == ms


def test_store_timeouts_default_well_under_ten_seconds(host_files: HostFiles):
    timeouts = load(host_files, None).store_timeouts
    assert (timeouts.statement_ms, timeouts.lock_ms, timeouts.idle_in_transaction_ms, timeouts.call_ms) == (
        4000,
        2000,
        4000,
        5000,
    )


@pytest.mark.parametrize("entries", [0, 1, 1_000_000])
def test_status_cache_entries_at_its_bounds_is_read(host_files: HostFiles, entries):
    assert load(host_files, mutate("host.status_cache_entries", entries)).status_cache_entries == entries


def test_status_cache_entries_default(host_files: HostFiles):
    assert load(host_files, base_document()).status_cache_entries == 1024


def test_stream_token_ttl_and_openapi_defaults(host_files: HostFiles):
    settings = load(host_files, mutate("host.openapi", False))
    assert settings.stream_token_ttl_s == 300 and settings.openapi is False and settings.store_pool_size == 4


def test_relative_paths_resolve_against_the_config_dir_not_cwd(host_files: HostFiles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = load_settings(Path("etc/host.toml"), environ={})
    assert settings.store_path == host_files.root / "state" / "host.db"


def test_notify_socket_is_read_from_the_environment(host_files: HostFiles):
    assert load_settings(host_files.config, environ={"NOTIFY_SOCKET": "@x"}).notify_socket == "@x"


def test_example_config_parses(tmp_path):
    text = (REPO / "host" / "host.example.toml").read_text()
    assert "max_response_bytes = 67108864" in text
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib

    doc = tomllib.loads(text)
    assert set(doc) == {"host", "sidecar", "crews", "tenants", "principals"}


def mutate(path: str, value) -> dict:
    """The base document with ``value`` at a dotted path (list indexes as numbers)."""
    doc = base_document()
    target = doc
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    last = parts[-1]
    target[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "key", "words"),
    [
        ("surprise", 1, "surprise", "unknown key"),
        ("host.extra", 1, "host.extra", "unknown key"),
        ("host.max_response_bytes", 0, "host.max_response_bytes", ">= 1"),
        ("host.max_response_bytes", 268_435_457, "host.max_response_bytes", "<= 268435456"),
        ("host.max_response_bytes", "big", "host.max_response_bytes", "int"),
        ("host.max_response_bytes", True, "host.max_response_bytes", "int"),
        ("host.bind", "localhost", "host.bind", "<address>:<port>"),
        ("host.bind", "127.0.0.1:70000", "host.bind", "port"),
        ("host.bind", "[zz]:1", "host.bind", "IPv6"),
        ("sidecar.url", "http://10.0.0.5:8090", "sidecar.url", "loopback"),
        ("sidecar.url", "http://example.com", "sidecar.url", "loopback"),
        ("sidecar.url", "ftp://127.0.0.1", "sidecar.url", "http"),
        ("sidecar.url", "https://u:p@sidecar.internal", "sidecar.url", "credentials"),
        ("sidecar.url", "https://sidecar.internal/?a=1", "sidecar.url", "query"),
        ("sidecar.token_file", "missing.token", "sidecar.token_file", "does not exist"),
        ("tenants.acme.crews", ["alpha", "nope"], "tenants.acme.crews[1]", "not an admitted crew"),
        ("tenants.acme.crews", ["alpha", "alpha"], "tenants.acme.crews[1]", "twice"),
        ("tenants.acme.crews", "alpha", "tenants.acme.crews", "array"),
        ("principals.1.token_sha256", "abc", "principals[1].token_sha256", "64 hexadecimal"),
        ("principals.1.ed25519_public_key", "!!!", "principals[1].ed25519_public_key", "base64"),
        ("principals.1.ed25519_public_key", "AAAA", "principals[1].ed25519_public_key", "32 bytes"),
        ("principals.1.roles", ["invoker", "admin"], "principals[1].roles[1]", "admin"),
        ("principals.1.roles", [], "principals[1].roles", "length >= 1"),
        ("principals.1.tenant", "initech", "principals[1].tenant", "unknown tenant"),
        ("principals.1.id", "acme-invoker", "principals[1].id", "already used"),
        ("principals.1.id", "", "principals[1].id", "1..256"),
        ("principals.1.extra", 1, "principals[1].extra", "unknown key"),
        ("host.dispatch_deadline_seconds", 0, "host.dispatch_deadline_seconds", ">= 1"),
        ("host.dispatch_deadline_seconds", 86_401, "host.dispatch_deadline_seconds", "<= 86400"),
        ("host.dispatch_deadline_seconds", "soon", "host.dispatch_deadline_seconds", "float"),
        ("host.stream_token_ttl_seconds", 9, "host.stream_token_ttl_seconds", ">= 10"),
        ("host.stream_token_ttl_seconds", 3601, "host.stream_token_ttl_seconds", "<= 3600"),
        ("host.openapi", "yes", "host.openapi", "bool"),
        ("host.store_pool_size", 0, "host.store_pool_size", ">= 1"),
        ("host.store_pool_size", 65, "host.store_pool_size", "<= 64"),
        ("host.store_statement_timeout_ms", 99, "host.store_statement_timeout_ms", ">= 100"),
        ("host.store_lock_timeout_ms", 60_001, "host.store_lock_timeout_ms", "<= 60000"),
        ("host.store_idle_in_transaction_timeout_ms", 99, "host.store_idle_in_transaction_timeout_ms", ">= 100"),
        ("host.status_cache_entries", -1, "host.status_cache_entries", ">= 0"),
        ("host.status_cache_entries", 1_000_001, "host.status_cache_entries", "<= 1000000"),
        ("host.status_cache_entries", 1.5, "host.status_cache_entries", "int"),
        ("host.status_cache_entries", "many", "host.status_cache_entries", "int"),
        ("sidecar.keepalive_seconds", 0, "sidecar.keepalive_seconds", ">= 0.1"),
        ("sidecar.keepalive_seconds", 3601, "sidecar.keepalive_seconds", "<= 3600"),
    ],
)
def test_errors_name_the_offending_key(host_files: HostFiles, path, value, key, words):
    err = error_of(host_files, mutate(path, value))
    assert err.key == key, err.message
    assert words in err.message
    assert err.message.startswith(key + table_hint(key) + ":")


def test_an_enum_error_names_the_valid_values_and_the_table(host_files: HostFiles, capsys):
    err = error_of(host_files, mutate("principals.0.roles", ["invokers"]))
    assert err.key == "principals[0].roles[0]"
    assert err.message == (
        "principals[0].roles[0] (in the first [[principals]] table): 'invokers' is not one of "
        "'approver', 'invoker', 'operator'"
    )
    host_files.write(mutate("principals.1.roles", ["invoker", "admin"]))
    assert main(["--config", str(host_files.config)]) == 2
    assert capsys.readouterr().err == (
        "aip-crewai host: configuration error: principals[1].roles[1] (in the second [[principals]] table): "
        "'admin' is not one of 'approver', 'invoker', 'operator'\n"
    )


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("principals[0]", " (in the first [[principals]] table)"),
        ("principals[2].roles[0]", " (in the third [[principals]] table)"),
        ("sidecars[3].url", " (in [[sidecars]] table number 4)"),
        ("webhooks[0].events[1]", " (in the first [[webhooks]] table)"),
        ("tenants.acme.crews[1]", ""),
        ("host.bind", ""),
    ],
)
def test_a_key_in_an_array_of_tables_says_which_table(key: str, hint: str):
    assert table_hint(key) == hint


class _Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class _Shape(msgspec.Struct):
    roles: list[Literal["a", "b"]]
    colour: _Colour | None = None
    by_name: dict[str, Literal["x"]] = {}
    plain: str = ""


@pytest.mark.parametrize(
    ("path", "values"),
    [
        (".roles[0]", ("a", "b")),
        (".colour", ("red", "blue")),
        (".by_name.k", ("x",)),
        (".plain", None),
        (".nope", None),
        (".roles", None),
    ],
)
def test_allowed_values_walk_the_toml_shape(path: str, values):
    assert allowed_values(_Shape, path) == values


@pytest.mark.parametrize("section", ["host", "sidecar", "crews"])
def test_missing_sections_are_named(host_files: HostFiles, section):
    doc = base_document()
    del doc[section]
    assert error_of(host_files, doc).key == section


def test_missing_required_key_is_named(host_files: HostFiles):
    doc = base_document()
    del doc["host"]["store"]
    err = error_of(host_files, doc)
    assert err.key == "host.store" and "missing" in err.message


def test_a_postgresql_store_is_a_url_kept_as_given_and_never_holds_a_password(host_files: HostFiles):
    """Issue 21 item 1: ``store = "postgresql://..."``; the password belongs in ~/.pgpass or PGPASSFILE."""
    doc = base_document()
    for url in ("postgresql://aip@db.internal:5432/aip_host", "postgres://db/aip?sslmode=verify-full"):
        doc["host"]["store"] = url
        assert load(host_files, doc).store_path == url
    for bad, why in (
        ("postgresql://aip:hunter2@db/aip", "PGPASSFILE"),
        ("postgresql://db/aip?password=hunter2", "PGPASSFILE"),
        ("postgresql://db/a\nb", "control"),
        ("postgresql://db/" + "a" * 4100, "4096"),
        ("postgresql://aip@db/aip?pass%77ord=hunter2", "PGPASSFILE"),  # an encoded parameter name
        ("postgresql://aip%3Ahunter2@db/aip", "PGPASSFILE"),  # a mis-encoded user:password
        ("postgresql://aip@db/aip?sslmode=require&sslpassword=hunter2", "sslpassword"),  # the client key's passphrase
        ("postgresql://aip@db/aip?SSLPASSWORD=hunter2", "sslpassword"),
        ("postgresql://aip@db/aip?ssl%70assword=hunter2", "sslpassword"),  # an encoded parameter name
        ("postgresql://aip@db/aip?bogus=hunter2", "not a valid PostgreSQL URL"),
        ("host=db dbname=aip password=hunter2", "postgresql:// URL"),
    ):
        doc["host"]["store"] = bad
        err = error_of(host_files, doc)
        assert err.key == "host.store" and why in err.message and "hunter2" not in err.message
    doc["host"]["store"] = "state/host.db"
    assert load(host_files, doc).store_path == host_files.config.parent / "state" / "host.db"


def test_principal_needs_a_credential(host_files: HostFiles):
    doc = base_document()
    doc["principals"][0].pop("token_sha256")
    assert error_of(host_files, doc).key == "principals[0]"


def test_duplicate_token_hash_is_refused(host_files: HostFiles):
    doc = base_document()
    doc["principals"][2]["token_sha256"] = doc["principals"][0]["token_sha256"]
    err = error_of(host_files, doc)
    assert err.key == "principals[2].token_sha256" and "acme-invoker" in err.message


def test_tenant_names_are_constrained(host_files: HostFiles):
    doc = base_document()
    doc["tenants"]["bad name"] = {"crews": []}
    assert error_of(host_files, doc).key == "tenants.bad name"


def test_descriptor_errors_surface_under_crews_file(host_files: HostFiles):
    host_files.write(crews=[{"id": "a"}])
    err = error_of(host_files, base_document())
    assert err.key == "crews.file" and "[0] (id 'a')" in err.message and "name" in err.message


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8090",
        "http://127.9.9.9",
        "http://[::1]:8090",
        "http://localhost:1",
        "https://sidecar.internal:8443/prefix/",
    ],
)
def test_accepted_sidecar_urls(url):
    assert check_sidecar_url(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8090/#", "http://127.0.0.1:8090/?", "https://s/p?x=1", "https://s#f"]
)
def test_a_sidecar_url_with_a_query_or_fragment_even_an_empty_one_is_refused(url):
    with pytest.raises(HostConfigError, match="query or fragment"):
        check_sidecar_url(url)


def test_sidecar_proxy_is_only_for_https_sidecars_and_absent_by_default(host_files: HostFiles):
    """Issue 16 item 2: without sidecar.proxy the client ignores the environment's proxies; an explicit
    proxy is refused for plain http (it would see the bearer token) and must be a bare http(s) URL."""
    assert load(host_files).sidecar_proxy is None
    assert check_sidecar_proxy("http://proxy.internal:3128", "https://sidecar:8443") == "http://proxy.internal:3128"
    for proxy, url in [
        ("http://proxy:3128", "http://127.0.0.1:8090"),
        ("socks5://p:1", "https://s"),
        ("http://user:pw@proxy:3128", "https://s"),
        ("http://proxy:3128?x=1", "https://s"),
        ("proxy:3128", "https://s"),
    ]:
        with pytest.raises(HostConfigError) as caught:
            check_sidecar_proxy(proxy, url)
        assert caught.value.key == "sidecar.proxy"
    err = error_of(host_files, mutate("sidecar.proxy", "http://proxy:3128"))
    assert err.key == "sidecar.proxy" and "https" in err.message


class TestTokenFile:
    def test_group_readable_token_is_refused(self, host_files: HostFiles):
        (host_files.root / "sidecar.token").chmod(0o640)
        err = error_of(host_files, base_document())
        assert err.key == "sidecar.token_file" and "0640" in err.message

    def test_read_only_owner_token_is_accepted(self, host_files: HostFiles):
        (host_files.root / "sidecar.token").chmod(0o400)
        assert load(host_files).sidecar_token == SIDECAR_TOKEN

    def test_symlinked_token_is_refused(self, host_files: HostFiles):
        os.symlink(host_files.root / "sidecar.token", host_files.root / "link.token")
        err = error_of(host_files, mutate("sidecar.token_file", "link.token"))
        assert err.key == "sidecar.token_file" and "symlink" in err.message

    def test_directory_is_refused(self, host_files: HostFiles):
        (host_files.root / "dir.token").mkdir(mode=0o700)
        err = error_of(host_files, mutate("sidecar.token_file", "dir.token"))
        assert err.key == "sidecar.token_file"

    @pytest.mark.parametrize("content", [b"", b"\n\n", b"x" * 16_385, b"two words"])
    def test_bad_contents_are_refused(self, host_files: HostFiles, content):
        path = host_files.root / "sidecar.token"
        path.write_bytes(content)
        err = error_of(host_files, base_document())
        assert err.key == "sidecar.token_file"

    def test_largest_token_is_accepted(self, host_files: HostFiles):
        path = host_files.root / "sidecar.token"
        path.write_bytes(b"t" * 16_384)
        assert len(load(host_files).sidecar_token) == 16_384
        assert os_mode(path) == 0o600


def test_not_toml_is_a_config_error(host_files: HostFiles):
    host_files.config.write_text("[host\n")
    with pytest.raises(HostConfigError, match="not valid TOML"):
        load_settings(host_files.config, environ={})


def test_main_exits_2_with_the_key_on_stderr(host_files: HostFiles, capsys):
    doc = base_document()
    doc["principals"][1]["token_sha256"] = "zz"
    host_files.write(doc)
    assert main(["--config", str(host_files.config)]) == 2
    err = capsys.readouterr().err
    assert "principals[1].token_sha256" in err and "Traceback" not in err


def test_main_exits_2_for_an_unsafe_store_directory(host_files: HostFiles, capsys):
    (host_files.root / "state").chmod(0o777)
    assert main(["--config", str(host_files.config)]) == 2
    assert "is group- or world-writable" in capsys.readouterr().err


def test_main_exits_2_in_one_line_when_the_store_lock_cannot_be_created(host_files: HostFiles, capsys, monkeypatch):
    """Regression: a store on a read-only file system (its directory fine) ended in a traceback from
    ``acquire_lock`` (OSError EROFS on ``<store>.lock``), exit 1; it is one line naming the file, exit 2."""
    import errno

    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["--config", str(host_files.config)]) == 2
    err = capsys.readouterr().err
    assert "cannot open the lock file" in err and ".lock: Read-only file system" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.processes
def test_cli_exit_code_2_in_a_subprocess(host_files: HostFiles):
    doc = copy.deepcopy(base_document())
    doc["sidecar"]["url"] = "http://192.0.2.1:8090"
    host_files.write(doc)
    proc = subprocess.run(
        [sys.executable, "-m", "aip_crewai.cli", "host", "--config", str(host_files.config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "sidecar.url" in proc.stderr and "Traceback" not in proc.stderr


def test_token_hash_is_case_insensitive_hex(host_files: HostFiles):
    doc = base_document()
    doc["principals"][0]["token_sha256"] = hashlib.sha256(b"tok-acme-invoker").hexdigest().upper()
    assert load(host_files, doc).principals[0].token_sha256 == hashlib.sha256(b"tok-acme-invoker").digest()


def test_main_exits_2_in_one_line_when_the_store_cannot_be_opened_at_start_up(
    host_files: HostFiles, capsys, monkeypatch
):
    """A store that fails while the app opens it (e.g. a PostgreSQL pool not filled in time: more pooled
    connections than the server allows) is one line on stderr and exit 2, like every other unusable store."""
    from aip_crewai.host.store.store import Store, StoreError

    async def refuse(*args, **kwargs):
        raise StoreError("the PostgreSQL store's 64 pooled connections were not ready within 10 s")

    monkeypatch.setattr(Store, "open", refuse)
    doc = base_document()
    doc["host"]["bind"] = "127.0.0.1:0"
    host_files.write(doc)
    assert main(["--config", str(host_files.config)]) == 2
    err = capsys.readouterr().err
    assert "store error: the PostgreSQL store's 64 pooled connections were not ready" in err
    assert "Traceback" not in err


def test_the_postgresql_pools_log_lines_are_one_structured_line_each(capsys):
    """psycopg's pool logs reconnection failures through stdlib logging (two lines of plain text); the host
    routes them through structlog: one JSON line each, the first line of the message."""
    import json
    import logging

    from aip_crewai.host.main import route_library_logs
    from aip_crewai.plumbing.log import configure_logging

    configure_logging(json=True, level="info", cache=False)
    route_library_logs("psycopg")
    try:
        logging.getLogger("psycopg.pool").warning(
            "error connecting in 'pool': connection refused\n\tIs the server running?"
        )
        logging.getLogger("psycopg.pool").info("below the threshold")
    finally:
        logging.getLogger("psycopg").handlers, logging.getLogger("psycopg").propagate = [], True
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["event"] == "library_log" and record["library"] == "psycopg.pool"
    assert record["message"] == "error connecting in 'pool': connection refused"


def test_each_log_record_is_one_write_with_its_newline(monkeypatch):
    """A job's worker shares the sidecar's stderr: a record written in two pieces (its text, then its newline)
    could be split by another process's record, as a suite run once saw (two records on one line)."""
    import json
    import sys

    import structlog

    from aip_crewai.plumbing.log import configure_logging

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    recorder = Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    configure_logging(json=True, level="info", cache=False)
    structlog.get_logger("t").info("one_write", size_bytes=3)
    assert len(recorder.writes) == 1, recorder.writes
    assert recorder.writes[0].endswith("\n") and json.loads(recorder.writes[0])["event"] == "one_write"
