"""Who a worker is (identity, epoch) and what KV it can exchange (geometry, compatibility hash)."""

from __future__ import annotations

import time
import uuid

from engine.engine_core import EngineCore
from engine.kv_cache.offload import compat_key
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from services.kv_transfer.wire import Geometry


def geometry(core: EngineCore) -> Geometry:
    cache = core.runner.kv_caches[0]
    return Geometry(len(core.runner.kv_caches), cache.shape[1], cache.shape[2], cache.dtype)


def compat_hash(core: EngineCore) -> str:
    """Same model config, cache dtype and geometry <=> KV can move between two engines (the key
    the offload tiers use too)."""
    return compat_key(core.cfg.model, core.runner.kv_caches)


def new_identity(endpoint: str, dp_rank: int) -> kv_pb.KvProducer:
    """A fresh engine id and an epoch that grows across restarts (start time in ms)."""
    return kv_pb.KvProducer(
        engine_id=uuid.uuid4().hex, epoch=time.time_ns() // 1_000_000, dp_rank=dp_rank, endpoint=endpoint
    )
