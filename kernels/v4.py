"""DeepSeek-V4's kernels: its manifold-constrained hyper-connections (mHC), its compressors' gated
pooling and its attention over window rows and compressed entries, each a PyTorch reference, a
Triton kernel (kernels/jit/v4.py; CUDA, and the interpreter in the tests) and, for a CPU's bf16
decode, a native one (kernels/native/v4.h). engine/models/deepseek_v4.py has the model around them.

mHC around a block, for a token's hc streams X [hc, H] (fn, base, scale learnt):
    m    = RMSNorm_unweighted(flatten X) fn^T                        [(2 + hc) hc]
    pre  = sigmoid(scale0 m[:hc] + base) + eps
    post = 2 sigmoid(scale1 m[hc:2hc] + base)
    comb = Sinkhorn(softmax_row(scale2 m[2hc:] + base) + eps)       columns, then iters - 1 x (rows, columns)
    u    = sum_i pre_i X_i                                           the block's input
    X'_j = post_j Block(u) + sum_i comb[i, j] X_i                    (merge)

Compressor pooling of one entry's S slots (kv, gate [S, W]; an empty slot's gate is -inf):
    entry = weight * RMSNorm(sum_s softmax_s(gate) kv)               the softmax per channel

Attention of a query token (H heads of D) over rows of two caches (K = V) and a sink per head:
    o_h = sum_j softmax(q_h . row_j * scale ..., sink_h)_j row_j     (the sink's term has no value)
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.dispatch import next_power_of_2, resolve_impl

# ---- hyper-connections -------------------------------------------------------------------------


def hc_pre_ref(streams, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """streams [N, hc, H] -> (post [N, hc], comb [N, hc, hc] float32, u [N, H] in streams' dtype)."""
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    u = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, u


def hc_merge_ref(streams, post, comb, out):
    """The streams after the block [N, hc, H]: post_j out + sum_i comb[i, j] X_i, in streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_pre(streams, fn, base, scale, iters: int, eps: float, norm_eps: float, impl: str = "auto"):
    """hc_pre_ref's contract: Triton on CUDA, the native kernel for a CPU's bf16 streams."""
    if resolve_impl(impl, streams, has_triton=True) == "triton":
        return _hc_pre_triton(streams, fn, base, scale, iters, eps, norm_eps)
    if impl == "auto" and native.loaded() and native.takes(streams) and streams.is_contiguous():
        return native.hc_pre(streams, fn, base, scale, iters, eps, norm_eps)
    return hc_pre_ref(streams, fn, base, scale, iters, eps, norm_eps)


def hc_merge(streams, post, comb, out, impl: str = "auto"):
    if resolve_impl(impl, streams, has_triton=True) == "triton":
        return _hc_merge_triton(streams, post, comb, out)
    if impl == "auto" and native.loaded() and native.takes(streams, out) and streams.is_contiguous():
        return native.hc_merge(streams, post, comb, out)
    return hc_merge_ref(streams, post, comb, out)


def _hc_pre_triton(streams, fn, base, scale, iters, eps, norm_eps):
    from kernels.jit import v4 as jit

    n, hc, h = streams.shape
    k = (2 + hc) * hc
    if fn.shape != (k, hc * h) or base.shape != (k,) or scale.shape != (3,):
        raise ValueError(f"fn must be [{k}, {hc * h}], base [{k}] and scale [3], got {tuple(fn.shape)}")
    streams = streams.contiguous()
    fn, base, scale = (t.float().contiguous() for t in (fn, base, scale))
    post = torch.empty(n, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=streams.device)
    u = torch.empty(n, h, dtype=streams.dtype, device=streams.device)
    if n:
        jit.hc_pre_kernel[(n,)](
            streams, fn, base, scale, post, comb, u, streams.stride(0), u.stride(0), float(eps), float(norm_eps),
            HC=hc, H=h, ITERS=iters, BLOCK_HC=next_power_of_2(hc), BLOCK_C=min(1024, next_power_of_2(hc * h)),
            BLOCK_H=min(512, next_power_of_2(h)),
        )  # fmt: skip
    return post, comb, u


def _hc_merge_triton(streams, post, comb, out):
    from kernels.jit import v4 as jit

    n, hc, h = streams.shape
    if post.shape != (n, hc) or comb.shape != (n, hc, hc) or out.shape != (n, h):
        raise ValueError(f"post [{n}, {hc}], comb [{n}, {hc}, {hc}] and out [{n}, {h}] expected")
    streams, out = streams.contiguous(), out.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    y = torch.empty_like(streams)
    block_h = min(256, next_power_of_2(h))
    if n:
        jit.hc_merge_kernel[(n, -(-h // block_h))](
            streams, post, comb, out, y, streams.stride(0), out.stride(0), y.stride(0),
            HC=hc, H=h, BLOCK_HC=next_power_of_2(hc), BLOCK_H=block_h,
        )  # fmt: skip
    return y


# ---- compressor pooling ------------------------------------------------------------------------


def compress_pool_ref(kv: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kv, gate [E, S, W] float32 -> entries [E, W] float32 (RMSNorm with weight)."""
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    return weight * (pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps))


