"""Fused mixture-of-experts: every token through its top-k SwiGLU experts, weighted and summed.

    out[t] = sum_k  w[t, k] * W2[e] (silu(W1[e] x_t) * W3[e] x_t),   e = topk_ids[t, k]

Experts are stored fused: w13[E, 2I, H] (gate rows then up rows) and w2[E, H, I]. Expert ids of
-1 (experts that live on another rank under expert parallelism) contribute nothing.

The Triton path (vLLM's fused_moe) works on the T*K (token, k) pairs, pair p = t * K + k:

1. `moe_align_block_size` sorts the pair ids by expert and pads each expert's segment to a
   multiple of BLOCK_M with the sentinel T*K, so that every BLOCK_M block of the sorted list
   belongs to one expert (`expert_ids[block]`). Pairs routed to -1 are left out entirely.
2. `fused_moe_kernel`, a grouped GEMM over (padded M blocks x N blocks): a program gathers its
   block's rows of A, multiplies them by its expert's weight tile and scatters the result to the
   rows of C named by the pair ids. It runs twice:
       gate_up[p] = x[p // K] @ w13[e]^T                 [T*K, 2I]
       out_k[p]   = w[p] * (silu(gate) * up)[p] @ w2[e]^T   [T*K, H]   (MUL_ROUTED_WEIGHT)
3. out[t] = sum_k out_k[t, k]; the rows of -1 pairs are never written and stay zero.

The reference sorts the (token, k) pairs by expert and runs one GEMM pair per expert that has
tokens (or two batched GEMMs over padded experts when the loads are even; with fewer pairs than
experts, as in decode, it groups the pairs on the host).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernels import native, quant
from kernels.dispatch import cdiv, resolve_impl
from kernels.linear import FEW_ROWS, linear
from kernels.quant import QuantWeight

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] in [-1, E) -> (sorted_token_ids [T*K + E*(bs-1)] int32,
    expert_ids [cdiv(T*K + E*(bs-1), bs)] int32, num_tokens_post_padded [1] int32).

    sorted_token_ids holds the flat pair ids p = t * K + k grouped by expert in expert order (within
    an expert in pair order), each expert's segment padded to a multiple of block_size with the
    sentinel T*K; experts without pairs get no segment. Its length is the worst case, so nothing
    here waits on the device; entries past num_tokens_post_padded (the padded total) are sentinels.
    expert_ids[i] is the expert of sorted_token_ids[i*bs : (i+1)*bs], -1 for blocks past the end.
    Pairs routed to -1 are left out entirely (they get no slot and no block), so a -1 block never
    precedes num_tokens_post_padded. Ids >= E are a caller error (an index error, not checked).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk_ids.is_floating_point() or topk_ids.is_complex():
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_padded = num_pairs + num_experts * (block_size - 1)
    # Pairs routed to -1 go to a spare bucket E, which sorts last and is dropped.
    flat = topk_ids.reshape(-1).long()  # [T*K]
    bucket = torch.where(flat < 0, num_experts, flat)  # [T*K] in [0, E]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [E+1]; bincount would sync on CUDA
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size  # [E]
    seg_end = torch.cumsum(padded, 0)  # [E] end of each expert's segment
    seg_start = seg_end - padded  # [E]

    order = torch.argsort(bucket, stable=True)  # [T*K] pair ids grouped by bucket
    sorted_bucket = bucket[order]
    bucket_first = torch.cumsum(counts, 0) - counts  # [E+1] where each bucket starts in `order`
    rank = torch.arange(num_pairs, device=device) - bucket_first[sorted_bucket]  # index in bucket
    dest = seg_start[sorted_bucket.clamp(max=num_experts - 1)] + rank  # [T*K] slot of each pair
    dest = torch.where(sorted_bucket < num_experts, dest, max_padded)  # -1 pairs: the spare slot
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:max_padded]  # drop the spare slot

    num_blocks = cdiv(max_padded, block_size)
    block_start = torch.arange(num_blocks, device=device) * block_size  # [blocks]
    # The expert owning position s is the first whose segment ends after s (empty ones end at s).
    expert_ids = torch.searchsorted(seg_end, block_start, right=True)  # [blocks] in [0, E]
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, seg_end[-1:].to(torch.int32)


def moe_block_sizes(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): vLLM's defaults where it has no tuned config -- 16-row blocks
    when experts see about a token each (decode), else 64-row blocks. BLOCK_M is also the
    alignment of moe_align_block_size."""
    if num_tokens <= num_experts:
        return 16, 32, 64
    return 64, 64, 32


