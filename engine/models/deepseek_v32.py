"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA) in every layer.

A layer's lightning indexer scores each earlier token for each query token (kernels/sparse_mla.py
has the equation) from its own small projections: queries from MLA's query latent c_q
(`wq_b`, n_I heads of d_I), one key per token from the layer input (`wk`, then a LayerNorm with a
bias), both roped on their LEADING qk_rope_head_dim elements in the half-split layout (MLA's rope
is interleaved and trails), and per-head weights from the layer input (`weights_proj`). MLA then
attends only to the `index_topk` best tokens of each query's context. Its keys are a second cache
group on the same layers and block table as the latent cache (`CacheKind.INDEXER_KEYS`), so prefix
caching, preemption, transfers and offload move them with the latents, block for block.

A token whose context holds at most `index_topk` tokens runs dense MLA (the V3 paths; only the
indexer keys are stored besides), whatever runs beside it, so its result never depends on its
batch or on how its prompt was chunked. The others attend in the absorbed form over the cache
slots their indexer chose (as DeepSeek's sparse kernels run prefill and decode alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import DecodeGroup, ForwardBatch
from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind
from engine.kv_cache.spec import KVCaches, KVCacheSpec
from engine.models.deepseek_v2 import DecoderLayer, DeepseekV2ForCausalLM
from engine.models.layers import LayerNorm, Linear
from engine.models.mla import MLAttention
from engine.models.registry import register_model
from engine.quant import QuantSpec
from kernels import native
from kernels.kv_store import store_rows
from kernels.mla import gather_blocks
from kernels.rotary import apply_rotary
from kernels.sparse_mla import (
    indexer_topk,
    indexer_topk_triton,
    positions_to_slots,
    sparse_mla,
    sparse_mla_triton,
)

INDEXER_NORM_EPS = 1e-6
"""The indexer key LayerNorm's epsilon (fixed in the reference, not in config.json)."""


class Indexer(nn.Module):
    """The lightning indexer of one layer: stores each token's key, picks each query's top-k."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype):
        super().__init__()
        icfg = cfg.indexer
        self.n_heads, self.head_dim, self.topk = icfg.n_heads, icfg.head_dim, icfg.topk
        self.rope_dim = cfg.qk_rope_head_dim
        q = QuantSpec.of(cfg.quant)  # wq_b and wk are FP8 in the released checkpoints; the rest is not
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype, quant=q)
        self.wk = Linear(cfg.hidden_size, self.head_dim, dtype=dtype, quant=q)
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS, dtype=dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype=dtype)
        self.scale = self.head_dim**-0.5

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the leading rope_dim elements (half-split pairs) of t [N, ..., dI], in place."""
        lead = t[..., : self.rope_dim]
        lead.copy_(apply_rotary(lead, cos, sin, interleaved=False))
        return t

    def store_keys(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        key_cache: torch.Tensor,
    ) -> None:
        """Each token's key LayerNorm(x W_k), roped, written at its cache slot."""
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)  # [N, dI]
        store_rows(k, key_cache, slots)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [N, nI, dI] roped, weights [N, nI] float32 with the reference's nI^-1/2)."""
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return self._rope(q, cos, sin), weights


