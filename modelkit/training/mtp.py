"""DeepSeek-V3's multi-token prediction (MTP) head for training, and a plain PyTorch reference of it.

The MTP module predicts the token after next. For position i of a sequence t_0 .. t_{T-1}:

    u_i      = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])   # [2H] -> [H], concat order: embedding first
    g        = DecoderLayer(u_0 .. u_{T-2})                  # one full V3 layer (MLA + MoE), causal over u,
                                                             # u_i at rotary position i
    logits_i = lm_head(shared_head.norm(g_i))                # predicts t_{i+2}

Convention: h_i is the main model's final hidden state AFTER the final norm (`model.norm`), i.e. the
very vector that feeds lm_head to predict t_{i+1}. `embed` and `lm_head` are the main model's
(shared, never stored twice). The inference side (engine/models/mtp.py) follows the same convention.

Checkpoint names (DeepSeek-V3's HF layout) live under `model.layers.{num_hidden_layers}.`:
`enorm.weight`, `hnorm.weight`, `eh_proj.weight`, `shared_head.norm.weight`, and the decoder layer's
own `self_attn.*`, `mlp.*` (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`),
`input_layernorm.weight`, `post_attention_layernorm.weight`.

`MTPLayer` is the trainable module (a transformers `DeepseekV3DecoderLayer` plus the MTP parts, so
it computes exactly what transformers computes for a layer); `mtp_reference_logits` recomputes the
same logits from checkpoint tensors with nothing but torch, as the reference for other
implementations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Config,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3RMSNorm,
)

__all__ = ["MTPLayer", "mtp_logits", "mtp_reference_logits"]


class MTPLayer(DeepseekV3DecoderLayer):
    """One MTP module: a V3 decoder layer (index num_hidden_layers) plus enorm, hnorm, eh_proj and
    shared_head.norm. Its state_dict names are those of the checkpoint, minus the layer prefix
    (routed experts are fused in memory, as transformers keeps them)."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__(config, layer_idx=config.num_hidden_layers)
        h = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)


def mtp_logits(
    model: DeepseekV3ForCausalLM, mtp: MTPLayer, input_ids: Tensor, hidden_final: Tensor
) -> Tensor:
    """MTP logits of a batch.

    input_ids [B, T] and the main model's hidden_final [B, T, H] (after model.norm) ->
    [B, T - 1, V]: row i predicts input_ids[:, i + 2] (the last row predicts the token after the input).
    """
    next_embeds = model.model.embed_tokens(input_ids[:, 1:])  # [B, T-1, H]: embed(t_{i+1})
    u = mtp.eh_proj(
        torch.cat((mtp.enorm(next_embeds), mtp.hnorm(hidden_final[:, :-1])), dim=-1)
    )  # [B, T-1, H]
    position_ids = torch.arange(u.shape[1], device=u.device).unsqueeze(0)  # [1, T-1]
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=u,
        attention_mask=None,
        past_key_values=None,
        position_ids=position_ids,
    )
    g = mtp(
        u,
        attention_mask=mask,
        position_ids=position_ids,
        position_embeddings=model.model.rotary_emb(u, position_ids),
    )  # [B, T-1, H]
    return model.lm_head(mtp.shared_head.norm(g))  # [B, T-1, V]


