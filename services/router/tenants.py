"""Who is calling: the router's API keys, each a tenant, and what each may see (pure).

A router may take several API keys (``--api-key``, ``--api-keys`` / ``KVMESH_API_KEYS``,
``--api-keys-file``), each a tenant, and an admin key (``--admin-api-key``). A tenant is named
by a digest of its key, never the key: the same key is the same tenant on every router, so its
cached prompt blocks are shared across routers, and nothing on the mesh or in a log carries the
key. With ``--salt-by-api-key`` (on by default with several keys) a tenant's requests are salted
with its name (``SamplingOptions.cache_salt``): two tenants never share a cached block, so one
cannot time another's prompt (issue 40: 28 ms TTFT for a guessed 2.5k-token document against
500 ms for an unseen one).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.shared.text.sampling import MAX_CACHE_SALT


@dataclass(frozen=True, slots=True)
class Tenant:
    """One caller of the router. ``name``: a digest of its key ("" for an open router);
    ``is_admin``: sees every tenant's timings."""

    name: str
    is_admin: bool = False


OPEN = Tenant("", is_admin=True)  # a router without keys: one tenant, everything is its own


def tenant_name(key: str) -> str:
    """The tenant a key stands for: 32 hex digits of its keyed digest, the same on every router."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvmesh-tenant").hexdigest()


class Tenants:
    """The router's API keys; ``identify`` answers an ``Authorization`` header. No keys: the
    router is open and every caller is ``OPEN``."""

    def __init__(self, keys: Iterable[str], admin_key: str | None = None) -> None:
        given = [k for k in keys if k]
        if admin_key:
            given.append(admin_key)
        self._expected = [(f"Bearer {k}".encode(), Tenant(tenant_name(k))) for k in given]
        if admin_key:
            self._expected[-1] = (self._expected[-1][0], Tenant(tenant_name(admin_key), True))
        self.num_keys = len({k for k, _ in self._expected})

    @property
    def is_open(self) -> bool:
        return not self._expected

    def identify(self, authorization: str) -> Tenant | None:
        """The tenant whose key ``authorization`` ("Bearer <key>") carries; None for no key or a
        wrong one. Compares with every key in constant time (no early exit)."""
        if self.is_open:
            return OPEN
        given = authorization.encode()
        found = None
        for expected, tenant in self._expected:
            if hmac.compare_digest(given, expected) and found is None:
                found = tenant
        return found


def cache_salt(tenant_salt: str, cache_salt: str, prompt_cache_key: str) -> str:
    """A request's salt (``SamplingOptions.cache_salt``) from its tenant's (with
    ``--salt-by-api-key``; else "") and its body's ``cache_salt`` and ``prompt_cache_key``.
    A body's salt alone goes on as given (vLLM's meaning: equal salts share blocks); several
    parts are digested together, so no choice of one part can reach another's salt."""
    parts = [tenant_salt, cache_salt, prompt_cache_key]
    if sum(1 for p in parts if p) <= 1:
        return next((p for p in parts if p), "")
    h = hashlib.blake2b(digest_size=16, person=b"kvmesh-salt")
    for part in parts:
        h.update(len(part).to_bytes(4, "little") + part.encode())
    salt = h.hexdigest()
    assert len(salt) <= MAX_CACHE_SALT
    return salt
