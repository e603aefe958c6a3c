"""Worker registry: where worker ranks advertise themselves and the router finds them.

`make_registry(url, static_endpoints, key)` picks the implementation: a `redis://` URL gives a
`RedisRegistry` (signing and checking records with `key`, the internal token, when given), no URL
gives a `StaticRegistry` over `static_endpoints`.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

from services.registry.base import ROLES, Registry, WorkerRecord
from services.registry.heartbeat import Heartbeat
from services.registry.redis_registry import URL_SCHEMES, RedisRegistry
from services.registry.static import StaticRegistry

__all__ = [
    "ROLES",
    "Heartbeat",
    "RedisRegistry",
    "Registry",
    "StaticRegistry",
    "WorkerRecord",
    "make_registry",
]

_BY_SCHEME: dict[str, Callable[..., Registry]] = {scheme: RedisRegistry for scheme in URL_SCHEMES}
"""Factories called as `factory(url, key=key)`."""


def make_registry(url: str | None, static_endpoints: list[str] | None, key: str | None = None) -> Registry:
    """A registry for `url` (`redis://host:port/db`), or a static one over `static_endpoints` when
    `url` is None or empty. `key` (the internal token) signs and checks the records of a shared
    registry; None: unsigned records (insecure). ValueError for a URL whose scheme no registry
    understands."""
    if not url:
        return StaticRegistry(static_endpoints or [])
    factory = _BY_SCHEME.get(urlsplit(url).scheme)
    if factory is None:
        raise ValueError(
            f"registry url scheme must be one of {sorted(_BY_SCHEME)}, got {url.split(':', 1)[0]!r}"
        )
    return factory(url, key=key)