# ---------------------------------------------------------------------------------------------
# Plain PyTorch reference, from checkpoint tensors (no transformers, no engine code).
# ---------------------------------------------------------------------------------------------


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """Rotary settings in either spelling: transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def _rope_tables(config: dict[str, Any], positions: Tensor) -> tuple[Tensor, Tensor, float]:
    """cos, sin [S, rope_dim / 2] (already times the YaRN attention factor) and the softmax scale.

    YaRN as in DeepSeek-V3: frequencies faster than beta_fast rotations over the original context are
    kept, slower than beta_slow are divided by `factor`, with a linear ramp between (rounded to whole
    dimensions); softmax scale gets mscale(factor, mscale_all_dim)^2.
    """
    dim = config["qk_rope_head_dim"]
    p = _rope_params(config)
    base = float(p["rope_theta"])
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
    scale = (config["qk_nope_head_dim"] + dim) ** -0.5
    attn_factor = 1.0
    if p["rope_type"] == "yarn":
        factor = float(p["factor"])
        original = int(p.get("original_max_position_embeddings") or config["max_position_embeddings"])
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attn_factor = _yarn_mscale(factor, 1.0)
        if mscale_all_dim:
            scale *= _yarn_mscale(factor, mscale_all_dim) ** 2
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [S, dim/2]
    cos = (angles.cos() * attn_factor).to(torch.float32)
    sin = (angles.sin() * attn_factor).to(torch.float32)
    return cos, sin, scale


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """x [..., S, D]; pairs (x0, x1), (x2, x3), ... when interleaved, else (x_j, x_{j + D/2})."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _mla(x: Tensor, w: dict[str, Tensor], config: dict[str, Any]) -> Tensor:
    """Multi-head latent attention over x [B, S, H] (causal, no cache) -> [B, S, H]."""
    b, s, _ = x.shape
    heads, nope, rope, vdim = (
        config["num_attention_heads"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
    )
    eps = config.get("rms_norm_eps", 1e-6)
    if config.get("q_lora_rank"):
        q = _rms_norm(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], eps)
        q = q @ w["self_attn.q_b_proj.weight"].T
    else:
        q = x @ w["self_attn.q_proj.weight"].T
    q = q.view(b, s, heads, nope + rope).transpose(1, 2)  # [B, heads, S, nope + rope]
    kv_a = x @ w["self_attn.kv_a_proj_with_mqa.weight"].T  # [B, S, kv_lora + rope]
    latent, k_pe = kv_a.split([config["kv_lora_rank"], rope], dim=-1)
    latent = _rms_norm(latent, w["self_attn.kv_a_layernorm.weight"], eps)  # [B, S, kv_lora]
    kv = (latent @ w["self_attn.kv_b_proj.weight"].T).view(b, s, heads, nope + vdim).transpose(1, 2)
    k_nope, v = kv.split([nope, vdim], dim=-1)  # [B, heads, S, nope], [B, heads, S, vdim]

    cos, sin, scale = _rope_tables(config, torch.arange(s))
    interleave = config.get("rope_interleave", True)
    q_pe = _rotate(q[..., nope:], cos, sin, interleave)  # [B, heads, S, rope]
    k_pe = _rotate(k_pe[:, None], cos, sin, interleave).expand(
        b, heads, s, rope
    )  # one rotary key for all heads
    q = torch.cat((q[..., :nope], q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe), dim=-1)  # [B, heads, S, nope + rope]

    scores = (q @ k.transpose(-1, -2)) * scale  # [B, heads, S, S]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, heads * vdim)  # [B, S, heads * vdim]
    return out @ w["self_attn.o_proj.weight"].T


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(x: Tensor, w: dict[str, Tensor], config: dict[str, Any]) -> Tensor:
    """DeepSeek-V3 MoE over x [N, H]: sigmoid scores, bias-corrected group-limited top-k, shared expert."""
    n_experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    scores = (x @ w["mlp.gate.weight"].T).sigmoid()  # [N, E]
    choice = scores + w["mlp.gate.e_score_correction_bias"]  # the bias picks experts, never weighs them
    # A group's score is the sum of its two best experts; only the topk_group best groups compete.
    group_scores = choice.view(-1, n_group, n_experts // n_group).topk(2, dim=-1).values.sum(-1)  # [N, G]
    groups = group_scores.topk(topk_group, dim=-1).indices  # [N, topk_group]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)  # [N, G]
    allowed = allowed.repeat_interleave(n_experts // n_group, dim=1)  # [N, E]
    chosen = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, chosen)  # [N, k]
    if config.get("norm_topk_prob", True):
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * config.get("routed_scaling_factor", 1.0)
    dense = torch.zeros_like(scores).scatter(1, chosen, weights)  # [N, E]: 0 for experts not chosen

    out = _swiglu(
        x,
        w["mlp.shared_experts.gate_proj.weight"],
        w["mlp.shared_experts.up_proj.weight"],
        w["mlp.shared_experts.down_proj.weight"],
    )
    for e in range(n_experts):  # every expert on every token, weighted by 0 where not routed
        pre = f"mlp.experts.{e}."
        y = _swiglu(x, w[pre + "gate_proj.weight"], w[pre + "up_proj.weight"], w[pre + "down_proj.weight"])
        out = out + dense[:, e : e + 1] * y
    return out


def mtp_reference_logits(
    tensors: dict[str, Tensor], config: dict[str, Any], input_ids: Tensor, hidden_final: Tensor
) -> Tensor:
    """The first MTP module's logits, from checkpoint tensors, in float32 plain PyTorch.

    tensors: a checkpoint's tensors by name (e.g. safetensors.torch.load_file), per-expert layout;
    only `model.embed_tokens.weight`, `lm_head.weight` and `model.layers.{num_hidden_layers}.*` are read.
    config: the checkpoint's config.json as a dict. input_ids [B, T] (or [T]); hidden_final [B, T, H]
    (or [T, H]): the main model's hidden states after its final norm. Returns [B, T - 1, V] (or
    [T - 1, V]) where row i predicts token i + 2. The MTP layer is an MoE layer (its index,
    num_hidden_layers, is past first_k_dense_replace) and attends causally over u, with u_i at rotary
    position i. Every expert runs on every token (weighted 0 where not routed): clear, not fast.
    """
    n, first_dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    if not config.get("n_routed_experts") or n < first_dense:
        raise ValueError(
            f"the MTP layer must be MoE: n_routed_experts={config.get('n_routed_experts')}, "
            f"num_hidden_layers={n} < first_k_dense_replace={first_dense}"
        )
    squeeze = input_ids.dim() == 1
    if squeeze:
        input_ids, hidden_final = input_ids[None], hidden_final[None]
    prefix = f"model.layers.{n}."
    w = {k.removeprefix(prefix): v.float() for k, v in tensors.items() if k.startswith(prefix)}
    eps = config.get("rms_norm_eps", 1e-6)
    b, t = input_ids.shape
    h = hidden_final.float()

    next_embeds = tensors["model.embed_tokens.weight"].float()[input_ids[:, 1:]]  # [B, T-1, H]
    u = torch.cat(
        (_rms_norm(next_embeds, w["enorm.weight"], eps), _rms_norm(h[:, :-1], w["hnorm.weight"], eps)), -1
    )
    x = u @ w["eh_proj.weight"].T  # [B, T-1, H]

    x = x + _mla(_rms_norm(x, w["input_layernorm.weight"], eps), w, config)
    y = _rms_norm(x, w["post_attention_layernorm.weight"], eps)  # [B, T-1, H]
    x = x + _moe(y.reshape(b * (t - 1), -1), w, config).view_as(x)

    g = _rms_norm(x, w["shared_head.norm.weight"], eps)  # [B, T-1, H]
    logits = g @ tensors["lm_head.weight"].float().T  # [B, T-1, V]
    return logits[0] if squeeze else logits
