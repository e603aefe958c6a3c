"""The native kernels' calls that take a whole block of a layer for a decode step's few tokens:
a layer's MLA attention (mla_attention, with the weights it takes in MLAWeights), its expert
routing (route) and its routed and shared experts (moe_pairs, moe_topk), or its whole MoE block
(moe_block, with MoEWeights); a decode step's whole stack of layers (decode_stack, with
DecodeStack); and a greedy speculative step with MTP drafts (greedy_spec_step, with MTPDrafter).
Each is one call where the Python path makes a dozen, with the Python path's bits (the tests hold
them to it), but for moe_block's router product (its float32 sums in another order than torch's
BLAS). Re-exported by kernels/native, whose `load` loads them; each requires `native.loaded()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import native
from kernels.quant import QuantWeight


@dataclass(frozen=True)
class IndexerWeights:
    """DeepSeek-V3.2's lightning indexer of one layer as mla_attention takes it (layer.h
    IndexerPlan): wq [nI*dI, q_lora] and wk [dI, hidden] (bf16 or kept quantized), the key
    LayerNorm's weight and bias [dI] and eps, weights_proj [nI, hidden], the leading `rope`
    elements of keys and query heads roped in halves, the best `topk` keys chosen at `scale`; the
    head weights scaled by nI^-1/2. Built by engine/models/deepseek_v32.py; `plan` is the row of
    pointers and sizes the native call reads (filled once, by the native field names)."""

    wq: torch.Tensor | QuantWeight
    wk: torch.Tensor | QuantWeight
    k_norm: torch.Tensor
    k_bias: torch.Tensor
    k_eps: float
    weights_proj: torch.Tensor | QuantWeight
    heads: int
    dim: int
    rope: int
    topk: int
    scale: float
    plan: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        heads, dim = self.heads, self.dim
        if (
            self.wq.shape[0] != heads * dim
            or self.wk.shape[0] != dim
            or self.weights_proj.shape != (heads, self.wk.shape[1])
            or self.k_norm.shape != (dim,)
            or self.k_bias.shape != (dim,)
            or not 0 < self.rope <= dim
            or self.rope % 2
            or self.topk < 1
        ):
            raise ValueError(
                f"an indexer needs wq [nI*dI={heads * dim}, q_lora], wk [dI={dim}, hidden], weights_proj "
                f"[nI, hidden], its key norm [dI], an even rope width in (0, dI] and topk >= 1"
            )
        if not (
            all(native.takes_weight(w) for w in (self.wq, self.wk, self.weights_proj))
            and native.takes(self.k_norm, self.k_bias)
            and self.k_norm.is_contiguous()
            and self.k_bias.is_contiguous()
        ):
            raise ValueError(
                "an indexer's weights must be CPU bfloat16 (or kept quantized), its key norm contiguous"
            )
        values = dict(
            **_plan_weight("wq", self.wq), **_plan_weight("wk", self.wk), **_plan_weight("wp", self.weights_proj),
            k_norm=self.k_norm.data_ptr(), k_bias=self.k_bias.data_ptr(), heads=heads, dim=dim, rope=self.rope,
            topk=self.topk, k_eps=self.k_eps, scale=self.scale, w_scale=heads**-0.5,
        )  # fmt: skip
        object.__setattr__(self, "plan", _plan_row(native._library.indexer_plan_fields(), values))


def _plan_row(fields: list[tuple[str, bool]], values: dict[str, int | float]) -> torch.Tensor:
    """A native plan struct's row (every field 8 bytes, int64 or double, in `fields`' order) filled
    from values by name; every field must be given, and nothing else."""
    row = torch.zeros(len(fields), dtype=torch.int64)
    reals = row.view(torch.float64)
    for i, (name, real) in enumerate(fields):
        if real:
            reals[i] = values.pop(name)
        else:
            row[i] = values.pop(name)
    assert not values, f"fields the native plan lacks: {sorted(values)}"
    return row


@dataclass(frozen=True)
class MLAWeights:
    """One MLA layer's decode weights as mla_attention takes them: bf16, contiguous rows, no biases;
    the projections, the absorbed per-head ones too, may be kept quantized (kernels/quant.py;
    native.takes_weight). Built by engine/models/mla.py once the weights are loaded."""

    q_a: (
        torch.Tensor | QuantWeight | None
    )  # [q_lora, hidden], or None: q_b is then q_proj [H*(nope+R), hidden]
    q_a_norm: torch.Tensor | None  # [q_lora]
    q_b: torch.Tensor | QuantWeight  # [H*(nope+R), q_lora]
    kv_a: torch.Tensor | QuantWeight  # [L+R, hidden]
    kv_a_norm: torch.Tensor  # [L]
    w_uk_t: torch.Tensor | QuantWeight  # [H, L, nope], unit stride along nope
    w_uv: torch.Tensor | QuantWeight  # [H, v, L], unit stride along L (a view of kv_b_proj's weight)
    o_proj: torch.Tensor | QuantWeight  # [hidden, H*v]
    heads: int
    nope_dim: int
    rope_dim: int
    kv_lora_rank: int
    v_dim: int
    q_eps: float
    kv_eps: float
    scale: float
    interleaved: bool
    indexer: IndexerWeights | None = None  # DeepSeek-V3.2's sparse MLA (it needs q_a)

    def __post_init__(self):
        if self.indexer is not None and (self.q_a is None or self.indexer.wq.shape[1] != self.q_a.shape[0]):
            raise ValueError("an indexer's queries come from the query latent: it needs q_a [q_lora, hidden]")

    @property
    def q_lora_rank(self) -> int:
        return 0 if self.q_a is None else self.q_a.shape[0]

    def takes_rows(self, rows: int) -> bool:
        """Whether M = rows tokens take every product natively (as the layer's own calls would)."""
        return native._few_enough(rows)


def _check_experts(x, w13, w2, out, shared) -> tuple[int, int, int, int]:
    """moe_pairs' and moe_topk's operand checks -> (T, H, E, I)."""
    (num_tokens, hidden), (num_experts, two_inter, _) = x.shape, w13.shape
    inter = two_inter // 2
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, inter) or out.shape != x.shape:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], w2 [E, H, I] and out [T, H] must agree, got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)} and {tuple(out.shape)}"
        )
    if not (native.takes(x, out) and native.takes_weight(w13) and native.takes_weight(w2)):
        raise ValueError(
            "x and out must be CPU bfloat16 with unit stride along the last dimension, w13 and w2 the "
            "same or kept quantized as native.takes_weight says"
        )
    if shared is not None:
        s13, s2 = shared
        if (
            s13.shape != (2 * s2.shape[-1], hidden)
            or s2.shape[0] != hidden
            or not (native.takes_weight(s13) and native.takes_weight(s2))
        ):
            raise ValueError(
                f"the shared expert must be w13 [2Is, H={hidden}] and w2 [H, Is], CPU bfloat16 with unit "
                f"stride along the last dimension or kept quantized as native.takes_weight says, got "
                f"{tuple(s13.shape)} and {tuple(s2.shape)}"
            )
    return num_tokens, hidden, num_experts, inter


