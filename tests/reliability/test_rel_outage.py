"""Sidecar outages around approvals, through real processes (``make chaos`` category
``outage`` runs every ``test_rel_*`` scenario here): the sidecar down, draining, frozen (SIGSTOP) and
killed and restarted while approved actions wait or run.

What each scenario holds to (ARCHITECTURE.md §9 "Dispatch" and "Final results"):

- zero approvals lost: an approved action whose start the sidecar did not admit stays ``queued`` and
  runs, once, when the sidecar is back (or fails past its dispatch deadline with
  ``connector.crewai.dispatch_deadline``, ``uncertain_outcome: false``);
- zero actions left non-final after reconciliation: every action ends with a final result
  (:func:`aip_crewai.host.actions.lifecycle.result_is_final`).

One sidecar serves the module (:class:`ModuleSidecar`; the tests keep apart by their unique action ids, each
test's hosts are its own): where the sidecar is down and then starts, the host reaches it through a
:class:`Relay` that refuses connections until it opens; the scenarios that drain or kill it meet the
real listener and start its successor on the same journal and port themselves.

Polling with deadlines only (``relkit.until``); never a sleep that waits for a result.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any
from weakref import WeakKeyDictionary

import httpx2
import pytest
import storebackend
from chaoslib import uid
from kits.host import Host, free_port
from kits.poll import until
from kits.sidecar import Sidecar
from relkit import (
    TERMINAL,
    Processes,
    action_status,
    approve,
    post_action,
    served,
    sidecar_events,
    wait_action,
)

from aip_crewai.host.actions.lifecycle import result_is_final

pytestmark = [pytest.mark.integration, pytest.mark.host_processes]


# ------------------------------------------------------------------ the module's sidecar, and a relay to it


class Relay:
    """A loopback TCP relay on a port of its own to a sidecar's port, closed (nothing listens: a connection is
    refused, as when no sidecar runs) until :meth:`open`, then relaying every byte both ways. A host configured
    with :attr:`url` sees its sidecar down and then started, while one sidecar process serves test after test
    (it starts no CrewAI). Not for a sidecar that drains or dies: there a host must meet the real listener."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._server,), daemon=True, name="relay-accept").start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True, name="relay-pump").start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for each in [self._server, *self._sockets]:
            if each is not None:
                with contextlib.suppress(OSError):
                    each.shutdown(socket.SHUT_RDWR)
                each.close()


class ModuleSidecar:
    """The module's one sidecar on a fixed port, with ``--max-concurrency 1`` (one job executes, the next
    queues) and ``--shutdown-grace-seconds 3``, and its successors on the same journal and port."""

    ARGS = ("--max-concurrency", "1", "--shutdown-grace-seconds", "3")

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.port = free_port()
        self.sidecar = procs.sidecar(args=["--port", str(self.port), *self.ARGS])

    def live(self) -> Sidecar:
        """The sidecar, running and idle as a new one is: one a failed test left frozen is continued, one it
        left down is restarted, and a job it left executing is waited for (it would queue the next test's)."""
        if self.sidecar.process.poll() is None:
            self.sidecar.process.send_signal(signal.SIGCONT)
        else:
            self.restart()

        def idle() -> bool:
            with httpx2.Client(base_url=self.sidecar.base_url, headers=self.sidecar.headers, timeout=10) as direct:
                return direct.get("/health").json().get("active_runs") == 0

        until(idle, timeout=60, interval=0.1, what="the module's sidecar idle")
        return self.sidecar

    def restart(self) -> Sidecar:
        """Its successor on the same journal and port (the sidecar must be gone)."""
        self.sidecar = self.procs.restart_sidecar(self.sidecar)
        return self.sidecar


#: The module's sidecar of a test's processes (the ``procs`` fixture below).
_MODULE_SIDECARS: WeakKeyDictionary[Processes, ModuleSidecar] = WeakKeyDictionary()


@pytest.fixture(scope="module")
def module_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleSidecar]:
    processes = Processes(tmp_path_factory.mktemp("rel-outage-sidecar"))
    try:
        yield ModuleSidecar(processes)
    finally:
        processes.close()


@pytest.fixture
def procs(procs: Processes, module_sidecar: ModuleSidecar) -> Processes:
    """The suite's ``procs`` (the test's own hosts), with the module's sidecar (:func:`shared_sidecar`)."""
    _MODULE_SIDECARS[procs] = module_sidecar
    return procs


