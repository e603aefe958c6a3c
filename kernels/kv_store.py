"""Write each token's MLA cache row into the paged latent KV cache.

    kv_cache[slot // block_size, slot % block_size] = [latent ; k_pe]   (cast to the cache dtype)

One row per token: the normalised KV latent c_kv (width L) and the rotary key k_pe (width R)
side by side. A slot of -1 means "no cache row for this token" (e.g. a padding token) and is
skipped: the cache is left untouched there.

Kernel layout: one program per token; it loads its slot and, when the slot is valid, copies the
two pieces into the row.
"""

from __future__ import annotations

import torch

from kernels.dispatch import next_power_of_2, resolve_impl


def _check(latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    n, width = latent.shape[0], latent.shape[-1] + k_pe.shape[-1]
    if latent.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != n:
        raise ValueError(
            f"latent and k_pe must be [N, L] and [N, R], got {tuple(latent.shape)} and {tuple(k_pe.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, L+R={width}], got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be [N={n}], got shape {tuple(slot_mapping.shape)}")


def _store_kv_triton(
    latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    from kernels.jit import kv_store as jit

    # (1) check (2) nothing to allocate (3) launch
    _check(latent, k_pe, kv_cache, slot_mapping)
    n, lat, rope = latent.shape[0], latent.shape[1], k_pe.shape[1]
    if n == 0:
        return
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    if k_pe.stride(1) != 1:
        k_pe = k_pe.contiguous()
    jit.store_kv_kernel[(n,)](
        latent,
        k_pe,
        kv_cache,
        slot_mapping.contiguous(),
        latent.stride(0),
        k_pe.stride(0),
        *kv_cache.stride(),
        kv_cache.shape[1],
        L=lat,
        R=rope,
        BLOCK_L=next_power_of_2(lat),
        BLOCK_R=next_power_of_2(rope),
    )


def store_kv(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: str = "auto",
) -> None:
    """latent [N, L], k_pe [N, R], kv_cache [num_blocks, block_size, L+R] (written in place),
    slot_mapping [N] int (block_id * block_size + offset, or -1 to skip the token)."""
    if resolve_impl(impl, kv_cache, has_triton=True) == "triton":
        _store_kv_triton(latent, k_pe, kv_cache, slot_mapping)
    else:
        store_kv_ref(latent, k_pe, kv_cache, slot_mapping)


def store_kv_ref(
    latent: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _check(latent, k_pe, kv_cache, slot_mapping)
    store_rows(torch.cat((latent, k_pe), dim=-1), kv_cache, slot_mapping)  # [N, L+R]


def store_rows(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """rows [N, W] into cache [num_blocks, block_size, W] at slot_mapping [N] (-1: skipped), cast
    to the cache's dtype: any one-row-per-token cache (DeepSeek-V3.2's indexer keys)."""
    if rows.shape != (slot_mapping.shape[0], cache.shape[-1]):
        raise ValueError(
            f"rows must be [N={slot_mapping.shape[0]}, {cache.shape[-1]}] for this cache, got {tuple(rows.shape)}"
        )
    rows = rows.to(cache.dtype)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        rows, slot_mapping = rows[valid], slot_mapping[valid]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows)
