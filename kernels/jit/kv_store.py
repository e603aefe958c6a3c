"""The Triton kernels of kernels/kv_store.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    latent_ptr,  # [N, L]
    k_pe_ptr,  # [N, R]
    kv_cache_ptr,  # [num_blocks, block_size, L + R]
    slot_ptr,  # [N] int32 or int64
    stride_ln,
    stride_pn,
    stride_cb,
    stride_cs,
    stride_cd,
    block_size,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    valid = slot >= 0
    row = kv_cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    cache_ty = kv_cache_ptr.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = (offs_l < L) & valid
    latent = tl.load(latent_ptr + token * stride_ln + offs_l, mask=mask_l)
    tl.store(row + offs_l * stride_cd, latent.to(cache_ty), mask=mask_l)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = (offs_r < R) & valid
    k_pe = tl.load(k_pe_ptr + token * stride_pn + offs_r, mask=mask_r)
    tl.store(row + (L + offs_r) * stride_cd, k_pe.to(cache_ty), mask=mask_r)
