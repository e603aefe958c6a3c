"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent KV cache.

Per token the cache holds c_kv (the normalised KV latent, width L = kv_lora_rank) and k_pe (the
rotary key shared by all heads, width R = qk_rope_head_dim), side by side in one row of width
L + R. Prefill chunks use the non-absorbed form: the latents of the whole context are
up-projected by kv_b_proj into per-head keys and values. Decodes, and speculative verifications
(a decode with its drafts, attending causally), use the absorbed form: W_UK is folded into the
query and W_UV applied after attention, so attention reads the latent rows directly (see
kernels/mla.py). Both compute the same function; tests hold them to each other and to HF
transformers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import DecodeGroup, ForwardBatch
from engine.models.layers import Linear, RMSNorm
from engine.quant import QuantSpec
from kernels import native
from kernels.attention import extend_attention
from kernels.kv_store import store_kv
from kernels.mla import NATIVE_MAX_BATCH, mla_decode
from kernels.quant import QuantWeight
from kernels.rotary import apply_rotary


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleaved = cfg.rope_interleave
        hidden, heads, qk_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
        q = QuantSpec.of(cfg.quant)  # every projection, as DeepSeek's FP8 checkpoints store them
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_dim, dtype=dtype, quant=q)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias, dtype=dtype, quant=q)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk_dim, dtype=dtype, quant=q)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(
            hidden, cfg.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias, dtype=dtype, quant=q
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (self.nope_dim + self.v_dim), dtype=dtype, quant=q)
        self.o_proj = Linear(heads * self.v_dim, hidden, bias=cfg.attention_bias, dtype=dtype, quant=q)
        self.dtype = dtype
        # The absorbed form's per-head matrices, set by process_weights: W_UK transposed [H, L, nope]
        # (a copy) and W_UV [H, v, L] (a view of kv_b_proj's weight), bf16 or kept FP8.
        self.w_uk_t: torch.Tensor | QuantWeight | None = None
        self.w_uv: torch.Tensor | QuantWeight | None = None
        self.native_weights: native.MLAWeights | None = None  # the one-call decode's, set by process_weights

    def process_weights(
        self, place: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous
    ) -> None:
        """Split kv_b_proj into the absorbed form's per-head matrices once the weights are loaded.
        place(t): a contiguous copy of t where the derived matrices should live (the model's
        arena). A kv_b_proj kept FP8 stays FP8 for them where the native kernels run (W_UK's bytes
        transposed, with its scales; W_UV a view), else it is dequantized once, here (as vLLM
        does); the prefill's up-projection reads it as kept."""
        H, nope, v, L = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        kv_b = self.kv_b_proj
        kept = self._fp8_heads(place) if kv_b.quant is not None and self.dtype == torch.bfloat16 else None
        if kept is not None:
            self.w_uk_t, self.w_uv = kept
        else:
            weight = kv_b.weight if kv_b.quant is None else place(kv_b.dense(self.dtype))
            w = weight.view(H, nope + v, L)
            self.w_uk_t = place(w[:, :nope].transpose(1, 2))
            self.w_uv = w[:, nope:]
        if native.loaded() and native.takes_weight(self.w_uk_t) and native.takes_weight(self.w_uv):
            self.native_weights = self._native_weights()

    def _fp8_heads(
        self, place: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[QuantWeight, QuantWeight] | None:
        """kv_b_proj's FP8 weight as the absorbed form's (W_UK^T [H, L, nope], W_UV [H, v, L]), where
        the native kernels take them: W_UK^T's scales run along nope, one per block of K (a
        multiple of 32), so each head's nope rows must fall in whole row blocks of the checkpoint's
        grid -- as DeepSeek's 128 x 128 grid with V3's 256-row heads, and the 32 x 32 grid; else None."""
        kv_b = self.kv_b_proj.w
        if not (native.loaded() and kv_b.fmt == "fp8"):
            return None
        H, nope, v, L = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        data, scale = kv_b.data.view(H, nope + v, L), kv_b.scale.view(H, nope + v, -1)
        uk_scale = scale[:, :nope]  # [H, nope, L / block_k]: row d's scale of each block of L
        for block in range(-(-nope // 32) * 32, 0, -32):  # W_UK^T's block of K, widest first
            per_block = uk_scale[:, ::block]  # [H, ceil(nope / block), L / block_k]
            if bool((uk_scale == per_block.repeat_interleave(block, dim=1)[:, :nope]).all()):
                break
        else:
            return None
        columns = torch.arange(L) // kv_b.block_k  # W_UK^T row c takes its column block's scales
        uk_scale = torch.empty(H, L, per_block.shape[1])  # unit stride along K even with one block
        uk_scale.copy_(per_block[:, :, columns].transpose(1, 2))
        uk_t = place(data[:, :nope].view(torch.uint8).transpose(1, 2)).view(data.dtype)
        uk_t = QuantWeight("fp8", uk_t, place(uk_scale), block)
        return uk_t, QuantWeight("fp8", data[:, nope:], scale[:, nope:], kv_b.block_k)

    def _native_weights(self) -> native.MLAWeights | None:
        """The weights of the one-call native decode (native.mla_attention), or None where it
        cannot take them (biases, another dtype, non-contiguous rows). The projections go as they
        are kept: bf16, or quantized (FP8, widened as they are read)."""
        q_a = self.q_a_proj if self.q_lora else None
        linears = [*([q_a] if q_a is not None else []), self.q_b_proj if self.q_lora else self.q_proj]
        linears += [self.kv_a_proj_with_mqa, self.o_proj]
        if any(m.bias is not None for m in linears):
            return None
        weights = native.MLAWeights(
            q_a=q_a.w if q_a is not None else None,
            q_a_norm=self.q_a_layernorm.weight if self.q_lora else None,
            q_b=(self.q_b_proj if self.q_lora else self.q_proj).w,
            kv_a=self.kv_a_proj_with_mqa.w,
            kv_a_norm=self.kv_a_layernorm.weight,
            w_uk_t=self.w_uk_t,
            w_uv=self.w_uv,
            o_proj=self.o_proj.w,
            heads=self.num_heads,
            nope_dim=self.nope_dim,
            rope_dim=self.rope_dim,
            kv_lora_rank=self.kv_lora_rank,
            v_dim=self.v_dim,
            q_eps=self.q_a_layernorm.eps if self.q_lora else 0.0,
            kv_eps=self.kv_a_layernorm.eps,
            scale=self.scale,
            interleaved=self.interleaved,
        )
        projections = [t for t in (weights.q_a, weights.q_b, weights.kv_a, weights.o_proj) if t is not None]
        projections += [weights.w_uk_t, weights.w_uv]
        norms = [t for t in (weights.q_a_norm, weights.kv_a_norm) if t is not None]
        if not (
            native.takes(*norms)
            and all(t.is_contiguous() for t in norms)
            and all(native.takes_weight(p) for p in projections)
        ):
            return None
        return weights

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, R/2] at each token's position, kv_cache [blocks, block_size, L+R]."""
        n = x.shape[0]
        if self.takes_in_one_call(batch, n, kv_cache):  # the whole path below in one native call
            return self.one_call(x, cos, sin, batch, kv_cache)
        _, q_nope, q_pe = self.queries(x, cos, sin)
        c_kv, k_pe = self.store_latents(x, cos, sin, batch.slot_mapping, kv_cache)
        out = self.attend(q_nope, q_pe, c_kv, k_pe, batch, kv_cache)
        return self.o_proj(out.view(n, self.num_heads * self.v_dim))

    def queries(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """-> (the query latent c_q [N, q_lora_rank] or None without q-LoRA, q_nope [N, H, nope],
        q_pe [N, H, R] rotated)."""
        n = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_latent) if self.q_lora else self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim :]
        return q_latent, q_nope, apply_rotary(q_pe, cos, sin, self.interleaved)

    def attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Every token's attention over its whole context (its own rows already stored) -> [N, H, v]:
        decode groups absorbed, prefill chunks not."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_dim)
        for g in batch.decodes:
            out[g.start : g.end] = self._decode(q_nope[g.start : g.end], q_pe[g.start : g.end], kv_cache, g)
        for seq in batch.prefills:
            s, e = seq.q_start, seq.q_start + seq.q_len
            out[s:e] = self._prefill(
                q_nope[s:e], q_pe[s:e], self.prefill_context(seq, seq.q_len, c_kv, k_pe, kv_cache)
            )
        return out

    def prefill_context(
        self, seq, n: int, c_kv: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """The latent rows [ctx, L+R] the first n tokens of prefill chunk `seq` attend to: the
        chunk's own latents where nothing was cached before it, else the cache's rows."""
        cached = seq.ctx_len - seq.q_len
        if cached == 0:
            s = seq.q_start
            return torch.cat((c_kv[s : s + n], k_pe[s : s + n]), dim=-1)
        return kv_cache.index_select(0, seq.block_ids).flatten(0, 1)[: cached + n].to(c_kv.dtype)

    def takes_in_one_call(self, batch: ForwardBatch, n: int, kv_cache: torch.Tensor) -> bool:
        """Whether this step's n tokens run as one native call (native.mla_attention): a few decode
        tokens (batch 1, a verification, the MTP draft) in one group, whose products all go native."""
        return (
            self.native_weights is not None
            and not batch.prefills
            and len(batch.decodes) == 1
            and n <= NATIVE_MAX_BATCH
            and self.native_weights.takes_rows(n)
            and native.takes(*self.split_cache(kv_cache))
        )

    def split_cache(self, kv_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the layer's cache holds as the one-call decode takes it: (its latent cache, its
        indexer-key cache or None)."""
        return kv_cache, None

    def one_call(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` when takes_in_one_call; with the decoder layer's input and post-attention norms,
        x is the layer's input before its norm and -> (post-norm output, residual stream)."""
        tables, lens = batch.decodes[0].per_token
        layer_norms = (
            None if norms is None else (norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps)
        )
        latent_cache, key_cache = self.split_cache(kv_cache)
        return native.mla_attention(
            x,
            self.native_weights,
            cos,
            sin,
            latent_cache,
            batch.slot_mapping,
            tables,
            lens,
            layer_norms,
            residual,
            key_cache,
        )

    def store_cache(self, x, cos, sin, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Only the cache rows of x's tokens (what the layer's attention would store), at slots."""
        self.store_latents(x, cos, sin, slots, kv_cache)

    def store_latents(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows of x's tokens, written at slots: -> (c_kv [N, L], k_pe [N, R])."""
        L = self.kv_lora_rank
        kv_a = self.kv_a_proj_with_mqa(x)  # [N, L+R]
        c_kv = self.kv_a_layernorm(kv_a[:, :L])
        k_pe = apply_rotary(kv_a[:, L:], cos, sin, self.interleaved)  # [N, R]
        store_kv(c_kv, k_pe, kv_cache, slots)
        return c_kv, k_pe

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Non-absorbed: q_* [n, H, *], ctx [ctx, L+R] -> [n, H, v]."""
        L, H = self.kv_lora_rank, self.num_heads
        kv = self.kv_b_proj(ctx[:, :L]).view(-1, H, self.nope_dim + self.v_dim)  # [ctx, H, nope+v]
        k_pe = ctx[:, None, L:].expand(-1, H, self.rope_dim)
        k = torch.cat((kv[..., : self.nope_dim], k_pe), dim=-1)  # [ctx, H, nope+R]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [n, H, nope+R]
        o, _ = extend_attention(q, k, kv[..., self.nope_dim :], self.scale, return_lse=False)
        return o

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup):
        """Absorbed: q_* [D*s, H, *] -> [D*s, H, v]."""
        few = self.absorbs_natively(q_nope)
        q = torch.cat((self.absorb(q_nope, few), q_pe), dim=-1)
        o_lat, _ = mla_decode(
            q.view(group.num_seqs, group.query_len, self.num_heads, -1),
            kv_cache,
            group.block_table,
            group.seq_lens,
            self.scale,
            self.kv_lora_rank,
            return_lse=False,
        )  # [D, s, H, L]
        return self.unabsorb(o_lat.reshape(-1, self.num_heads, self.kv_lora_rank), few)

    def absorbs_natively(self, q_nope: torch.Tensor) -> bool:
        """Whether the absorbed form's per-head products of these query rows go native (a few
        bf16 rows: per-head GEMVs), else torch's batched GEMMs."""
        heads = (self.w_uk_t, self.w_uv)
        return native.takes_rows(q_nope.transpose(0, 1), None) and all(map(native.takes_weight, heads))

    def absorb(self, q_nope: torch.Tensor, few: bool) -> torch.Tensor:
        """W_UK folded into the query: q_nope [n, H, nope] -> q_lat [n, H, L]."""
        per_head = q_nope.transpose(0, 1)  # [H, n, nope]
        if few:
            return native.linear_heads(per_head, self.w_uk_t).transpose(0, 1)
        return torch.bmm(per_head, self._dense(self.w_uk_t).transpose(1, 2)).transpose(0, 1)

    def unabsorb(self, o_lat: torch.Tensor, few: bool) -> torch.Tensor:
        """W_UV applied after attention: o_lat [n, H, L] -> [n, H, v]."""
        per_head = o_lat.transpose(0, 1)  # [H, n, L]
        if few:
            return native.linear_heads(per_head, self.w_uv).transpose(0, 1)
        return torch.bmm(per_head, self._dense(self.w_uv).transpose(1, 2)).transpose(0, 1)

    def _dense(self, w: torch.Tensor | QuantWeight) -> torch.Tensor:
        """A per-head matrix for torch's batched products: as it is, or a kept FP8 one widened."""
        return w.dequantize(self.dtype) if isinstance(w, QuantWeight) else w
