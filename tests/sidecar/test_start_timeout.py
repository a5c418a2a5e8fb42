"""EXTEND_TIMEOUT_USEC while the sidecar starts, against a real datagram socket."""

from __future__ import annotations

import socket

import pytest

from aip_crewai.sidecar import starting as sidecar_main

pytestmark = pytest.mark.timeout(30)


def received(listener: socket.socket) -> list[bytes]:
    listener.setblocking(False)
    out = []
    while True:
        try:
            out.append(listener.recv(1024))
        except BlockingIOError:
            return out


def test_an_extension_is_sent_at_once_and_nothing_after_the_block(tmp_path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        with sidecar_main.extending_start_timeout(path):
            pass
        assert received(listener) == [b"EXTEND_TIMEOUT_USEC=30000000"]


def test_no_extension_past_the_cap(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(sidecar_main, "MAX_EXTENDED_START_SECONDS", 0.0)
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        with sidecar_main.extending_start_timeout(path):
            pass
        assert received(listener) == []
