"""What a worker serves as: its role, its model's name, its place in a DP/EP group, and how its KV
moves (leases, pin limits, transports, checksums)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.export import DEFAULT_MAX_TOTAL_LEASE_S
from pdserve.v1 import worker_pb2 as wpb
from services.kv_transfer.nixl_pull import KV_TRANSPORTS
from services.kv_transfer.wire import MAX_CHUNK_BYTES

ROLES = {
    "prefill": wpb.WORKER_ROLE_PREFILL,
    "decode": wpb.WORKER_ROLE_DECODE,
    "colocated": wpb.WORKER_ROLE_COLOCATED,
}


@dataclass(frozen=True)
class WorkerSettings:
    role: str
    """"prefill", "decode" or "colocated" (answers both Prefill and Decode)."""
    model_name: str
    dp_rank: int = 0
    dp_size: int = 1
    """Ranks in this worker's data-parallel group."""
    ep_size: int = 1
    """Expert-parallel ranks (the group, when experts are spread; else 1)."""
    lease_s: float = 30.0
    """How long a prefill worker keeps exported KV pinned waiting for the decode side."""
    kv_chunk_bytes: int = MAX_CHUNK_BYTES
    """Largest KV chunk this worker asks a producer for."""
    max_total_lease_s: float = DEFAULT_MAX_TOTAL_LEASE_S
    """No transfer stays pinned longer than this after its Prefill, however often it is renewed."""
    max_pinned_fraction: float = 0.75
    """Most of this worker's KV blocks one caller (host) may hold pinned in transfers; a Prefill
    past it is RESOURCE_EXHAUSTED before it runs."""
    kv_producers: tuple[str, ...] | None = None
    """host:port of the prefill workers a decode worker may pull KV from; None: any producer
    (whose handle is signed, when the worker has an internal token)."""
    kv_transport: str = "auto"
    """How KV moves: "nixl" (this worker's caches registered with a NIXL agent; producers must
    offer theirs), "grpc" (the KvTransfer chunk stream only), "auto" (NIXL when installed here and
    offered by the producer, gRPC otherwise)."""
    kv_checksums: bool = True
    """Take (producer) and verify (consumer) an end-to-end checksum of every block moved over
    NIXL; off only on trusted fabrics."""

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got {self.max_pinned_fraction}")
        if self.max_total_lease_s <= 0:
            raise ValueError(f"max_total_lease_s must be > 0, got {self.max_total_lease_s}")
