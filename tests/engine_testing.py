"""Driving an engine in tests, the way every step loop does: step and keep what finished."""

from __future__ import annotations

import torch

from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.spec import KVCaches, mla_spec
from engine.outputs import RequestOutput
from engine.request import Request


def mla_caches(layer_caches: list[torch.Tensor], mtp_caches: list[torch.Tensor] = ()) -> KVCaches:
    """Tensors made by a test as the engine's caches: the layers' latent caches, then the MTP
    layers', under the MLA spec of their geometry (rotary width: the model's own is not needed)."""
    first = layer_caches[0]
    spec = mla_spec(
        num_layers=len(layer_caches),
        num_mtp_layers=len(mtp_caches),
        block_size=first.shape[1],
        kv_lora_rank=first.shape[2],
        rope_dim=0,
        dtype=first.dtype,
        fingerprint="test",
    )
    return KVCaches(spec, [*layer_caches, *mtp_caches])


def full_manager(num_blocks: int, block_size: int, **kwargs) -> KVCacheManager:
    """A KV cache manager of one full-attention table (DeepSeek-V2/V3's: one latent group)."""
    spec = mla_spec(
        num_layers=1,
        num_mtp_layers=0,
        block_size=block_size,
        kv_lora_rank=8,
        rope_dim=0,
        dtype=torch.float32,
        fingerprint="test",
    )
    return KVCacheManager(spec, num_blocks, **kwargs)


def table(req: Request, t: int = 0) -> list[int]:
    """The request's block table t ([] while it holds no blocks)."""
    return req.block_ids[t] if req.block_ids else []


def run_finished(core, steps: int | None = None) -> dict[str, RequestOutput]:
    """Step while the engine has work (at most `steps` times) -> request id -> final output of
    every request that finished meanwhile."""
    final: dict[str, RequestOutput] = {}
    n = 0
    while core.has_unfinished_requests() and (steps is None or n < steps):
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        n += 1
    return final
