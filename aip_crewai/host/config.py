"""Host configuration: ``host.toml`` → a validated, frozen :class:`~.settings.Settings`.

TOML shape (ARCHITECTURE.md §11; every table rejects unknown keys)::

    [host]
    bind = "127.0.0.1:8081"            # "<ipv4|name>:<port>" or "[<ipv6>]:<port>"; default shown
    store = "host.db"                  # required; SQLite file of the host store, or "postgresql://user@host/db"
    max_response_bytes = 67108864      # 1 .. 268435456 bytes; default 64 MiB
    readiness_interval_ms = 5000       # our addition: sidecar /health poll period, 100 .. 600000 ms
    cors_origins = []                  # browser origins allowed to call the AIP routes, e.g. "https://app.example"
    dispatch_deadline_seconds = 600    # retry a start the sidecar did not admit for this long, 1 .. 86400 s
    stream_token_ttl_seconds = 300     # lifetime of a minted stream token (EventSource auth), 10 .. 3600 s
    openapi = true                     # serve the generated OpenAPI document at /openapi.json
    console = true                     # serve the approval console at /console/ (false: 404)
    host_id = "<hostname>:<port>"      # this host in dispatch leases; unique per host sharing a PostgreSQL store
    lease_seconds = 30                 # a dispatch lease lasts this long unless renewed, 1 .. 3600 s
    store_pool_size = 4                # a PostgreSQL store's pooled connections (= store threads), 1 .. 64
    store_statement_timeout_ms = 4000  # PostgreSQL store: a statement's bound, 100 .. 60000 ms; a store call's is +1000 ms
    store_lock_timeout_ms = 2000       # PostgreSQL store: a lock wait's bound (the writer lock), 100 .. 60000 ms
    store_idle_in_transaction_timeout_ms = 4000  # PostgreSQL store: an abandoned transaction's, 100 .. 60000 ms
    status_cache_entries = 1024        # final job views kept for key-less :status reads, 0 .. 1000000; 0 disables
    unauthenticated_body_budget_bytes = 67108864  # bodies read before authentication, in total, 2 MiB .. 1 TiB
    public_authorities = ["aip.example.com"]  # Host values signed requests may name; default: the bind address
    webhook_allow_cidrs = []           # private networks webhook deliveries may reach anyway (webhooks/config.py)

    [sidecar]                          # one sidecar serving every crew; or several, each with its crews:
    url = "http://127.0.0.1:8090"      # https://…, or http:// to a loopback address only
    token_file = "sidecar.token"       # regular, non-symlink, no group/other permission bits, 1..16384 bytes
    proxy = "http://proxy:3128"        # optional; only with an https url. Without it HTTP(S)_PROXY are ignored
    keepalive_seconds = 15.0           # the sidecar's SSE keep-alive interval when its /health does not say, 0.1 .. 3600
    ca_file = "sidecar-ca.pem"         # optional; only with an https url: PEM CA certificates trusted instead of the public CAs

    # [[sidecars]]                     # instead of [sidecar]: the same keys, plus
    # name = "eu-1"                    # optional, for logs (default sidecar-<n>)
    # crews = ["support-primary"]      # the admitted crews it serves; each crew in at least one entry

    [crews]
    file = "crews.json"                # descriptors, see admission.py

    [tenants.acme]                     # tenant name: ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$
    crews = ["support-primary"]        # admitted crew ids; an empty list closes the tenant

    [[principals]]
    id = "svc:acme-app"                # 1..256 characters, no control characters, unique
    tenant = "acme"                    # must be a configured tenant
    roles = ["invoker"]                # non-empty subset of invoker | approver | operator
    token_sha256 = "<64 hex>"          # and/or
    ed25519_public_key = "<base64 of the raw 32-byte key>"

    [[webhooks]]                       # optional: see host/webhooks/config.py and docs/webhooks.md

Relative paths (``store``, ``token_file``, ``file``) resolve against the
directory of the configuration file, not the working directory, so a config
and its neighbours move together. The sidecar token is read once, here; its
surrounding whitespace (a trailing newline) is stripped and the rest must be
visible ASCII. The only environment variable read is ``NOTIFY_SOCKET``.

Every error is a :class:`HostConfigError` whose message starts with the offending
key, e.g. ``principals[1].token_sha256: must be 64 hexadecimal characters``.

Source: ARCHITECTURE.md §7 (admission, tenant routing, principals), §11 (operator
interface).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import socket
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from ..contracts.inputs import has_control_characters
from ..plumbing.files import FileTooLarge, NotRegularFile, read_regular
from .config_values import HostConfigError as HostConfigError
from .config_values import check_bind, cors_origin, enum_reason, read_sidecar_ca, resolve_path, store_location
from .config_values import check_sidecar_proxy as check_sidecar_proxy
from .config_values import check_sidecar_url as check_sidecar_url
from .config_values import read_token_file as read_token_file
from .crews.descriptors import AdmissionError, CrewDescriptor, load_descriptors
from .ledger.receipts import load_keys
from .ledger.usage import SettingError, parse_pricing
from .settings import (
    DEFAULT_BODY_BUDGET_BYTES,
    DEFAULT_DISPATCH_DEADLINE_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_SIDECAR_KEEPALIVE_S,
    DEFAULT_STORE_POOL_SIZE,
    DEFAULT_STREAM_TOKEN_TTL_S,
    MIN_BODY_BUDGET_BYTES,
    PrincipalConfig,
    Settings,
    SidecarSettings,
)
from .sidecars.view_cache import DEFAULT_ENTRIES as DEFAULT_STATUS_CACHE_ENTRIES
from .sidecars.view_cache import MAX_ENTRIES as MAX_STATUS_CACHE_ENTRIES
from .store.engines.postgres import (
    DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS,
    DEFAULT_LOCK_TIMEOUT_MS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    StoreTimeouts,
)
from .webhooks.config import parse_webhooks

MAX_RESPONSE_BYTES_LIMIT = 256 * 1024 * 1024
MAX_STORE_POOL_SIZE = 64
#: At most this many ``[[sidecars]]`` entries.
MAX_SIDECARS = 64
#: At most this many ``[host] cors_origins``.
MAX_CORS_ORIGINS = 64
MIN_STREAM_TOKEN_TTL_S, MAX_STREAM_TOKEN_TTL_S = 10, 3600
#: Sidecar token file bounds, bytes (ARCHITECTURE.md §4).
#: Crews file bound, bytes (1,000 descriptors of at most ~17 KiB each, with room).
MAX_CREWS_FILE_BYTES = 32 * 1024 * 1024
#: Bound of host.toml, bytes.
MAX_CONFIG_FILE_BYTES = 4 * 1024 * 1024
#: Tenant names: no ":" (sidecar job ids are "<tenant>:<action id>"; a colon would let
#: tenant "a" with action "b:c" and tenant "a:b" with action "c" share one sidecar job).
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_HEX64_RE = re.compile(r"^[0-9a-fA-F]{64}\Z")
#: One ``[host] public_authorities`` entry: ``host`` or ``host:port`` as a client sends ``Host``.
_Authority = Annotated[
    str, msgspec.Meta(max_length=261, pattern=r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(?::[0-9]{1,5})?$")
]


# --- the TOML shape ----------------------------------------------------------


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the TOML tables: unknown keys are errors."""


