"""How a kvmesh command reaches NATS: the server URL, the mesh it belongs to, credentials, TLS.

``NatsClientConfig`` is the base of every config whose command connects (the services, ``kvmesh
up``, ``kvmesh admin``), so each has the same flags and ``KVMESH_*`` variables:

- ``--nats-url``: ``nats://HOST:PORT`` or ``tls://HOST:PORT``, or a comma-separated list of a
  NATS cluster's members (nats-py's server list); ``nats://TOKEN@HOST:PORT`` and
  ``nats://USER:PASSWORD@HOST:PORT`` authenticate (nats-py reads them from the URL). kvmesh never
  prints a URL's credentials (``redact_url``);
- ``--mesh``: the mesh's name (shared/config/subjects.py), by default derived from the model;
- ``--nats-creds``: a ``.creds`` file (user JWT and nkey seed, as ``nsc`` writes it) or a file
  holding a bare nkey seed (``SU...``, for servers with ``nkey`` users);
- ``--nats-tls-ca`` / ``--nats-tls-cert`` / ``--nats-tls-key``: the CA that signed the server's
  certificate, and a client certificate with its key for servers that verify clients.

User and password may also come from the environment (shared/bus/nats_auth.py). docs/security.md
shows each against a nats-server config.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvmesh.shared.config.service_config import DEFAULT_NATS_URL, option
from kvmesh.shared.config.subjects import Subjects, check_mesh

NATS_SCHEMES = ("nats", "tls", "ws", "wss")
JWT_MARKER = "-----BEGIN NATS USER JWT-----"


class NatsOptionsError(ValueError):
    """A credentials or TLS file that cannot be used; the message names the flag and the file."""


def split_nats_urls(url: str) -> list[str]:
    """The servers of a ``--nats-url``: one URL, or several members of one NATS cluster separated
    by commas (``nats://a:4222,nats://b:4222``), handed to nats-py as its server list so that a
    client reconnects to another member when its server goes."""
    return [part.strip() for part in url.split(",") if part.strip()]


def redact_url(url: str) -> str:
    """``url`` without its secret: ``nats://alice:***@host:4222``, ``nats://***@host:4222``
    (each server of a comma-separated list)."""
    if "," in url:
        return ",".join(redact_url(part) for part in split_nats_urls(url))
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable NATS URL>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    shown = f"{user}:***" if has_password else "***"
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))


def strip_credentials(url: str) -> str:
    """``url`` without a token or user:password (what may be written to a file)."""
    if "," in url:
        return ",".join(strip_credentials(part) for part in split_nats_urls(url))
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def url_has_credentials(url: str) -> bool:
    if "," in url:
        return any(url_has_credentials(part) for part in split_nats_urls(url))
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:
        return False


def redact_secrets(text: str, url: str) -> str:
    """``text`` (an error message) with ``url``'s credentials blanked wherever it shows them."""
    for part in split_nats_urls(url):
        if url_has_credentials(part):
            text = text.replace(urlsplit(part).netloc.rpartition("@")[0], "***")
    return text


def _check_readable(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise NatsOptionsError(f"{flag} {path}: no such file")
    if not p.is_file():
        raise NatsOptionsError(f"{flag} {path}: not a file")
    if not os.access(p, os.R_OK):
        raise NatsOptionsError(f"{flag} {path}: cannot be read by this user")


@dataclass(frozen=True, slots=True)
class NatsSecurity:
    """Credentials files and TLS material of one client; ``connect_options()`` turns them into
    keyword arguments of ``nats.aio.client.Client.connect``."""

    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # send credentials to a server that neither runs here under this user (or root) nor proves
    # itself by TLS (shared/bus/nats_vetting.py): a private network the operator vouches for
    trust_network: bool = False

    def __post_init__(self) -> None:
        for path, flag in (
            (self.creds, "--nats-creds"),
            (self.tls_ca, "--nats-tls-ca"),
            (self.tls_cert, "--nats-tls-cert"),
            (self.tls_key, "--nats-tls-key"),
        ):
            if path is not None:
                _check_readable(path, flag)
        if self.tls_key is not None and self.tls_cert is None:
            raise NatsOptionsError("--nats-tls-key needs --nats-tls-cert (the key's certificate)")

    @property
    def uses_tls(self) -> bool:
        return any(p is not None for p in (self.tls_ca, self.tls_cert))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context trusting ``tls_ca`` (else the system's CAs), presenting
        ``tls_cert``/``tls_key`` when given; None without TLS options."""
        if not self.uses_tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            raise NatsOptionsError(
                f"--nats-tls-ca {self.tls_ca}: not a PEM CA certificate ({exc})"
            ) from None
        if self.tls_cert is not None:
            try:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            except (ssl.SSLError, OSError) as exc:
                raise NatsOptionsError(
                    f"--nats-tls-cert {self.tls_cert} / --nats-tls-key {self.tls_key}: not a PEM "
                    f"certificate and its private key ({exc})"
                ) from None
        return context

    def connect_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        if self.creds is not None:
            try:
                text = Path(self.creds).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise NatsOptionsError(
                    f"--nats-creds {self.creds}: cannot be read ({exc})"
                ) from None
            try:
                import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
            except ImportError:
                raise NatsOptionsError(
                    "--nats-creds needs the nkeys package: pip install 'nats-py[nkeys]'"
                ) from None
            if JWT_MARKER in text:
                options["user_credentials"] = self.creds
            elif text.strip().startswith("SU"):
                options["nkeys_seed"] = self.creds
            else:
                raise NatsOptionsError(
                    f"--nats-creds {self.creds}: neither a .creds file (with a NATS USER JWT "
                    "block) nor an nkey user seed (SU...)"
                )
        return options


@dataclass(frozen=True, slots=True)
class NatsClientConfig:
    """The NATS flags every connecting command shares. A subclass's ``__post_init__`` calls
    ``check_nats_options(default_mesh)``; the mesh is then set."""

    nats_url: str = option(
        DEFAULT_NATS_URL,
        help="NATS server: nats://HOST:PORT or tls://HOST:PORT, or several members of one "
        "cluster separated by commas (a client reconnects to another when its server goes); a token (nats://TOKEN@HOST:PORT) "
        "or user and password (nats://USER:PASSWORD@HOST:PORT) in it authenticate; prefer "
        "KVMESH_NATS_URL for those, since ps shows flags",
    )
    mesh: str | None = option(
        None,
        help="the mesh's name: its NATS subjects are kvmesh.<mesh>.*, so meshes sharing a NATS "
        "server never meet (default: from --model, e.g. the checkpoint directory's name; "
        "kvmesh-tiny for commands without --model)",
    )
    nats_creds: str | None = option(
        None, help="NATS credentials: a .creds file (user JWT + nkey seed) or an nkey seed file"
    )
    nats_tls_ca: str | None = option(
        None, help="CA certificate (PEM) that signed the NATS server's (default: the system's CAs)"
    )
    nats_tls_cert: str | None = option(
        None, help="client certificate (PEM) for a NATS server that verifies clients"
    )
    nats_tls_key: str | None = option(None, help="private key (PEM) of --nats-tls-cert")
    nats_trust_network: bool = option(
        False,
        help="send NATS credentials to a server that neither runs on this machine under this "
        "user (or root) nor proves itself by TLS: only on a private network you control (the "
        "compose stack's); without it such a server gets nothing",
    )

    def check_nats_options(self, default_mesh: str | None) -> None:
        """Validate the URL, mesh and files; a mesh left unset becomes ``default_mesh`` (None
        leaves it unset, for commands that look the mesh up)."""
        servers = split_nats_urls(self.nats_url)
        for url in servers or [""]:
            scheme = url.split("://", 1)[0] if "://" in url else ""
            if scheme not in NATS_SCHEMES:
                raise ValueError(
                    f"nats_url must look like nats://HOST:PORT (or tls://, ws://, wss://; "
                    f"several members of a cluster separated by commas), got "
                    f"{redact_url(self.nats_url)!r}"
                )
        if self.mesh is None and default_mesh is not None:
            object.__setattr__(self, "mesh", default_mesh)
        if self.mesh is not None:
            check_mesh(self.mesh)
        _ = self.nats_security  # the files exist and are readable

    @property
    def nats_security(self) -> NatsSecurity:
        return NatsSecurity(
            self.nats_creds,
            self.nats_tls_ca,
            self.nats_tls_cert,
            self.nats_tls_key,
            trust_network=self.nats_trust_network,
        )

    @property
    def subjects(self) -> Subjects:
        assert self.mesh is not None, "mesh not resolved"
        return Subjects(self.mesh)

    @property
    def safe_nats_url(self) -> str:
        return redact_url(self.nats_url)
