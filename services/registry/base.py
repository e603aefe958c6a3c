"""The worker registry: what a worker rank advertises and the interface the router reads it through.

A `WorkerRecord` is one worker rank's advertisement. It travels through Redis as a flat hash of
strings (`to_hash` / `from_hash`); nothing read back is ever evaluated or unpickled, only parsed as
integers and JSON.

Given a key (the internal token), a record carries a "mac" field: HMAC-SHA256 over its canonical
fields exactly as written, so whoever can write the registry's Redis but does not hold the token
cannot advertise a worker (which would receive users' prompts and the token itself).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "colocated")
"""Roles a worker may advertise. The empty string means "unknown: ask the worker" (static registry)."""

# A load map is a handful of gauges; anything much larger is not a load map.
_MAX_LOAD_JSON_BYTES = 64 * 1024
_FIELDS = ("endpoint", "role", "model", "dp_rank", "epoch", "load", "updated_unix_ms")
MAC_FIELD = "mac"
"""Hash field holding the record's HMAC-SHA256 (64 lowercase hex digits) when the registry is keyed."""
_MAC_DOMAIN = b"pdserve.worker-record.v1\n"
_MAC_HEX_LEN = 64


def record_mac(fields: Mapping[str, str], key: str) -> str:
    """HMAC-SHA256 (hex) of a record's canonical fields, keyed by `key`.

    The message is a JSON array of the `_FIELDS` values in order, as the strings stored in Redis
    (not re-serialized after parsing, so `load` is covered byte for byte); a JSON array of strings
    has one encoding per field list, so no two records share a message.
    """
    message = _MAC_DOMAIN + json.dumps([fields[name] for name in _FIELDS], separators=(",", ":")).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def _check_mac(text: Mapping[str, str], mac: str | None, key: str) -> None:
    if mac is None:
        raise ValueError(f"worker record: missing field {MAC_FIELD!r} (the registry requires signed records)")
    if len(mac) != _MAC_HEX_LEN or not all(c in "0123456789abcdef" for c in mac):
        raise ValueError(f"worker record: field {MAC_FIELD!r} must be {_MAC_HEX_LEN} lowercase hex digits")
    if not hmac.compare_digest(mac, record_mac(text, key)):
        raise ValueError(
            f"worker record: field {MAC_FIELD!r} does not match (not signed with this registry's key)"
        )