class _HostTable(_Table, frozen=True):
    store: str
    bind: str = "127.0.0.1:8081"
    max_response_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_RESPONSE_BYTES_LIMIT)] = DEFAULT_MAX_RESPONSE_BYTES
    readiness_interval_ms: Annotated[int, msgspec.Meta(ge=100, le=600_000)] = 5_000
    cors_origins: Annotated[list[str], msgspec.Meta(max_length=MAX_CORS_ORIGINS)] = []
    dispatch_deadline_seconds: Annotated[float, msgspec.Meta(ge=1, le=86_400)] = DEFAULT_DISPATCH_DEADLINE_S
    stream_token_ttl_seconds: Annotated[int, msgspec.Meta(ge=MIN_STREAM_TOKEN_TTL_S, le=MAX_STREAM_TOKEN_TTL_S)] = (
        DEFAULT_STREAM_TOKEN_TTL_S
    )
    openapi: bool = True
    console: bool = True
    host_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")] | None = None
    lease_seconds: Annotated[float, msgspec.Meta(ge=1, le=3600)] = DEFAULT_LEASE_S
    store_pool_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_STORE_POOL_SIZE)] = DEFAULT_STORE_POOL_SIZE
    store_statement_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=60_000)] = DEFAULT_STATEMENT_TIMEOUT_MS
    store_lock_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=60_000)] = DEFAULT_LOCK_TIMEOUT_MS
    store_idle_in_transaction_timeout_ms: Annotated[int, msgspec.Meta(ge=100, le=60_000)] = (
        DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS
    )
    status_cache_entries: Annotated[int, msgspec.Meta(ge=0, le=MAX_STATUS_CACHE_ENTRIES)] = DEFAULT_STATUS_CACHE_ENTRIES
    receipt_key_file: str | None = None
    receipt_previous_public_keys: Annotated[list[str], msgspec.Meta(max_length=16)] = []
    unauthenticated_body_budget_bytes: Annotated[int, msgspec.Meta(ge=MIN_BODY_BUDGET_BYTES, le=1 << 40)] = (
        DEFAULT_BODY_BUDGET_BYTES
    )
    public_authorities: Annotated[list[_Authority], msgspec.Meta(min_length=1, max_length=64)] | None = None
    webhook_allow_cidrs: list[str] = []