def _grouped_gemm(a, b, c, topk_weights, sorted_ids, expert_ids, num_post, top_k, mul_weight, blocks):
    """c[p] = (w[p] *) a[p // top_k] @ b[expert of p]^T for the pairs p in sorted_ids."""
    from kernels.jit import moe as jit

    block_m, block_n, block_k = blocks
    n, k = b.shape[1], b.shape[2]
    grid = (cdiv(sorted_ids.numel(), block_m), cdiv(n, block_n))
    jit.fused_moe_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_post,
        n,
        k,
        c.shape[0],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        TOP_K=top_k,
        MUL_ROUTED_WEIGHT=mul_weight,
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_sizes: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """fused_moe's Triton path; block_sizes (BLOCK_M, BLOCK_N, BLOCK_K) default to moe_block_sizes."""
    # (1) check
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {x.shape}, {w13.shape}, {w2.shape}"
        )
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H] and [E, H, I] with H={hidden}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must both be [T={num_tokens}, K]"
        )
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"x, w13, w2 must share one of {FLOAT_DTYPES}; got {x.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if not (x.device == w13.device == w2.device == topk_weights.device == topk_ids.device):
        raise ValueError("x, w13, w2, topk_weights and topk_ids must be on one device")
    top_k = topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    blocks = block_sizes or moe_block_sizes(num_tokens, num_experts)

    # (2) allocate
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, blocks[0], num_experts)
    topk_weights = topk_weights.contiguous()  # indexed by flat pair id
    gate_up = x.new_empty(num_tokens * top_k, 2 * inter)  # [T*K, 2I]; rows of -1 pairs unused
    out_k = x.new_zeros(num_tokens, top_k, hidden)  # [T, K, H]; rows of -1 pairs stay zero

    # (3) launch
    _grouped_gemm(x, w13, gate_up, topk_weights, sorted_ids, expert_ids, num_post, top_k, False, blocks)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [T*K, I], the reference's arithmetic
    out_rows = out_k.view(num_tokens * top_k, hidden)  # [T*K, H]
    _grouped_gemm(act, w2, out_rows, topk_weights, sorted_ids, expert_ids, num_post, 1, True, blocks)
    return out_k.sum(dim=1)  # [T, H]; 16-bit sums accumulate in fp32


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [2I, H] (gate rows, then up rows), w2 [H, I] -> [T, H]: one SwiGLU MLP (a
    dense layer's, a shared expert's), every row."""
    inter = w2.shape[-1]
    gate_up = linear(x, w13)  # [T, 2I]
    return linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    impl: str = "auto",
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, K], topk_ids [T, K] -> [T, H] in
    x's dtype. shared: the shared experts' (w13 [2Is, H], w2 [H, Is]), whose `swiglu` is then added
    to the output (in the same native call as the routed experts where those run natively).
    Quantized experts (kernels/quant.py QuantWeight) take their own path."""
    if isinstance(w13, QuantWeight):
        return fused_moe_quant(x, w13, w2, topk_weights, topk_ids, shared, impl)
    if resolve_impl(impl, x, has_triton=True) == "triton":
        out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
        return out if shared is None else out + swiglu(x, *shared)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared)


def _quant_products(a, w, c, topk_weights, sorted_ids, expert_ids, num_post, top_k, mul_weight, block_m):
    """c[p] = (w[p] *) a[p // top_k] @ w[expert of p]^T with w kept quantized: FP8 with a quantized
    per row per block of K (act_quant), MXFP4 with a as it is."""
    from kernels.jit import moe as jit

    fp8 = w.fmt == "fp8"
    if fp8:
        a_q, a_scale = quant.act_quant(a, w.block_k, impl="triton")
    else:
        a_q, a_scale = a.contiguous(), a.new_empty(0, 0, dtype=torch.float32)
    n, k = w.shape[1], w.shape[2]
    grid = (cdiv(sorted_ids.numel(), block_m), cdiv(n, 32))
    jit.fused_moe_quant_kernel[grid](
        a_q, a_scale, w.data, w.scale, c, topk_weights, sorted_ids, expert_ids, num_post, n, k, c.shape[0],
        a_q.stride(0), a_scale.stride(0) if fp8 else 0, w.data.stride(0), w.data.stride(1), w.scale.stride(0),
        w.scale.stride(1), c.stride(0), TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_weight, MXFP4=not fp8,
        WIDEN=not a.is_cuda, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=w.block_k,
    )  # fmt: skip


