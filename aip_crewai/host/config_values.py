"""The value checks of the host configuration: one ``host.toml`` value each (bind address, store URL,
sidecar URL and proxy, token files, CORS origins), raising :class:`HostConfigError` that names the key.
Pure but for reading a token file. :mod:`.config` holds the TOML shape and builds the settings.

Source: ARCHITECTURE.md §7, §10; docs/reference/configuration.md "Configuration reference", "Security".
"""

from __future__ import annotations

import enum
import ipaddress
import re
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit

import msgspec.inspect as mi

from ..contracts.errors import AipError, Category
from ..contracts.inputs import has_control_characters
from ..plumbing.files import FileTooLarge, NotRegularFile, read_regular
from ..plumbing.keys import SecretFileError, read_token
from ..plumbing.loopback import is_loopback

_BIND_RE = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})\Z")


class HostConfigError(AipError):
    """The host configuration is unusable (the sidecar's own is :class:`aip_crewai.sidecar.config.ConfigError`). ``key`` names the offending key
    (``principals[1].token_sha256``), ``reason`` says what is wrong."""

    code = "config.invalid"
    category = Category.PERMANENT
    http_status = 500
    default_message = "invalid host configuration"

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}{table_hint(key)}: {reason}" if key else reason, details={"key": key, "reason": reason})


#: The arrays of tables of ``host.toml``: ``principals[0]`` is the first ``[[principals]]`` table.
ARRAYS_OF_TABLES = ("principals", "sidecars", "webhooks")
_ORDINALS = ("first", "second", "third")


def table_hint(key: str) -> str:
    """Where ``key`` is in ``host.toml`` when it starts in an array of tables (pure):
    ``principals[0].roles[0]`` → `` (in the first [[principals]] table)``, ``principals[7]`` →
    `` (in [[principals]] table number 8)``; any other key: ``""``."""
    found = re.match(r"(\w+)\[(\d+)\]", key)
    if found is None or found.group(1) not in ARRAYS_OF_TABLES:
        return ""
    index, name = int(found.group(2)), found.group(1)
    where = (
        f"the {_ORDINALS[index]} [[{name}]] table" if index < len(_ORDINALS) else f"[[{name}]] table number {index + 1}"
    )
    return f" (in {where})"


_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def allowed_values(type_: Any, path: str) -> tuple[Any, ...] | None:
    """The values a ``Literal`` or ``Enum`` at ``path`` of ``type_`` allows (pure), for an error
    that names them.

    Args:
        type_: a msgspec-convertible type (a Struct of the TOML shape).
        path: msgspec's JSON path under it without the ``$``: ``.roles[0]``.

    Returns:
        The allowed values (as msgspec lists them), or None when the path leads to no literal or enum.
    """
    steps = [(m.group(1), m.group(2)) for m in _PATH_STEP.finditer(path)]
    return _values_at(mi.type_info(type_), steps)


def _values_at(info: Any, steps: list[tuple[str | None, str | None]]) -> tuple[Any, ...] | None:
    if isinstance(info, mi.Metadata):
        return _values_at(info.type, steps)
    if isinstance(info, mi.UnionType):
        found = [_values_at(member, steps) for member in info.types]
        values = [value for group in found if group for value in group]
        return tuple(values) or None
    if not steps:
        if isinstance(info, mi.LiteralType):
            return tuple(info.values)
        if isinstance(info, mi.EnumType) and issubclass(info.cls, enum.Enum):
            return tuple(member.value for member in info.cls)
        return None
    (name, index), rest = steps[0], steps[1:]
    if name is not None and isinstance(info, mi.StructType):
        field = next((f for f in info.fields if f.encode_name == name), None)
        return None if field is None else _values_at(field.type, rest)
    if name is not None and isinstance(info, mi.DictType):
        return _values_at(info.value_type, rest)
    if index is not None and isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return _values_at(info.item_type, rest)
    return None


def enum_reason(rule: str, type_: Any, path: str) -> str:
    """msgspec's ``Invalid enum value 'x'`` with the allowed values named (``'x' is not one of
    'invoker', 'approver', 'operator'``); any other rule, or no values found, unchanged. Pure."""
    found = re.fullmatch(r"Invalid enum value (.+)", rule, flags=re.DOTALL)
    values = allowed_values(type_, path) if found else None
    if found is None or not values:
        return rule
    return f"{found.group(1)} is not one of {', '.join(repr(value) for value in values)}"


