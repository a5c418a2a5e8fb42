"""``[[webhooks]]`` entries and ``[host] webhook_allow_cidrs`` of ``host.toml`` → :class:`WebhookSettings`.

TOML shape (docs/webhooks.md; unknown keys are errors)::

    [host]
    webhook_allow_cidrs = ["10.20.0.0/16"]   # private destinations allowed anyway, at most 64 networks

    [[webhooks]]
    tenant = "acme"                          # a configured tenant
    url = "https://hooks.example/aip"        # https://…, or http:// to a loopback address only
    secret_file = "acme-webhook.secret"      # regular file, mode 0600, one Standard Webhooks "whsec_<base64>"
    events = ["approval.requested", "action.completed"]   # a non-empty subset of EVENT_TYPES
    timeout_seconds = 10                     # one attempt (resolve, connect, answer), 0.1 .. 60 s
    deadline_seconds = 86400                 # keep retrying this long after the event, 1 .. 604800 s
    retry_initial_seconds = 5                # first backoff, 0.01 .. 3600 s; doubles (with jitter)
    retry_max_seconds = 300                  # up to this, retry_initial_seconds .. 86400 s
    include_output = false                   # send action results with their output

Errors are :class:`~aip_crewai.host.config_values.HostConfigError` keyed ``webhooks[i].<key>``; the secret's
bytes never appear in one.

Source: docs/webhooks.md; docs/reference/configuration.md "Configuration reference"; ARCHITECTURE.md §11.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from standardwebhooks.webhooks import Webhook

from ...contracts.inputs import has_control_characters
from ...plumbing.keys import SecretFileError, read_private
from ...plumbing.loopback import is_loopback
from ..config_values import HostConfigError, resolve_path

#: The events a webhook may subscribe to, in the order of an action's life.
EVENT_TYPES = ("approval.requested", "approval.decided", "action.completed", "action.failed", "action.cancelled")
EventType = Literal["approval.requested", "approval.decided", "action.completed", "action.failed", "action.cancelled"]
#: At most this many ``[[webhooks]]`` entries, and ``[host] webhook_allow_cidrs`` networks.
MAX_WEBHOOKS = 64
MAX_ALLOW_CIDRS = 64
#: A URL's length bound, characters.
MAX_URL_CHARS = 2048
#: A Standard Webhooks secret: ``whsec_`` and the base64 of 24 .. 64 random bytes.
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_DEADLINE_S = 86_400.0
DEFAULT_RETRY_INITIAL_S = 5.0
DEFAULT_RETRY_MAX_S = 300.0
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class _WebhookTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tenant: str
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]
    secret_file: str
    events: Annotated[list[EventType], msgspec.Meta(min_length=1, max_length=len(EVENT_TYPES))]
    timeout_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=60)] = DEFAULT_TIMEOUT_S
    deadline_seconds: Annotated[float, msgspec.Meta(ge=1, le=604_800)] = DEFAULT_DEADLINE_S
    retry_initial_seconds: Annotated[float, msgspec.Meta(ge=0.01, le=3600)] = DEFAULT_RETRY_INITIAL_S
    retry_max_seconds: Annotated[float, msgspec.Meta(ge=0.01, le=86_400)] = DEFAULT_RETRY_MAX_S
    include_output: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One ``[[webhooks]]`` entry, validated. ``endpoint_id``: ``whe_`` + 24 hex digits of SHA-256 over
    tenant and URL, stable across restarts and hosts (the outbox rows name it). Times in seconds."""

    endpoint_id: str
    tenant: str
    url: str = field(repr=False)  # a URL may carry a token in its query: never in logs
    signer: Webhook = field(repr=False, compare=False)
    events: frozenset[str]
    timeout_s: float = DEFAULT_TIMEOUT_S
    deadline_s: float = DEFAULT_DEADLINE_S
    retry_initial_s: float = DEFAULT_RETRY_INITIAL_S
    retry_max_s: float = DEFAULT_RETRY_MAX_S
    include_output: bool = False


@dataclass(frozen=True)
class WebhookSettings:
    """Every webhook endpoint and the private networks deliveries may reach anyway."""

    endpoints: tuple[Endpoint, ...] = ()
    allow_cidrs: tuple[Network, ...] = ()

    def subscribed(self, tenant: str, event_type: str) -> list[Endpoint]:
        """The endpoints of ``tenant`` subscribed to ``event_type``, in configuration order."""
        return [e for e in self.endpoints if e.tenant == tenant and event_type in e.events]

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        """The endpoint ``endpoint_id`` (None: no longer configured)."""
        return next((e for e in self.endpoints if e.endpoint_id == endpoint_id), None)


def endpoint_id(tenant: str, url: str) -> str:
    """The stable id of the endpoint ``url`` of ``tenant``."""
    return "whe_" + hashlib.sha256(f"{tenant}\x1f{url}".encode()).hexdigest()[:24]