def _expert_strides(w: torch.Tensor | QuantWeight) -> tuple[int, int]:
    """An expert stack's per-expert strides: in its data's units and in its scales'."""
    if isinstance(w, QuantWeight):
        return w.data.stride(0), w.scale.stride(0)
    return w.stride(0), 0


def _experts_args(w13, w2) -> tuple:
    """Routed experts as the kernels take them: each stack's weight_args and per-expert strides."""
    return native.weight_args(w13), *_expert_strides(w13), native.weight_args(w2), *_expert_strides(w2)


def _shared_weight_args(shared) -> tuple:
    """The shared expert as the kernels take it: (s13's, s2's weight_args, Is); zeros for none."""
    if shared is None:
        return native.weight_args(None), native.weight_args(None), 0
    return native.weight_args(shared[0]), native.weight_args(shared[1]), shared[1].shape[-1]


def _plan_weight(name: str, w: torch.Tensor | QuantWeight | None) -> dict[str, int]:
    """A weight's LayerPlan fields (layer.h PDSERVE_WEIGHT), from its weight_args."""
    keys = (name, f"{name}_ld", f"{name}_scale", f"{name}_lds", f"{name}_block", f"{name}_fmt")
    return dict(zip(keys, native.weight_args(w), strict=True))


def _shared_args(shared: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int, int, int, int]:
    if shared is None:
        return 0, 0, 0, 0, 0
    s13, s2 = shared
    return s13.data_ptr(), s13.stride(0), s2.data_ptr(), s2.stride(0), s2.shape[-1]


def moe_pairs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    experts: list[int],
    tokens: list[int],
    weights: list[float],
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place, for each (expert e, token t, weight) in order: out[t] += weight * e's SwiGLU MLP
    of x[t], with kernels/moe.py's per-expert roundings. Pairs of one expert should be adjacent
    (its weights are then read once for all its tokens). shared: the shared expert's weights
    (w13 [2Is, H], w2 [H, Is]), then added to every token after its routed experts, as
    `out + shared(x)` rounds. x [T, H], w13 [E, 2I, H], w2 [E, H, I], out [T, H], all CPU bf16
    with unit stride along their last dimension. Requires `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    num_tokens, hidden, num_experts, inter = _check_experts(x, w13, w2, out, shared)
    if not len(experts) == len(tokens) == len(weights):
        raise ValueError(
            f"experts, tokens and weights must be as long, got {len(experts)}, {len(tokens)}, {len(weights)}"
        )
    if experts and not (
        0 <= min(experts) and max(experts) < num_experts and 0 <= min(tokens) and max(tokens) < num_tokens
    ):
        raise ValueError(f"expert ids must lie in [0, {num_experts}) and tokens in [0, {num_tokens})")
    if shared is not None:
        experts, tokens = [*experts, *[-1] * num_tokens], [*tokens, *range(num_tokens)]
        weights = [*weights, *[1.0] * num_tokens]
    native._library.moe_pairs(
        x.data_ptr(), x.stride(0),
        w13.data_ptr(), w13.stride(0), w13.stride(1),
        w2.data_ptr(), w2.stride(0), w2.stride(1),
        out.data_ptr(), out.stride(0),
        experts, tokens, weights, hidden, inter, *_shared_args(shared),
    )  # fmt: skip


def moe_topk(
    x: torch.Tensor,
    w13: torch.Tensor | QuantWeight,
    w2: torch.Tensor | QuantWeight,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: tuple[torch.Tensor | QuantWeight, torch.Tensor | QuantWeight] | None = None,
) -> None:
    """moe_pairs from the router's output: topk_ids [T, K] (int64, -1 for an expert on another
    rank) and topk_weights [T, K] (float32), the pairs grouped by expert in ascending order (an
    expert's in (token, k) order), in one call without the Python lists. The weights may be kept
    quantized (FP8, MXFP4: kernels/quant.py), each widened as it is read. Requires `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    num_tokens, hidden, num_experts, inter = _check_experts(x, w13, w2, out, shared)
    top_k = topk_ids.shape[-1]
    if topk_ids.shape != (num_tokens, top_k) or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must be [T={num_tokens}, K], got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_ids must be int64 and topk_weights float32, got {topk_ids.dtype} and {topk_weights.dtype}"
        )
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    bad = native._library.moe_topk(
        x.data_ptr(), x.stride(0), *_experts_args(w13, w2),
        out.data_ptr(), out.stride(0), topk_ids.data_ptr(), topk_weights.data_ptr(),
        num_tokens, top_k, num_experts, hidden, inter, *_shared_weight_args(shared),
    )  # fmt: skip
    if bad:
        raise ValueError(f"{bad} expert ids lie at or past E={num_experts}")


