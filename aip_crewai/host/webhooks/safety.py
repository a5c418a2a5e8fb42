"""Where a delivery may go (docs/webhooks.md "Safety"; docs/security.md "Security"): the URL's name is resolved at each attempt and
every address checked; the attempt connects to the checked address (never re-resolving), so a name that
changes between check and connect cannot redirect it.

Refused unless inside ``[host] webhook_allow_cidrs``: private (RFC 1918, unique-local IPv6, site-local IPv6
fec0::/10, carrier-grade NAT 100.64.0.0/10), link-local (169.254.0.0/16, fe80::/10), multicast, reserved,
unspecified, and the cloud metadata addresses (169.254.169.254, fd00:ec2::254, 100.100.100.200). Loopback is
always allowed (the configuration already limits plain http to it). An IPv6 address that embeds an IPv4
address is judged as that IPv4 address: IPv4-mapped (::ffff:0:0/96) and 6to4 (2002::/16, RFC 3056), so
``2002:a9fe:a9fe::`` is the metadata address it embeds. Teredo (2001::/32, RFC 4380) is refused whatever it
embeds (Python counts 2001::/23 as private): a tunnel through relays no receiver needs. An allow entry that covers a metadata address
(``0.0.0.0/0``, ``::/0``) is accepted but warned about at start-up (:func:`metadata_opened`).

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
#: The cloud metadata addresses (AWS/GCP/Azure and others, AWS over IPv6, Alibaba), in this order.
METADATA = tuple(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
#: Private beyond Python's ``is_private``: carrier-grade NAT, and IPv6 site-local (deprecated by RFC 3879,
#: still routed privately where it is used).
_ALSO_PRIVATE = tuple(ipaddress.ip_network(n) for n in ("100.64.0.0/10", "fec0::/10"))


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (the system resolver, off the event loop), in its order, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def embedded_ipv4(address: Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 address an IPv6 ``address`` stands for, as Python's ``ipaddress`` decodes it: the
    IPv4-mapped address or the 6to4 address (bits 16..48 of 2002::/16); ``()`` for any other address
    (Teredo included: :func:`refusal` refuses it as private whatever it embeds). Pure.

    Source: RFC 4291 §2.5.5.2, RFC 3056 §2."""
    if isinstance(address, ipaddress.IPv4Address):
        return ()
    if address.ipv4_mapped is not None:
        return (address.ipv4_mapped,)
    if address.sixtofour is not None:
        return (address.sixtofour,)
    return ()


def refusal(address: Address, allow: Sequence[Network]) -> str | None:
    """Why a delivery may not connect to ``address`` (``metadata``, ``link_local``, ``multicast``,
    ``private``), or None when it may. An address that embeds IPv4 addresses (:func:`embedded_ipv4`) is
    judged as them: the first one refused gives the reason. Pure.

    Source: docs/webhooks.md "Safety"."""
    embedded = embedded_ipv4(address)
    if embedded:
        return next((reason for reason in (refusal(inner, allow) for inner in embedded) if reason), None)
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
    if address.is_private or address.is_reserved or address.is_unspecified:
        return "private"
    if any(address in net for net in _ALSO_PRIVATE):
        return "private"
    return None


def metadata_opened(allow: Sequence[Network]) -> list[tuple[int, Network, Address]]:
    """The ``[host] webhook_allow_cidrs`` entries that cover a cloud metadata address (:data:`METADATA`), so
    that the filter lets deliveries reach it: ``[(index, entry, the first such address)]``, in configuration
    order. Such an entry (``0.0.0.0/0``, ``::/0``, ``169.254.0.0/16``) is accepted, since an operator may mean
    it, and the host warns about it at start-up. Pure.

    Source: docs/webhooks.md "Safety"."""
    opened = []
    for index, net in enumerate(allow):
        covered = next((a for a in METADATA if a.version == net.version and a in net), None)
        if covered is not None:
            opened.append((index, net, covered))
    return opened


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