def fused_moe_quant_triton(
    x: torch.Tensor, w13: QuantWeight, w2: QuantWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """fused_moe_triton with the experts kept quantized (kernels/jit/moe.py fused_moe_quant_kernel):
    FP8 experts as w8a8 block products (x, then the activations, quantized per token per block of
    K), MXFP4 experts weight-only. fused_moe_quant_ref's arithmetic."""
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden or w13.fmt != w2.fmt:
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E, 2I, H={hidden}] and [E, H, I]"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids and topk_weights must both be [T={num_tokens}, K]")
    top_k = topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0:
        return torch.zeros_like(x)
    block_m = moe_block_sizes(num_tokens, num_experts)[0]
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, num_experts)
    topk_weights = topk_weights.contiguous()
    gate_up = x.new_empty(num_tokens * top_k, 2 * inter)
    out_k = x.new_zeros(num_tokens, top_k, hidden)
    _quant_products(
        x.contiguous(), w13, gate_up, topk_weights, sorted_ids, expert_ids, num_post, top_k, False, block_m
    )
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out_rows = out_k.view(num_tokens * top_k, hidden)
    _quant_products(act, w2, out_rows, topk_weights, sorted_ids, expert_ids, num_post, 1, True, block_m)
    return out_k.sum(dim=1)