def shared_sidecar(procs: Processes) -> ModuleSidecar:
    """The module's sidecar of the test; for processes without one (``make chaos`` calls each scenario with
    processes of its own, tests/reliability/chaos.py) one is started in them."""
    found = _MODULE_SIDECARS.get(procs)
    if found is None:
        found = _MODULE_SIDECARS[procs] = ModuleSidecar(procs)
    return found


# ------------------------------------------------------------------ helpers


def _approved_run(host: Host, http: httpx2.Client, crew: str, prefix: str) -> str:
    """Submit a governed ``run`` of ``crew`` and approve it; returns the action id."""
    action_id = uid(prefix)
    pending = post_action(http, f"cap:crewai:{crew}", {"topic": action_id}, action_id, key=f"key-{action_id}")
    assert pending.status_code in (200, 202), pending.text
    decided = approve(host, pending)
    assert decided.status_code == 200, decided.text
    return action_id


def _final(view: dict[str, Any]) -> bool:
    result = view.get("result") or {}
    error = result.get("error") or {}
    return result_is_final(
        view.get("state", ""), startable=True, error_code=error.get("code"), details=error.get("details")
    )


def assert_all_final(http: httpx2.Client, action_ids: list[str], timeout: float = 90.0) -> dict[str, dict[str, Any]]:
    """Every action reaches a final result (reconciliation included); returns the views."""
    views: dict[str, dict[str, Any]] = {}
    for action_id in action_ids:
        views[action_id] = until(
            lambda a=action_id: (lambda v: v if _final(v) else None)(action_status(http, a)),
            timeout=timeout,
            interval=0.1,
            what=f"{action_id} final",
        )
    return views


def _started_once(sidecar: Any, action_id: str) -> list[dict[str, Any]]:
    events = sidecar_events(sidecar, f"acme:{action_id}")
    assert [e["event"] for e in events].count("started") == 1, events
    return events


def _events_so_far(sidecar: Any, action_id: str) -> int:
    """How many events the sidecar journaled for the action's job (0 while it is not admitted yet)."""
    with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=30) as direct:
        answer = direct.get(f"/jobs/acme:{action_id}")
    return int(answer.json().get("event_count") or 0) if answer.status_code == 200 else 0


# ------------------------------------------------------------------ scenarios


@pytest.mark.timeout(180)
def test_rel_outage_approved_while_the_sidecar_is_down_runs_once_when_it_is_back(procs):
    """Item 1: the sidecar is down when the run is approved (and when a knowledge query, which needs no
    approval, is submitted to the unready host): both are accepted and stay ``queued`` (not failed), then
    complete once the sidecar starts (the relay opens), each started exactly once under its one job id."""
    shared = shared_sidecar(procs)
    sidecar = shared.live()
    relay = Relay(shared.port)
    host = served(procs.host(relay.url, ready=False))
    with relay, host.http("acme-app") as http:
        run_id = _approved_run(host, http, "echo", "down")
        query_id = uid("down-kq")
        answer = post_action(
            http, "cap:crewai:knowledge_a:knowledge_query", {"query": ["refunds"]}, query_id, key=f"key-{query_id}"
        )
        assert answer.status_code in (200, 202), answer.text
        for action_id in (run_id, query_id):
            until(
                lambda a=action_id: action_status(http, a).get("state") == "queued",
                timeout=30,
                what=f"{action_id} queued while the sidecar is down",
            )
        assert action_status(http, run_id)["state"] == "queued"  # still not burned after several retries
        relay.open()
        views = assert_all_final(http, [run_id, query_id])
        assert views[run_id]["state"] == "completed", views[run_id]
        assert views[query_id]["state"] == "completed", views[query_id]
        _started_once(sidecar, run_id)


