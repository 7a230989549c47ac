"""--advertise-host: what a worker's transport descriptor tells peers to dial (shared/config/advertise.py)."""

from __future__ import annotations

import pytest
from kvmesh.shared.config.advertise import (
    AdvertiseHostError,
    check_advertise_host,
    default_advertise_host,
    nats_hosts,
    resolve_transport_hosts,
)
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.config.worker_config import EngineWorkerConfig
from kvmesh.shared.transport import TransportConfig, create_transport


def test_default_advertise_host_is_loopback_with_loopback_nats():
    assert default_advertise_host("nats://127.0.0.1:4222") == "127.0.0.1"
    assert resolve_transport_hosts(None, None, "nats://localhost:4222") == ("127.0.0.1",) * 2


def test_default_advertise_host_uses_first_routable_server_of_a_list():
    url = "nats://no-such-host.invalid:4222,nats://127.0.0.1:4223"
    assert nats_hosts(url) == ["no-such-host.invalid", "127.0.0.1"]
    assert default_advertise_host(url) == "127.0.0.1"


def test_default_advertise_host_fails_clearly_without_any_route():
    with pytest.raises(AdvertiseHostError, match="give --advertise-host"):
        default_advertise_host("nats://no-such-host.invalid:4222")


def test_given_advertise_host_is_honoured_and_bound_by_default():
    assert resolve_transport_hosts(None, "10.77.0.3", "nats://127.0.0.1:4222") == (
        "10.77.0.3",
        "10.77.0.3",
    )
    assert resolve_transport_hosts("0.0.0.0", "decode-1.example", "nats://127.0.0.1:4222") == (
        "0.0.0.0",
        "decode-1.example",
    )


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "", "bad host!", "-x.example", "224.0.0.1"])
def test_bad_advertise_host_is_refused(bad):
    with pytest.raises(AdvertiseHostError, match="advertise-host"):
        check_advertise_host(bad)


def test_bad_advertise_host_is_refused_by_the_worker_config():
    with pytest.raises(ValueError, match=r"--advertise-host '0.0.0.0'|unspecified"):
        EngineWorkerConfig(advertise_host="0.0.0.0")


def test_loopback_bind_with_routable_advertise_host_is_refused():
    config = EngineWorkerConfig(tcp_host="127.0.0.1", advertise_host="10.77.0.3")
    with pytest.raises(ServiceStartError, match="listens on loopback only"):
        config.transport_hosts()


async def test_tcp_descriptor_carries_the_advertise_host():
    config = EngineWorkerConfig(advertise_host="127.0.0.1", nats_url="nats://127.0.0.1:4222")
    bind, _ = config.transport_hosts()
    tconf = TransportConfig(tcp_host=bind, tcp_advertise_host="localhost")
    async with create_transport("tcp", tconf) as transport:
        assert transport.descriptor().backend("tcp").host == "localhost"
    async with create_transport("tcp", TransportConfig(tcp_host="0.0.0.0")) as transport:
        host = transport.descriptor().backend("tcp").host
        check_advertise_host(host)  # a dialable address, not the host name
        assert host[0].isdigit()
