"""NATS authentication on every command that connects, against real nats-servers: user and
password or a token in the URL, a .creds file (user JWT + nkey seed) and a bare nkey seed
(--nats-creds), TLS with a CA made here (--nats-tls-ca, and client certificates); a bad file is
one clear line, and no credential of a URL ever reaches a log or a message."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nkeys
import pytest
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.admin_client import admin_client
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, connect_nats
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.config.nats_options import (
    NatsOptionsError,
    NatsSecurity,
    redact_url,
    strip_credentials,
)
from kvmesh.shared.config.service_config import ConfigError, config_from_args
from support.nats_keys import NKey, OperatorChain

REPO = Path(__file__).resolve().parents[2]


async def _roundtrip(url: str, security: NatsSecurity | None = None) -> bytes:
    """Connect, and receive what this client publishes (the connection really works)."""
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg) -> None:
        await got.put(msg.data)

    async with connect_nats(url, "t", connect_wait_s=3.0, security=security) as nc:
        await nc.subscribe("probe", cb=on_msg)
        await nc.publish("probe", b"hello")
        return await asyncio.wait_for(got.get(), 3.0)


# --- credentials in the URL --------------------------------------------------------------------


def test_urls_are_shown_and_stored_without_their_credentials() -> None:
    assert redact_url("nats://alice:s3cret@h:4222") == "nats://alice:***@h:4222"
    assert redact_url("tls://t0ken@h:4222") == "tls://***@h:4222"
    assert redact_url("nats://h:4222") == "nats://h:4222"
    assert strip_credentials("nats://alice:s3cret@h:4222") == "nats://h:4222"


async def test_user_and_password_in_the_url_connect_and_a_wrong_one_is_refused_unshown() -> None:
    users = 'authorization { user: alice, password: "s3cret-pw" }'
    with NatsServer(authorization=users, jetstream=False) as server:
        url = f"nats://alice:s3cret-pw@127.0.0.1:{server.port}"
        assert await _roundtrip(url) == b"hello"
        wrong = f"nats://alice:wrong-pw@127.0.0.1:{server.port}"
        with pytest.raises(NatsUnavailableError) as refused:
            await _roundtrip(wrong)
    message = str(refused.value)
    assert "refused the credentials in the URL" in message and "alice:***@" in message
    assert "wrong-pw" not in message


async def test_token_in_the_url_connects(tmp_path: Path) -> None:
    with NatsServer(authorization='authorization { token: "t0k3n" }', jetstream=False) as server:
        assert await _roundtrip(f"nats://t0k3n@127.0.0.1:{server.port}") == b"hello"
        with pytest.raises(NatsUnavailableError, match="refused no credentials"):
            await _roundtrip(server.url)


async def test_a_service_logs_its_url_without_the_password(tmp_path: Path) -> None:
    """kvmesh serve logs its config at start: the URL's password is not in it."""
    users = 'authorization { user: reg, password: "hush-hush" }'
    with NatsServer(authorization=users, jetstream=False) as server:
        url = f"nats://reg:hush-hush@127.0.0.1:{server.port}"
        log = tmp_path / "registry.log"
        env = {**os.environ, "KVMESH_NATS_URL": url, "KVMESH_LOG_LEVEL": "info"}
        argv = [sys.executable, "-m", "kvmesh.cli", "serve", "kv-registry", "--mesh", "m1"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + 60
            while "kv-registry ready" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(30)
    text = log.read_text()
    assert "reg:***@127.0.0.1" in text and "hush-hush" not in text


# --- credentials files ---------------------------------------------------------------------------


async def test_creds_file_with_a_user_jwt_connects_and_another_operators_is_refused(
    tmp_path: Path,
) -> None:
    chain, stranger = OperatorChain.generate(), OperatorChain.generate()
    creds, foreign = tmp_path / "user.creds", tmp_path / "foreign.creds"
    creds.write_text(chain.creds)
    foreign.write_text(stranger.creds)
    with NatsServer(authorization=chain.server_config, jetstream=False) as server:
        assert await _roundtrip(server.url, NatsSecurity(creds=str(creds))) == b"hello"
        with pytest.raises(NatsUnavailableError, match=f"refused --nats-creds {foreign}"):
            await _roundtrip(server.url, NatsSecurity(creds=str(foreign)))


async def test_nkey_seed_file_connects(tmp_path: Path) -> None:
    user = NKey.generate(nkeys.PREFIX_BYTE_USER)
    seed = tmp_path / "user.nk"
    seed.write_bytes(user.seed + b"\n")
    users = f"authorization {{ users = [ {{ nkey: {user.public} }} ] }}"
    with NatsServer(authorization=users, jetstream=False) as server:
        assert await _roundtrip(server.url, NatsSecurity(creds=str(seed))) == b"hello"


def test_missing_or_unreadable_files_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NatsOptionsError, match=r"^--nats-creds /no/such\.creds: no such file$"):
        NatsSecurity(creds="/no/such.creds")
    with pytest.raises(ConfigError, match=r"--nats-tls-ca .*: no such file"):
        config_from_args(RegistryConfig, None, {"KVMESH_NATS_TLS_CA": str(tmp_path / "ca.pem")})
    junk = tmp_path / "junk.creds"
    junk.write_text("neither a JWT nor a seed\n")
    with pytest.raises(NatsOptionsError, match=r"neither a \.creds file"):
        NatsSecurity(creds=str(junk)).connect_options()
    key = tmp_path / "client.key"
    key.write_text("x")
    with pytest.raises(NatsOptionsError, match="--nats-tls-key needs --nats-tls-cert"):
        NatsSecurity(tls_key=str(key))
    if os.geteuid() != 0:  # root reads anything
        secret = tmp_path / "secret.creds"
        secret.write_text("x")
        secret.chmod(0)
        with pytest.raises(NatsOptionsError, match="cannot be read by this user"):
            NatsSecurity(creds=str(secret))