class _SidecarTable(_Table, frozen=True):
    url: str
    token_file: str
    proxy: str | None = None
    keepalive_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=3600)] = DEFAULT_SIDECAR_KEEPALIVE_S
    ca_file: str | None = None


class _SidecarsEntry(_SidecarTable, frozen=True):
    """One ``[[sidecars]]`` entry: a ``[sidecar]`` table plus the crews it serves."""

    crews: Annotated[list[str], msgspec.Meta(min_length=1)] = []
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")] | None = None


class _CrewsTable(_Table, frozen=True):
    file: str


class _TenantTable(_Table, frozen=True):
    crews: list[str]


class _PrincipalTable(_Table, frozen=True):
    id: str
    tenant: str
    roles: Annotated[list[Literal["invoker", "approver", "operator"]], msgspec.Meta(min_length=1)]
    token_sha256: str | None = None
    ed25519_public_key: str | None = None


class _Root(_Table, frozen=True):
    host: Any
    crews: Any
    sidecar: Any = None
    sidecars: Annotated[list[Any], msgspec.Meta(max_length=MAX_SIDECARS)] | None = None
    tenants: dict[str, Any] = {}
    principals: list[Any] = []
    pricing: Any = None
    webhooks: list[Any] = []


# --- loading -----------------------------------------------------------------


def _convert(value: Any, type_: Any, prefix: str) -> Any:
    """msgspec.convert with errors re-keyed under ``prefix``."""
    try:
        return msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        rule, sep, where = text.rpartition(" - at `")
        path = where.rstrip("`")[1:] if sep else ""  # drop the leading "$"
        rule = rule if sep else text
        key = (prefix + path).lstrip(".")
        unknown = re.match(r"Object contains unknown field `(.+)`\Z", rule)
        missing = re.match(r"Object missing required field `(.+)`\Z", rule)
        if unknown or missing:
            name = (unknown or missing).group(1)  # type: ignore[union-attr]
            raise HostConfigError(
                f"{key}.{name}" if key else name, "unknown key" if unknown else "required key is missing"
            ) from exc
        raise HostConfigError(key or "(root)", enum_reason(rule, type_, path)) from exc


def _default_host_id(bind: str) -> str:
    """``<hostname>:<port>`` (stable across restarts, so a restarted host keeps its own leases), or
    ``<hostname>:pid<pid>`` for an ephemeral port (0)."""
    port = bind.rsplit(":", 1)[-1]
    return f"{socket.gethostname()}:{port if port != '0' else f'pid{os.getpid()}'}"[:128]


def _read_crews(path: Path) -> tuple[CrewDescriptor, ...]:
    key = "crews.file"
    try:
        data = read_regular(path, MAX_CREWS_FILE_BYTES)  # non-blocking: a FIFO is refused, never waited on
    except (NotRegularFile, FileTooLarge) as exc:
        raise HostConfigError(key, str(exc)) from None
    except OSError as exc:
        raise HostConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    try:
        return load_descriptors(data)
    except AdmissionError as exc:
        raise HostConfigError(key, f"{path}: {exc.message}") from exc


def _principal(index: int, raw: Any, tenants: Mapping[str, Any]) -> PrincipalConfig:
    key = f"principals[{index}]"
    table: _PrincipalTable = _convert(raw, _PrincipalTable, key)
    if not 1 <= len(table.id) <= 256 or has_control_characters(table.id):
        raise HostConfigError(f"{key}.id", "must be 1..256 characters without control characters")
    if table.tenant not in tenants:
        raise HostConfigError(f"{key}.tenant", f"unknown tenant {table.tenant!r}; add a [tenants.{table.tenant}] table")
    digest = None
    if table.token_sha256 is not None:
        if not _HEX64_RE.match(table.token_sha256):
            raise HostConfigError(
                f"{key}.token_sha256", "must be 64 hexadecimal characters (SHA-256 of the bearer token)"
            )
        digest = bytes.fromhex(table.token_sha256)
    public_key = None
    if table.ed25519_public_key is not None:
        try:
            raw_key = base64.b64decode(table.ed25519_public_key, validate=True)
        except (binascii.Error, ValueError):
            raise HostConfigError(f"{key}.ed25519_public_key", "must be standard base64") from None
        if len(raw_key) != 32:
            raise HostConfigError(f"{key}.ed25519_public_key", f"must decode to 32 bytes, not {len(raw_key)}")
        public_key = Ed25519PublicKey.from_public_bytes(raw_key)
    if digest is None and public_key is None:
        raise HostConfigError(key, "needs token_sha256 and/or ed25519_public_key")
    return PrincipalConfig(table.id, table.tenant, frozenset(table.roles), digest, public_key)


