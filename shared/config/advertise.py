"""Which address a worker tells its peers to dial (``--advertise-host``), apart from the one it
binds (``--tcp-host``).

On one host both are 127.0.0.1. Across hosts a worker must advertise an address the others can
reach; the host name is no good (it often resolves to 127.0.1.1, or not at all elsewhere). The
default is the address of the interface that routes to the NATS server: every peer reaches that
server, so the same network reaches this worker. It is found with a UDP ``connect()`` to the
server's address and ``getsockname()``; no packet is sent.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class AdvertiseHostError(ValueError):
    """An advertise host peers could not dial, or none could be found; the message says which
    flag to set."""


def check_advertise_host(host: str) -> None:
    """Refuse what is not an IP address or host name a peer could dial (``0.0.0.0`` and ``::``
    mean "every interface" to a listener, nothing to a peer)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        labels = host.rstrip(".").split(".")
        if not host or len(host) > 253 or not all(_LABEL.match(label) for label in labels):
            raise AdvertiseHostError(
                f"--advertise-host {host!r} is neither an IP address nor a host name; give the "
                "address peers on other hosts dial to reach this worker"
            ) from None
        return
    if address.is_unspecified or address.is_multicast:
        raise AdvertiseHostError(
            f"--advertise-host {host}: peers cannot dial an unspecified or multicast address; "
            "give this host's address on the network its peers share (or leave the flag out: "
            "the interface that routes to the NATS server)"
        )


def nats_hosts(nats_url: str) -> list[str]:
    """The host of every server in a comma-separated ``--nats-url`` list, in order."""
    hosts = []
    for url in nats_url.split(","):
        try:
            host = urlsplit(url.strip()).hostname
        except ValueError:
            host = None
        if host:
            hosts.append(host)
    return hosts


def route_address(host: str, port: int = 4222) -> str:
    """The local address of the interface that routes to ``host`` (no packet sent)."""
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return sock.getsockname()[0]
        except OSError:
            continue
    raise OSError(f"no route to {host}")


def default_advertise_host(nats_url: str) -> str:
    """The address of the interface that routes to the first reachable NATS server of
    ``nats_url`` (127.0.0.1 when that server is on this host's loopback)."""
    hosts = nats_hosts(nats_url)
    errors = []
    for host in hosts:
        try:
            return route_address(host)
        except OSError as exc:
            errors.append(f"{host}: {exc}")
    raise AdvertiseHostError(
        "cannot find the address peers should dial: no route to any NATS server in --nats-url "
        f"({'; '.join(errors) or 'no host in it'}); give --advertise-host"
    )


def resolve_transport_hosts(
    tcp_host: str | None, advertise_host: str | None, nats_url: str
) -> tuple[str, str]:
    """``(bind, advertise)``: the advertise host is given or routes to NATS; the bind address
    is given or the advertise host itself. A loopback bind advertised as a routable address
    could never be dialled from another host: refused."""
    advertise = advertise_host or default_advertise_host(nats_url)
    check_advertise_host(advertise)
    bind = tcp_host or advertise
    if _is_loopback(bind) and not _is_loopback(advertise):
        raise AdvertiseHostError(
            f"--tcp-host {bind} listens on loopback only, but peers are told to dial {advertise}; "
            f"bind {advertise} (or 0.0.0.0), or advertise a loopback address"
        )
    return bind, advertise


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def default_route_address() -> str:
    """The address of the interface holding the default route (127.0.0.1 without one): what
    a listener on every interface advertises when nobody said."""
    try:
        return route_address("192.0.2.1")  # TEST-NET-1: routed by the default route, never sent
    except OSError:
        return "127.0.0.1"
