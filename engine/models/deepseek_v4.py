"""DeepSeek-V4 (V4-Flash): shared-KV attention over a sliding window plus compressed history,
hyper-connections instead of a plain residual, hash-routed and sqrt-softplus-routed MoE.

One layer (the model notes, ../shared/models/deepseek-v32-v4.md, have the equations):

    X [N, hc, H]  -- hc residual streams per token (hc_mult, 4)
    post, comb, u = attn_hc(X)              u: the streams collapsed by sigmoid weights
    X = post * Attention(RMSNorm(u)) + comb^T X
    post, comb, u = ffn_hc(X)
    X = post * MoE(RMSNorm(u)) + comb^T X

and after the last layer hc_head collapses the streams, RMSNorm, LM head.

Attention has one 512-wide head shared by every query head (K = V), roped on its trailing
qk_rope_head_dim elements (interleaved pairs), and a learnt sink logit per head. Every layer attends
to the last `sliding_window` tokens; a CSA layer also to the `index_topk` compressed entries its
lightning indexer picks (one entry per 4 tokens, pooled over overlapping 8-token windows), an HCA
layer to every compressed entry (one per 128 tokens). A query at position t sees entry w only once
the entry is complete: w < (t + 1) // m. The output's rope slice is rotated back by -t and goes
through the grouped low-rank output projection.

Caches (`kv_cache_spec`): the window's K=V rows in a sliding-window table (blocks behind the window
go back to the pool as a request runs), the CSA entries and the CSA indexer keys in one compressed
table (m = 4), the HCA entries in another (m = 128), and per request and layer each compressor's
state: the pre-pooling rows of the tokens its next entry still needs (`ring_shape`).
Every entry is written by the token that completes it, so chunked prefill at any split and decode
write what one full pass writes.

This is the PyTorch path (per request attention; the MoE an expert loop), exact against
transformers' DeepseekV4ForCausalLM. The released checkpoints' FP8 projections and MXFP4 experts
are kept as stored (kernels/quant.py QuantWeight); MTP is not run yet (refused by name).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind, StateSpec
from engine.kv_cache.spec import KVCaches, KVCacheSpec
from engine.models.layers import Embedding, Linear, _param
from engine.models.moe import FusedExperts
from engine.models.registry import register_model
from engine.quant import QuantSpec
from engine.sampler import argmax
from engine.spec_decode.config import MAX_SPECULATIVE_TOKENS
from kernels import v4 as v4_kernels
from kernels.linear import linear
from kernels.rotary import rope_cos_sin_cache

if TYPE_CHECKING:
    from engine.parallel.ep_moe import ExpertParallel

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
FP32 = torch.float32

STATE_CSA, STATE_CSA_INDEXER, STATE_HCA = "csa_compressor", "csa_indexer", "hca_compressor"
"""The per-request compressor states of the KV cache spec."""


# ---- small pieces ------------------------------------------------------------------------------


def layer_type(cfg: ModelConfig, layer_idx: int) -> str:
    """A main layer's attention type; the MTP layers after them (layer_idx >= num_hidden_layers)
    are sliding-window layers (and route by score, not by hash)."""
    types = cfg.v4.layer_types
    return types[layer_idx] if layer_idx < len(types) else SLIDING


class RMSNorm32(nn.Module):
    """RMSNorm with its weight in float32 and the product taken there (V4 keeps its norms so)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim, dtype=FP32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] elements of x [N, ..., D] as interleaved pairs
    (x0, x1), (x2, x3), ... by the angles of cos / sin [N, R/2]; in float32, back in x's dtype."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    c, s = cos.view(shape), sin.view(shape)
    pairs = x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection (mHC) around one block: from the hc streams X [N, hc,
    H] the block's input (a sigmoid-weighted sum of the streams), the weights that spread its
    output over the streams (post) and the doubly stochastic stream mixing (comb, Sinkhorn)."""

    def __init__(self, hc: int, hidden: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        self.fn = _param((2 + hc) * hc, hc * hidden, dtype=FP32)
        self.base = _param((2 + hc) * hc, dtype=FP32)
        self.scale = _param(3, dtype=FP32)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, hc, H] -> (post [N, hc], comb [N, hc, hc] float32, block input [N, H])
        (kernels/v4.py hc_pre: one native call for a CPU's bf16 streams, Triton on CUDA)."""
        return v4_kernels.hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)

    @staticmethod
    def merge(
        streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """The streams after the block: post_j * out + sum_i comb[i, j] * X_i."""
        return v4_kernels.hc_merge(streams, post, comb, out)


class HyperHead(nn.Module):
    """The final collapse of the streams before the last norm."""

    def __init__(self, hc: int, hidden: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = _param(hc, hc * hidden, dtype=FP32)
        self.hc_base = _param(hc, dtype=FP32)
        self.hc_scale = _param(1, dtype=FP32)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedMLP(nn.Module):
    """The shared expert: SwiGLU with the gate clamped from above and the up projection both ways."""

    def __init__(self, hidden: int, inter: int, limit: float, *, dtype: torch.dtype, quant: QuantSpec | None):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = Linear(hidden, 2 * inter, dtype=dtype, quant=quant)
        self.down_proj = Linear(inter, hidden, dtype=dtype, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x), self.limit))


