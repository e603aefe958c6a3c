"""DeepSeek-V3 multi-token prediction (MTP) layer, used to draft tokens for speculative decoding.

For position i with final hidden state h_i (after the main model's final norm: the vector the
LM head reads) and the next token t_{i+1}:

    u_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])        # [2H] -> [H]
    g_i = shared_head.norm(DecoderLayer(u))_i                  # MLA + MoE, its own KV cache
    logits_i = lm_head(g_i)                                    # predicts t_{i+2}

The embedding and LM head are the main model's. Checkpoint tensors live under
`model.layers.{num_hidden_layers + j}.` (enorm, hnorm, eh_proj, shared_head.norm and the decoder
layer's own names). To draft more than one token the same layer is reused: g_i stands in for
the next position's hidden state.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.layers import Embedding, Linear, RMSNorm
from kernels import native


def make_mtp_layer(decoder_layer_cls, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    class MTPLayer(decoder_layer_cls):
        def __init__(self) -> None:
            super().__init__(cfg, layer_idx, dtype=dtype)
            h = cfg.hidden_size
            self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
            self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)
            self.eh_proj = Linear(2 * h, h, dtype=dtype)
            self.shared_head = nn.Module()
            self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)

        def layer_input(self, next_ids: torch.Tensor, hidden: torch.Tensor, embed: Embedding) -> torch.Tensor:
            """next_ids [N] (t_{i+1}), hidden [N, H] (h_i) -> u [N, H]; a few rows in one native call."""
            norms = (self.enorm.weight, self.enorm.eps, self.hnorm.weight, self.hnorm.eps)
            u = native.mtp_input(next_ids, embed.weight, hidden, norms, self.eh_proj.weight)
            if u is not None:
                return u
            return self.eh_proj(torch.cat((self.enorm(embed(next_ids)), self.hnorm(hidden)), dim=-1))

        def draft(
            self,
            next_ids: torch.Tensor,
            hidden: torch.Tensor,
            embed: Embedding,
            cos: torch.Tensor,
            sin: torch.Tensor,
            batch: ForwardBatch,
            kv_cache: torch.Tensor,
        ) -> torch.Tensor:
            """-> g [N, H], the layer's output at each position (writing its cache rows)."""
            x, residual = self(self.layer_input(next_ids, hidden, embed), None, cos, sin, batch, kv_cache)
            return self.shared_head.norm(x, residual)[0]

        def store_kv(
            self,
            next_ids: torch.Tensor,
            hidden: torch.Tensor,
            embed: Embedding,
            cos: torch.Tensor,
            sin: torch.Tensor,
            slots: torch.Tensor,
            kv_cache: torch.Tensor,
        ) -> None:
            """Only the layer's cache rows for these positions: a position's KV depends on its
            input alone, so positions no draft is read from skip the attention and the MoE."""
            x = self.input_layernorm(self.layer_input(next_ids, hidden, embed))
            self.self_attn.store_cache(x, cos, sin, slots, kv_cache)

    return MTPLayer()
