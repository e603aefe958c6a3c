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


@triton.jit
def _e2m1(nibble):
    """e2m1 codes (int32, bit 3 the sign) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    exponent = (nibble >> 1) & 3
    mantissa = (nibble & 1).to(tl.float32)
    magnitude = tl.where(
        exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    )
    return tl.where((nibble & 8) != 0, -magnitude, magnitude)


@triton.jit
def fused_moe_quant_kernel(
    a_ptr,  # [rows, K]: e4m3 (FP8: quantized per row per block of K) or the activations (MXFP4)
    as_ptr,  # [rows, ceil(K / BLOCK_K)] float32 activation scales (FP8; unused for MXFP4)
    b_ptr,  # [E, N, K] e4m3 (FP8), or [E, N, K / 2] bytes of two e2m1 values (MXFP4)
    bs_ptr,  # [E, N, ceil(K / BLOCK_K)]: float32 (FP8) or e8m0 bytes (MXFP4, BLOCK_K = 32)
    c_ptr,  # [T*K, N]: one row per (token, k) pair
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    MXFP4: tl.constexpr,
    WIDEN: tl.constexpr,  # fp32 dots (the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the weight scales' block of K (MXFP4: 32)
):
    """fused_moe_kernel with the experts kept quantized, its grouping and padding the same. FP8
    (w8a8, DeepSeek's): each K block's e4m3 product times the row's and the weight row's scales.
    MXFP4 (weight only): the block's bytes unpacked into even and odd columns, each multiplied by
    the activations' even and odd columns, times the block's e8m0 scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    pair_mask = offs_pair < num_pairs
    rows = offs_pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_rows = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
    bs_rows = bs_ptr + expert * stride_bse + offs_n.to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        if MXFP4:
            half = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(b_rows + (k0 // 2 + half)[:, None], mask=n_mask[None, :], other=0).to(tl.int32)
            even_w, odd_w = _e2m1(packed & 15), _e2m1((packed >> 4) & 15)  # [BLOCK_K / 2, BLOCK_N]
            a_even = tl.load(
                a_ptr + rows[:, None] * stride_am + (k0 + 2 * half)[None, :],
                mask=pair_mask[:, None],
                other=0.0,
            )
            a_odd = tl.load(
                a_ptr + rows[:, None] * stride_am + (k0 + 2 * half + 1)[None, :],
                mask=pair_mask[:, None],
                other=0.0,
            )
            if WIDEN:
                part = tl.dot(a_even.to(tl.float32), even_w, input_precision="ieee")
                part = tl.dot(a_odd.to(tl.float32), odd_w, part, input_precision="ieee")
            else:  # every e2m1 value is a 16-bit float's
                part = tl.dot(a_even, even_w.to(a_even.dtype))
                part = tl.dot(a_odd, odd_w.to(a_odd.dtype), part)
            scale = tl.exp2(tl.load(bs_rows + kb, mask=n_mask, other=127).to(tl.float32) - 127.0)
            acc += part * scale[None, :]
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                mask=pair_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            b = tl.load(b_rows + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if WIDEN:
                part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, b)
            a_scale = tl.load(as_ptr + rows * stride_asm + kb, mask=pair_mask, other=0.0)
            b_scale = tl.load(bs_rows + kb, mask=n_mask, other=0.0)
            acc += part * a_scale[:, None] * b_scale[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + offs_pair, mask=pair_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + offs_pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])
