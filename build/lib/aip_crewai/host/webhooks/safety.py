"""Where a delivery may go (docs/webhooks.md "Safety"; docs/security.md "Security"): the URL's name is resolved at each attempt and
every address checked; the attempt connects to the checked address (never re-resolving), so a name that
changes between check and connect cannot redirect it.

Refused unless inside ``[host] webhook_allow_cidrs``: private (RFC 1918, unique-local IPv6, carrier-grade
NAT 100.64.0.0/10), link-local (169.254.0.0/16, fe80::/10), multicast, reserved, unspecified, and the cloud
metadata addresses (169.254.169.254, fd00:ec2::254, 100.100.100.200). Loopback is always allowed (the
configuration already limits plain http to it). IPv4-mapped IPv6 addresses are judged as the IPv4 address.

Source: docs/webhooks.md (safe by default).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

from .config import Network

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``(host, port) -> addresses``: the system resolver by default; tests inject their own.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
METADATA = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
_SHARED = ipaddress.ip_network("100.64.0.0/10")


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (the system resolver, off the event loop), in its order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def refusal(address: Address, allow: Sequence[Network]) -> str | None:
    """Why a delivery may not connect to ``address`` (``metadata``, ``link_local``, ``multicast``,
    ``private``), or None when it may. Pure."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return None
    if any(address.version == net.version and address in net for net in allow):
        return None
    if address in METADATA:
        return "metadata"
    if address.is_link_local:
        return "link_local"
    if address.is_multicast:
        return "multicast"
    if address.is_private or address.is_reserved or address.is_unspecified or address in _SHARED:
        return "private"
    return None


async def checked_address(host: str, port: int, resolver: Resolver, allow: Sequence[Network]) -> tuple[str | None, str]:
    """Resolve ``host`` and return ``(address, "")`` for the first address allowed, or ``(None, reason)``
    when none is (the reason of the first refused, or ``unresolved``). A literal IP is not resolved."""
    try:
        addresses: Sequence[str] = [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        try:
            addresses = await resolver(host, port)
        except OSError:
            return None, "unresolved"
    reason = "unresolved"
    for text in addresses:
        try:
            address = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        problem = refusal(address, allow)
        if problem is None:
            return str(address), ""
        if reason == "unresolved":
            reason = problem
    return None, reason