def _check_step(rows: int, cos, sin, slots, block_table, seq_lens) -> None:
    """A decode step's per-token operands, as mla_attention and decode_stack take them."""
    if slots.shape != (rows,) or block_table.shape[0] != rows or seq_lens.shape != (rows,):
        raise ValueError(
            f"slots, block_table and seq_lens must have a row per token (M={rows}), got {tuple(slots.shape)}, "
            f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
    if (
        slots.dtype != torch.int64
        or block_table.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
    ):
        raise ValueError("slots must be int64, block_table and seq_lens int32, cos and sin float32")


def mla_attention(
    x: torch.Tensor,
    weights: MLAWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    norms: tuple[torch.Tensor, float, torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    key_cache: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One MLA layer's attention for the M decode tokens x [M, hidden] (bf16), each its own
    sequence of block_table [M, max_blocks] / seq_lens [M] (int32), whose cache rows it writes at
    slots [M] (int64, -1 skips) before attending: engine/models/mla.py's decode path in one call,
    with its bits. cos/sin [M, R/2] float32, kv_cache [blocks, block_size, L+R] bf16 contiguous
    -> [M, hidden] bf16. norms (the decoder layer's input and post-attention RMSNorms: weight [hidden],
    eps, weight, eps): x is then the layer's input before its norm, added to `residual` (None in the
    first layer) as DecoderLayer does, and -> (the post-attention norm's output, the new residual
    stream), the bits of the two norms' own calls. With an indexer in the weights (DeepSeek-V3.2),
    key_cache [blocks, block_size, dI] bf16 contiguous is the layer's indexer-key cache: each
    token's key is stored there, and a token whose context is longer than the indexer's topk
    attends over the slots it chose (engine/models/deepseek_v32.py's path, its bits). Requires
    `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    w = weights
    rows, hidden = x.shape
    heads, width, latent = w.heads, kv_cache.shape[-1], w.kv_lora_rank
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    if (
        hidden != w.kv_a.shape[1]
        or width != latent + w.rope_dim
        or cos.shape != (rows, w.rope_dim // 2)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"x must be [M, hidden={w.kv_a.shape[1]}], kv_cache rows L+R = {latent + w.rope_dim} wide and "
            f"cos/sin [M={rows}, R/2], got {tuple(x.shape)}, {tuple(kv_cache.shape)}, {tuple(cos.shape)} "
            f"and {tuple(sin.shape)}"
        )
    _check_step(rows, cos, sin, slots, block_table, seq_lens)
    if not (native.takes(x, kv_cache) and x.is_contiguous() and kv_cache.is_contiguous()):
        raise ValueError("x and kv_cache must be contiguous CPU bfloat16")
    if norms is not None and not (
        norms[0].shape == norms[2].shape == (hidden,)
        and native.takes(norms[0], norms[2], residual)
        and (residual is None or (residual.shape == x.shape and residual.is_contiguous()))
    ):
        raise ValueError(
            f"the norms' weights must be [hidden={hidden}] and the residual like x, CPU bfloat16"
        )
    _check_key_cache(w.indexer, key_cache, kv_cache.shape)
    slots, block_table, seq_lens = slots.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(rows, hidden, dtype=torch.bfloat16)
    stream = None if norms is None else torch.empty(rows, hidden, dtype=torch.bfloat16)  # the new residual
    if rows == 0:
        return out if stream is None else (out, stream)
    pre, pre_eps, post, post_eps = norms if norms is not None else (None, 0.0, None, 0.0)
    bad = native._library.mla_attention(
        x.data_ptr(), rows, hidden,
        native.weight_args(w.q_a), 0 if w.q_a_norm is None else w.q_a_norm.data_ptr(),
        w.q_lora_rank, w.q_eps, native.weight_args(w.q_b),
        native.weight_args(w.kv_a), w.kv_a_norm.data_ptr(), w.kv_eps,
        native.weight_args(w.w_uk_t), *native.batch_strides(w.w_uk_t),
        native.weight_args(w.w_uv), *native.batch_strides(w.w_uv), native.weight_args(w.o_proj),
        cos.data_ptr(), sin.data_ptr(), w.interleaved,
        kv_cache.data_ptr(), num_blocks, block_size,
        slots.data_ptr(), block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(),
        out.data_ptr(), heads, w.nope_dim, w.rope_dim, latent, w.v_dim, w.scale,
        0 if pre is None else pre.data_ptr(), pre_eps, 0 if residual is None else residual.data_ptr(),
        0 if post is None else post.data_ptr(), post_eps, 0 if stream is None else stream.data_ptr(),
        0 if w.indexer is None else w.indexer.plan.data_ptr(), 0 if w.indexer is None else key_cache.data_ptr(),
    )  # fmt: skip
    if bad:
        raise ValueError(
            f"{bad} block ids or slots lie outside the cache's {num_blocks} blocks of {block_size}"
        )
    return out if stream is None else (out, stream)


def _check_key_cache(
    indexer: IndexerWeights | None, cache: torch.Tensor | None, latent_shape: torch.Size
) -> None:
    """A layer with an indexer needs its key cache: contiguous CPU bf16 [blocks, block_size, dI],
    the latent cache's blocks (the same block table addresses both); a layer without one, none."""
    if indexer is None:
        if cache is not None:
            raise ValueError("a key cache was given to a layer without an indexer")
        return
    want = (latent_shape[0], latent_shape[1], indexer.dim)
    if cache is None or cache.shape != want or not (native.takes(cache) and cache.is_contiguous()):
        raise ValueError(
            f"a layer with an indexer needs its key cache, contiguous CPU bfloat16 {want}, got "
            f"{None if cache is None else (cache.dtype, tuple(cache.shape))}"
        )


def _check_routing(num_experts: int, n_group: int, topk_group: int, top_k: int) -> None:
    if n_group < 1 or num_experts % n_group or not 0 < top_k <= num_experts or not 0 < topk_group <= n_group:
        raise ValueError(
            f"E={num_experts} must split into n_group={n_group} groups, 0 < topk_group={topk_group} <= n_group "
            f"and 0 < top_k={top_k} <= E"
        )


def route(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert routing from the scores on: scores [T, E] float32 (after the sigmoid or softmax),
    bias [E] float32 or None -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64),
    kernels/gate.py grouped_topk_ref's values bit for bit. For a decode step's few tokens (one
    call for the reference's dozen small ops). Requires `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    num_tokens, num_experts = scores.shape
    if (
        scores.dtype != torch.float32
        or not scores.is_cpu
        or (bias is not None and bias.dtype != torch.float32)
    ):
        raise ValueError(
            f"scores and bias must be CPU float32, got {scores.dtype} and {getattr(bias, 'dtype', None)}"
        )
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"bias must be [E={num_experts}], got {tuple(bias.shape)}")
    _check_routing(num_experts, n_group, topk_group, top_k)
    scores = scores.contiguous()
    bias = None if bias is None else bias.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    native._library.route(
        scores.data_ptr(), 0 if bias is None else bias.data_ptr(), num_tokens, num_experts, n_group, topk_group,
        top_k, norm_topk_prob, routed_scaling_factor, ids.data_ptr(), weights.data_ptr(),
    )  # fmt: skip
    return weights, ids


@dataclass(frozen=True)
class MoEWeights:
    """One MoE layer as moe_block takes it: the router in float32, its routing, and the experts in
    bf16 with unit stride along their last dimension, or kept quantized (native.takes_weight).
    Built by engine/models/moe.py once the weights are loaded."""

    gate: torch.Tensor  # [E, hidden] float32
    bias: torch.Tensor | None  # [E] float32: V3's score correction, or None
    softmax: bool  # scores: softmax over the experts (V2), else the sigmoid (V3)
    n_group: int
    topk_group: int
    top_k: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    w13: torch.Tensor | QuantWeight  # [E, 2I, hidden]
    w2: torch.Tensor | QuantWeight  # [E, hidden, I]
    shared: (
        tuple[torch.Tensor | QuantWeight, torch.Tensor | QuantWeight] | None
    )  # w13 [2Is, hidden], w2 [hidden, Is]

    def __post_init__(self):
        num_experts, hidden = self.gate.shape
        if self.gate.dtype != torch.float32 or self.gate.stride(1) != 1 or not self.gate.is_cpu:
            raise ValueError(f"gate must be CPU float32 with unit stride, got {self.gate.dtype}")
        if self.bias is not None and (self.bias.dtype != torch.float32 or self.bias.shape != (num_experts,)):
            raise ValueError(
                f"bias must be [E={num_experts}] float32, got {tuple(self.bias.shape)} {self.bias.dtype}"
            )
        if self.w13.shape[0] != num_experts or self.w13.shape[2] != hidden:
            raise ValueError(f"w13 must be [E={num_experts}, 2I, H={hidden}], got {tuple(self.w13.shape)}")
        _check_routing(num_experts, self.n_group, self.topk_group, self.top_k)


def moe_block(x: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """DeepseekMoE.forward for a decode step's few tokens in one call: the router's product,
    scores, `route` and the experts with `moe_topk` (the shared one with them). x [T, hidden] CPU
    bf16 -> [T, hidden]. The router's float32 sums go in the kernel's order (torch's BLAS has its
    own), so a logit can differ in its last bits from the torch path's; each token gets the same
    operations whatever T is. Requires `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    out = torch.zeros_like(x)
    num_tokens, hidden, num_experts, inter = _check_experts(x, w.w13, w.w2, out, w.shared)
    if num_tokens:
        native._library.moe_block(
            x.data_ptr(), x.stride(0), num_tokens, hidden, w.gate.data_ptr(), w.gate.stride(0),
            0 if w.bias is None else w.bias.data_ptr(), num_experts, w.softmax,
            w.n_group, w.topk_group, w.top_k, w.norm_topk_prob, w.routed_scaling_factor,
            *_experts_args(w.w13, w.w2), out.data_ptr(), out.stride(0), inter, *_shared_weight_args(w.shared),
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as decode_stack takes it: its attention, its two norms (weight [hidden]
    bf16, eps) and its MLP: the MoE block, or a dense SwiGLU MLP's (gate_up [2I, hidden], down
    [hidden, I]) in bf16 with unit stride along their last dimension."""

    attention: MLAWeights
    input_norm: tuple[torch.Tensor, float]
    post_attention_norm: tuple[torch.Tensor, float]
    mlp: MoEWeights | tuple[torch.Tensor, torch.Tensor]


_ROUTED_FIELDS = (
    "moe gate ld_gate bias experts softmax n_group topk_group top_k norm_topk_prob w13_expert w13_scale_expert "
    "w2_expert w2_scale_expert inter"
).split() + [
    *_plan_weight("w13", None),
    *_plan_weight("w2", None),
]  # a LayerPlan's MoE fields, 0 in a dense layer's


class DecodeStack:
    """A model's decoder layers, its embedding [V, hidden] and its final norm as decode_stack takes
    them: one row of pointers and sizes per layer (the native LayerPlan, filled by its field names),
    checked and filled once; built by engine/models/deepseek_v2.py once the weights are loaded.
    Holds the tensors it points into."""

    def __init__(self, layers: list[StackLayer], embed: torch.Tensor, norm: tuple[torch.Tensor, float]):
        assert native._library is not None, "kernels.native.load() first"
        vocab, hidden = embed.shape
        if not (layers and native.takes(embed) and embed.is_contiguous() and norm[0].shape == (hidden,)):
            raise ValueError(
                f"a stack needs layers, a contiguous CPU bf16 embedding and a final norm [hidden={hidden}]"
            )
        first = layers[0].attention
        self.width = first.kv_lora_rank + first.rope_dim
        self.rope_dim, self.hidden, self.vocab = first.rope_dim, hidden, vocab
        self.embed, self.norm = embed, norm
        self.layers = layers
        fields = native._library.layer_plan_fields()
        self.plan = torch.stack([_plan_row(fields, self._fields(layer)) for layer in layers])
        self.indexed = [layer.attention.indexer is not None for layer in layers]
        if any(self.indexed) and not all(self.indexed):
            raise ValueError("a stack's layers must all have an indexer, or none")
        self._kv: tuple[tuple[int, ...], torch.Tensor] = ((), torch.empty(0, dtype=torch.int64))

    def _fields(self, layer: StackLayer) -> dict[str, int | float]:
        w, hidden = layer.attention, self.hidden
        (pre, pre_eps), (post, post_eps) = layer.input_norm, layer.post_attention_norm
        if (
            w.kv_a.shape[1] != hidden
            or w.kv_lora_rank + w.rope_dim != self.width
            or w.rope_dim != self.rope_dim
        ):
            raise ValueError(
                f"every layer must take hidden={hidden} and cache rows {self.width} wide, "
                f"got {w.kv_a.shape[1]} and {w.kv_lora_rank + w.rope_dim}"
            )
        if not (pre.shape == post.shape == (hidden,) and native.takes(pre, post)):
            raise ValueError(f"the norms' weights must be [hidden={hidden}] CPU bfloat16")
        fields: dict[str, int | float] = dict(
            **_plan_weight("qa", w.q_a), **_plan_weight("qb", w.q_b), **_plan_weight("kva", w.kv_a),
            **_plan_weight("o", w.o_proj),
            qa_norm=0 if w.q_a_norm is None else w.q_a_norm.data_ptr(),
            q_lora=w.q_lora_rank, kva_norm=w.kv_a_norm.data_ptr(),
            **_plan_weight("wuk", w.w_uk_t), **_plan_weight("wuv", w.w_uv),
            **dict(zip(("wuk_h", "wuk_scale_h"), native.batch_strides(w.w_uk_t), strict=True)),
            **dict(zip(("wuv_h", "wuv_scale_h"), native.batch_strides(w.w_uv), strict=True)),
            heads=w.heads, nope=w.nope_dim, rope=w.rope_dim, latent=w.kv_lora_rank, v=w.v_dim,
            interleaved=int(w.interleaved), pre_norm=pre.data_ptr(), post_norm=post.data_ptr(),
            indexer=0 if w.indexer is None else w.indexer.plan.data_ptr(),
            q_eps=w.q_eps, kv_eps=w.kv_eps, scale=w.scale, pre_eps=pre_eps, post_eps=post_eps,
        )  # fmt: skip
        routed = dict.fromkeys(_ROUTED_FIELDS, 0)
        if isinstance(layer.mlp, MoEWeights):
            m = layer.mlp
            none = torch.empty(0, hidden, dtype=torch.bfloat16)
            num_experts, inter = _check_experts(none, m.w13, m.w2, none, m.shared)[2:]
            routed.update(
                moe=1, gate=m.gate.data_ptr(), ld_gate=m.gate.stride(0),
                bias=0 if m.bias is None else m.bias.data_ptr(), experts=num_experts, softmax=int(m.softmax),
                n_group=m.n_group, topk_group=m.topk_group, top_k=m.top_k, norm_topk_prob=int(m.norm_topk_prob),
                **_plan_weight("w13", m.w13), **_plan_weight("w2", m.w2), inter=inter,
            )  # fmt: skip
            routed["w13_expert"], routed["w13_scale_expert"] = _expert_strides(m.w13)
            routed["w2_expert"], routed["w2_scale_expert"] = _expert_strides(m.w2)
            shared, fields["routed_scaling_factor"] = m.shared, m.routed_scaling_factor
        else:
            w13, w2 = shared = layer.mlp
            inter = w2.shape[-1]
            if (
                w13.shape != (2 * inter, hidden)
                or w2.shape[0] != hidden
                or not (native.takes_weight(w13) and native.takes_weight(w2))
            ):
                raise ValueError(
                    f"a dense MLP must be gate_up [2I, H={hidden}] and down [H, I], CPU bfloat16 with unit "
                    f"stride along the last dimension or kept quantized as native.takes_weight says, got "
                    f"{tuple(w13.shape)} and {tuple(w2.shape)}"
                )
            fields["routed_scaling_factor"] = 0.0
        s13, s2, shared_inter = _shared_weight_args(shared)
        fields.update(
            routed,
            **dict(zip(_plan_weight("s13", None), s13, strict=True)),
            **dict(zip(_plan_weight("s2", None), s2, strict=True)),
            shared_inter=shared_inter,
        )
        return fields

    def takes_rows(self, rows: int) -> bool:
        """Whether M = rows tokens take every product natively, in every layer (as the layers' own
        calls would)."""
        return native._few_enough(rows)

    def kv_pointers(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The layers' caches' addresses, int64 [layers] (or [2, layers] with their key caches, the
        last step's when they are the same)."""
        pointers = tuple(c.data_ptr() for c in kv_caches)
        if pointers != self._kv[0]:
            self._kv = (pointers, torch.tensor(pointers, dtype=torch.int64).view(-1, len(self.layers)))
        return self._kv[1]


def _check_caches(stack: DecodeStack, kv_caches: list[torch.Tensor]) -> torch.Size:
    """A cache per layer of the stack, all alike -> their shape [blocks, block_size, L+R]."""
    shape = kv_caches[0].shape if kv_caches else None
    if (
        len(kv_caches) != len(stack.layers)
        or shape is None
        or len(shape) != 3
        or shape[2] != stack.width
        or not all(c.shape == shape and native.takes(c) and c.is_contiguous() for c in kv_caches)
    ):
        raise ValueError(
            f"kv_caches must be {len(stack.layers)} contiguous CPU bfloat16 caches [blocks, block_size, "
            f"{stack.width}], all alike"
        )
    return shape


def _cache_pointers(
    stack: DecodeStack,
    kv_caches: list[torch.Tensor],
    key_caches: list[torch.Tensor] | None,
    shape: torch.Size,
) -> tuple[int, int]:
    """The addresses of the arrays of the stack's layers' latent caches and of their indexer-key
    caches (0 where the layers have no indexer), each key cache checked against its layer."""
    indexed = any(stack.indexed)
    if indexed and (key_caches is None or len(key_caches) != len(kv_caches)):
        raise ValueError(f"a stack with indexers needs a key cache per layer ({len(kv_caches)})")
    for layer, cache in zip(stack.layers, key_caches or [None] * len(kv_caches), strict=True):
        _check_key_cache(layer.attention.indexer, cache, shape)
    pointers = stack.kv_pointers([*kv_caches, *(key_caches if indexed else [])])
    return pointers[0].data_ptr(), pointers[1].data_ptr() if indexed else 0


def decode_stack(
    stack: DecodeStack,
    ids: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: list[torch.Tensor],
    slots: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    x: torch.Tensor | None = None,
    key_caches: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The model's forward for M decode tokens in one call: embedding, every layer (mla_attention
    with the layer's norms, then moe_block or the dense MLP), the final norm -> hidden states [M,
    hidden] bf16, the layer by layer calls' bits. ids [M] int64, or None and x [M, hidden] bf16 the
    first layer's input (an MTP layer's u); cos, sin, slots, block_table and seq_lens as
    mla_attention takes them; kv_caches: a cache per layer, each contiguous bf16 [blocks,
    block_size, L+R] and all alike; key_caches: where the layers have indexers (DeepSeek-V3.2), a
    key cache per layer as mla_attention takes it. Requires `loaded()`."""
    assert native._library is not None, "kernels.native.load() first"
    if (ids is None) == (x is None):
        raise ValueError("give ids or x, not both")
    if ids is not None:
        rows = ids.shape[0]
        if ids.shape != (rows,) or ids.dtype != torch.int64:
            raise ValueError(f"ids must be int64 [M], got {ids.dtype} {tuple(ids.shape)}")
    else:
        rows = x.shape[0]
        if x.shape != (rows, stack.hidden) or not native.takes(x):
            raise ValueError(
                f"x must be CPU bfloat16 [M, hidden={stack.hidden}], got {x.dtype} {tuple(x.shape)}"
            )
    if cos.shape != (rows, stack.rope_dim // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must be [M={rows}, R/2={stack.rope_dim // 2}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    _check_step(rows, cos, sin, slots, block_table, seq_lens)
    shape = _check_caches(stack, kv_caches)
    kv_ptrs, keys_ptrs = _cache_pointers(stack, kv_caches, key_caches, shape)
    slots, block_table, seq_lens = slots.contiguous(), block_table.contiguous(), seq_lens.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    ids, x = (None if t is None else t.contiguous() for t in (ids, x))
    out = torch.empty(rows, stack.hidden, dtype=torch.bfloat16)
    if rows == 0:
        return out
    norm, norm_eps = stack.norm
    bad = native._library.decode_stack(
        stack.plan.data_ptr(), len(stack.layers), 0 if ids is None else ids.data_ptr(),
        0 if x is None else x.data_ptr(), stack.embed.data_ptr(), stack.vocab, rows,
        stack.hidden, cos.data_ptr(), sin.data_ptr(), kv_ptrs, keys_ptrs, shape[0], shape[1],
        slots.data_ptr(), block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), norm.data_ptr(),
        norm_eps, out.data_ptr(),
    )  # fmt: skip
    if bad < 0:
        raise ValueError(f"{-bad} token ids lie outside [0, {stack.vocab})")
    if bad:
        raise ValueError(f"{bad} block ids or slots lie outside the cache's {shape[0]} blocks of {shape[1]}")
    return out


@dataclass(frozen=True)
class MTPDrafter:
    """What greedy_spec_step runs besides the target's stack: the MTP layer as a one-layer stack
    (its final norm the shared head's), its input's norms and eh_proj [H, 2H] (as mtp_input takes
    them), the LM head [V', H] with the vocabulary its argmax reads (the first `vocab` logits), and
    the rope tables [P, R/2] float32 its later drafts' positions are read from; with a draft
    vocabulary, the LM head's rows of its tokens draft_ids [N] (int64, each in [0, vocab)) as
    draft_head [N, H], whose argmax the drafts take instead of the whole vocabulary's. Built by
    engine/models/deepseek_v2.py once the weights are loaded."""

    stack: DecodeStack
    enorm: tuple[torch.Tensor, float]
    hnorm: tuple[torch.Tensor, float]
    eh_proj: torch.Tensor
    lm_head: torch.Tensor
    vocab: int
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    draft_head: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None

    def __post_init__(self):
        h = self.stack.hidden
        if (
            len(self.stack.layers) != 1
            or self.enorm[0].shape != (h,)
            or self.hnorm[0].shape != (h,)
            or self.eh_proj.shape != (h, 2 * h)
            or self.lm_head.shape[1] != h
            or not 0 < self.vocab <= self.lm_head.shape[0]
            or self.rope_cos.shape != (self.rope_cos.shape[0], self.stack.rope_dim // 2)
            or self.rope_sin.shape != self.rope_cos.shape
        ):
            raise ValueError(
                f"an MTP drafter needs one layer, norms [H={h}], eh_proj [H, 2H], an LM head [V' >= vocab, H] and "
                f"rope tables [P, R/2]"
            )
        tensors = (self.enorm[0], self.hnorm[0], self.eh_proj, self.lm_head)
        if not all(native.takes(t) and t.is_contiguous() for t in tensors):
            raise ValueError("an MTP drafter's norms, eh_proj and LM head must be contiguous CPU bfloat16")
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (self.rope_cos, self.rope_sin)):
            raise ValueError("an MTP drafter's rope tables must be contiguous float32")
        if (self.draft_head is None) != (self.draft_ids is None):
            raise ValueError("an MTP drafter's draft vocabulary needs both draft_head and draft_ids")
        if self.draft_head is not None:
            ids, head = self.draft_ids, self.draft_head
            if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or ids.numel() < 1:
                raise ValueError("an MTP drafter's draft_ids must be a non-empty contiguous int64 vector")
            if head.shape != (ids.numel(), h) or not (native.takes(head) and head.is_contiguous()):
                raise ValueError(
                    "an MTP drafter's draft_head must be contiguous CPU bfloat16 [len(draft_ids), H]"
                )
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
                raise ValueError(f"an MTP drafter's draft_ids must lie in [0, vocab={self.vocab})")


def greedy_spec_step(
    target: DecodeStack,
    drafter: MTPDrafter,
    ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    mtp_cache: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_len: int,
    caps: list[int],
    k: int,
    key_caches: list[torch.Tensor] | None = None,
    mtp_key_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy speculative decode step in one call: R = len(caps) requests, each query_len rows
    of ids [M = R * query_len] (its last known token, then the drafts it verifies) at positions
    [M] (their cos and sin read from the drafter's rope tables), with slots, block_table and
    seq_lens as decode_stack takes them; kv_caches: the target's layers' caches, mtp_cache the MTP
    layer's. The target verifies, then the MTP layer writes its cache rows for each request's
    known positions and drafts up to min(k, caps[r] - emitted) tokens (caps:
    engine/spec_decode/drafter.py draft_cap).
    -> (tokens [M]: the target's greedy token after each row; accepted [R]: the drafts accepted,
    a, so request r emits tokens[r * query_len : r * query_len + a + 1]; drafts [R, k]: its next
    drafts, -1 past its room), all int64: verify_greedy's and draft_with_mtp's tokens and cache
    rows, bit for bit. With indexers (DeepSeek-V3.2), key_caches and mtp_key_cache are the layers'
    and the MTP layer's indexer-key caches, as decode_stack takes them."""
    assert native._library is not None, "kernels.native.load() first"
    rows, requests = ids.shape[0], len(caps)
    if ids.shape != (rows,) or positions.shape != (rows,) or not ids.dtype == positions.dtype == torch.int64:
        raise ValueError(
            f"ids and positions must be int64 [M], got {tuple(ids.shape)} and {tuple(positions.shape)}"
        )
    if query_len < 1 or rows != requests * query_len or k < 0:
        raise ValueError(
            f"M={rows} rows must be {requests} requests of query_len={query_len} >= 1, k={k} >= 0"
        )
    if drafter.stack.rope_dim != target.rope_dim or drafter.stack.hidden != target.hidden:
        raise ValueError("the MTP layer's rope dimension and hidden size must be the target's")
    _check_step(rows, drafter.rope_cos, drafter.rope_sin, slots, block_table, seq_lens)
    shape = _check_caches(target, kv_caches)
    if _check_caches(drafter.stack, [mtp_cache]) != shape:
        raise ValueError("the MTP layer's cache must be like the target's")
    kv_ptrs, keys_ptrs = _cache_pointers(target, kv_caches, key_caches, shape)
    mtp_keys = None if mtp_key_cache is None else [mtp_key_cache]
    mtp_kv_ptrs, mtp_keys_ptrs = _cache_pointers(drafter.stack, [mtp_cache], mtp_keys, shape)
    ids, positions, slots, block_table, seq_lens = (
        t.contiguous() for t in (ids, positions, slots, block_table, seq_lens)
    )
    caps_t = torch.tensor(caps, dtype=torch.int64)
    tokens = torch.empty(rows, dtype=torch.int64)
    accepted = torch.empty(requests, dtype=torch.int64)
    drafts = torch.empty(requests, k, dtype=torch.int64)
    if rows == 0:
        return tokens, accepted, drafts
    norm, norm_eps = target.norm
    mtp_norm, mtp_eps = drafter.stack.norm
    if drafter.draft_head is None:  # the whole vocabulary's argmax, as the target's tokens take it
        draft_head, draft_vocab, draft_ids = drafter.lm_head, drafter.vocab, 0
    else:
        draft_head, draft_vocab = drafter.draft_head, drafter.draft_head.shape[0]
        draft_ids = drafter.draft_ids.data_ptr()
    bad = native._library.greedy_spec_step(
        target.plan.data_ptr(), len(target.layers), ids.data_ptr(), target.embed.data_ptr(), target.vocab, rows,
        target.hidden, kv_ptrs, keys_ptrs, mtp_keys_ptrs, shape[0], shape[1], slots.data_ptr(),
        block_table.data_ptr(), block_table.shape[1], seq_lens.data_ptr(), norm.data_ptr(), norm_eps,
        drafter.lm_head.data_ptr(), drafter.lm_head.shape[0], drafter.vocab, drafter.stack.plan.data_ptr(),
        mtp_kv_ptrs, mtp_norm.data_ptr(), mtp_eps,
        drafter.enorm[0].data_ptr(), drafter.enorm[1], drafter.hnorm[0].data_ptr(), drafter.hnorm[1],
        drafter.eh_proj.data_ptr(), drafter.rope_cos.data_ptr(), drafter.rope_sin.data_ptr(),
        drafter.rope_cos.shape[0], target.rope_dim // 2, requests, query_len, positions.data_ptr(),
        caps_t.data_ptr(), k, draft_head.data_ptr(), draft_head.shape[0], draft_vocab, draft_ids,
        tokens.data_ptr(), accepted.data_ptr(), drafts.data_ptr(),
    )  # fmt: skip
    if bad < 0:
        raise ValueError(f"{-bad} token ids lie outside [0, {target.vocab})")
    if bad:
        raise ValueError(
            f"{bad} block ids, slots or positions lie outside the cache's {shape[0]} blocks of {shape[1]}, the "
            f"block table or the rope tables' {drafter.rope_cos.shape[0]} positions"
        )
    return tokens, accepted, drafts