@pytest.mark.parametrize(
    "argv",
    [
        ("serve", "kv-registry", "--nats-creds", "/no/such.creds"),
        ("admin", "status", "--nats-tls-ca", "/no/such/ca.pem"),
        ("up", "--nats-tls-cert", "/no/such/cert.pem"),
    ],
)
def test_commands_refuse_a_missing_file_in_one_line(argv: tuple[str, ...]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no such file" in lines[0] and argv[-1] in lines[0], out.stderr


# --- TLS -----------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all PEM."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=kvmesh test CA", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", f"/CN=kvmesh {name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext",
                 cwd=d)  # fmt: skip
    return d


def _tls_block(pki: Path, verify: bool) -> str:
    return (
        f'tls {{ cert_file: "{pki / "server.pem"}", key_file: "{pki / "server.key"}", '
        f'ca_file: "{pki / "ca.pem"}", verify: {"true" if verify else "false"} }}'
    )


async def test_tls_with_the_servers_ca_connects_and_without_it_is_a_clear_error(pki: Path):
    with NatsServer(tls=_tls_block(pki, verify=False), jetstream=False) as server:
        url = f"tls://127.0.0.1:{server.port}"
        trusted = NatsSecurity(tls_ca=str(pki / "ca.pem"))
        assert await _roundtrip(url, trusted) == b"hello"
        with pytest.raises(NatsUnavailableError, match=r"TLS with the NATS server .* failed"):
            await _roundtrip(url)  # the system's CAs do not know this one


async def test_tls_client_certificate_for_a_server_that_verifies_clients(pki: Path) -> None:
    with NatsServer(tls=_tls_block(pki, verify=True), jetstream=False) as server:
        url = f"tls://127.0.0.1:{server.port}"
        mutual = NatsSecurity(
            tls_ca=str(pki / "ca.pem"),
            tls_cert=str(pki / "client.pem"),
            tls_key=str(pki / "client.key"),
        )
        assert await _roundtrip(url, mutual) == b"hello"
        with pytest.raises(NatsUnavailableError):
            await _roundtrip(url, NatsSecurity(tls_ca=str(pki / "ca.pem")))  # no certificate


async def test_registry_and_admin_work_over_tls_with_a_password(pki: Path) -> None:
    """The options reach every layer: a kv-registry and an admin client over TLS, with the
    user and password in the URL, on mesh m1."""
    users = 'authorization { user: ops, password: "pw-ops" }'
    with NatsServer(authorization=users, tls=_tls_block(pki, verify=False)) as server:
        url = f"tls://ops:pw-ops@127.0.0.1:{server.port}"
        config = RegistryConfig(
            nats_url=url, mesh="m1", nats_tls_ca=str(pki / "ca.pem"), worker_id="reg-tls"
        )
        async with (
            registry_service(config),
            admin_client(url, mesh="m1", security=config.nats_security) as admin,
        ):
            status = await admin.status()
    assert status.registry.worker_id == "reg-tls" and status.registry.mesh == "m1"