def store_location(base: Path, raw: str) -> Path | str:
    """``[host] store``: a SQLite file (relative to the config's directory), or a ``postgresql://`` URL
    kept as given (libpq URL syntax; the password belongs in ``~/.pgpass`` or ``PGPASSFILE``, not here)."""
    if raw.startswith(("postgresql://", "postgres://")):
        if has_control_characters(raw) or len(raw) > 4096:
            raise HostConfigError(
                "host.store", "a PostgreSQL URL must be at most 4096 characters without control characters"
            )
        problem = _postgres_url_problem(raw)
        if problem is not None:
            raise HostConfigError("host.store", problem)
        return raw
    if _CONNINFO_RE.match(raw):
        raise HostConfigError(
            "host.store",
            "a PostgreSQL store is a postgresql:// URL (key=value connection strings "
            "are not accepted); anything else is a SQLite file path",
        )
    return resolve_path(base, raw, "host.store")


#: A libpq key/value connection string (``host=... dbname=...``), refused as a store path.
_CONNINFO_RE = re.compile(r"^\s*[A-Za-z_]+\s*=")
_PASSWORD_ADVICE = (
    "keep credentials out of the URL: the password in ~/.pgpass or PGPASSFILE (0600); a client key unencrypted "
    "in a 0600 sslkey file, without sslpassword"
)


def _postgres_url_problem(raw: str) -> str | None:
    """Why a ``postgresql://`` store URL is refused, or None. The URL is read as libpq reads it (percent-
    decoded names and values, via psycopg's parser when installed), so a password hides nowhere: not as
    ``user:password@``, not in ``?password=`` or the client key's ``?sslpassword=`` however encoded, not in a
    user name holding a ``:`` (a mis-encoded ``user:password``, which the server would echo back in its error)."""
    if re.match(r"^postgres(ql)?://[^/@]*:[^/@]*@", raw) or re.search(r"[?&](?:ssl)?password=", raw, re.IGNORECASE):
        return _PASSWORD_ADVICE
    try:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:  # the store cannot be opened without psycopg anyway (a clear error at start-up)
        return None
    try:
        params = conninfo_to_dict(raw)
    except psycopg.Error:
        return "is not a valid PostgreSQL URL (libpq URI syntax: postgresql://user@host:port/dbname?param=value)"
    if "password" in params or "sslpassword" in params or ":" in str(params.get("user") or ""):
        return _PASSWORD_ADVICE
    return None


def resolve_path(base: Path, raw: str, key: str) -> Path:
    """``raw`` as a path, relative to ``base`` (the config file's directory) unless absolute; ``~`` expanded.

    Raises:
        HostConfigError: keyed ``key``, for an empty path or one with control characters."""
    if not raw or has_control_characters(raw):
        raise HostConfigError(key, "must be a non-empty path without control characters")
    path = Path(raw).expanduser()
    return path if path.is_absolute() else (base / path)


def check_bind(bind: str) -> None:
    """``[host] bind``: ``<address>:<port>``, IPv6 in brackets, port 0..65535.

    Raises:
        HostConfigError: keyed ``host.bind``."""
    match = _BIND_RE.match(bind)
    if match is None or int(match["port"]) > 65535:
        raise HostConfigError("host.bind", "must be <address>:<port> (IPv6 in brackets), port 0..65535")
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(match["v6"])
        except ValueError:
            raise HostConfigError("host.bind", f"{match['v6']!r} is not an IPv6 address") from None


