"""Tenants at the sidecar: which tenant a job belongs to, and its private names (pure, no I/O).

The sidecar contract carries no tenant field: a job's tenant is read from its
job id. The host sends ``<tenant>:<action id>`` (README.md, "How it fits
together"; host tenant names match :data:`TENANT_PATTERN`, which has no
``:``). A job id without such a prefix (a peer host that knows no tenants)
belongs to the *default tenant* ``""``, so peer hosts keep working and share
one namespace among themselves, as before.

Everything CrewAI keeps for a crew is then kept per ``(tenant, crew id)``:
memory storage, knowledge collections, the replay index and training
artifacts (docs/security.md, "Tenant-scoped crew state").

Source: README.md ("How it fits together": sidecar job ids; "Tenant-scoped crew state").
"""

from __future__ import annotations

import hashlib
import re

#: Tenant names as the host accepts them (``host/config.py``): no ``:``, no ``/``, never ``.``/``..``.
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: The tenant of job ids that carry none (peer hosts).
DEFAULT_TENANT = ""
#: Directory name of the default tenant (a tenant name never starts with ``_``).
DEFAULT_TENANT_DIR = "_default"


def tenant_of(job_id: str) -> str:
    """The tenant of a sidecar job id.

    Args:
        job_id: ``<tenant>:<action id>`` (or any id a peer host sends).

    Returns:
        The text before the first ``:`` when it is a tenant name
        (:data:`TENANT_PATTERN`) and an action id follows; else
        :data:`DEFAULT_TENANT` (``""``).
    """
    prefix, sep, rest = job_id.partition(":")
    if sep and rest and TENANT_PATTERN.match(prefix):
        return prefix
    return DEFAULT_TENANT


def namespace_key(tenant: str, crew_id: str) -> str:
    """One string naming a ``(tenant, crew id)`` pair, unambiguously.

    The default tenant's key is the crew id itself (so its knowledge
    collections keep their names from before tenancy); any other tenant's is
    ``<tenant>\\x00<crew id>`` (crew ids hold no control characters, so no two
    pairs share a key).
    """
    return crew_id if tenant == DEFAULT_TENANT else f"{tenant}\x00{crew_id}"


def namespace_digest(tenant: str, crew_id: str) -> str:
    """32 hex characters of SHA-256 of :func:`namespace_key`: a file-name-safe private name."""
    return hashlib.sha256(namespace_key(tenant, crew_id).encode("utf-8")).hexdigest()[:32]


def tenant_dir_name(tenant: str) -> str:
    """Directory name of a tenant: the tenant name, or ``_default`` for the default tenant."""
    return tenant if tenant != DEFAULT_TENANT else DEFAULT_TENANT_DIR


def crew_dir_name(crew_id: str) -> str:
    """Directory name of a crew: the crew id when it is a safe file name
    (:data:`TENANT_PATTERN`), else ``crew-<24 hex of its SHA-256>``."""
    if TENANT_PATTERN.match(crew_id):
        return crew_id
    return "crew-" + hashlib.sha256(crew_id.encode("utf-8")).hexdigest()[:24]


def private_collection_name(namespace: str, collection_name: str | None) -> str:
    """A Chroma-safe collection name owned by one namespace.

    Args:
        namespace: ``tenancy.namespace_key(tenant, crew_id)`` (the crew id
            itself for the default tenant).
        collection_name: CrewAI's own collection name (``crew``, an agent role).

    Returns:
        ``aip_<16 hex of sha256(namespace)>_<8 hex of sha256(collection_name)>``
        (CrewAI prefixes ``knowledge_``: 38 characters, within Chroma's 3..63;
        distinct namespaces or names give distinct collections).
    """
    crew_part = hashlib.sha256(namespace.encode("utf-8")).hexdigest()[:16]
    name_part = hashlib.sha256((collection_name or "").encode("utf-8")).hexdigest()[:8]
    return f"aip_{crew_part}_{name_part}"
