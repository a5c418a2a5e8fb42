"""The one loopback rule of both processes (plain http to the sidecar, unauthenticated sidecars).

Loopback means ``localhost``, an IPv4 address in 127.0.0.0/8, or ``::1``.
IPv4-mapped IPv6 forms such as ``::ffff:127.0.0.1`` are not loopback here,
whatever the Python version says (3.13 calls them loopback, earlier versions
do not): the rule must not change with the interpreter.

Source: docs/ARCHITECTURE.md §4, §7; docs/reference/configuration.md "Configuration reference".
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ``::1`` (brackets allowed); False otherwise."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        return address == ipaddress.IPv6Address("::1")
    return address.is_loopback