def _http_url(key: str, value: str) -> SplitResult:
    """``value`` split as an http(s) URL with a host and a valid port; HostConfigError naming ``key`` otherwise."""
    if has_control_characters(value) or " " in value:
        raise HostConfigError(key, "must not contain spaces or control characters")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not 0..65535
    except ValueError as exc:
        raise HostConfigError(key, f"not a valid URL ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HostConfigError(key, "must be an http:// or https:// URL with a host")
    return parts


def check_sidecar_url(url: str) -> str:
    """Return ``url`` without a trailing ``/`` when it is an acceptable sidecar URL.

    Accepts ``https://<host>[:port][/prefix]`` and ``http://`` only to
    127.0.0.0/8, ``::1`` or ``localhost``. No credentials, query or fragment.

    Raises:
        HostConfigError: keyed ``sidecar.url``.

    Source: ARCHITECTURE.md §7 (sidecar client: https or loopback http).
    """
    key = "sidecar.url"
    parts = _http_url(key, url)
    if parts.username is not None or parts.password is not None:
        raise HostConfigError(key, "must not carry credentials; use sidecar.token_file")
    if "?" in url or "#" in url:  # an empty one too ("http://127.0.0.1:8090/#"): the routes would follow it
        raise HostConfigError(key, "must not have a query or fragment")
    if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
        raise HostConfigError(
            key, "plain http is only allowed to a loopback address (127.0.0.0/8, ::1, localhost); use https"
        )
    return url.rstrip("/")


def check_sidecar_proxy(proxy: str | None, sidecar_url: str) -> str | None:
    """Validate ``sidecar.proxy``: an http(s) URL with a host and no credentials,
    query or fragment, allowed only when ``sidecar.url`` is https (through a
    proxy, plain http would hand the sidecar bearer token to the proxy in
    cleartext, which the loopback-only rule for http exists to prevent).

    Raises:
        HostConfigError: keyed ``sidecar.proxy``.

    Source: docs/security.md "Security" (the sidecar client and proxies).
    """
    if proxy is None:
        return None
    key = "sidecar.proxy"
    parts = _http_url(key, proxy)
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise HostConfigError(key, "must not carry credentials, a query or a fragment")
    if not sidecar_url.startswith("https://"):
        raise HostConfigError(
            key, "is only allowed with an https:// sidecar.url (the proxy would see the bearer token)"
        )
    return proxy


def read_token_file(path: Path, key: str = "sidecar.token_file") -> str:
    """Read a bearer token from a protected file.

    The file must be a regular file (not a symlink) without group or other
    permission bits (0600 or 0400), holding 1..16384 bytes; surrounding
    whitespace is stripped and the token must be visible ASCII.

    Raises:
        HostConfigError: keyed ``key``, naming the rule.

    Source: ARCHITECTURE.md §4 (token file rules), §7.
    """
    try:
        return read_token(path)
    except SecretFileError as exc:
        raise HostConfigError(key, str(exc)) from None


#: Largest ``ca_file`` read, bytes (a bundle of a few hundred certificates).
MAX_CA_FILE_BYTES = 1 << 20


def read_sidecar_ca(path: Path, key: str, sidecar_url: str) -> str:
    """A sidecar's ``ca_file``: the PEM certificates of the CA(s) the host trusts for that sidecar's https
    certificate instead of the public ones (a private CA), read without blocking (a regular file, at most
    :data:`MAX_CA_FILE_BYTES`). Returns the PEM text. Certificates are public: no mode rule.

    Raises:
        HostConfigError: keyed ``key``: an http:// ``sidecar_url`` (nothing to verify), a missing, non-regular
            or oversized file, or one holding no usable PEM certificate.

    Source: docs/reference/configuration.md (``[sidecar] ca_file``).
    """
    if not sidecar_url.startswith("https://"):
        raise HostConfigError(key, "is only allowed with an https:// url (plain http has no certificate to verify)")
    try:
        data = read_regular(path, MAX_CA_FILE_BYTES)  # non-blocking: a FIFO is refused, never waited on
    except FileNotFoundError:
        raise HostConfigError(key, f"{path} does not exist") from None
    except NotRegularFile:
        raise HostConfigError(key, f"{path} is not a regular file") from None
    except FileTooLarge:
        raise HostConfigError(key, f"{path} is over {MAX_CA_FILE_BYTES} bytes") from None
    except OSError as exc:
        raise HostConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    try:
        pem = data.decode("ascii")
        ssl.create_default_context(cadata=pem)
    except (UnicodeDecodeError, ssl.SSLError):
        raise HostConfigError(key, f"{path} holds no usable PEM certificate (-----BEGIN CERTIFICATE-----)") from None
    return pem


_ORIGIN = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?$")


def cors_origin(index: int, origin: str) -> str:
    """One ``[host] cors_origins`` entry: an exact ``http(s)://host[:port]`` origin (no path, no wildcard).

    Raises:
        HostConfigError: ``host.cors_origins[index]`` otherwise.
    """
    if not _ORIGIN.match(origin):
        raise HostConfigError(
            f"host.cors_origins[{index}]",
            f"{origin!r} is not an origin: use scheme://host[:port] with http or https, without a path or a wildcard",
        )
    return origin.lower()