def _quant_product_ref(a: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """a @ w^T in float32 as the Triton path computes it: FP8 w8a8, MXFP4 weight-only."""
    if w.fmt == "fp8":
        return quant.w8a8_linear_ref(a.float(), w)
    return F.linear(a.float(), w.dequantize(torch.float32))


def fused_moe_quant_ref(
    x: torch.Tensor, w13: QuantWeight, w2: QuantWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """fused_moe_quant_triton's arithmetic in torch, pair by pair: gate_up and the activations in
    x's dtype, each pair's weighted row in x's dtype, summed over k in float32."""
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[-1]
    out_k = torch.zeros(num_tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for t in range(num_tokens):
        for j, e in enumerate(topk_ids[t].tolist()):
            if e < 0:
                continue
            gate_up = _quant_product_ref(x[t : t + 1], w13[e]).to(x.dtype)
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out_k[t, j] = (_quant_product_ref(act, w2[e])[0] * topk_weights[t, j].float()).to(x.dtype)
    return out_k.sum(dim=1)


def fused_moe_quant(
    x: torch.Tensor,
    w13: QuantWeight,
    w2: QuantWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: tuple[QuantWeight, QuantWeight] | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """fused_moe with quantized weights (kernels/quant.py). A few tokens' (as many pairs per expert
    as `native_pairs_per_expert`, any number in a batch-invariant step) run in the native kernel
    where it takes them, each weight widened as it is read, with the bf16 loop's roundings
    (_fused_moe_few's). Otherwise torch: each expert a token routes to widened once for its
    tokens, the products in float32 for the weighted sum. On a GPU: fused_moe_quant_triton."""
    if resolve_impl(impl, x, has_triton=True) == "triton":
        out = fused_moe_quant_triton(x, w13, w2, topk_weights, topk_ids)
        return out if shared is None else out + swiglu(x, *shared)
    num_experts = w13.shape[0]
    if (
        native.loaded()
        and native.takes(x)
        and all(native.takes_weight(w) for w in (w13, w2, *(shared or ())))
        and topk_ids.numel() <= native_pairs_per_expert() * num_experts
    ):
        out = torch.zeros_like(x)
        native.moe_topk(x, w13, w2, out, topk_ids.long(), topk_weights.float(), shared)
        return out
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat[flat >= 0]).tolist():
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        y = swiglu(x[token], w13[e], w2[e])  # [n, H]
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    if shared is not None:
        out += swiglu(x, *shared).float()
    return out.to(x.dtype)


MOE_PASS_TOKENS = 256
"""Tokens the torch path's experts take at a time: a longer step (a 4096-token prefill chunk) runs
in passes of this many. The padded path's temporaries are [E, most pairs of an expert, 2I], so a
whole chunk at once held ~100 MB a layer and left the heap fragmented; in a pass of 256 tokens the
bench model's experts (top-4 of 32) get ~32 rows each, under WX_ROWS, where w @ x^T reads each
weight once. Bench model in bf16 (2 GiB cache, 256 prompts of 256 tokens in 4096-token steps,
then 64 tokens at batch 256; 2 cores): peak RSS 2,050 / 2,154 / 2,199 / 2,177 MiB with passes of
256 / 512 / 1024 / 2048 tokens against 2,411-2,454 in one pass, in 22.2-23.4 s against 25.6-25.9."""


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    if num_tokens > MOE_PASS_TOKENS:  # a prefill chunk: a pass at a time, its temporaries bounded
        out = torch.empty_like(x)
        for s in range(0, num_tokens, MOE_PASS_TOKENS):
            e = s + MOE_PASS_TOKENS
            out[s:e] = fused_moe_ref(x[s:e], w13, w2, topk_weights[s:e], topk_ids[s:e], shared)
        return out
    if num_tokens == 0:
        return torch.zeros_like(x)
    if num_tokens * top_k < w13.shape[0] or (
        native.loaded()
        and num_tokens * top_k <= native_pairs_per_expert() * w13.shape[0]
        and native.takes(x, w13, w2)
    ):  # too few pairs to load every expert, or few enough for the native kernel: decode batches
        return _fused_moe_few(x, w13, w2, topk_weights, topk_ids, shared)
    out = _fused_moe_loop(x, w13, w2, topk_weights, topk_ids, torch.zeros_like(x))
    return out if shared is None else out + swiglu(x, *shared)


def _fused_moe_loop(x, w13, w2, topk_weights, topk_ids, out) -> torch.Tensor:
    """The pairs sorted by expert, then per expert a GEMM pair (or all experts padded to two batched
    GEMMs where that pays), added into out."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = counts[0]  # pairs routed to -1 sort first and are skipped
    inter = w2.shape[-1]
    num_pairs = len(flat_ids) - start
    if _padded_pays(counts[1:], num_pairs, x.device):
        return _fused_moe_padded(x, w13, w2, counts[1:], token_of[start:], weight_of[start:], out)
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate_up = linear(x[tokens], w13[expert])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = linear(act, w2[expert])  # [n, H]
        expert_out = (expert_out * weight_of[start : start + count, None]).to(out.dtype)
        out.index_add_(0, tokens, expert_out)
        start += count
    return out


NATIVE_PAIRS_PER_EXPERT = 2
NATIVE_PAIRS_PER_EXPERT_AMX = 64
"""Up to this many (token, expert) pairs per expert on average, the few-token path runs them in
the native kernel (kernels/native moe_pairs: each loaded expert's weights read once for its
tokens, experts over both threads) instead of the padded batched GEMMs. Bench model's MoE (32
experts of 512 x 256, top-4, bf16, weights out of cache, 2-core Xeon) at 8 / 16 / 32 / 64 tokens
(1 / 2 / 4 / 8 pairs per expert): VDPBF16PS products 1.69 / 2.53 / 4.45 / 6.00 ms against the
padded GEMMs' 2.90 / 3.08 / 3.19 / 3.47 (from 4 rows per expert they turn compute-bound); AMX
products (x packed once per product) at 64 / 128 / 256 / 512 tokens 1.40 / 1.75 / 2.73 / 4.56
against 1.99 / 2.40 / 3.10 / 5.98."""


def native_pairs_per_expert() -> int:
    """NATIVE_PAIRS_PER_EXPERT_AMX wherever the products take more than FEW_ROWS rows natively: on
    the tile unit, and where the kernels emulate AVX512-BF16 (native.EMULATED_ROWS: any number;
    there torch's bf16 GEMMs are emulated too; not measured on its own); any number in a
    batch-invariant step (native.set_batch_invariant)."""
    if native.batch_invariant():  # every MoE the same way, whatever the step holds
        return sys.maxsize
    return NATIVE_PAIRS_PER_EXPERT_AMX if native.max_rows() > native.FEW_ROWS else NATIVE_PAIRS_PER_EXPERT


def _fused_moe_few(x, w13, w2, topk_weights, topk_ids, shared=None) -> torch.Tensor:
    """The per-expert loop for a handful of pairs (all of them in one native call where the
    kernels are loaded, the shared expert's too), grouped on the host from one small copy of the
    ids: the sort, bincount and gathers of the general loop cost more than the GEMMs here. Same
    per-expert arithmetic, experts in the same (ascending) order, the shared expert after."""
    out = torch.zeros_like(x)
    if native.loaded() and native.takes(x, w13, w2, out, *(shared or ())):
        # All pairs in one native call, expert by expert as the loop below: an expert seeing two
        # tokens (a verification's drafts, a small batch) reads its weights the second time from cache.
        native.moe_topk(x, w13, w2, out, topk_ids.long(), topk_weights.float(), shared)
        return out
    inter = w2.shape[-1]
    pairs: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(topk_ids.tolist()):
        for k, e in enumerate(row):
            if e >= 0:
                pairs.setdefault(e, []).append((t, k))
    for expert in sorted(pairs):
        (t, k), *more = pairs[expert]
        if not more:  # one token: slices, no gathers
            gate_up = linear(x[t : t + 1], w13[expert])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out[t : t + 1] += (linear(act, w2[expert]) * topk_weights[t, k]).to(out.dtype)
            continue
        tokens = torch.tensor([t for t, _ in pairs[expert]], device=x.device)
        ks = torch.tensor([k for _, k in pairs[expert]], device=x.device)
        gate_up = linear(x[tokens], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = linear(act, w2[expert]) * topk_weights[tokens, ks][:, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out if shared is None else out + swiglu(x, *shared)


WX_ROWS = 64
"""Up to this many tokens per expert the padded path's batched GEMMs are taken as w @ x^T on CPU.
Measured on the bench model's MoE (32 experts of 512 x 256, top-4, bf16, 2 cores): 1.15-1.5x
faster from 8 to 512 tokens (up to ~64 per expert), 0.93x at 1024."""


PADDED_ROWS_MULTIPLE = 8
"""The padded path's rows per expert are rounded up to a multiple of this. On CPU every new GEMM
shape costs oneDNN a primitive: ~1.5 ms to create, and ~170 KB kept in each of its two caches
(ideep's and oneDNN's, 1024 entries each). Unrounded, a decode batch's largest expert load takes
almost any value from step to step, so the caches filled with one-off shapes. Bench model bf16,
256 x 256-token prefill + 64 decode tokens, run twice: 13.3 / 22.4 s against 14.3 / 23.1 s, heap
in use 297 against 333 MiB, peak RSS 1,598 against 1,674 MiB."""


def _padded_pays(counts: list[int], num_pairs: int, device: torch.device) -> bool:
    """Whether every expert, padded to the largest count, should run as two batched GEMMs instead
    of a loop of per-expert ones: when the loads are even (little padded compute), or, on CPU,
    when each expert sees fewer than FEW_ROWS tokens and at least half the experts are loaded (a
    decode batch: the products are bound by reading the weights, which the batched GEMMs read once
    each, and the loop's ~10 ops per expert cost more than the unused experts' weights)."""
    cap, loaded = max(counts), sum(1 for c in counts if c)
    if min(counts) > 0 and len(counts) * cap <= 2 * num_pairs:
        return True
    return device.type == "cpu" and cap < FEW_ROWS and 2 * loaded >= len(counts)


def _fused_moe_padded(x, w13, w2, counts, token_of, weight_of, out) -> torch.Tensor:
    """Pad each expert's tokens to the largest count (experts without tokens get zero rows) and run
    all experts as two batched GEMMs instead of a loop of small ones. Same per-expert arithmetic as
    the loop; up to WX_ROWS rows per expert are taken as w @ x^T, which reads each weight once
    (see kernels/linear.py)."""
    num_experts, cap = len(counts), cdiv(max(counts), PADDED_ROWS_MULTIPLE) * PADDED_ROWS_MULTIPLE
    counts_t = torch.tensor(counts, device=x.device)
    starts = torch.cumsum(counts_t, 0) - counts_t
    expert_of = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts_t)
    slot = torch.arange(len(token_of), device=x.device) - starts[expert_of]
    padded = x.new_zeros(num_experts, cap, x.shape[-1])
    padded[expert_of, slot] = x[token_of]  # [E, cap, H]
    inter = w2.shape[-1]
    if x.device.type == "cpu" and cap <= WX_ROWS:
        gate_up = torch.bmm(w13, padded.transpose(1, 2)).transpose(1, 2)  # [E, cap, 2I]
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [E, cap, I]
        expert_out = torch.bmm(w2, act.transpose(1, 2)).transpose(1, 2)[expert_of, slot]  # [pairs, H]
    else:
        gate_up = torch.bmm(padded, w13.transpose(1, 2))  # [E, cap, 2I]
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        expert_out = torch.bmm(act, w2.transpose(1, 2))[expert_of, slot]  # [pairs, H]
    out.index_add_(0, token_of, (expert_out * weight_of[:, None]).to(out.dtype))
    return out