class Router(nn.Module):
    """sqrt(softplus) expert scores; a routed layer takes the top-k of score + correction bias, a
    hash layer the experts its table gives the token. Weights: the chosen scores, renormalised,
    times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        e = cfg.n_routed_experts
        self.hashed, self.top_k, self.scaling = hashed, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = _param(e, cfg.hidden_size, dtype=FP32)
        if hashed:
            self.tid2eid = _param(cfg.vocab_size, self.top_k, dtype=torch.int64)
        else:
            self.e_score_correction_bias = _param(e, dtype=FP32)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [N, k] float32, expert ids [N, k] int64)."""
        scores = F.softplus(F.linear(x.float(), self.weight)).sqrt()
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids


class MoE(nn.Module):
    """Routed experts (kept as the checkpoint stores them: bf16, FP8 or MXFP4) and the shared one,
    each a clamped SwiGLU; the routed ones an expert at a time over its tokens, or under expert
    parallelism on the ranks that hold them (engine/parallel/ep_moe.py; the hash layers' table
    names logical experts, placed like the scored ones')."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype, ep: ExpertParallel | None = None
    ):
        super().__init__()
        v4 = cfg.v4
        e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.layer_idx, self.ep, self.limit = layer_idx, ep, v4.swiglu_limit
        self.gate = Router(cfg, hashed=layer_idx < len(v4.hash_layers) and v4.hash_layers[layer_idx])
        num_local = ep.slots_per_rank if ep is not None else e
        self.experts = FusedExperts(
            num_local, h, inter, dtype=dtype, quant=QuantSpec.of(cfg.quant, experts=True)
        )
        self.shared_experts = ClampedMLP(
            h, inter, v4.swiglu_limit, dtype=dtype, quant=QuantSpec.of(cfg.quant)
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        if self.ep is not None:
            w13, w2 = self.experts.weights()
            out = self.ep.forward(self.layer_idx, x, weights, ids, w13, w2, experts=self.local)
        else:
            out = self.routed(x, weights, ids)
        return out + self.shared_experts(x)

    def local(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's rows [M, H], each through its local slot [M, 1], weight 1."""
        return self.routed(rows, torch.ones_like(slots, dtype=torch.float32), slots)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert ids[t, k] (x[t]), an expert (local slot) at a time."""
        out = torch.zeros_like(x)
        w13, w2 = self.experts.weights()
        for e in ids.unique().tolist():
            token, k = torch.where(ids == e)
            act = clamped_swiglu(linear(x[token], w13[e]), self.limit)
            out.index_add_(0, token, (linear(act, w2[e]) * weights[token, k, None]).to(x.dtype))
        return out


# ---- compressors -------------------------------------------------------------------------------


def ring_shape(m: int, overlap: bool, width: int) -> tuple[int, int]:
    """One request's and layer's compressor state: the rows (C | Z, 2 coff width) of the coff m
    positions its next entries read, and room for MAX_SPECULATIVE_TOKENS more -- a verification's
    rejected drafts then overwrite only rows no later token reads, so rejecting them rolls
    nothing back (and the spec is the same whether an engine drafts or not)."""
    coff = 2 if overlap else 1
    return (coff * m + MAX_SPECULATIVE_TOKENS, 2 * coff * width)


class Compressor(nn.Module):
    """Pools each m consecutive tokens into one entry: C = x W_kv, Z = x W_gate + position_bias[p
    mod m]; entry w = RMSNorm(sum_s softmax_s(Z) * C) over its tokens (per channel), roped at
    position w * m. With `overlap` (CSA) each token projects twice the width: its first half joins
    the next window's entry, its second half its own, so an entry pools 2m slots (window w - 1's
    first halves, window w's second halves; entry 0 only its own m).

    A request's state: the projected rows (C | Z) of the tokens its next entry still reads, a ring
    of `coff * m` rows indexed by position mod coff * m."""

    def __init__(self, hidden: int, width: int, m: int, overlap: bool, rope_dim: int, eps: float):
        super().__init__()
        self.width, self.m, self.overlap, self.rope_dim = width, m, overlap, rope_dim
        self.coff = 2 if overlap else 1
        self.kv_proj = Linear(hidden, self.coff * width, dtype=FP32)
        self.gate_proj = Linear(hidden, self.coff * width, dtype=FP32)
        self.position_bias = _param(m, self.coff * width, dtype=FP32)
        self.kv_norm = RMSNorm32(width, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every token of the step at once: x [N, H] -> its pre-pooling row [N, 2 coff width], C
        then Z + position_bias[p mod m], float32."""
        xf = x.float()
        return torch.cat(
            (self.kv_proj(xf), self.gate_proj(xf) + self.position_bias[positions % self.m]), dim=-1
        )

    def compress(
        self,
        rows: torch.Tensor,
        start: int,
        state: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        snapshots: list[tuple[int, torch.Tensor]] = (),
    ) -> tuple[int, torch.Tensor]:
        """Tokens [start, start + n) of one request (their `project` rows [n, 2 coff width]) -> (first
        entry, entries [k, width] float32) they complete, roped with the table cos / sin [P, R/2];
        the state (a view [coff m, 2 coff width]) is updated in place, and each snapshot (b, view)
        of a boundary start < b <= start + n gets the state after token b - 1."""
        n, m, cw = rows.shape[0], self.m, self.coff * self.width
        end = start + n
        kv, gate, device = rows[:, :cw], rows[:, cw:], rows.device
        first, last = start // m, end // m  # entries [first, last) complete in this chunk
        entries = kv.new_empty(0, self.width)
        if last > first:
            ring = state.shape[0]
            lo = max(0, (first - self.coff + 1) * m)  # the first token they read
            held = torch.arange(lo, start, device=device) % ring
            all_kv = torch.cat((state[held, :cw], kv))  # positions lo .. end - 1
            all_gate = torch.cat((state[held, cw:], gate))
            ws = torch.arange(first, last, device=device)
            own = (ws * m - lo)[:, None] + torch.arange(m, device=device)  # [k, m] rows of each window
            kv_s, gate_s = all_kv[own][..., -self.width :], all_gate[own][..., -self.width :]
            if self.overlap:
                prev = (own - m).clamp(min=0)
                kv_a, gate_a = all_kv[prev][..., : self.width], all_gate[prev][..., : self.width].clone()
                gate_a[ws == 0] = float("-inf")  # entry 0 has no previous window
                kv_a = kv_a.masked_fill((ws == 0)[:, None, None], 0.0)
                kv_s, gate_s = torch.cat((kv_a, kv_s), dim=1), torch.cat((gate_a, gate_s), dim=1)
            pooled = v4_kernels.compress_pool(kv_s, gate_s, self.kv_norm.weight, self.kv_norm.eps)
            entries = rope_tail(pooled, cos[ws * m], sin[ws * m])
        ring = state.shape[0]
        for b, snap in snapshots:  # before the state moves on: it holds the rows before start
            first_row = max(0, b - ring)  # the ring after b holds positions [b - ring, b)
            held = torch.arange(min(first_row, start), start, device=device)
            snap.zero_()
            snap[held % ring] = state[held % ring]
            new = torch.arange(max(first_row, start), b, device=device)
            snap[new % ring] = rows[new - start]
        keep = torch.arange(max(start, end - ring), end, device=device)
        state[keep % ring] = rows[keep - start]
        return first, entries


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int):
        super().__init__()
        self.weights_proj = Linear(hidden, n_heads, dtype=FP32)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim gives one key per
    entry; a query scores entry w as sum_h (x W_w)_h nI^-1/2 ReLU(q_h . K_w) dI^-1/2 and keeps the
    index_topk best of the complete ones."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        v4 = cfg.v4
        super().__init__(cfg.hidden_size, v4.index_head_dim, v4.csa_rate, True, v4.rope_dim, cfg.rms_norm_eps)
        self.n_heads, self.topk = v4.index_n_heads, v4.index_topk
        q = QuantSpec.of(cfg.quant)  # FP8 in the released checkpoints, as the attention's
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * self.width, dtype=dtype, quant=q)
        self.scorer = IndexerScorer(cfg.hidden_size, self.n_heads)

    def queries(
        self, x: torch.Tensor, cq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step at once: x [N, H], cq [N, q_lora] (the query latent) -> (q [N,
        heads, dI] float32, roped; weights [N, heads] float32 with the reference's heads^-1/2)."""
        n = x.shape[0]
        q = rope_tail(self.q_b_proj(cq).float().view(n, self.n_heads, self.width), cos, sin)
        return q, self.scorer.weights_proj(x.float()) * self.n_heads**-0.5

    def pick(
        self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """One request's queries (`queries`' rows) over its keys [E, dI] -> visible [n, E] bool:
        the entries each query picked among the complete ones."""
        n, e = q.shape[0], keys.shape[0]
        scores = torch.relu(torch.einsum("nhd,ed->nhe", q, keys.float())) * self.width**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, E]
        complete = (positions + 1).div(self.m, rounding_mode="floor")[:, None]
        future = torch.arange(e, device=q.device)[None, :] >= complete
        picked = scores.masked_fill(future, float("-inf")).topk(min(self.topk, e), dim=-1).indices
        visible = torch.zeros(n, e, dtype=torch.bool, device=q.device)
        visible.scatter_(1, picked, True)
        return visible & ~future


class CSACompressor(Compressor):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        v4 = cfg.v4
        super().__init__(cfg.hidden_size, v4.head_dim, v4.csa_rate, True, v4.rope_dim, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, dtype)


class HCACompressor(Compressor):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        v4 = cfg.v4
        super().__init__(cfg.hidden_size, v4.head_dim, v4.hca_rate, False, v4.rope_dim, cfg.rms_norm_eps)


# ---- attention ---------------------------------------------------------------------------------


@dataclass
class Seq:
    """One request of the step, as every layer's attention reads it."""

    row: int
    """Its first row in the flat batch."""
    n: int
    start: int
    """The position of its first token in the step."""
    window_blocks: torch.Tensor
    """Its block table in the window table (null ids behind the window)."""
    tables: dict[int, torch.Tensor]
    """Spec table index -> its block table there (the compressed tables)."""
    state_row: int
    snapshots: list[tuple[int, int]]
    """(block boundary b, state row) to write the state after token b - 1 into."""


def step_seqs(batch: ForwardBatch) -> list[Seq]:
    seqs: list[Seq] = []
    rows = batch.state_rows.tolist() if batch.state_rows is not None else None
    snapshots = batch.snapshots

    def extra(i: int) -> tuple[int, list[tuple[int, int]]]:
        return (rows[i] if rows is not None else -1), (snapshots[i] if snapshots is not None else [])

    for gi, g in enumerate(batch.decodes):
        lens = g.seq_lens.tolist()
        for d in range(g.num_seqs):
            tables = {t.table: t.decode_tables[gi][d].long() for t in batch.tables}
            start = lens[d] - g.query_len
            row = g.start + d * g.query_len
            seqs.append(Seq(row, g.query_len, start, g.block_table[d].long(), tables, *extra(len(seqs))))
    for pi, p in enumerate(batch.prefills):
        tables = {t.table: t.prefill_blocks[pi] for t in batch.tables}
        seqs.append(Seq(p.q_start, p.q_len, p.ctx_len - p.q_len, p.block_ids, tables, *extra(len(seqs))))
    return seqs


def token_slots(blocks: torch.Tensor, block_size: int, first: int, end: int) -> torch.Tensor:
    """Cache rows (block id x block_size + offset) of entries [first, end) of a block table."""
    idx = torch.arange(first, end, device=blocks.device)
    return blocks[idx // block_size] * block_size + idx % block_size


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype):
        super().__init__()
        v4 = cfg.v4
        self.layer_type = layer_type(cfg, layer_idx)
        self.num_heads, self.head_dim, self.window = cfg.num_attention_heads, v4.head_dim, v4.sliding_window
        self.groups, self.eps = v4.o_groups, cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        q = QuantSpec.of(cfg.quant)  # the projections are FP8 in the released checkpoints
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype=dtype, quant=q)
        self.q_a_norm = RMSNorm32(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, dtype=dtype, quant=q)
        self.kv_proj = Linear(cfg.hidden_size, self.head_dim, dtype=dtype, quant=q)
        self.kv_norm = RMSNorm32(self.head_dim, cfg.rms_norm_eps)
        group_in = self.num_heads * self.head_dim // self.groups
        self.o_lora_rank = v4.o_lora_rank
        self.o_a_proj = Linear(group_in, self.groups * v4.o_lora_rank, dtype=dtype, quant=q)
        self.o_b_proj = Linear(self.groups * v4.o_lora_rank, cfg.hidden_size, dtype=dtype, quant=q)
        self.sinks = _param(self.num_heads, dtype=FP32)
        compressor = {CSA: CSACompressor, HCA: HCACompressor}.get(self.layer_type)
        self.compressor = compressor(cfg, dtype) if compressor is not None else None

    def forward(self, x: torch.Tensor, step: V4Step, caches: LayerCaches) -> torch.Tensor:
        n = x.shape[0]
        cos, sin = step.rope(self.layer_type)
        cq = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(cq).view(n, self.num_heads, self.head_dim)
        q = rope_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # [N, D]: the key and the value
        window, slots = caches.window.view(-1, self.head_dim), step.batch.slot_mapping
        written = slots >= 0  # all but an idle rank's dummy token (runner.execute_dummy)
        window[slots[written]] = kv[written].to(window.dtype)
        pre = self._project(x, cq, step) if self.compressor is not None else None
        if v4_kernels.attends_by_slots(q, caches.window):  # every token of the step in one call
            out = self._attend_slots(q, step, caches, pre)
        else:
            out = torch.empty_like(q)
            for seq in step.seqs:
                rows = slice(seq.row, seq.row + seq.n)
                out[rows] = self._attend(q[rows], seq, step, caches, pre)
        out = rope_tail(out, cos, -sin)  # the values' rope slice back by -t
        return self.o_b_proj(self.grouped_out(out.view(n, self.groups, -1)))

    def grouped_out(self, grouped: torch.Tensor) -> torch.Tensor:
        """[N, groups, heads x D / groups] -> [N, groups x o_lora_rank]: group g through its own
        o_lora_rank rows of o_a_proj (a block-diagonal product)."""
        if self.o_a_proj.quant is None:
            w = self.o_a_proj.weight.view(self.groups, self.o_lora_rank, grouped.shape[-1])
            return torch.einsum("ngi,goi->ngo", grouped, w).flatten(1)
        r, w = self.o_lora_rank, self.o_a_proj.w
        return torch.cat([linear(grouped[:, g], w[g * r : (g + 1) * r]) for g in range(self.groups)], dim=-1)

    def _project(self, x: torch.Tensor, cq: torch.Tensor, step: V4Step) -> Projected:
        """The compressors' projections of every token of the step at once (the requests then only
        pool their own rows)."""
        comp, positions = self.compressor, step.positions
        pre = Projected(comp.project(x, positions))
        if isinstance(comp, CSACompressor):
            cos, sin = step.rope(self.layer_type)
            pre.index_rows = comp.indexer.project(x, positions)
            pre.index_q, pre.index_w = comp.indexer.queries(x, cq, cos, sin)
        return pre

    def _attend_slots(self, q, step: V4Step, caches: LayerCaches, pre: Projected | None) -> torch.Tensor:
        """Every token's window rows and visible entries as cache rows (-1: none), the compressed
        entries written first; then kernels/v4.py v4_attention over all of them (native or Triton).
        One-token requests that complete no entry are taken together (_decode_entries), the
        others request by request."""
        entries = eslots = None
        if self.compressor is not None and any(seq.state_row >= 0 for seq in step.seqs):
            parts: list[tuple[int, torch.Tensor]] = []  # (first row, [n, E] entry rows)
            batched: set[int] = set()
            together = step.decodes
            if together is not None:
                completing = (together.positions + 1) % self.compressor.m == 0
                rows, slots = self._decode_entries(step, together, ~completing, caches, pre)
                batched = set(rows.tolist())
                parts += zip(rows.tolist(), slots, strict=True)
            for seq in step.seqs:
                if seq.state_row >= 0 and seq.row not in batched:
                    positions = step.positions[seq.row : seq.row + seq.n]
                    entry_rows, visible = self._compressed(positions, seq, step, caches, pre)
                    parts.append((seq.row, torch.where(visible, entry_rows[None, :], -1)))
            width = max((e.shape[-1] for _, e in parts), default=0)
            eslots = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
            for row, e in parts:
                e = e.unsqueeze(0) if e.dim() == 1 else e  # a one-token request's [E]
                eslots[row : row + e.shape[0], : e.shape[1]] = e
            entries = caches.entries
        return v4_kernels.v4_attention(
            q, caches.window, step.window_rows(self.window), entries, eslots, self.sinks, self.scale
        )

    def _decode_entries(
        self, step: V4Step, d: Decodes, take: torch.Tensor, caches: LayerCaches, pre: Projected
    ):
        """One-token requests (d, those where `take`) that complete no entry: their rows into
        their rings in one write, then their visible entries (HCA: all complete ones; CSA: the
        indexer's top-k, scored for all of them at once) -> (their rows [B'], entry rows [B', E])."""
        comp = self.compressor
        rows, positions, state_rows = d.rows[take], d.positions[take], d.state_rows[take]
        blocks = d.tables[caches.table][take]
        if not rows.numel():
            return rows, rows.new_empty(0, 0)
        for ring_states, pre_rows in ((caches.states, pre.rows), (caches.index_states, pre.index_rows)):
            if ring_states is not None:
                ring = ring_states.shape[2]
                ring_states[state_rows, caches.layer, positions % ring] = pre_rows[rows]
        m, per_block = comp.m, step.block_size // comp.m
        complete = (positions + 1).div(m, rounding_mode="floor")  # [B] entries each sees
        e = torch.arange(int(complete.max()), device=rows.device)
        slots = blocks[:, e // per_block] * per_block + e % per_block  # [B, E]
        valid = e[None, :] < complete[:, None]
        if isinstance(comp, CSACompressor) and e.numel():
            idx = comp.indexer
            keys = caches.index_keys.view(-1, idx.width)[slots].float()  # [B, E, dI]
            scores = torch.relu(torch.einsum("bhd,bed->bhe", pre.index_q[rows], keys)) * idx.width**-0.5
            scores = (scores * pre.index_w[rows].unsqueeze(-1)).sum(dim=1).masked_fill(~valid, float("-inf"))
            picked = scores.topk(min(idx.topk, e.numel()), dim=-1).indices
            chosen = torch.zeros_like(valid).scatter_(1, picked, True)
            valid &= chosen
        return rows, torch.where(valid, slots, -1)

    def _attend(self, q, seq: Seq, step: V4Step, caches: LayerCaches, pre: Projected | None) -> torch.Tensor:
        """One request's queries q [n, heads, D] over its window and compressed entries."""
        end = seq.start + seq.n
        positions = step.positions[seq.row : seq.row + seq.n]
        lo = max(0, seq.start - self.window + 1)
        keys = caches.window.view(-1, self.head_dim)[token_slots(seq.window_blocks, step.block_size, lo, end)]
        key_pos = torch.arange(lo, end, device=q.device)
        visible = (key_pos[None, :] <= positions[:, None]) & (
            key_pos[None, :] > positions[:, None] - self.window
        )
        if self.compressor is not None and seq.state_row >= 0:  # (a dummy token has no state)
            entry_rows, picked = self._compressed(positions, seq, step, caches, pre)
            entries = caches.entries.view(-1, self.head_dim)[entry_rows]
            keys = torch.cat((keys, entries.to(keys.dtype)))
            visible = torch.cat((visible, picked), dim=1)
        logits = torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * self.scale
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = self.sinks.view(1, -1, 1).expand(seq.n, -1, 1)
        probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("nhl,ld->nhd", probs, keys.float()).to(q.dtype)

    def _compressed(self, positions, seq: Seq, step: V4Step, caches: LayerCaches, pre: Projected):
        """Write the entries the request's tokens complete (and, CSA, their indexer keys); -> (the
        cache rows of its entries so far [E], visible [n, E])."""
        comp = self.compressor
        m, end = comp.m, seq.start + seq.n
        rows = slice(seq.row, seq.row + seq.n)
        table_cos, table_sin = step.rope_table(self.layer_type)
        blocks = seq.tables[caches.table]
        per_block = step.block_size // m
        cache = caches.entries.view(-1, comp.width)
        snaps = [(b, caches.state(row)) for b, row in seq.snapshots]
        first, new = comp.compress(
            pre.rows[rows], seq.start, caches.state(seq.state_row), table_cos, table_sin, snaps
        )
        if new.shape[0]:
            cache[token_slots(blocks, per_block, first, first + new.shape[0])] = new.to(cache.dtype)
        entries = token_slots(blocks, per_block, 0, end // m)
        if isinstance(comp, CSACompressor):
            idx = comp.indexer
            key_cache = caches.index_keys.view(-1, idx.width)
            snaps = [(b, caches.index_state(row)) for b, row in seq.snapshots]
            state = caches.index_state(seq.state_row)
            first, new = idx.compress(pre.index_rows[rows], seq.start, state, table_cos, table_sin, snaps)
            if new.shape[0]:
                key_cache[token_slots(blocks, per_block, first, first + new.shape[0])] = new.to(
                    key_cache.dtype
                )
            return entries, idx.pick(pre.index_q[rows], pre.index_w[rows], positions, key_cache[entries])
        complete = (positions + 1).div(m, rounding_mode="floor")[:, None]
        return entries, torch.arange(end // m, device=positions.device)[None, :] < complete


@dataclass
class Projected:
    """A compressed layer's projections of every token of the step (Attention._project)."""

    rows: torch.Tensor
    """The compressor's pre-pooling rows [N, 2 coff D]."""
    index_rows: torch.Tensor | None = None
    """CSA: its indexer's compressor's rows."""
    index_q: torch.Tensor | None = None
    """CSA: the indexer's queries [N, heads, dI] and their weights [N, heads]."""
    index_w: torch.Tensor | None = None


# ---- the model ---------------------------------------------------------------------------------


@dataclass
class LayerCaches:
    """What one layer's attention reads and writes."""

    window: torch.Tensor
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    table: int = -1
    """The spec table of its compressed caches."""
    states: torch.Tensor | None = None
    """[rows, layers, *shape]: its compressor's state tensor, and its layer's index in it."""
    layer: int = 0
    index_states: torch.Tensor | None = None

    def state(self, row: int) -> torch.Tensor:
        return self.states[row, self.layer]

    def index_state(self, row: int) -> torch.Tensor:
        return self.index_states[row, self.layer]


@dataclass
class Decodes:
    """A step's one-token requests that the compressed layers take together (V4Step.decodes)."""

    seqs: list[Seq]
    rows: torch.Tensor
    """[B] their rows in the flat batch."""
    positions: torch.Tensor
    state_rows: torch.Tensor
    tables: dict[int, torch.Tensor]
    """Spec table -> [B, blocks] their block tables, zero-padded."""


class V4Step:
    """What every layer of one forward shares: the requests, the rope rows per table."""

    def __init__(self, model: DeepseekV4ForCausalLM, batch: ForwardBatch, block_size: int):
        self.batch, self.block_size = batch, block_size
        self.positions = batch.positions
        self.seqs = step_seqs(batch)
        self._tables = {
            "main": (model.rope_cos, model.rope_sin),
            "compress": (model.crope_cos, model.crope_sin),
        }
        self._rows = {k: (c[batch.positions], s[batch.positions]) for k, (c, s) in self._tables.items()}
        self.window_slots: dict[int, torch.Tensor] = {}

    def window_rows(self, window: int) -> torch.Tensor:
        """[N, window] the cache rows of each token's window, oldest first, -1 before position 0
        (the same for every layer: built once a step)."""
        if window not in self.window_slots:
            back = torch.arange(window - 1, -1, -1, device=self.positions.device)
            parts = []
            for seq in self.seqs:
                pos = self.positions[seq.row : seq.row + seq.n, None] - back
                slots = seq.window_blocks[pos.clamp(min=0) // self.block_size] * self.block_size
                parts.append(torch.where(pos >= 0, slots + pos.clamp(min=0) % self.block_size, -1))
            self.window_slots[window] = torch.cat(parts)
        return self.window_slots[window]

    @functools.cached_property
    def decodes(self) -> Decodes | None:
        """The step's one-token requests with a state and no snapshot to write, as tensors (the
        compressed layers take them together); None without any."""
        seqs = [q for q in self.seqs if q.n == 1 and q.state_row >= 0 and not q.snapshots]
        if not seqs:
            return None
        dev = self.positions.device
        rows = torch.tensor([q.row for q in seqs], dtype=torch.long, device=dev)
        tables = {}
        for t in seqs[0].tables:
            width = max(q.tables[t].shape[0] for q in seqs)
            padded = torch.zeros(len(seqs), width, dtype=torch.long, device=dev)
            for i, q in enumerate(seqs):
                padded[i, : q.tables[t].shape[0]] = q.tables[t]
            tables[t] = padded
        state_rows = torch.tensor([q.state_row for q in seqs], dtype=torch.long, device=dev)
        return Decodes(seqs, rows, self.positions[rows], state_rows, tables)

    def rope(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [N, R/2] at the step's positions, from the layer's table."""
        return self._rows["main" if layer_type == SLIDING else "compress"]

    def rope_table(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tables["main" if layer_type == SLIDING else "compress"]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype, ep: ExpertParallel | None = None
    ):
        super().__init__()
        v4 = cfg.v4
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype)
        self.mlp = MoE(cfg, layer_idx, dtype=dtype, ep=ep)
        self.input_layernorm = RMSNorm32(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm32(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (v4.hc_mult, cfg.hidden_size, v4.hc_sinkhorn_iters, v4.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, step: V4Step, caches: LayerCaches) -> torch.Tensor:
        post, comb, u = self.attn_hc(streams)
        streams = HyperConnection.merge(
            streams, post, comb, self.self_attn(self.input_layernorm(u), step, caches)
        )
        post, comb, u = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(u), step.batch.input_ids)
        return HyperConnection.merge(streams, post, comb, out)


class MTPLayer(DecoderLayer):
    """DeepSeek-V4's multi-token prediction layer: a sliding-window V4 layer (score-routed) whose
    input mixes the target's streams at position i with the next token's embedding,

        X = h_proj(hnorm(streams_i)) + e_proj(enorm(embed(t_{i+1})))    (the embedding 0 at position 0)

    and whose own hc_head, norm and head give the draft's logits; its output streams stand in for
    the target's at the next position when it drafts again. Checkpoint tensors: DeepSeek's
    `mtp.0.*` (e_proj, h_proj, enorm, hnorm, hc_head_*, norm, head, and the block's own names)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype):
        super().__init__(cfg, layer_idx, dtype=dtype)
        h, q, v4 = cfg.hidden_size, QuantSpec.of(cfg.quant), cfg.v4
        self.enorm = RMSNorm32(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm32(h, cfg.rms_norm_eps)
        self.e_proj = Linear(h, h, dtype=dtype, quant=q)
        self.h_proj = Linear(h, h, dtype=dtype, quant=q)
        self.hc_head = HyperHead(v4.hc_mult, h, v4.hc_eps, cfg.rms_norm_eps)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm32(h, cfg.rms_norm_eps)
        self.shared_head.head = Linear(h, cfg.vocab_size, dtype=dtype)

    def layer_input(
        self, next_ids: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor, embed: Embedding
    ) -> torch.Tensor:
        e = embed(next_ids).masked_fill((positions == 0)[:, None], 0.0)
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(e)).unsqueeze(-2)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(self.hc_head(streams)))


@register_model("DeepseekV4ForCausalLM")
class DeepseekV4ForCausalLM(nn.Module):
    @staticmethod
    def kv_cache_spec(
        cfg: ModelConfig, *, num_mtp_layers: int, block_size: int, dtype: torch.dtype, fingerprint: str
    ) -> KVCacheSpec:
        """Every layer's window rows (K = V, head_dim wide); CSA layers' entries and indexer keys
        (one per csa_rate tokens) and HCA layers' entries (one per hca_rate tokens); each
        compressor's state. The engine block is block_size rounded up to a multiple of both rates,
        so every group's block is one engine block. The MTP layers (model layers num_hidden_layers
        + j, sliding) keep their window rows in the same group.

        A compressor's state is a ring of its last rows (`ring_shape`, Compressor.compress)."""
        v4 = cfg.v4
        unit = math.lcm(v4.csa_rate, v4.hca_rate)
        bs = -(-block_size // unit) * unit
        layers = {t: tuple(i for i, lt in enumerate(v4.layer_types) if lt == t) for t in (CSA, HCA)}
        rope = {"rope_width": v4.rope_dim, "rotary_layout": "interleaved"}
        groups = [
            CacheGroupSpec(
                CacheKind.SLIDING_WINDOW,
                tuple(range(cfg.num_hidden_layers + num_mtp_layers)),
                bs,
                v4.head_dim,
                dtype,
                window=v4.sliding_window,
                **rope,
            )
        ]
        states = []
        if layers[CSA]:
            m = v4.csa_rate
            groups.append(
                CacheGroupSpec(
                    CacheKind.COMPRESSED, layers[CSA], bs // m, v4.head_dim, dtype, tokens_per_entry=m, **rope
                )
            )
            groups.append(
                CacheGroupSpec(
                    CacheKind.COMPRESSED_INDEXER_KEYS,
                    layers[CSA],
                    bs // m,
                    v4.index_head_dim,
                    dtype,
                    tokens_per_entry=m,
                    **rope,
                )
            )
            states.append(StateSpec(STATE_CSA, layers[CSA], ring_shape(m, True, v4.head_dim), FP32))
            states.append(
                StateSpec(STATE_CSA_INDEXER, layers[CSA], ring_shape(m, True, v4.index_head_dim), FP32)
            )
        if layers[HCA]:
            m = v4.hca_rate
            groups.append(
                CacheGroupSpec(
                    CacheKind.HEAVILY_COMPRESSED,
                    layers[HCA],
                    bs // m,
                    v4.head_dim,
                    dtype,
                    tokens_per_entry=m,
                    **rope,
                )
            )
            states.append(StateSpec(STATE_HCA, layers[HCA], ring_shape(m, False, v4.head_dim), FP32))
        return KVCacheSpec(tuple(groups), fingerprint, tuple(states))

    def __init__(
        self, cfg: ModelConfig, *, dtype: torch.dtype, max_positions: int, ep=None, num_mtp_layers: int = 0
    ):
        super().__init__()
        if num_mtp_layers and ep is not None:
            raise ValueError("MTP speculative decoding with expert parallelism is not supported yet")
        v4 = cfg.v4
        self.cfg, self.dtype = cfg, dtype
        self.hc_mult = v4.hc_mult
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype=dtype, ep=ep) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(v4.hc_mult, cfg.hidden_size, v4.hc_eps, cfg.rms_norm_eps)
        self.norm = RMSNorm32(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, cfg.num_hidden_layers + j, dtype=dtype) for j in range(num_mtp_layers)
        )
        for name, rope in (("rope", v4.rope), ("crope", v4.compress_rope)):
            cos, sin = rope_cos_sin_cache(rope, v4.rope_dim, max_positions)
            self.register_buffer(f"{name}_cos", cos, persistent=False)  # [P, R/2] float32
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    def process_weights(
        self, place: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous
    ) -> None:
        """Nothing derived yet (the PyTorch path takes the weights as loaded)."""

    def runs_in_one_call(self, batch: ForwardBatch, kv_caches: KVCaches) -> bool:
        return False

    def layer_caches(self, kv_caches: KVCaches, batch: ForwardBatch) -> list[LayerCaches]:
        spec = kv_caches.spec
        out = []
        for i, layer in enumerate(self.layers):
            c = LayerCaches(kv_caches.layer(CacheKind.SLIDING_WINDOW, i))
            lt = layer.self_attn.layer_type
            if lt != SLIDING and batch.states is not None:
                kind, state = (
                    (CacheKind.COMPRESSED, STATE_CSA)
                    if lt == CSA
                    else (CacheKind.HEAVILY_COMPRESSED, STATE_HCA)
                )
                g = spec.group(kind)
                c.entries, c.table = kv_caches.layer(kind, i), spec.table_index(kind)
                c.states, c.layer = batch.states[state], g.layers.index(i)
                if lt == CSA:
                    c.index_keys = kv_caches.layer(CacheKind.COMPRESSED_INDEXER_KEYS, i)
                    c.index_states = batch.states[STATE_CSA_INDEXER]
            out.append(c)
        return out

    def forward(self, batch: ForwardBatch, kv_caches: KVCaches) -> torch.Tensor:
        """-> the last layer's hyper-connection streams [N, hc x hidden] (what the MTP layer reads;
        compute_logits collapses them through hc_head and the final norm)."""
        step = V4Step(self, batch, kv_caches.spec.block_size)
        x = self.embed_tokens(batch.input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer, caches in zip(self.layers, self.layer_caches(kv_caches, batch), strict=True):
            streams = layer(streams, step, caches)
        return streams.flatten(1)

    def _streams(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.view(hidden.shape[0], self.hc_mult, self.cfg.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hc x hidden] (forward's streams) -> logits [M, vocab] float32."""
        return self.lm_head(self.norm(self.hc_head(self._streams(hidden)))).float()

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> list[int]:
        return argmax(self.compute_logits(hidden)[:, :vocab_size]).tolist()

    # ---- MTP speculative decoding (engine/spec_decode/drafter.py calls these) -----------------

    def greedy_spec_step(self, batch, kv_caches, caps, k):
        """No one-call speculative step: the runner takes forward, greedy_tokens and mtp_forward."""
        return None

    def use_draft_vocab(self, token_ids: torch.Tensor) -> None:
        raise NotImplementedError("a draft vocabulary for DeepSeek-V4's MTP layer is not supported yet")

    def mtp_cache(self, kv_caches: KVCaches) -> LayerCaches:
        """The first MTP layer's window rows (model layer num_hidden_layers)."""
        return LayerCaches(kv_caches.layer(CacheKind.SLIDING_WINDOW, len(self.layers)))

    def mtp_forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches
    ) -> torch.Tensor:
        """The first MTP layer over the batch: next_ids [N] (t_{i+1}), hidden [N, hc x hidden] (the
        target's streams at i, or the previous draft's) -> its streams [N, hc x hidden], which
        draft_tokens reads and the next draft takes as hidden."""
        step = V4Step(self, batch, caches.window.shape[1])
        mtp = self.mtp[0]
        streams = mtp.layer_input(next_ids, self._streams(hidden), batch.positions, self.embed_tokens)
        return mtp(streams, step, caches).flatten(1)

    def mtp_store_kv(self, next_ids, hidden, positions, slots, caches) -> None:
        """Only the first MTP layer's window rows at these positions (cache rows `slots`)."""
        mtp = self.mtp[0]
        streams = mtp.layer_input(next_ids, self._streams(hidden), positions, self.embed_tokens)
        _, _, u = mtp.attn_hc(streams)
        attn = mtp.self_attn
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        kv = rope_tail(attn.kv_norm(attn.kv_proj(mtp.input_layernorm(u))), cos, sin)
        window = caches.window.view(-1, attn.head_dim)
        written = slots >= 0
        window[slots[written]] = kv[written].to(window.dtype)

    def draft_tokens(self, hidden: torch.Tensor, vocab_size: int) -> list[int]:
        """The MTP layer's greedy drafts from its streams (its own hc_head, norm and head)."""
        logits = self.mtp[0].logits(self._streams(hidden))
        return argmax(logits[:, :vocab_size].float()).tolist()