class SparseMLAttention(MLAttention):
    """MLA that attends over the cache slots its indexer chose. Its cache is the pair (latent
    cache, indexer-key cache) of its layer."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype):
        super().__init__(cfg, dtype=dtype)
        self.indexer = Indexer(cfg, dtype=dtype)

    def process_weights(
        self, place: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous
    ) -> None:
        """MLA's, and the indexer's weights for the one-call native decode beside MLA's (where the
        kernels take them as they are)."""
        super().process_weights(place)
        ix = self.indexer
        if self.native_weights is None or not (
            all(native.takes_weight(m.w) for m in (ix.wq_b, ix.wk, ix.weights_proj))
            and native.takes(ix.k_norm.weight, ix.k_norm.bias)
        ):
            self.native_weights = None
            return
        indexer = native.IndexerWeights(
            wq=ix.wq_b.w,
            wk=ix.wk.w,
            k_norm=ix.k_norm.weight,
            k_bias=ix.k_norm.bias,
            k_eps=ix.k_norm.eps,
            weights_proj=ix.weights_proj.w,
            heads=ix.n_heads,
            dim=ix.head_dim,
            rope=ix.rope_dim,
            topk=ix.topk,
            scale=ix.scale,
        )
        self.native_weights = dataclasses.replace(self.native_weights, indexer=indexer)

    def split_cache(self, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache  # (latent cache, indexer-key cache)

    def store_cache(self, x, cos, sin, slots: torch.Tensor, kv_cache) -> None:
        latent_cache, key_cache = kv_cache
        self.store_latents(x, cos, sin, slots, latent_cache)
        self.indexer.store_keys(x, cos, sin, slots, key_cache)

    def forward(self, x, cos, sin, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        latent_cache, key_cache = kv_cache
        n = x.shape[0]
        q_latent, q_nope, q_pe = self.queries(x, cos, sin)
        c_kv, k_pe = self.store_latents(x, cos, sin, batch.slot_mapping, latent_cache)
        self.indexer.store_keys(x, cos, sin, batch.slot_mapping, key_cache)
        if batch.max_context <= self.indexer.topk:  # every query chooses its whole context
            out = self.attend(q_nope, q_pe, c_kv, k_pe, batch, latent_cache)
        else:
            out, sparse = self.attend_within_topk(q_nope, q_pe, c_kv, k_pe, batch, latent_cache)
            slots = self.choose(x, q_latent, cos, sin, batch, key_cache)
            out[sparse] = self.attend_sparse(q_nope[sparse], q_pe[sparse], slots[sparse], latent_cache)
        return self.o_proj(out.view(n, self.num_heads * self.v_dim))

    def attend_within_topk(self, q_nope, q_pe, c_kv, k_pe, batch: ForwardBatch, latent_cache: torch.Tensor):
        """Dense MLA for the step's tokens whose context fits in index_topk (as a step of them alone
        runs it: a token's result never depends on what runs beside it) -> (out [N, H, v] with their
        rows written, the other tokens' rows [M] int64: theirs go sparse)."""
        topk = self.indexer.topk
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        sparse = []
        for g in batch.decodes:
            tables, lens = g.per_token  # a row per query token, each its own sequence
            fits = lens <= topk
            rows = g.start + fits.nonzero().flatten().to(q_nope.device)
            if rows.numel():
                sub = DecodeGroup(0, rows.numel(), 1, tables[fits], lens[fits])
                out[rows] = self._decode(q_nope[rows], q_pe[rows], latent_cache, sub)
            sparse.append(g.start + (~fits).nonzero().flatten().to(q_nope.device))
        for seq in batch.prefills:
            cached = seq.ctx_len - seq.q_len
            m = min(max(topk - cached, 0), seq.q_len)  # the chunk's first m tokens see <= topk
            s = seq.q_start
            if m:
                ctx = self.prefill_context(seq, m, c_kv, k_pe, latent_cache)
                out[s : s + m] = self._prefill(q_nope[s : s + m], q_pe[s : s + m], ctx)
            sparse.append(torch.arange(s + m, s + seq.q_len, device=q_nope.device))
        return out, torch.cat(sparse)

    def choose(self, x, q_latent, cos, sin, batch: ForwardBatch, key_cache: torch.Tensor) -> torch.Tensor:
        """The cache slots each of the step's tokens attends to -> [N, topk] int64, -1 = none."""
        q, weights = self.indexer.queries(x, q_latent, cos, sin)
        if native.loaded() and native.takes(q, key_cache):  # every token of the step in one call
            tables, lens = batch.token_contexts
            return native.indexer_topk(
                q, weights, key_cache, tables, lens, self.indexer.topk, self.indexer.scale
            )
        block_size = key_cache.shape[1]
        slots = torch.full((x.shape[0], self.indexer.topk), -1, dtype=torch.long, device=x.device)
        topk, scale = self.indexer.topk, self.indexer.scale
        for rows, block_ids, lens in request_rows(batch):
            if q.is_cuda:  # the keys read in place
                pos = indexer_topk_triton(q[rows], weights[rows], key_cache, block_ids, lens, topk, scale)
            else:
                keys = gather_blocks(key_cache, block_ids[None], int(lens.max()))[0]  # [S, dI]
                pos = indexer_topk(q[rows], weights[rows], keys, lens, topk, scale)
            slots[rows, : pos.shape[1]] = positions_to_slots(pos, block_ids, block_size)
        return slots

    def attend_sparse(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, slots: torch.Tensor, latent_cache: torch.Tensor
    ) -> torch.Tensor:
        """The absorbed form over the chosen slots -> [N, H, v]."""
        few = self.absorbs_natively(q_nope)
        q = torch.cat((self.absorb(q_nope, few), q_pe), dim=-1)  # [N, H, L+R]
        if native.loaded() and native.takes(q, latent_cache):
            o_lat = native.sparse_mla_decode(q, latent_cache, slots, self.scale, self.kv_lora_rank)
        elif q.is_cuda:
            o_lat = sparse_mla_triton(q, latent_cache, slots, self.scale, self.kv_lora_rank)
        else:
            o_lat = sparse_mla(q, latent_cache, slots, self.scale, self.kv_lora_rank)  # [N, H, L]
        return self.unabsorb(o_lat, few).contiguous()