@pytest.mark.timeout(180)
def test_rel_outage_a_queued_approval_survives_a_host_restart(procs):
    """Item 1: the run is approved and queued while the sidecar is down; the host is killed (-9) and
    restarted on its store, the sidecar still down: recovery keeps it queued and retries it; once the
    sidecar starts (the relay opens), it completes, started once."""
    shared = shared_sidecar(procs)
    sidecar = shared.live()
    relay = Relay(shared.port)
    host = served(procs.host(relay.url, ready=False))
    with host.http("acme-app") as http:
        action_id = _approved_run(host, http, "echo", "restart")
        until(lambda: action_status(http, action_id).get("state") == "queued", timeout=30, what="queued")
    host.kill(signal.SIGKILL)
    host = served(procs.host(relay.url, port=host.port, ready=False))
    with relay, host.http("acme-app") as http:
        until(lambda: b"dispatch_not_admitted" in host.output(), timeout=60, what="the restarted host retrying")
        # Each retry marks the action running while its start is sent and requeues it once refused (after
        # the log line): between two retries a tenant sees it queued again.
        until(lambda: action_status(http, action_id).get("state") == "queued", timeout=30, what="requeued")
        relay.open()
        view = assert_all_final(http, [action_id])[action_id]
        assert view["state"] == "completed", view
        _started_once(sidecar, action_id)


@pytest.mark.timeout(120)
def test_rel_outage_past_the_dispatch_deadline_fails_with_a_certain_outcome(procs):
    """Item 1: with ``dispatch_deadline_seconds = 1`` and no sidecar, an approved run fails with
    ``connector.crewai.dispatch_deadline``, ``uncertain_outcome: false``, dispatch ``not_sent``; a sidecar
    started afterwards (the relay opens; the host is ready: it reaches the sidecar) never runs it."""
    shared = shared_sidecar(procs)
    sidecar = shared.live()
    relay = Relay(shared.port)
    host = served(procs.host(relay.url, ready=False, host_options={"dispatch_deadline_seconds": 1}))
    with relay, host.http("acme-app") as http:
        action_id = _approved_run(host, http, "echo", "deadline")
        view = wait_action(http, action_id, timeout=60)
        error = view["result"]["error"]
        assert view["state"] == "failed" and error["code"] == "connector.crewai.dispatch_deadline", view
        assert error["details"]["uncertain_outcome"] is False and error["details"]["dispatch"] == "not_sent"
        assert _final(view)
        relay.open()
        until(lambda: http.get("/ready").status_code == 200, timeout=60, what="the host reaching the sidecar")
        with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=30) as direct:
            assert direct.get(f"/jobs/acme:{action_id}").status_code == 404


@pytest.mark.timeout(180)
def test_rel_outage_a_run_approved_while_the_sidecar_drains_is_queued_not_burned(procs):
    """Item 1: the sidecar is draining (SIGTERM with a slow job still running) when a run is approved: its
    start gets 503 "shutting down" on a pooled connection, or a refused connection once the listener is
    closed (both provably not admitted; the 503 itself is pinned in-process by
    ``tests/host/test_lifecycle_regressions.py``). The approval is kept, and the run completes once a new
    sidecar serves the journal (the module's sidecar: ``--shutdown-grace-seconds 3``, and its successor)."""
    shared = shared_sidecar(procs)
    sidecar = shared.live()
    host = procs.host(sidecar.base_url)
    with host.http("acme-app") as http:
        slow_id = _approved_run(host, http, "slow", "drain-slow")
        until(lambda: action_status(http, slow_id).get("state") == "running", timeout=30, what="slow run running")
        pending_id = uid("drain")
        pending = post_action(http, "cap:crewai:echo", {"topic": pending_id}, pending_id, key=f"key-{pending_id}")
        sidecar.process.send_signal(signal.SIGTERM)

        def draining() -> bool:
            try:
                return (
                    httpx2.get(f"{sidecar.base_url}/health", headers=sidecar.headers, timeout=5).json().get("status")
                    == "stopping"
                )
            except httpx2.HTTPError:
                return sidecar.process.poll() is not None  # already gone: a refused connection instead

        until(draining, timeout=30, what="the sidecar draining")
        assert approve(host, pending).status_code == 200
        sidecar.process.wait(timeout=60)
        assert action_status(http, pending_id)["state"] in ("queued", "running")
        restarted = shared.restart()
        views = assert_all_final(http, [slow_id, pending_id])
        assert views[pending_id]["state"] == "completed", views[pending_id]
        _started_once(restarted, pending_id)


