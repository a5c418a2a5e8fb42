"""Placement: which of the sidecars serving a crew gets a new job.

A crew may be served by several ``[[sidecars]]`` entries (a hot crew on several machines; a rolling
upgrade drains one while the others take the new jobs). Each new startable job is placed on a READY
sidecar serving its crew, the one with the fewest in-flight jobs of this host first, the first in
configuration order on a tie (:func:`pick`, pure). The placement is recorded in the host store with the
action before the start is sent, and every follow-up of the job (status, events, cancel, resume,
reconciliation, correction) goes to the sidecar that holds it: the dispatcher asks
:meth:`Placement.home` only for rows that carry no placement (rows from before placements existed).

When no sidecar of the crew is ready (none checked yet, all down), the job is placed as if all were
ready: its start is tried and, refused, retried with backoff until the dispatch deadline, exactly as with
one sidecar (docs/operating.md "Failure behaviour").

Source: docs/operating.md "Several sidecars"; docs/ARCHITECTURE.md §10 ("Several sidecars").
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

__all__ = ["Placement", "pick"]


def pick(
    candidates: Sequence[str],
    *,
    ready: Collection[str],
    inflight: Mapping[str, int],
    exclude: Collection[str] = (),
    ready_only: bool = False,
) -> str | None:
    """The sidecar a new job goes to. Pure.

    Args:
        candidates: the names of the sidecars serving the job's crew, in configuration order.
        ready: the names of those that are ready now.
        inflight: name -> jobs of this host in flight on it (absent: 0).
        exclude: names not to use (they refused this job already).
        ready_only: when no candidate outside ``exclude`` is ready, answer None instead of the
            least loaded unready one.

    Returns:
        Among the candidates outside ``exclude``: the ready one with the fewest in-flight jobs (the
        first in ``candidates`` on a tie); when none is ready, the same choice among all of them
        (unless ``ready_only``); None when every candidate is excluded.
    """
    allowed = [name for name in candidates if name not in exclude]
    usable = [name for name in allowed if name in ready] or ([] if ready_only else allowed)
    best: str | None = None
    for name in usable:  # strict "<": the first in configuration order wins a tie
        if best is None or inflight.get(name, 0) < inflight.get(best, 0):
            best = name
    return best


class Placement:
    """The routing table of crews to sidecars and this host's view of their load.

    Args:
        routes: ``(sidecar name, crew ids it serves or None for every crew)`` in configuration order.
        ready: whether the named sidecar is ready now (default: always).

    ``inflight`` (name -> jobs of this host running there) is set by the action service, which
    knows its live dispatches; placements being written (:meth:`placing`) count too.
    """

    def __init__(
        self,
        routes: Sequence[tuple[str, frozenset[str] | None]],
        *,
        ready: Callable[[str], bool] | None = None,
    ) -> None:
        if not routes:
            raise ValueError("placement needs at least one sidecar")
        self.routes = tuple(routes)
        self.ready: Callable[[str], bool] = ready or (lambda _name: True)
        self.inflight: Callable[[str], int] = lambda _name: 0
        self._placing: Counter[str] = Counter()

    @property
    def names(self) -> tuple[str, ...]:
        """Every configured sidecar name, in configuration order."""
        return tuple(name for name, _ in self.routes)

    def candidates(self, crew_id: str) -> tuple[str, ...]:
        """The sidecars serving ``crew_id``, in configuration order (empty: none does)."""
        return tuple(name for name, crews in self.routes if crews is None or crew_id in crews)

    def home(self, crew_id: str) -> str:
        """Where a job of ``crew_id`` without a recorded placement lives: the crew's first configured
        sidecar (rows written before placements existed, when each crew had one sidecar)."""
        found = self.candidates(crew_id)
        return found[0] if found else self.routes[0][0]

    def place(self, crew_id: str, *, exclude: Collection[str] = (), ready_only: bool = False) -> str | None:
        """Choose a sidecar for a new job of ``crew_id`` (:func:`pick` over the current readiness and
        load). None when every candidate is excluded (or, with ``ready_only``, none left is ready)."""
        names = self.candidates(crew_id)
        return pick(
            names,
            ready={name for name in names if self.ready(name)},
            inflight={name: self.inflight(name) + self._placing[name] for name in names},
            exclude=exclude,
            ready_only=ready_only,
        )

    @contextlib.contextmanager
    def placing(self, crew_id: str) -> Iterator[str | None]:
        """:meth:`place`, counting the choice as in flight until the block ends (its dispatch is then
        registered and counted by ``inflight``): concurrent submissions spread over the sidecars
        although none of them is dispatched yet."""
        name = self.place(crew_id)
        if name is not None:
            self._placing[name] += 1
        try:
            yield name
        finally:
            if name is not None:
                self._placing[name] -= 1
                if self._placing[name] <= 0:
                    del self._placing[name]
