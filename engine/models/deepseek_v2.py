"""DeepSeek-V2 and DeepSeek-V3 causal LMs (one class: V3 is V2 with sigmoid, bias-corrected routing).

Layer i: h += MLA(RMSNorm(h)); h += FFN(RMSNorm(h)) (each add fused into the next norm), where FFN is a dense SwiGLU MLP for the
first `first_k_dense_replace` layers and a DeepSeekMoE block after. The forward works on the
flat batch (see engine/forward_batch.py), never on padded [B, T] tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.layers import Embedding, GatedMLP, Linear, RMSNorm
from engine.models.mla import MLAttention
from engine.models.moe import DeepseekMoE
from engine.models.registry import register_model
from kernels.rotary import rope_cos_sin_cache


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: torch.dtype, ep=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (
            DeepseekMoE(cfg, dtype=dtype, layer_idx=layer_idx, ep=ep)
            if cfg.is_moe_layer(layer_idx)
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos,
        sin,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output, residual: the stream before it (None for layer 0).
        Each residual add is fused into the following RMSNorm. -> (mlp output, residual stream)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, batch, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@register_model("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype, max_positions: int, ep=None):
        """ep: an engine.parallel.ep_moe.ExpertParallel when the routed experts are spread over ranks."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype=dtype, ep=ep) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        cos, sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, R/2] float32
        self.register_buffer("rope_sin", sin, persistent=False)

    def process_weights(self) -> None:
        for layer in self.layers:
            layer.self_attn.process_weights()

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """-> hidden states [N, hidden] after the final norm."""
        x, residual = self.embed_tokens(batch.input_ids), None
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, batch, kv_cache)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] -> logits [M, vocab] float32."""
        if hidden.shape[0] >= 8 and hidden.device.type == "cpu":
            # On CPU the [V, H] @ [H, M] orientation of the same product runs ~1.8x faster for
            # a batch of rows than [M, H] @ [H, V]^T.
            return torch.mm(self.lm_head.weight, hidden.t()).t().float().contiguous()
        return self.lm_head(hidden).float()