def build_settings(data: Mapping[str, Any], config_path: Path, *, environ: Mapping[str, str] | None = None) -> Settings:
    """Validate a parsed TOML document into :class:`Settings`.

    Args:
        data: the parsed TOML.
        config_path: where it came from; relative paths resolve against its directory.
        environ: environment (only ``NOTIFY_SOCKET`` is read); default ``os.environ``.

    Raises:
        HostConfigError: the first problem found, keyed.
    """
    base = config_path.resolve().parent
    root: _Root = _convert(dict(data), _Root, "")
    host: _HostTable = _convert(root.host, _HostTable, "host")
    crews_table: _CrewsTable = _convert(root.crews, _CrewsTable, "crews")
    check_bind(host.bind)
    crews_file = resolve_path(base, crews_table.file, "crews.file")
    crews = _read_crews(crews_file)
    crew_ids = {crew.id for crew in crews}
    sidecars = _sidecars(root, base, [crew.id for crew in crews], crews_file)
    first = sidecars[0]
    tenants: dict[str, tuple[str, ...]] = {}
    for name, raw in root.tenants.items():
        key = f"tenants.{name}"
        if not _TENANT_RE.match(name):
            raise HostConfigError(key, "tenant names match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$ (no colon)")
        table: _TenantTable = _convert(raw, _TenantTable, key)
        for position, crew_id in enumerate(table.crews):
            if crew_id not in crew_ids:
                raise HostConfigError(
                    f"{key}.crews[{position}]", f"{crew_id!r} is not an admitted crew id in {crews_file}"
                )
            if crew_id in table.crews[:position]:
                raise HostConfigError(f"{key}.crews[{position}]", f"{crew_id!r} is listed twice")
        tenants[name] = tuple(table.crews)
    principals: list[PrincipalConfig] = []
    for index, raw in enumerate(root.principals):
        principal = _principal(index, raw, tenants)
        for other in principals:
            if other.id == principal.id:
                raise HostConfigError(
                    f"principals[{index}].id", f"{principal.id!r} is already used by another principal"
                )
            if principal.token_sha256 is not None and other.token_sha256 == principal.token_sha256:
                raise HostConfigError(f"principals[{index}].token_sha256", f"already used by principal {other.id!r}")
        principals.append(principal)
    try:
        key_file = (
            None
            if host.receipt_key_file is None
            else resolve_path(base, host.receipt_key_file, "host.receipt_key_file")
        )
        receipt_keys, pricing = (
            load_keys(key_file, host.receipt_previous_public_keys),
            parse_pricing(root.pricing, crew_ids),
        )
    except SettingError as exc:
        raise HostConfigError(exc.key, exc.reason) from None
    env = os.environ if environ is None else environ
    webhooks = parse_webhooks(root.webhooks, tenants, base, host.webhook_allow_cidrs, _convert)
    return Settings(
        config_path=config_path.resolve(),
        bind=host.bind,
        store_path=store_location(base, host.store),
        max_response_bytes=host.max_response_bytes,
        sidecar_url=first.url,
        sidecar_token=first.token,
        crews_file=crews_file,
        crews=crews,
        tenants=types.MappingProxyType(tenants),
        principals=tuple(principals),
        readiness_interval_s=host.readiness_interval_ms / 1000,
        notify_socket=env.get("NOTIFY_SOCKET") or None,
        sidecar_proxy=first.proxy,
        cors_origins=tuple(cors_origin(index, origin) for index, origin in enumerate(host.cors_origins)),
        dispatch_deadline_s=float(host.dispatch_deadline_seconds),
        sidecar_keepalive_s=first.keepalive_s,
        stream_token_ttl_s=host.stream_token_ttl_seconds,
        openapi=host.openapi,
        console=host.console,
        host_id=host.host_id or _default_host_id(host.bind),
        lease_s=float(host.lease_seconds),
        store_pool_size=host.store_pool_size,
        store_timeouts=StoreTimeouts(
            host.store_statement_timeout_ms, host.store_lock_timeout_ms, host.store_idle_in_transaction_timeout_ms
        ),
        sidecars=sidecars,
        status_cache_entries=host.status_cache_entries,
        receipt_keys=receipt_keys,
        pricing=pricing,
        body_budget_bytes=host.unauthenticated_body_budget_bytes,
        public_authorities=None
        if host.public_authorities is None
        else tuple(dict.fromkeys(a.lower() for a in host.public_authorities)),
        webhooks=webhooks,
    )


