"""A bounded in-memory cache of the FINAL job views of runs (ARCHITECTURE.md §9).

A run's job view (the sidecar's ``GET /jobs/{id}``) stops changing once the
run is final, so the host answers a key-less ``:status`` of a final run from
here instead of paying the sidecar hop (:meth:`.actions.ActionService._read_inline`;
the read is still recorded as an action, with its target check, in the store).

- :func:`is_final_view` says which views may be kept (the rule and its source).
- :class:`ViewCache` is a plain LRU bounded both by entries and by the total
  bytes of the encoded views; it knows nothing of HTTP, the store or asyncio
  (pure data structure, one event loop uses it: no locking).

Keys are ``(tenant, crew_id, run_action_id)`` so that no tenant can ever be
answered another tenant's entry, whatever the caller checks around it.

Multi-host: each host process has its own cache, filled by its own reads.
Nothing is shared or invalidated between hosts, and nothing needs to be: a
final view never changes, so two hosts can only hold the same bytes.

Source: ARCHITECTURE.md "Action states" (key-less reads answered inline);
``aip_crewai/sidecar/jobs/reader.py`` ``JobReader.view`` (what a view holds) and
``aip_crewai/sidecar/jobs/runtime.py`` (when ``provider_stop_observed`` is written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = ["DEFAULT_ENTRIES", "DEFAULT_MAX_BYTES", "MAX_ENTRIES", "CacheKey", "ViewCache", "is_final_view"]

#: Default bound on cached views, entries (``[host] status_cache_entries``; 0 disables the cache).
DEFAULT_ENTRIES = 1024
#: Largest ``[host] status_cache_entries`` accepted.
MAX_ENTRIES = 1_000_000
#: Default bound on the total size of the cached encoded views, bytes (4 MiB).
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

#: ``(tenant, crew_id, run_action_id)``.
CacheKey = tuple[str, str, str]


def is_final_view(view: Any) -> bool:
    """Whether a sidecar job view (the decoded ``GET /jobs/{id}`` JSON object) can never change again.

    Final: ``status`` ``completed``; ``cancelled`` only once ``provider_stop_observed`` is
    ``True`` (until then ``uncertain_outcome`` may still turn false, and an unconfirmed
    stop stays ``False``/absent); ``failed``, except a failure that stopped a still-running
    worker (``error.error_type == "ExecutionTimeout"``) before its ``provider_stop_observed``
    is recorded (the sidecar writes that key once, later, on ``failed`` and ``cancelled`` jobs
    only). Anything else (``running``, ``queued``, a shape this does not know) is not final.
    Pure.

    Source: ``sidecar/jobs/reader.py`` ``JobReader.view``; ``sidecar/journal/store.py``
    ``set_provider_stop_observed``; ``sidecar/jobs/runtime.py`` (the execution bound).
    """
    if not isinstance(view, Mapping):
        return False
    status = view.get("status")
    if status == "completed":
        return True
    if status == "cancelled":
        return view.get("provider_stop_observed") is True
    if status == "failed":
        error = view.get("error")
        stopped = isinstance(error, Mapping) and error.get("error_type") == "ExecutionTimeout"
        return not stopped or "provider_stop_observed" in view
    return False


class ViewCache:
    """An LRU of encoded final views, bounded by entries and by total bytes.

    Args:
        max_entries: at most this many views (0: the cache is disabled, every
            :meth:`get` misses and :meth:`put` keeps nothing). Raises
            ValueError when negative.
        max_bytes: the encoded views together take at most this many bytes;
            one larger than this is not kept. Raises ValueError when negative.

    Invariants (after every call): ``len(self) <= max_entries`` and
    ``self.total_bytes <= max_bytes``; entries are evicted least recently used
    first (a :meth:`get` hit and a :meth:`put` both make an entry the most
    recent). ``hits`` and ``misses`` count :meth:`get` answers.
    """

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._views: OrderedDict[CacheKey, bytes] = OrderedDict()
        self.total_bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        """False when ``max_entries`` (or ``max_bytes``) is 0: nothing is ever kept."""
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._views)

    def keys(self) -> list[CacheKey]:
        """The cached keys, least recently used first."""
        return list(self._views)

    def get(self, key: CacheKey) -> bytes | None:
        """The encoded view under ``key`` (now the most recently used), or None."""
        encoded = self._views.get(key)
        if encoded is None:
            self.misses += 1
            return None
        self._views.move_to_end(key)
        self.hits += 1
        return encoded

    def put(self, key: CacheKey, encoded: bytes) -> bool:
        """Keep ``encoded`` under ``key`` as the most recently used entry (replacing
        one already there), evicting the least recently used until both bounds hold.
        Returns False (and keeps nothing new) when the cache is disabled or
        ``encoded`` alone exceeds ``max_bytes``; a previous entry under ``key`` is
        then dropped too, so the cache never answers older bytes than it was given."""
        self._drop(key)
        if not self.enabled or len(encoded) > self.max_bytes:
            return False
        self._views[key] = encoded
        self.total_bytes += len(encoded)
        while len(self._views) > self.max_entries or self.total_bytes > self.max_bytes:
            _, evicted = self._views.popitem(last=False)
            self.total_bytes -= len(evicted)
        return True

    def _drop(self, key: CacheKey) -> None:
        previous = self._views.pop(key, None)
        if previous is not None:
            self.total_bytes -= len(previous)