def _check_endpoint(endpoint: object) -> None:
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError(f"worker record: field 'endpoint' must be a non-empty 'host:port', got {endpoint!r}")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or any(c.isspace() for c in endpoint) or not port.isdigit():
        raise ValueError(f"worker record: field 'endpoint' must be 'host:port', got {endpoint!r}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"worker record: field 'endpoint' port must be in 1..65535, got {endpoint!r}")


def _check_load(load: object) -> None:
    if not isinstance(load, dict):
        raise ValueError(f"worker record: field 'load' must be a flat object of numbers, got {load!r}")
    for key, value in load.items():
        if not isinstance(key, str):
            raise ValueError(f"worker record: field 'load' keys must be strings, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"worker record: field 'load' entry {key!r} must be a finite number, got {value!r}"
            )


@dataclass(frozen=True)
class WorkerRecord:
    """One worker rank as advertised in the registry. Validated on construction (ValueError names the field)."""

    endpoint: str
    """`host:port` of the worker's internal gRPC server; the registry key."""
    role: str
    """One of `ROLES`, or "" when unknown (the router then asks the worker)."""
    model: str
    """Served model name; "" when unknown."""
    dp_rank: int
    """Data-parallel rank this endpoint serves (>= 0)."""
    epoch: int
    """Bumped on every worker restart; KV handles from an older epoch are invalid (>= 0)."""
    load: dict[str, float] = field(default_factory=dict)
    """Flat gauges, e.g. num_running, num_waiting, kv_usage. Finite numbers only."""
    updated_unix_ms: int = 0
    """When the worker produced this record (wall clock, ms); 0 when unknown."""

    def __post_init__(self) -> None:
        _check_endpoint(self.endpoint)
        if self.role != "" and self.role not in ROLES:
            raise ValueError(f"worker record: field 'role' must be one of {ROLES} or '', got {self.role!r}")
        if not isinstance(self.model, str):
            raise ValueError(f"worker record: field 'model' must be a string, got {self.model!r}")
        for name in ("dp_rank", "epoch", "updated_unix_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"worker record: field {name!r} must be an integer >= 0, got {value!r}")
        _check_load(self.load)
        # Own a copy so the caller's dict cannot change a frozen record behind its back.
        object.__setattr__(self, "load", dict(self.load))

    def to_hash(self, key: str | None = None) -> dict[str, str]:
        """The record as a Redis hash: every value a string, `load` as compact JSON; with `key`,
        plus the `MAC_FIELD` signature over the other fields."""
        fields = {
            "endpoint": self.endpoint,
            "role": self.role,
            "model": self.model,
            "dp_rank": str(self.dp_rank),
            "epoch": str(self.epoch),
            "load": json.dumps(self.load, separators=(",", ":"), sort_keys=True, allow_nan=False),
            "updated_unix_ms": str(self.updated_unix_ms),
        }
        if key is not None:
            fields[MAC_FIELD] = record_mac(fields, key)
        return fields

    @classmethod
    def from_hash(cls, raw: Mapping[bytes | str, bytes | str], key: str | None = None) -> WorkerRecord:
        """Parse a hash read from Redis. Unknown fields are ignored (newer writers may add some).

        With `key`, the `MAC_FIELD` must be present and match the fields as read; without, it is
        not checked (unsigned mode). Raises ValueError naming the first missing or malformed field.
        """
        text: dict[str, str] = {}
        for name_raw, value in raw.items():
            name = name_raw.decode("utf-8", "replace") if isinstance(name_raw, bytes) else name_raw
            if name not in _FIELDS and name != MAC_FIELD:
                continue
            try:
                text[name] = value.decode("utf-8") if isinstance(value, bytes) else value
            except UnicodeDecodeError as exc:
                raise ValueError(f"worker record: field {name!r} is not valid UTF-8") from exc
        for name in _FIELDS:
            if name not in text:
                raise ValueError(f"worker record: missing field {name!r}")
        if key is not None:
            _check_mac(text, text.get(MAC_FIELD), key)
        ints = {name: _parse_int(name, text[name]) for name in ("dp_rank", "epoch", "updated_unix_ms")}
        return cls(
            endpoint=text["endpoint"],
            role=text["role"],
            model=text["model"],
            load=_parse_load(text["load"]),
            **ints,
        )


def _parse_int(name: str, text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"worker record: field {name!r} must be a non-negative integer, got {text!r}")
    return int(text)


def _reject_constant(name: str) -> float:
    raise ValueError(f"worker record: field 'load' contains non-finite number {name}")


def _parse_load(text: str) -> dict[str, float]:
    if len(text) > _MAX_LOAD_JSON_BYTES:
        raise ValueError(f"worker record: field 'load' is {len(text)} bytes, limit {_MAX_LOAD_JSON_BYTES}")
    try:
        load = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"worker record: field 'load' is not valid JSON: {exc}") from exc
    _check_load(load)
    return {key: float(value) for key, value in load.items()}


class Registry(ABC):
    """Where worker ranks advertise themselves and the router finds them.

    Contract:
    - All methods are coroutines called from one asyncio event loop; implementations need no locks.
    - `register(record, ttl_s)` creates or replaces the entry keyed by `record.endpoint`; the entry
      vanishes after `ttl_s` seconds unless registered again (a `Heartbeat` does that). Raises
      `ConnectionError` when the backing store is unreachable; the caller retries.
    - `deregister(endpoint)` removes the entry; removing an absent entry is not an error.
    - `list_workers()` returns the live entries sorted by endpoint. It never raises because the
      backing store blipped: it then returns the last list it read (the router keeps serving from
      last-known state) and returns promptly (bounded by short socket timeouts).
    - `close()` releases connections; the registry is not used afterwards.
    """

    @abstractmethod
    async def register(self, record: WorkerRecord, ttl_s: float) -> None: ...

    @abstractmethod
    async def deregister(self, endpoint: str) -> None: ...

    @abstractmethod
    async def list_workers(self) -> list[WorkerRecord]: ...

    @abstractmethod
    async def close(self) -> None: ...
