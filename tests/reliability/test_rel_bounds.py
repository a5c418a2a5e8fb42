"""Bounds found by the second independent security review, replayed against the real host and sidecar on
loopback: the budget of bodies read before authentication, the 16 KiB request head, the signed request's
``@authority``. The README's "Security" section lists each bound tested here.

Raw sockets where the bytes on the wire matter; polling with deadlines, never sleeping for a result.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack
from urllib.parse import urlsplit

import httpx
import pytest
from chaoslib import uid
from relkit import OPERATOR_TOKEN, post_action, until

pytestmark = [pytest.mark.integration, pytest.mark.host_processes]

MIB = 1024 * 1024


def _connect(base_url: str, timeout: float = 30.0) -> socket.socket:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None  # the suite's base URLs name their port
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def _answer(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sends until it closes the connection (or 15 s pass): (bytes, closed)."""
    received = b""
    sock.settimeout(15)
    while True:
        try:
            piece = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return received, False
        if not piece:
            return received, True
        received += piece


def _gauge(base_url: str, name: str) -> int | None:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return int(float(line.split()[1]))
    return None


def _slow_message(base_url: str, declared: int, sent: int) -> socket.socket:
    """An unauthenticated ``POST /aip/v1/messages`` announcing ``declared`` bytes and sending ``sent`` of them."""
    sock = _connect(base_url)
    head = (
        "POST /aip/v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/aip+json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    sock.sendall(head + b" " * sent)
    return sock


# --- 1. bodies read before authentication: one budget per process ---------------------------------


@pytest.mark.timeout(180)
def test_rel_slow_unauthenticated_bodies_are_bounded_in_total_while_bearer_traffic_goes_on(procs):
    """Regression (second review, item 1): 100 anonymous connections each holding most of a 2 MB body took the host
    from 63 to 410 MB. The bodies read before authentication share one budget (here its floor, 2 MiB): 100
    slow bodies of 20,000 bytes hold 2,000,000 bytes of it (the host's gauge says so), one more body that does
    not fit is 503 `server.body_budget_exhausted` with Retry-After and closed, a bearer request still goes
    through, and closing the slow connections gives everything back."""
    sidecar = procs.sidecar()
    host = procs.host(sidecar.base_url, host_options={"unauthenticated_body_budget_bytes": 2 * MIB})
    gauge = "aip_host_unauthenticated_body_bytes"
    assert _gauge(host.base_url, gauge) == 0
    with ExitStack() as stack:
        slow = [stack.enter_context(_slow_message(host.base_url, 20_000, 10_000)) for _ in range(100)]
        until(lambda: _gauge(host.base_url, gauge) == 2_000_000, timeout=60, what="100 slow bodies in the budget")
        with _slow_message(host.base_url, 2 * MIB - 2_000_000 + 1, 10) as refused:
            received, closed = _answer(refused)
        head = received.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 503") and b"retry-after: 1" in head, received[:400]
        assert b"connection: close" in head and closed
        assert b'"code":"server.body_budget_exhausted"' in received and b'"budget_bytes":2097152' in received
        with _slow_message(host.base_url, 2 * MIB - 2_000_000, 10):  # exactly the rest still fits
            until(lambda: _gauge(host.base_url, gauge) == 2 * MIB, timeout=30, what="the last byte of the budget")
        until(lambda: _gauge(host.base_url, gauge) == 2_000_000, timeout=30, what="a closed body given back")
        with host.client("acme-app") as app:
            answer = post_action(app, "cap:crewai:echo:status", {"run_action_id": uid("b1")}, uid("b1s"))
            assert answer.status_code in (200, 202, 404), answer.text
        assert len(slow) == 100
    until(lambda: _gauge(host.base_url, gauge) == 0, timeout=60, what="every slow body given back")
    with _slow_message(host.base_url, 100_000, 100_000) as again:
        received, _ = _answer(again)
    assert received.startswith(b"HTTP/1.1 401"), received[:300]  # read whole, then refused as unauthenticated