@pytest.mark.timeout(180)
def test_rel_outage_a_frozen_sidecar_is_detected_and_followed_again_not_cancelled(procs):
    """Item 2: SIGSTOP of the sidecar mid-stream. The host sees the silence after a few missed keep-alives
    (the sidecar publishes ``sse_keepalive_seconds`` 0.2 in ``/health``: silent after 2 s), keeps the action
    running (never cancelled, never failed), and after SIGCONT reads the job view and follows the job
    again: the run completes with every sidecar event stored once."""
    sidecar = shared_sidecar(procs).live()
    host = procs.host(sidecar.base_url)
    with host.http("acme-app") as http:
        action_id = _approved_run(host, http, "slow", "frozen")
        until(lambda: _events_so_far(sidecar, action_id) >= 3, timeout=60, what="events flowing")
        sidecar.process.send_signal(signal.SIGSTOP)
        try:
            until(lambda: b"sidecar_stream_silent" in host.output(), timeout=30, what="the host seeing the silence")
            assert action_status(http, action_id)["state"] == "running"
        finally:
            sidecar.process.send_signal(signal.SIGCONT)
        view = wait_action(http, action_id, timeout=90)
        assert view["state"] == "completed", view
        events = _started_once(sidecar, action_id)
        stored = _stored_chunk_sequences(host, action_id)
        assert stored == list(range(len(events))), (stored, len(events))


def _stored_chunk_sequences(host: Host, action_id: str) -> list[int]:
    """The sequences of the chunks the host stored for an acme action, read from its store (either backend)."""

    async def read(store: Any) -> list[int]:
        return [chunk.sequence for chunk in await store.list_chunks("acme", action_id, limit=100_000)]

    return storebackend.read_host_store(host.workdir, read)


def _stored_result(host: Host, action_id: str) -> dict[str, Any] | None:
    """The result the host stored for an acme action (no tenant read: nothing reconciles it on the way)."""

    async def read(store: Any) -> str | None:
        record = await store.get_action("acme", action_id)
        return record.result_json if record is not None else None

    raw = storebackend.read_host_store(host.workdir, read)
    return json.loads(raw) if raw else None


@pytest.mark.timeout(240)
def test_rel_outage_sidecar_killed_mid_run_provisional_results_are_corrected_by_the_reconciler(procs):
    """Item 3: kill -9 of the sidecar while one run executes and another waits in its queue
    (``--max-concurrency 1``). A broken read is never a cancel nor a failure: the host retries the job
    view, then leaves both actions running for the reconciler (``dispatch_deferred``), storing no result.
    After the sidecar restarts, the periodic reconciler (no tenant read involved: the store is watched
    directly) settles them with the journal's word: the running job ``failed`` with ``uncertain_outcome:
    true``, the queued one ``failed`` with ``uncertain_outcome: false`` (it never ran); both final. The module's
    sidecar has ``--max-concurrency 1``; its successor on the same journal and port restarts."""
    shared = shared_sidecar(procs)
    sidecar = shared.live()
    host = procs.host(sidecar.base_url)
    with host.http("acme-app") as http:
        running_id = _approved_run(host, http, "slow", "k9-run")
        until(lambda: _events_so_far(sidecar, running_id) >= 2, timeout=60, what="first run going")
        queued_id = _approved_run(host, http, "slow", "k9-queued")

        def admitted() -> bool:
            with httpx2.Client(base_url=sidecar.base_url, headers=sidecar.headers, timeout=10) as direct:
                return direct.get(f"/jobs/acme:{queued_id}").status_code == 200

        until(admitted, timeout=60, what="second run admitted (queued at the sidecar)")
        sidecar.kill(signal.SIGKILL)
        until(
            lambda: host.output().count(b"dispatch_deferred") >= 2,
            timeout=60,
            interval=0.1,
            what="both dispatches left to the reconciler",
        )
        for action_id in (running_id, queued_id):  # what the host says with the sidecar gone: nothing final
            assert _stored_result(host, action_id) is None
        shared.restart()

        def corrected(action_id: str) -> dict[str, Any] | None:
            result = _stored_result(host, action_id)
            error = (result or {}).get("error") or {}
            return result if error.get("code") == "connector.crewai.execution_failed" else None

        # Each read opens the host's store beside the running host: polled gently (a loaded machine), with the
        # reconciler's period (5 s) and a restarted sidecar's journal replay well inside the deadline.
        ran = until(lambda: corrected(running_id), timeout=120, interval=0.5, what="running job corrected")
        never_ran = until(lambda: corrected(queued_id), timeout=120, interval=0.5, what="queued job corrected")
        assert ran["error"]["details"]["uncertain_outcome"] is True
        assert never_ran["error"]["details"]["uncertain_outcome"] is False
        assert_all_final(http, [running_id, queued_id])
        assert all(
            s in TERMINAL for s in (action_status(http, running_id)["state"], action_status(http, queued_id)["state"])
        )
