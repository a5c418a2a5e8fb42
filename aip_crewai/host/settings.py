"""The host's validated configuration, as the rest of the host sees it: frozen :class:`Settings`, its
principals and sidecars, and the defaults of every optional key. Built from ``host.toml`` by
:func:`aip_crewai.host.config.load_settings` (which holds the TOML shape and the bounds).

Source: ARCHITECTURE.md §11; docs/reference/configuration.md "Configuration reference".
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .crews.descriptors import CrewDescriptor
from .ledger.receipts import ReceiptKeys
from .ledger.usage import Pricing
from .sidecars.view_cache import DEFAULT_ENTRIES as DEFAULT_STATUS_CACHE_ENTRIES
from .store.engines.postgres import StoreTimeouts
from .webhooks.config import WebhookSettings

#: Response bound, bytes (ARCHITECTURE.md §8, §11).
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024


#: Default ``[host] lease_seconds``: a dispatch lease lasts this long unless renewed (ARCHITECTURE.md §10).
DEFAULT_LEASE_S = 30.0


#: Default and largest ``[host] store_pool_size``: the pooled connections (and store worker threads) of a
#: PostgreSQL host store (a SQLite store keeps its one connection).
DEFAULT_STORE_POOL_SIZE = 4


#: How long a start the sidecar provably did not admit is retried, seconds (ARCHITECTURE.md §9).
DEFAULT_DISPATCH_DEADLINE_S = 600.0


#: Lifetime of a stream token, seconds (docs/reference/http-api.md "Stream tokens"), and its bounds.
DEFAULT_STREAM_TOKEN_TTL_S = 300


#: Default ``[host] unauthenticated_body_budget_bytes``: bodies read before authentication, in total, bytes;
#: and its floor, one whole message body (``http/routes.MAX_MESSAGE_BYTES``; docs/security.md "Security").
DEFAULT_BODY_BUDGET_BYTES, MIN_BODY_BUDGET_BYTES = 64 * 1024 * 1024, 2 * 1024 * 1024


#: The sidecar's SSE keep-alive interval assumed when its ``/health`` has no ``sse_keepalive_seconds``, seconds.
DEFAULT_SIDECAR_KEEPALIVE_S = 15.0


ROLES: frozenset[str] = frozenset({"invoker", "approver", "operator"})


@dataclass(frozen=True)
class PrincipalConfig:
    """One configured principal. ``token_sha256`` is the 32-byte digest (not hex)."""

    id: str
    tenant: str
    roles: frozenset[str]
    token_sha256: bytes | None = field(default=None, repr=False)
    ed25519_public_key: Ed25519PublicKey | None = field(default=None, repr=False)


@dataclass(frozen=True)
class SidecarSettings:
    """One sidecar the host dispatches to (``[sidecar]`` or one ``[[sidecars]]`` entry).

    ``crews``: the admitted crew ids it serves; None for the one ``[sidecar]`` of a single-sidecar host
    (every crew). ``name``: for logs and errors (``sidecar`` for ``[sidecar]``; ``sidecars[i].name`` or
    ``sidecar-<i>``)."""

    name: str
    url: str
    token: str = field(repr=False)
    proxy: str | None = None
    keepalive_s: float = DEFAULT_SIDECAR_KEEPALIVE_S
    crews: frozenset[str] | None = None
    #: PEM certificates of the CA(s) its https certificate must chain to (``ca_file``), None: the system's.
    ca_pem: str | None = field(default=None, repr=False)

    def serves(self, crew_id: str) -> bool:
        return self.crews is None or crew_id in self.crews

    def verify(self) -> ssl.SSLContext | bool:
        """What the host's connections to this sidecar check its https certificate against: a context
        trusting the CAs of :attr:`ca_pem` alone (a private CA), else True (httpx's default, the public CAs).

        Raises:
            ssl.SSLError: :attr:`ca_pem` holds no usable certificate (checked when the config loads).

        Source: docs/reference/configuration.md (``[sidecar] ca_file``)."""
        return ssl.create_default_context(cadata=self.ca_pem) if self.ca_pem else True


@dataclass(frozen=True)
class Settings:
    """Everything the host needs, validated. Built by :func:`load_settings`;
    tests may derive variants with ``dataclasses.replace``.

    Attributes:
        bind: ``host:port`` for hypercorn.
        store_path: absolute path of the SQLite host store, or a ``postgresql://`` URL (ARCHITECTURE.md §10).
        max_response_bytes: bound of one sidecar response body, bytes.
        sidecar_url: base URL of the sidecar (https, or http to loopback).
        sidecar_token: the bearer token for the sidecar (never logged).
        sidecar_proxy: the proxy the sidecar client uses, or None: then the
            client ignores ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` and
            ``.netrc`` (docs/security.md "Security").
        crews: admitted descriptors in file order.
        tenants: tenant name -> admitted crew ids it may see (file order).
        principals: configured principals in file order.
        readiness_interval_s: sidecar ``/health`` poll period, seconds.
        notify_socket: systemd ``NOTIFY_SOCKET`` address, or None.
        cors_origins: browser origins (``scheme://host[:port]``) allowed by
            CORS; empty: no CORS headers at all (docs/reference/configuration.md "Browsers").
        dispatch_deadline_s: how long a start the sidecar provably did not
            admit is retried with backoff before the action fails with
            ``connector.crewai.dispatch_deadline``, seconds (ARCHITECTURE.md §9).
        sidecar_keepalive_s: the sidecar's SSE keep-alive interval, seconds,
            when its ``/health`` does not publish ``sse_keepalive_seconds``
            (a silent stream is detected after a few missed keep-alives).
        stream_token_ttl_s: lifetime of a minted stream token, seconds (docs/reference/http-api.md "Stream tokens").
        openapi: serve ``/openapi.json`` (docs/reference/http-api.md "OpenAPI").
        console: serve the approval console at ``/console/`` (docs/approvals.md "Approval console").
        host_id: this host in dispatch leases (default ``<hostname>:<bind port>``); hosts sharing a
            PostgreSQL store need distinct ids (one process per id: ARCHITECTURE.md §10).
        lease_s: how long a dispatch lease lasts unless renewed, seconds; a dead host's running actions
            are taken over by another host after it.
        store_pool_size: connections of a PostgreSQL store's pool, one per store worker thread.
        store_timeouts: the session bounds of a PostgreSQL store and of each store call (docs/operating.md
            "Faults and their bounds").
        sidecars: every sidecar, each with the crews it serves (``[[sidecars]]``), or the one
            ``[sidecar]`` serving every crew; the ``sidecar_*`` fields are the first one's.
        status_cache_entries: bound of this host's own cache of final job views, entries (0: off);
            a key-less ``:status`` of a completed, failed or confirmed-cancelled run is answered from
            it without the sidecar hop, and still recorded as an action (ARCHITECTURE.md §9;
            :mod:`.view_cache`). Not shared between hosts: final views never change.
        receipt_keys: the key signing result receipts and the previous public keys still published
            (``[host] receipt_key_file``, ``receipt_previous_public_keys``); None: no receipts.
        pricing: ``[pricing]``: prices per model and each crew's model; None: no cost (docs/observing.md "Observing actions").
        public_authorities: the ``Host`` values (``@authority``) a signed request may name, lower-case;
            None: the forms of the bind address (docs/approvals.md "Signed requests").
        webhooks: the ``[[webhooks]]`` endpoints and ``[host] webhook_allow_cidrs`` (docs/webhooks.md).
        body_budget_bytes: the bytes of request bodies read before authentication (signed envelopes
            and signed requests), in total; past it such a body is 503 (docs/security.md "Security").
    """

    config_path: Path
    bind: str
    store_path: Path | str
    max_response_bytes: int
    sidecar_url: str
    sidecar_token: str = field(repr=False)
    crews_file: Path
    crews: tuple[CrewDescriptor, ...]
    tenants: Mapping[str, tuple[str, ...]]
    principals: tuple[PrincipalConfig, ...]
    readiness_interval_s: float = 5.0
    notify_socket: str | None = None
    sidecar_proxy: str | None = None
    cors_origins: tuple[str, ...] = ()
    dispatch_deadline_s: float = DEFAULT_DISPATCH_DEADLINE_S
    sidecar_keepalive_s: float = DEFAULT_SIDECAR_KEEPALIVE_S
    stream_token_ttl_s: int = DEFAULT_STREAM_TOKEN_TTL_S
    openapi: bool = True
    console: bool = True
    host_id: str = "host"
    lease_s: float = DEFAULT_LEASE_S
    store_pool_size: int = DEFAULT_STORE_POOL_SIZE
    store_timeouts: StoreTimeouts = StoreTimeouts()
    sidecars: tuple[SidecarSettings, ...] = ()
    receipt_keys: ReceiptKeys | None = field(default=None, repr=False)
    pricing: Pricing | None = None
    status_cache_entries: int = DEFAULT_STATUS_CACHE_ENTRIES
    body_budget_bytes: int = DEFAULT_BODY_BUDGET_BYTES
    public_authorities: tuple[str, ...] | None = None
    webhooks: WebhookSettings = WebhookSettings()
