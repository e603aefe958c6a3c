"""The Triton kernels of kernels/moe.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def fused_moe_kernel(
    a_ptr,  # [rows, K]: x (row = pair // TOP_K) or the activations (TOP_K = 1: row = pair)
    b_ptr,  # [E, N, K]: w13 or w2; C = A @ B[e]^T
    c_ptr,  # [T*K, N]: one row per (token, k) pair
    topk_weights_ptr,  # [T*K] routing weights, contiguous
    sorted_token_ids_ptr,  # [max_padded] pair ids grouped by expert, padded with num_pairs
    expert_ids_ptr,  # [num_blocks] the expert of each BLOCK_M block of sorted_token_ids
    num_tokens_post_padded_ptr,  # [1] length of the used part of sorted_token_ids
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the worst-case padding, known without a device sync; blocks past the end
    # of the real padding have nothing to do.
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)  # int64: E * stride_be passes 2^31
    if expert == -1:  # non-local pairs; moe_align_block_size emits -1 only past the end
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    pair_mask = offs_pair < num_pairs  # the sentinel num_pairs pads the expert's last block
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (offs_pair // TOP_K)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # Tiles are widened to fp32 before any arithmetic (bf16 math is wrong in the interpreter).
    # 16-bit values are exact in tf32, so the tf32 dot is exact products with fp32 accumulation;
    # fp32 inputs ask for the full-precision dot.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if MUL_ROUTED_WEIGHT:  # weights before the sum over k, as the reference applies them
        weight = tl.load(topk_weights_ptr + offs_pair, mask=pair_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + offs_pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])
