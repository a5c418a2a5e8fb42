"""Changes committed by other hosts, pushed to this host's followers (ARCHITECTURE.md §10).

On a PostgreSQL store every write that stores chunks or a result also sends
``NOTIFY aip_actions, '<tenant> <action_id>'`` (delivered at its commit:
:meth:`~aip_crewai.host.store.store.Store.append_chunks`, ``update_action``).
:func:`listen` keeps one extra connection in ``LISTEN aip_actions`` on a
thread of its own and hands each notification to :class:`RemoteChanges` on
the event loop, which wakes the followers of that action on this host: a
tenant following an action that another host dispatches sees its chunks as
they are committed, not at the next poll. Without a listener (a SQLite
store, one host) nothing is pushed and followers poll.

Follow the rule of :mod:`aip_crewai.plumbing.wakeup`: take :meth:`RemoteChanges.signal`
and its ``version`` BEFORE reading the store, then wait with ``seen``.

Source: ARCHITECTURE.md §10 (live followers).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable

import structlog

from ...plumbing.wakeup import ChangeSignal
from .engines.engine import Db
from .engines.postgres import StoreTimeouts, interrupt_connection

log = structlog.get_logger(__name__)

#: The PostgreSQL notification channel of action changes.
CHANNEL = "aip_actions"
#: Seconds between two reconnection attempts of a listener that lost its connection.
RECONNECT_S = 1.0
#: The listener's liveness check: a round trip (``SELECT 1``) every :data:`PING_S` seconds; one not
#: answered within :data:`PING_TIMEOUT_S` ends the connection (a backend that died silently: TCP up,
#: nothing delivered) and a new one replaces it. Followers poll meanwhile.
PING_S, PING_TIMEOUT_S = 0.5, 1.0


def payload(tenant: str, action_id: str) -> str:
    """The notification payload of one action: ``<tenant> <action_id>`` (tenant names hold no space)."""
    return f"{tenant} {action_id}"


def send(db: Db, tenant: str, action_id: str) -> None:
    """On a shared (PostgreSQL) store: tell the other hosts' followers that this action changed
    (``NOTIFY``, delivered at the commit of the write ``db`` runs now; on the store's worker). Nothing on SQLite."""
    if db.engine == "postgresql":
        db.fetch("SELECT pg_notify(?, ?)", (CHANNEL, payload(tenant, action_id)))


class RemoteChanges:
    """Per-action change signals, kept only while a follower holds one (weak values)."""

    def __init__(self) -> None:
        self._signals: weakref.WeakValueDictionary[tuple[str, str], ChangeSignal] = weakref.WeakValueDictionary()
        #: Whether a listener delivers notifications (else followers must poll).
        self.pushed = False
        self._listening: asyncio.Event | None = None

    def set_pushed(self, value: bool) -> None:
        """The listener's connection is up (True) or lost (False); event loop only. A change wakes every
        follower: a lost listener's followers switch to polling now (not at their next keep-alive), and a
        new one's re-read what was committed while none listened."""
        changed = value != self.pushed
        self.pushed = value
        if value:
            self.listening().set()
        elif self._listening is not None:
            self._listening.clear()
        if changed:
            for found in list(self._signals.values()):
                found.notify()

    def listening(self) -> asyncio.Event:
        """Set while a listener delivers notifications (event loop only)."""
        if self._listening is None:
            self._listening = asyncio.Event()
            if self.pushed:
                self._listening.set()
        return self._listening

    def signal(self, tenant: str, action_id: str) -> ChangeSignal:
        """The signal of one action (created on first use; hold it while following)."""
        key = (tenant, action_id)
        found = self._signals.get(key)
        if found is None:
            found = self._signals[key] = ChangeSignal()
        return found

    def deliver(self, text: str) -> None:
        """One notification payload (event loop only): wake that action's followers, if any."""
        tenant, _, action_id = text.partition(" ")
        found = self._signals.get((tenant, action_id))
        if found is not None:
            found.notify()


def listen(
    url: str, changes: RemoteChanges, loop: asyncio.AbstractEventLoop, timeouts: StoreTimeouts | None = None
) -> Callable[[], None]:
    """Start the listener thread (``LISTEN aip_actions`` on its own connection, with the store's session
    bounds and keepalives); returns ``stop``.

    The connection is checked by a round trip every :data:`PING_S` seconds; one not answered within
    :data:`PING_TIMEOUT_S` is interrupted. A lost connection is reopened every :data:`RECONNECT_S`
    seconds; while it is down, ``changes.pushed`` is False and followers fall back to polling.
    docs/operating.md "Faults and their bounds".
    """
    import psycopg

    stopping = threading.Event()
    kwargs = (timeouts or StoreTimeouts()).connect_kwargs(url, "aip-crewai-host-listen")

    def ping(conn: psycopg.Connection[tuple[object, ...]]) -> None:
        """One liveness round trip, interrupted past :data:`PING_TIMEOUT_S` (raises OperationalError then)."""
        watchdog = threading.Timer(PING_TIMEOUT_S, interrupt_connection, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.execute("SELECT 1")
        finally:
            watchdog.cancel()

    def run() -> None:
        while not stopping.is_set():
            try:
                with psycopg.connect(url, **kwargs) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    loop.call_soon_threadsafe(changes.set_pushed, True)
                    while not stopping.is_set():
                        for note in conn.notifies(timeout=PING_S):
                            loop.call_soon_threadsafe(changes.deliver, note.payload)
                        ping(conn)
            except Exception as exc:  # the listener must outlive a database restart
                if stopping.is_set():
                    return
                log.warning("store_listener_lost", error=type(exc).__name__)
            finally:
                _set_soon(loop, changes, False)  # followers poll until it is back
            stopping.wait(RECONNECT_S)

    thread = threading.Thread(target=run, name="aip-host-listen", daemon=True)
    thread.start()

    def stop() -> None:
        stopping.set()
        thread.join(timeout=5)

    return stop


def _set_soon(loop: asyncio.AbstractEventLoop, changes: RemoteChanges, value: bool) -> None:
    try:
        loop.call_soon_threadsafe(changes.set_pushed, value)
    except RuntimeError:  # the loop is closed: the host is stopping
        pass