def compress_pool(kv, gate, weight, eps: float, impl: str = "auto") -> torch.Tensor:
    """compress_pool_ref's contract: Triton on CUDA, the native kernel on a CPU that has it."""
    if resolve_impl(impl, kv, has_triton=True) == "triton":
        return _compress_pool_triton(kv, gate, weight, eps)
    if impl == "auto" and native.loaded() and kv.is_cpu and kv.dtype == torch.float32:
        return native.compress_pool(kv, gate, weight.float(), eps)
    return compress_pool_ref(kv, gate, weight, eps)


def _compress_pool_triton(kv, gate, weight, eps):
    from kernels.jit import v4 as jit

    e, s, w = kv.shape
    if gate.shape != kv.shape or weight.shape != (w,):
        raise ValueError(f"gate must be like kv {tuple(kv.shape)} and weight [{w}]")
    kv, gate, weight = (t.float().contiguous() for t in (kv, gate, weight))
    out = torch.empty(e, w, dtype=torch.float32, device=kv.device)
    if e:
        block_s = next_power_of_2(s)
        jit.compress_pool_kernel[(e,)](
            kv, gate, weight, out, float(eps), S=s, W=w, BLOCK_S=block_s,
            BLOCK_W=max(16, min(next_power_of_2(w), 8192 // block_s)),
        )  # fmt: skip
    return out


# ---- attention ---------------------------------------------------------------------------------


def v4_attention_ref(q, window, wslots, entries, eslots, sinks, scale: float) -> torch.Tensor:
    """q [T, H, D]; each token over rows `wslots` [T, Kw] of window (any [..., D] tensor, read as
    rows) and `eslots` [T, Kc] of entries (None: none), -1 none; K = V; sinks [H] -> [T, H, D] in
    q's dtype, computed in float32."""
    d = q.shape[-1]
    rows = [window.reshape(-1, d)[wslots.clamp(min=0)]]  # [T, Kw, D]
    valid = [wslots >= 0]
    if entries is not None:
        rows.append(entries.reshape(-1, d)[eslots.clamp(min=0)])
        valid.append(eslots >= 0)
    keys, valid = torch.cat(rows, dim=1).float(), torch.cat(valid, dim=1)
    logits = torch.einsum("thd,tld->thl", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thl,tld->thd", probs, keys).to(q.dtype)


def attends_by_slots(q: torch.Tensor, window: torch.Tensor) -> bool:
    """Whether v4_attention runs a kernel here (Triton, or native for a CPU's bf16), so the model
    should hand it every token's rows at once rather than attend request by request in torch."""
    return resolve_impl("auto", q, has_triton=True) == "triton" or native.loaded() and native.takes(q, window)


def v4_attention(q, window, wslots, entries, eslots, sinks, scale: float, impl: str = "auto") -> torch.Tensor:
    """v4_attention_ref's contract: Triton on CUDA, the native kernel for a CPU's bf16 caches."""
    if resolve_impl(impl, q, has_triton=True) == "triton":
        return _v4_attention_triton(q, window, wslots, entries, eslots, sinks, scale)
    if impl == "auto" and native.loaded() and native.takes(q, window, entries):
        return native.v4_attention(q, window, wslots, entries, eslots, sinks, scale)
    return v4_attention_ref(q, window, wslots, entries, eslots, sinks, scale)


def _v4_attention_triton(q, window, wslots, entries, eslots, sinks, scale):
    from kernels.jit import v4 as jit

    t, h, d = q.shape
    if sinks.shape != (h,) or wslots.shape[0] != t or (entries is not None and eslots.shape[0] != t):
        raise ValueError(f"sinks must be [{h}] and the slots [T={t}, K]")
    wslots = wslots.contiguous()
    eslots = eslots.contiguous() if entries is not None else wslots[:, :0]
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t:
        jit.v4_attention_kernel[(t, h)](
            q, window, entries if entries is not None else window, wslots, eslots, sinks.float().contiguous(), out,
            float(scale), wslots.shape[1], eslots.shape[1], q.stride(0), q.stride(1), wslots.stride(0),
            max(eslots.stride(0), 1), out.stride(0), out.stride(1),
            D=d, BLOCK_D=next_power_of_2(d), BLOCK_N=16,
        )  # fmt: skip
    return out
