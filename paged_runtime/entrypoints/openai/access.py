"""Who may call the server, from which ``Host``, and what one caller may learn of another's requests.

API keys (``ApiKeys``)
    No key: every route is open and all callers are one tenant. With keys,
    the guarded routes need ``Authorization: Bearer <key>`` with one of them
    (compared in constant time). With two or more keys each key is a tenant:
    its requests' prefix-cache salt starts with a salt of its own, so no
    tenant's request can hit (and time, or count in ``cached_tokens``) the
    blocks another tenant's prompt left in the cache
    (``share_prefix_cache_across_keys`` turns sharing back on). A request's
    own ``cache_salt`` still separates within a tenant. Stored responses
    (``/v1/responses``) belong to the key that created them, shared caches or not.

Hosts (``HostGuard``)
    DNS rebinding lets a web page reach a server on 127.0.0.1 under a name
    the attacker controls; the browser then sends that name as ``Host``. A
    server bound to a loopback address without an API key therefore answers
    only requests whose ``Host`` is a loopback name or address (and the names
    in ``--allowed-hosts``; ``*`` accepts any), with a 403 otherwise, as
    Ollama does. Given ``--allowed-hosts``, the check holds wherever the
    server is bound.

Torch-free: the adapters' front processes import it.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_runtime.entrypoints.openai.errors import OpenAIError, unauthorized

LOOPBACK_NAMES = ("localhost",)  # and any name ending in .localhost (RFC 6761 keeps those on the machine)


@dataclass(frozen=True)
class Tenant:
    """One caller's share of the prefix cache: ``salt`` None shares it with every caller. ``owner``: who the
    caller is (its key's id; None without keys), whatever the cache sharing: what it stores (responses) is its own."""
    salt: str | None = None
    owner: str | None = None

    def cache_salt(self, requested: str | None) -> str | None:
        """The salt a request runs with: the tenant's, then the request's own (a tenant cannot pick another's:
        every salt of a tenant starts with its own prefix)."""
        if self.salt is None:
            return requested
        return f"tenant:{self.salt}\0{requested or ''}"


SHARED = Tenant()


class ApiKeys:
    """The accepted API keys, and the tenant each one is (see the module docstring)."""

    def __init__(self, keys: str | Sequence[str] | None = None, share_prefix_cache: bool = False) -> None:
        keys = [keys] if isinstance(keys, str) else list(keys or ())
        if any(not k or k != k.strip() for k in keys):
            raise ValueError("an API key must be non-empty text without surrounding spaces")
        self._keys = [k.encode() for k in keys]
        self._separate = len(keys) > 1 and not share_prefix_cache

    @classmethod
    def of(cls, server: object) -> ApiKeys:
        """The keys of a ``ServerConfig``: ``api_key`` plus those in ``api_keys_file``."""
        keys = getattr(server, "api_key", None)
        keys = [keys] if isinstance(keys, str) else list(keys or ())
        path = getattr(server, "api_keys_file", None)
        if path:
            keys += read_keys_file(path)
        return cls(keys, getattr(server, "share_prefix_cache_across_keys", False))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ApiKeys) and (self._keys, self._separate) == (other._keys, other._separate)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} keys, {'separate' if self._separate else 'shared'} prefix caches)"

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant, from its ``Authorization`` header; a 401 OpenAIError without a valid key."""
        if not self._keys:
            return SHARED
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        given = token.strip().encode()
        matched = None
        for key in self._keys:  # every key compared, so the time does not tell which one was close
            if hmac.compare_digest(given, key):
                matched = key
        if matched is None:
            raise unauthorized("Incorrect API key provided.")
        owner = hashlib.sha256(b"paged-runtime tenant\0" + matched).hexdigest()[:32]
        return Tenant(owner if self._separate else None, owner)


def read_keys_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    lines = Path(path).expanduser().read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


# ---- Host -----------------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address, no port) stays on this machine."""
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def trusted_hosts(bind_host: str | None, keys: ApiKeys, allowed_hosts: Sequence[str] | None) -> list[str] | None:
    """The Host names a server accepts beyond the loopback ones, or None where it accepts any Host: bound
    beyond loopback or behind a key, unless ``allowed_hosts`` was given ('*' in it: any)."""
    if allowed_hosts:
        return None if "*" in allowed_hosts else [h.lower() for h in allowed_hosts]
    if keys.enabled or bind_host is None or not is_loopback(bind_host):
        return None
    return []


def host_name(header: str) -> str:
    """The name in a Host header, without its port ('[::1]:8000' -> '::1')."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostGuard:
    """ASGI: a request whose Host is neither loopback nor in ``allowed`` gets a 403 before the app sees it.
    A request without a Host header (HTTP/1.0) passes: a browser always sends one."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = frozenset(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = Headers(scope=scope).get("host")
            if header is not None and not self.accepts(host_name(header)):
                error = OpenAIError(403, f"Host {header!r} is not allowed: this server answers loopback names "
                                         "only (start it with --allowed-hosts to add names, or with --api-key)",
                                    type="invalid_request_error", code="host_not_allowed")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def accepts(self, host: str) -> bool:
        return is_loopback(host) or host.lower().rstrip(".") in self.allowed
