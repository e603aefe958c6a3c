"""Who a worker is: its engine id and an epoch that grows across restarts. (What KV it can exchange
is its engine's KV cache spec, `EngineCore.kv_spec`.)"""

from __future__ import annotations

import time
import uuid

from pdserve.v1 import kv_transfer_pb2 as kv_pb


def new_identity(endpoint: str, dp_rank: int) -> kv_pb.KvProducer:
    """A fresh engine id and an epoch that grows across restarts (start time in ms)."""
    return kv_pb.KvProducer(
        engine_id=uuid.uuid4().hex, epoch=time.time_ns() // 1_000_000, dp_rank=dp_rank, endpoint=endpoint
    )
