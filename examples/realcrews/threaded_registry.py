"""The :mod:`realcrews` registry behind a module that starts a thread at import.

Many SDK clients do this (a metrics flusher, an exporter's batch processor).
The thread takes a lock in a loop: a process forked while it holds the lock
would hang on its first use of it.
"""

from __future__ import annotations

import threading

from realcrews import CREWS  # noqa: F401 - the registry

_lock = threading.Lock()
_stop = threading.Event()
flushed = 0


def _flush_forever() -> None:
    global flushed
    while not _stop.wait(0.001):
        with _lock:
            flushed += 1


FLUSHER = threading.Thread(target=_flush_forever, name="metrics-flusher", daemon=True)
FLUSHER.start()