def _sidecar(base: Path, table: _SidecarTable, key: str, name: str, crews: frozenset[str] | None) -> SidecarSettings:
    """One sidecar's settings; errors keyed under ``key`` (``sidecar`` or ``sidecars[i]``)."""
    try:
        url = check_sidecar_url(table.url)
        proxy = check_sidecar_proxy(table.proxy, url)
    except HostConfigError as exc:
        if key == "sidecar":
            raise
        raise HostConfigError(exc.key.replace("sidecar", key, 1), exc.reason) from None
    token = read_token_file(resolve_path(base, table.token_file, f"{key}.token_file"))
    ca_pem = (
        None
        if table.ca_file is None
        else read_sidecar_ca(resolve_path(base, table.ca_file, f"{key}.ca_file"), f"{key}.ca_file", url)
    )
    return SidecarSettings(name, url, token, proxy, float(table.keepalive_seconds), crews, ca_pem)


def _sidecars(root: _Root, base: Path, crew_ids: list[str], crews_file: Path) -> tuple[SidecarSettings, ...]:
    """``[sidecar]`` (every crew) or ``[[sidecars]]`` (each admitted crew served by at least one; a crew on
    several is placed per job: docs/operating.md "Several sidecars").

    Raises:
        HostConfigError: neither or both given; a crew not admitted, listed twice in one entry, or served by none.
    """
    if (root.sidecar is None) == (root.sidecars is None):
        raise HostConfigError("sidecar", "give either one [sidecar] table or [[sidecars]] entries, not both or neither")
    if root.sidecar is not None:
        return (_sidecar(base, _convert(root.sidecar, _SidecarTable, "sidecar"), "sidecar", "sidecar", None),)
    entries = root.sidecars or []
    if not entries:
        raise HostConfigError("sidecars", "needs at least one entry")
    served: set[str] = set()
    result: list[SidecarSettings] = []
    for index, raw in enumerate(entries):
        key = f"sidecars[{index}]"
        entry: _SidecarsEntry = _convert(raw, _SidecarsEntry, key)
        name = entry.name or f"sidecar-{index + 1}"
        if any(other.name == name for other in result):
            raise HostConfigError(f"{key}.name", f"{name!r} is already the name of another sidecar")
        for position, crew_id in enumerate(entry.crews):
            where = f"{key}.crews[{position}]"
            if crew_id not in crew_ids:
                raise HostConfigError(where, f"{crew_id!r} is not an admitted crew id in {crews_file}")
            if crew_id in entry.crews[:position]:
                raise HostConfigError(where, f"{crew_id!r} is listed twice for sidecar {name!r}")
            served.add(crew_id)
        result.append(_sidecar(base, entry, key, name, frozenset(entry.crews)))
    unserved = [crew_id for crew_id in crew_ids if crew_id not in served]
    if unserved:
        raise HostConfigError(
            "sidecars",
            f"no sidecar serves the admitted crews {', '.join(unserved)}: list each in at least one [[sidecars]] entry",
        )
    return tuple(result)


def load_settings(path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> Settings:
    """Read and validate ``host.toml``.

    Raises:
        HostConfigError: the file is missing, not TOML, or breaks a rule (keyed).

    Source: ARCHITECTURE.md §11.
    """
    config_path = Path(path)
    try:
        raw = read_regular(config_path, MAX_CONFIG_FILE_BYTES)  # non-blocking: a FIFO is refused, never waited on
    except FileNotFoundError:
        raise HostConfigError("--config", f"{config_path} does not exist") from None
    except (NotRegularFile, FileTooLarge) as exc:
        raise HostConfigError("--config", str(exc)) from None
    except OSError as exc:
        raise HostConfigError("--config", f"cannot read {config_path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise HostConfigError("--config", f"{config_path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise HostConfigError("--config", f"{config_path} is not valid TOML: {exc}") from None
    return build_settings(data, config_path, environ=environ)
