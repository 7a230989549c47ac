"""NATS credentials for tests, made without ``nsc``: nkey seeds, and a decentralized-auth chain
(operator -> account -> user JWTs, signed with ed25519 nkeys) written as a ``.creds`` file.

nats-server's operator mode trusts the operator JWT, finds the account JWT in a memory resolver,
and accepts a user whose JWT the account signed and who signs the server's nonce with the user
seed: what a ``.creds`` file from ``nsc`` carries.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from dataclasses import dataclass

import nkeys


@dataclass(frozen=True)
class NKey:
    seed: bytes  # "S..." (SU for a user)
    public: str  # "U...", "A...", "O..."

    @classmethod
    def generate(cls, prefix: int) -> NKey:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed, nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def jwt(issuer: NKey, subject: str, name: str, nats: dict) -> str:
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {
        "jti": base64.b32encode(secrets.token_bytes(20)).decode().rstrip("="),
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    body = _b64(json.dumps(claims).encode())
    return f"{header}.{body}.{_b64(issuer.sign(f'{header}.{body}'.encode()))}"


@dataclass(frozen=True)
class OperatorChain:
    """A server config (operator mode) and one user's ``.creds`` text."""

    server_config: str
    creds: str

    @classmethod
    def generate(cls) -> OperatorChain:
        operator = NKey.generate(nkeys.PREFIX_BYTE_OPERATOR)
        account = NKey.generate(nkeys.PREFIX_BYTE_ACCOUNT)
        user = NKey.generate(nkeys.PREFIX_BYTE_USER)
        operator_jwt = jwt(operator, operator.public, "test-operator", {"type": "operator"})
        unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1}
        account_jwt = jwt(
            operator,
            account.public,
            "test-account",
            {"type": "account", "limits": {**unlimited, "wildcards": True, "conn": -1}},
        )
        user_jwt = jwt(
            account,
            user.public,
            "test-user",
            {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1},
        )
        config = (
            f"operator: {operator_jwt}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{ {account.public}: {account_jwt} }}\n"
        )
        creds = (
            "-----BEGIN NATS USER JWT-----\n"
            f"{user_jwt}\n"
            "------END NATS USER JWT------\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        return cls(config, creds)
