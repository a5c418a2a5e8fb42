"""The retry schedule of a delivery (pure; docs/webhooks.md).

After failed attempt ``n`` (1-based) the next one is due ``min(retry_max, retry_initial * 2^(n-1))``
seconds later, times a jitter factor drawn uniformly from [0.8, 1.2) (so hosts and endpoints that failed
together do not retry together), and never past ``retry_max * 1.2``. A delivery whose next attempt would
fall at or after its deadline is recorded ``expired`` instead (the store decides, on its clock).

Source: docs/webhooks.md (retry schedule).
"""

from __future__ import annotations

from collections.abc import Callable

#: The jitter factor's range.
JITTER_LOW, JITTER_HIGH = 0.8, 1.2


def backoff_s(attempt: int, initial_s: float, max_s: float, draw: Callable[[], float]) -> float:
    """The wait after failed attempt ``attempt`` (1-based), seconds; ``draw()`` is uniform in [0, 1).

    Raises:
        ValueError: ``attempt`` < 1, or ``initial_s`` not in (0, ``max_s``].
    """
    if attempt < 1 or not 0 < initial_s <= max_s:
        raise ValueError("attempt >= 1 and 0 < initial_s <= max_s")
    base = initial_s * 2 ** min(attempt - 1, 64) if attempt < 64 else max_s
    return min(base, max_s) * (JITTER_LOW + (JITTER_HIGH - JITTER_LOW) * draw())