def request_rows(batch: ForwardBatch):
    """Per request of the step: (its rows in the flat batch [n] int64, its block ids [blocks],
    each row's visible context length [n] int64)."""
    device = batch.input_ids.device
    for g in batch.decodes:
        s = g.query_len
        for d in range(g.num_seqs):
            start = g.start + d * s
            rows = torch.arange(start, start + s, device=device)
            lens = int(g.seq_lens[d]) - s + 1 + torch.arange(s, device=device)
            yield rows, g.block_table[d].long(), lens
    for seq in batch.prefills:
        rows = torch.arange(seq.q_start, seq.q_start + seq.q_len, device=device)
        lens = seq.ctx_len - seq.q_len + 1 + torch.arange(seq.q_len, device=device)
        yield rows, seq.block_ids.long(), lens


class SparseDecoderLayer(DecoderLayer):
    attention = SparseMLAttention


@register_model("DeepseekV32ForCausalLM")
class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer = SparseDecoderLayer

    @staticmethod
    def kv_cache_spec(
        cfg: ModelConfig, *, num_mtp_layers: int, block_size: int, dtype: torch.dtype, fingerprint: str
    ) -> KVCacheSpec:
        """Every layer's MLA latent row per token (the MTP layers' in their own group, as V3's), and
        its indexer key, the MTP layers' included: d_I elements whose leading qk_rope_head_dim are
        rotary, in the half-split layout (the cache's dtype; DeepSeek's FP8 + scale layout is
        describable, `scale`, not run yet)."""
        base = DeepseekV2ForCausalLM.kv_cache_spec(
            cfg, num_mtp_layers=num_mtp_layers, block_size=block_size, dtype=dtype, fingerprint=fingerprint
        )
        keys = CacheGroupSpec(
            kind=CacheKind.INDEXER_KEYS,
            layers=tuple(range(cfg.num_hidden_layers + num_mtp_layers)),
            block_size=block_size,
            width=cfg.indexer.head_dim,
            dtype=dtype,
            rope_width=cfg.qk_rope_head_dim,
            rotary_layout="halves",
            rope_offset=0,
        )
        return KVCacheSpec((*base.groups, keys), fingerprint)

    def stack_key_caches(self, kv_caches: KVCaches) -> list[torch.Tensor]:
        """The decoder layers' indexer-key caches (the MTP layers' follow them in the group)."""
        return kv_caches.group(CacheKind.INDEXER_KEYS)[: len(self.layers)]

    def layer_caches(self, kv_caches: KVCaches) -> list:
        """Each layer's (latent cache, indexer-key cache)."""
        return list(zip(kv_caches.group(CacheKind.LATENT), self.stack_key_caches(kv_caches), strict=True))

    def mtp_cache(self, kv_caches: KVCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """The first MTP layer's (latent cache, indexer-key cache): model layer num_hidden_layers."""
        layer = len(self.layers)
        return kv_caches.layer(CacheKind.MTP_LATENT, layer), kv_caches.layer(CacheKind.INDEXER_KEYS, layer)