def check_webhook_url(key: str, url: str) -> str:
    """``url`` when it is an acceptable webhook URL: ``https://host[:port][/path][?query]``, or ``http://``
    to a loopback address only (as for sidecars); no credentials, no fragment.

    Raises:
        HostConfigError: keyed ``key``.
    """
    if has_control_characters(url) or " " in url:
        raise HostConfigError(key, "must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port outside 0..65535
    except ValueError as exc:
        raise HostConfigError(key, f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HostConfigError(key, "must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise HostConfigError(key, "must not carry credentials")
    if parts.fragment:
        raise HostConfigError(key, "must not have a fragment")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise HostConfigError(
            key, "plain http is only allowed to a loopback address (127.0.0.0/8, ::1, localhost); use https"
        )
    return url


def read_secret(path: Path, key: str) -> Webhook:
    """The signer of the Standard Webhooks secret in ``path`` (:func:`~aip_crewai.plumbing.keys.read_private`
    rules: regular, not a symlink, 0600 or 0400): ``whsec_`` then the standard base64 of 24 .. 64 bytes.

    Raises:
        HostConfigError: keyed ``key``, naming the file and the rule, never its content.
    """
    try:
        data = read_private(path, what="webhook secret file")
    except SecretFileError as exc:
        raise HostConfigError(key, str(exc)) from None
    text = data.decode("ascii", errors="replace")
    problem = f"{path} must hold one Standard Webhooks secret: whsec_ and the base64 of 24..64 random bytes"
    if not text.startswith("whsec_"):
        raise HostConfigError(key, problem)
    try:
        raw = base64.b64decode(text[len("whsec_") :], validate=True)
    except (binascii.Error, ValueError):
        raise HostConfigError(key, problem) from None
    if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        raise HostConfigError(key, problem)
    return Webhook(raw)


def parse_allow_cidrs(raw: Sequence[str]) -> tuple[Network, ...]:
    """``[host] webhook_allow_cidrs`` → networks (host bits must be zero: ``10.0.0.0/8``, not ``10.0.0.1/8``).
    Any network is accepted, ``0.0.0.0/0`` too; one that covers a metadata address is warned about when the
    host starts (:func:`~.safety.metadata_opened`, docs/webhooks.md "Safety").

    Raises:
        HostConfigError: keyed ``host.webhook_allow_cidrs[i]``.
    """
    if len(raw) > MAX_ALLOW_CIDRS:
        raise HostConfigError("host.webhook_allow_cidrs", f"at most {MAX_ALLOW_CIDRS} networks")
    networks = []
    for index, text in enumerate(raw):
        try:
            networks.append(ipaddress.ip_network(text, strict=True))
        except (TypeError, ValueError) as exc:
            raise HostConfigError(f"host.webhook_allow_cidrs[{index}]", f"not a network in CIDR form ({exc})") from None
    return tuple(networks)


def parse_webhooks(
    entries: Sequence[Any],
    tenants: Mapping[str, Any],
    base: Path,
    allow_cidrs: Sequence[str],
    convert: Callable[[Any, Any, str], Any],
) -> WebhookSettings:
    """The ``[[webhooks]]`` entries (parsed TOML tables) → :class:`WebhookSettings`.

    Args:
        entries: the tables; tenants: the configured tenants; base: the config file's directory (relative
            ``secret_file`` paths resolve against it); allow_cidrs: ``[host] webhook_allow_cidrs``;
            convert: the config loader's keyed ``msgspec.convert``.

    Raises:
        HostConfigError: the first problem, keyed ``webhooks[i].<key>``.
    """
    if len(entries) > MAX_WEBHOOKS:
        raise HostConfigError("webhooks", f"at most {MAX_WEBHOOKS} entries")
    endpoints: list[Endpoint] = []
    for index, raw in enumerate(entries):
        key = f"webhooks[{index}]"
        table: _WebhookTable = convert(raw, _WebhookTable, key)
        if table.tenant not in tenants:
            raise HostConfigError(
                f"{key}.tenant", f"unknown tenant {table.tenant!r}; add a [tenants.{table.tenant}] table"
            )
        url = check_webhook_url(f"{key}.url", table.url)
        if table.retry_max_seconds < table.retry_initial_seconds:
            raise HostConfigError(f"{key}.retry_max_seconds", "must be at least retry_initial_seconds")
        if len(set(table.events)) != len(table.events):
            raise HostConfigError(f"{key}.events", "lists an event twice")
        ident = endpoint_id(table.tenant, url)
        if any(e.endpoint_id == ident for e in endpoints):
            raise HostConfigError(f"{key}.url", "this tenant already has a webhook with this url")
        signer = read_secret(resolve_path(base, table.secret_file, f"{key}.secret_file"), f"{key}.secret_file")
        endpoints.append(
            Endpoint(
                endpoint_id=ident,
                tenant=table.tenant,
                url=url,
                signer=signer,
                events=frozenset(table.events),
                timeout_s=float(table.timeout_seconds),
                deadline_s=float(table.deadline_seconds),
                retry_initial_s=float(table.retry_initial_seconds),
                retry_max_s=float(table.retry_max_seconds),
                include_output=table.include_output,
            )
        )
    return WebhookSettings(tuple(endpoints), parse_allow_cidrs(allow_cidrs))
