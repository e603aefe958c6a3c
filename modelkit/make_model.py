"""Deterministic builder of the project's default models: random DeepSeek-V3 checkpoints in HF format.

`make_model("tiny", dir)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and generation_config.json. Weights are seeded random numbers drawn in
float32 in a fixed order and cast to bfloat16, under the tensor names of a real DeepSeek-V3
checkpoint (per-expert `mlp.experts.{e}.gate_proj.weight`, as on the Hub). The same preset, builder
version and package versions give byte-identical files, so a folder can be reused across runs:
config.json carries a fingerprint, and a folder whose fingerprint matches is returned as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from safetensors.torch import save_file

from modelkit.bpe_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, tokenizer_config, train_tokenizer

if TYPE_CHECKING:
    from modelkit.quantize import QuantOptions

__all__ = ["PRESETS", "ModelPreset", "make_model", "train_tokenizer", "BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN"]

logger = logging.getLogger(__name__)

BUILDER_VERSION = 2
"""Bump when the recipe (init scales, config fields, tokenizer) changes, so old folders are rebuilt."""

OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
FINGERPRINT_KEY = "pdserve_build_fingerprint"
PRESET_KEY = "pdserve_preset"


@dataclass(frozen=True)
class ModelPreset:
    """Shape and seed of one default model; field names follow DeepseekV3Config."""

    vocab_size: int
    """Tokenizer size the BPE trainer is asked for; also the embedding rows."""
    hidden_size: int
    """Residual stream width."""
    num_hidden_layers: int
    """Decoder layers."""
    first_k_dense_replace: int
    """The first k layers use a dense MLP; the rest are MoE."""
    num_attention_heads: int
    """Attention heads (MLA: all heads share one compressed KV latent)."""
    q_lora_rank: int | None
    """Rank of the query down-projection; None means a full q_proj."""
    kv_lora_rank: int
    """Width of the compressed KV latent that is cached."""
    qk_nope_head_dim: int
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head query/key dims with rotary embedding (the key part is shared by all heads)."""
    v_head_dim: int
    """Per-head value dims."""
    n_routed_experts: int
    """Routed experts per MoE layer."""
    num_experts_per_tok: int
    """Experts each token is routed to."""
    n_group: int
    """Expert groups for group-limited routing."""
    topk_group: int
    """Groups a token may pick experts from."""
    n_shared_experts: int
    """Always-on experts per MoE layer (fused into one MLP of n_shared * moe_intermediate_size)."""
    moe_intermediate_size: int
    """Hidden width of each expert."""
    intermediate_size: int
    """Hidden width of the dense MLP layers."""
    max_position_embeddings: int
    """Longest context; also the tokenizer's model_max_length."""
    yarn_factor: float = 4.0
    """YaRN context extension factor."""
    yarn_original_max_position_embeddings: int = 1024
    """Context length before YaRN extension."""
    rope_theta: float = 10000.0
    """RoPE base, DeepSeek-V3's value."""
    norm_topk_prob: bool = True
    """Renormalize the chosen experts' sigmoid scores to sum to 1."""
    routed_scaling_factor: float = 2.5
    """Multiplier on the routed experts' weights, DeepSeek-V3's value."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    dtype: str = "bfloat16"
    """Storage dtype of every tensor except e_score_correction_bias (float32, as in V3)."""
    seed: int = 0
    """Seed of the torch.Generator that draws all weights."""
    num_nextn_predict_layers: int = 0
    """MTP layers after the main layers (DeepSeek-V3 has 1), drawn after all main weights."""
    index_n_heads: int = 0
    """DeepSeek-V3.2's lightning indexer: its query heads; 0 builds a DeepSeek-V3 model."""
    index_head_dim: int = 0
    """Width of an indexer head and key (its leading qk_rope_head_dim are rotary)."""
    index_topk: int = 0
    """Tokens each query attends to once its context is longer."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


PRESETS: dict[str, ModelPreset] = {
    # The default model: small enough that a forward pass on a 2-core CPU takes milliseconds.
    "tiny": ModelPreset(
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=64,
        intermediate_size=256,
        max_position_embeddings=4096,
        seed=0,
    ),
    # Benchmark model (~137M parameters). The stdlib corpus reaches the full 32000-token vocabulary
    # in a few seconds, so tokenizer and config agree on 32000.
    "bench": ModelPreset(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=256,
        intermediate_size=1024,
        max_position_embeddings=4096,
        seed=1,
    ),
}
# The tiny model plus one MTP layer (same main weights): tests of MTP speculative decoding.
PRESETS["tiny-mtp"] = dataclasses.replace(PRESETS["tiny"], num_nextn_predict_layers=1)
# DeepSeek-V3.2 (an indexer per layer, drawn after the rest of its layer's attention). tiny-v32's
# top-32 makes prompts of a few dozen tokens sparse; bench-v32 keeps DeepSeek's 2048, with an
# indexer (16 heads of 64) whose scoring costs ~1/8 of the bench model's MLA per token, and
# contexts up to 32k (benchmarks/sparse_decode.py).
PRESETS["tiny-v32"] = dataclasses.replace(
    PRESETS["tiny"], index_n_heads=16, index_head_dim=32, index_topk=32, seed=2
)
PRESETS["tiny-v32-mtp"] = dataclasses.replace(PRESETS["tiny-v32"], num_nextn_predict_layers=1)
PRESETS["bench-v32"] = dataclasses.replace(
    PRESETS["bench"],
    index_n_heads=16,
    index_head_dim=64,
    index_topk=2048,
    max_position_embeddings=32768,
    seed=3,
)


@dataclass(frozen=True)
class V4Preset:
    """A DeepSeek-V4 model; field names follow DeepSeek's released config.json (compress_ratios,
    num_hash_layers, rope_scaling), and its tensors take DeepSeek's names, as V4-Flash ships."""

    vocab_size: int
    hidden_size: int
    compress_ratios: tuple[int, ...]
    """Per layer: 0 sliding window only, csa_rate (4) CSA, hca_rate (128 in V4-Flash) HCA."""
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    hca_rate: int = 128
    csa_rate: int = 4
    num_hash_layers: int = 1
    hc_mult: int = 4
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 4.0
    yarn_original_max_position_embeddings: int = 1024
    routed_scaling_factor: float = 1.5
    rms_norm_eps: float = 1e-6
    dtype: str = "bfloat16"
    seed: int = 0
    num_nextn_predict_layers: int = 0
    """MTP layers (`mtp.j.*`, sliding-window, score-routed), drawn after the main weights."""

    @property
    def num_hidden_layers(self) -> int:
        return len(self.compress_ratios)


PRESETS.update(
    {
        # Every layer type under a 32-token window, 32-token HCA entries and top-8 CSA entries, so
        # prompts of a few dozen tokens use all of it.
        "tiny-v4": V4Preset(
            vocab_size=4096,
            hidden_size=128,
            compress_ratios=(0, 4, 32, 4),
            hca_rate=32,
            num_attention_heads=4,
            head_dim=128,
            qk_rope_head_dim=32,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            sliding_window=32,
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=64,
            index_n_heads=16,
            index_head_dim=32,
            index_topk=8,
            max_position_embeddings=4096,
            seed=4,
        ),
        # V4-Flash's attention at the bench model's width (512): one 512-wide K = V head, V4-Flash's
        # 128-token window, rates 4 / 128 and top-512, its layer pattern (two sliding layers, then
        # CSA and HCA alternating); 32 experts as the bench model.
        "bench-v4": V4Preset(
            vocab_size=32000,
            hidden_size=512,
            compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128),
            num_attention_heads=8,
            head_dim=512,
            qk_rope_head_dim=64,
            q_lora_rank=256,
            o_groups=4,
            o_lora_rank=256,
            sliding_window=128,
            n_routed_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            index_n_heads=16,
            index_head_dim=64,
            index_topk=512,
            max_position_embeddings=32768,
            seed=5,
        ),
    }
)


PRESETS["tiny-v4-mtp"] = dataclasses.replace(PRESETS["tiny-v4"], num_nextn_predict_layers=1)


def v4_config(p: V4Preset, fingerprint: str, preset_name: str) -> dict[str, Any]:
    """config.json in the released V4 checkpoints' spelling (compress_ratios, num_hash_layers), or
    with rates other than V4-Flash's 4 / 128, which that spelling cannot say, transformers' own
    (layer_types, mlp_layer_types, compress_rates)."""
    if (p.csa_rate, p.hca_rate) == (4, 128):
        layout = {"compress_ratios": list(p.compress_ratios), "num_hash_layers": p.num_hash_layers}
    else:
        kinds = {
            0: "sliding_attention",
            p.csa_rate: "compressed_sparse_attention",
            p.hca_rate: "heavily_compressed_attention",
        }
        n = p.num_hidden_layers
        layout = {
            "layer_types": [kinds[r] for r in p.compress_ratios],
            "mlp_layer_types": ["hash_moe"] * p.num_hash_layers + ["moe"] * (n - p.num_hash_layers),
            "compress_rates": {
                "compressed_sparse_attention": p.csa_rate,
                "heavily_compressed_attention": p.hca_rate,
            },
        }
    return {
        **layout,
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": p.dtype,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": p.head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "q_lora_rank": p.q_lora_rank,
        "o_groups": p.o_groups,
        "o_lora_rank": p.o_lora_rank,
        "sliding_window": p.sliding_window,
        "n_routed_experts": p.n_routed_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": p.num_experts_per_tok,
        "moe_intermediate_size": p.moe_intermediate_size,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": p.routed_scaling_factor,
        "swiglu_limit": 10.0,
        "hc_mult": p.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "index_n_heads": p.index_n_heads,
        "index_head_dim": p.index_head_dim,
        "index_topk": p.index_topk,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": p.rope_theta,
        "compress_rope_theta": p.compress_rope_theta,
        "rope_scaling": {
            "type": "yarn",
            "factor": p.yarn_factor,
            "original_max_position_embeddings": p.yarn_original_max_position_embeddings,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "rms_norm_eps": p.rms_norm_eps,
        "num_nextn_predict_layers": p.num_nextn_predict_layers,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        PRESET_KEY: preset_name,
        FINGERPRINT_KEY: fingerprint,
    }


def v4_weight_specs(p: V4Preset) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, shape, std) in DeepSeek's V4 names, drawn in order; std None: a norm weight (near 1),
    0.0: drawn separately (the hash table). Linear weights N(0, 1/fan_in); the hyper-connection
    and attention-sink parameters small and non-zero, so none of them can be skipped unnoticed."""
    h, heads, d = p.hidden_size, p.num_attention_heads, p.head_dim
    hc, mix = p.hc_mult, (2 + p.hc_mult) * p.hc_mult
    out_scale = 1.0 / math.sqrt(2 * p.num_hidden_layers)

    def lin(name: str, out_f: int, in_f: int, scale: float = 1.0) -> tuple[str, tuple[int, ...], float]:
        return name, (out_f, in_f), scale / math.sqrt(in_f)

    def norm(name: str, n: int) -> tuple[str, tuple[int, ...], None]:
        return name, (n,), None

    def compressor(pre: str, width: int, m: int, coff: int) -> list:
        return [
            lin(f"{pre}.wkv.weight", coff * width, h),
            lin(f"{pre}.wgate.weight", coff * width, h),
            (f"{pre}.ape", (m, coff * width), 0.5),
            norm(f"{pre}.norm.weight", width),
        ]

    def layer(pre: str, ratio: int, hashed: bool) -> list[tuple[str, tuple[int, ...], float | None]]:
        specs: list[tuple[str, tuple[int, ...], float | None]] = []
        a = f"{pre}.attn"
        specs += [norm(f"{pre}.attn_norm.weight", h), norm(f"{pre}.ffn_norm.weight", h)]
        for hc_name in ("hc_attn", "hc_ffn"):
            specs += [
                lin(f"{pre}.{hc_name}_fn", mix, hc * h),
                (f"{pre}.{hc_name}_base", (mix,), 0.5),
                (f"{pre}.{hc_name}_scale", (3,), 0.3),
            ]
        specs += [
            lin(f"{a}.wq_a.weight", p.q_lora_rank, h),
            norm(f"{a}.q_norm.weight", p.q_lora_rank),
            lin(f"{a}.wq_b.weight", heads * d, p.q_lora_rank),
            lin(f"{a}.wkv.weight", d, h),
            norm(f"{a}.norm.weight", d),
            lin(f"{a}.wo_a.weight", p.o_groups * p.o_lora_rank, heads * d // p.o_groups),
            lin(f"{a}.wo_b.weight", h, p.o_groups * p.o_lora_rank, out_scale),
            (f"{a}.attn_sink", (heads,), 0.5),
        ]
        if ratio:
            specs += compressor(f"{a}.compressor", d, ratio, 2 if ratio == p.csa_rate else 1)
        if ratio == p.csa_rate:
            specs += compressor(f"{a}.indexer.compressor", p.index_head_dim, ratio, 2)
            specs += [
                lin(f"{a}.indexer.wq_b.weight", p.index_n_heads * p.index_head_dim, p.q_lora_rank),
                lin(f"{a}.indexer.weights_proj.weight", p.index_n_heads, h),
            ]
        f = f"{pre}.ffn"
        specs.append(lin(f"{f}.gate.weight", p.n_routed_experts, h))
        if hashed:
            specs.append((f"{f}.gate.tid2eid", (p.vocab_size, p.num_experts_per_tok), 0.0))
        else:
            specs.append((f"{f}.gate.bias", (p.n_routed_experts,), 0.1))
        for e in [*range(p.n_routed_experts), "shared"]:
            ex = f"{f}.experts.{e}" if e != "shared" else f"{f}.shared_experts"
            inter = p.moe_intermediate_size
            specs += [lin(f"{ex}.w1.weight", inter, h), lin(f"{ex}.w3.weight", inter, h)]
            specs.append(lin(f"{ex}.w2.weight", h, inter, out_scale))
        return specs

    def head(pre: str) -> list[tuple[str, tuple[int, ...], float | None]]:
        return [
            lin(f"{pre}hc_head_fn", hc, hc * h),
            (f"{pre}hc_head_base", (hc,), 0.5),
            (f"{pre}hc_head_scale", (1,), 0.3),
            norm(f"{pre}norm.weight", h),
            lin(f"{pre}head.weight", p.vocab_size, h),
        ]

    specs: list[tuple[str, tuple[int, ...], float | None]] = [("embed.weight", (p.vocab_size, h), 1.0)]
    for i, ratio in enumerate(p.compress_ratios):
        specs += layer(f"layers.{i}", ratio, i < p.num_hash_layers)
    specs += head("")
    for j in range(p.num_nextn_predict_layers):  # last: the main weights are those of the preset without
        pre = f"mtp.{j}."
        specs += [
            norm(f"{pre}enorm.weight", h),
            norm(f"{pre}hnorm.weight", h),
            lin(f"{pre}e_proj.weight", h, h),
            lin(f"{pre}h_proj.weight", h, h),
        ]
        specs += layer(f"mtp.{j}", 0, False) + head(pre)
    return specs


_V4_FLOAT32 = (
    "attn_sink",
    "ape",
    "_fn",
    "_base",
    "_scale",
    "gate.bias",
    "gate.weight",
    "compressor.wkv.weight",
)
"""Tensors V4 keeps in float32 (its router, hyper-connections, sinks, position biases)."""


def make_v4_weights(p: V4Preset) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(p.seed)
    dtype = getattr(torch, p.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, std in v4_weight_specs(p):
        if name.endswith("tid2eid"):  # distinct experts per token
            table = torch.rand(shape[0], p.n_routed_experts, generator=gen).argsort(dim=-1)
            tensors[name] = table[:, : shape[1]].to(torch.int32).contiguous()
            continue
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        x = 1.0 + 0.02 * x if std is None else x * std
        if name.endswith("_scale"):
            x = 1.0 + x  # the hyper-connections' logit scales
        keep = name.endswith(_V4_FLOAT32) or ".norm." in name or name.endswith("norm.weight")
        tensors[name] = x if keep else x.to(dtype)
    return tensors


def hf_config(p: ModelPreset, fingerprint: str, preset_name: str) -> dict[str, Any]:
    """config.json as transformers 4.x writes it for DeepSeek-V3 (rope_theta + rope_scaling spelling)."""
    v32 = {"index_n_heads": p.index_n_heads, "index_head_dim": p.index_head_dim, "index_topk": p.index_topk}
    return {
        "architectures": ["DeepseekV32ForCausalLM" if p.index_topk else "DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v32" if p.index_topk else "deepseek_v3",
        **(v32 if p.index_topk else {}),
        "dtype": p.dtype,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "moe_intermediate_size": p.moe_intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_attention_heads,
        "n_shared_experts": p.n_shared_experts,
        "n_routed_experts": p.n_routed_experts,
        "num_experts_per_tok": p.num_experts_per_tok,
        "n_group": p.n_group,
        "topk_group": p.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": p.norm_topk_prob,
        "routed_scaling_factor": p.routed_scaling_factor,
        "first_k_dense_replace": p.first_k_dense_replace,
        "moe_layer_freq": 1,
        "q_lora_rank": p.q_lora_rank,
        "kv_lora_rank": p.kv_lora_rank,
        "qk_nope_head_dim": p.qk_nope_head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "v_head_dim": p.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": p.rope_theta,
        "rope_scaling": {
            "type": "yarn",
            "factor": p.yarn_factor,
            "original_max_position_embeddings": p.yarn_original_max_position_embeddings,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rope_interleave": True,
        "rms_norm_eps": p.rms_norm_eps,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "use_cache": True,
        "num_nextn_predict_layers": p.num_nextn_predict_layers,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        PRESET_KEY: preset_name,
        FINGERPRINT_KEY: fingerprint,
    }


def generation_config() -> dict[str, Any]:
    """DeepSeek-V3's generation defaults (sampling at T=0.6, top_p=0.95) plus the pad id."""
    return {
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
    }


def weight_specs(p: ModelPreset) -> list[tuple[str, tuple[int, ...], float | None]]:
    """(name, shape, std) for every tensor, in the order they are drawn; std None marks a norm weight.

    Linear weights get std 1/sqrt(fan_in) so each projection keeps activations O(1); the projections
    that write into the residual stream (o_proj, down_proj) are further scaled by 1/sqrt(2 * layers)
    so the stream stays dominated by no single layer.
    """
    h, heads = p.hidden_size, p.num_attention_heads
    out_scale = 1.0 / math.sqrt(2 * p.num_hidden_layers)

    def lin(name: str, out_f: int, in_f: int, scale: float = 1.0) -> tuple[str, tuple[int, ...], float]:
        return name, (out_f, in_f), scale / math.sqrt(in_f)

    def norm(name: str, n: int) -> tuple[str, tuple[int, ...], None]:
        return name, (n,), None

    def mlp(prefix: str, inter: int) -> list[tuple[str, tuple[int, ...], float | None]]:
        return [
            lin(f"{prefix}.gate_proj.weight", inter, h),
            lin(f"{prefix}.up_proj.weight", inter, h),
            lin(f"{prefix}.down_proj.weight", h, inter, out_scale),
        ]

    def layer(i: int) -> list[tuple[str, tuple[int, ...], float | None]]:
        pre = f"model.layers.{i}"
        specs: list[tuple[str, tuple[int, ...], float | None]] = []
        specs += [norm(f"{pre}.input_layernorm.weight", h), norm(f"{pre}.post_attention_layernorm.weight", h)]
        a = f"{pre}.self_attn"
        if p.q_lora_rank is None:
            specs.append(lin(f"{a}.q_proj.weight", heads * p.qk_head_dim, h))
        else:
            specs += [
                lin(f"{a}.q_a_proj.weight", p.q_lora_rank, h),
                norm(f"{a}.q_a_layernorm.weight", p.q_lora_rank),
                lin(f"{a}.q_b_proj.weight", heads * p.qk_head_dim, p.q_lora_rank),
            ]
        specs += [
            lin(f"{a}.kv_a_proj_with_mqa.weight", p.kv_lora_rank + p.qk_rope_head_dim, h),
            norm(f"{a}.kv_a_layernorm.weight", p.kv_lora_rank),
            lin(f"{a}.kv_b_proj.weight", heads * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank),
            lin(f"{a}.o_proj.weight", h, heads * p.v_head_dim, out_scale),
        ]
        if p.index_topk:
            idx = f"{a}.indexer"
            specs += [
                lin(f"{idx}.wq_b.weight", p.index_n_heads * p.index_head_dim, p.q_lora_rank),
                lin(f"{idx}.wk.weight", p.index_head_dim, h),
                norm(f"{idx}.k_norm.weight", p.index_head_dim),
                (f"{idx}.k_norm.bias", (p.index_head_dim,), 0.02),
                lin(f"{idx}.weights_proj.weight", p.index_n_heads, h),
            ]
        if i < p.first_k_dense_replace:
            return specs + mlp(f"{pre}.mlp", p.intermediate_size)
        specs += [
            lin(f"{pre}.mlp.gate.weight", p.n_routed_experts, h),
            (f"{pre}.mlp.gate.e_score_correction_bias", (p.n_routed_experts,), 0.02),
        ]
        for e in range(p.n_routed_experts):
            specs += mlp(f"{pre}.mlp.experts.{e}", p.moe_intermediate_size)
        return specs + mlp(f"{pre}.mlp.shared_experts", p.moe_intermediate_size * p.n_shared_experts)

    specs: list[tuple[str, tuple[int, ...], float | None]] = [
        ("model.embed_tokens.weight", (p.vocab_size, h), 1.0)
    ]
    for i in range(p.num_hidden_layers):
        specs += layer(i)
    specs += [norm("model.norm.weight", h), lin("lm_head.weight", p.vocab_size, h)]
    # MTP layers come last, so a preset with them draws the same main-model weights as one without.
    for j in range(p.num_nextn_predict_layers):
        pre = f"model.layers.{p.num_hidden_layers + j}"
        specs += [
            norm(f"{pre}.enorm.weight", h),
            norm(f"{pre}.hnorm.weight", h),
            lin(f"{pre}.eh_proj.weight", h, 2 * h),
        ]
        specs += layer(p.num_hidden_layers + j) + [norm(f"{pre}.shared_head.norm.weight", h)]
    return specs


def make_weights(p: ModelPreset) -> dict[str, torch.Tensor]:
    """Draw every tensor in weight_specs order from one seeded generator, in float32, then cast."""
    gen = torch.Generator(device="cpu").manual_seed(p.seed)
    dtype = getattr(torch, p.dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, std in weight_specs(p):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if std is None:
            x = 1.0 + 0.02 * x  # norm weights near 1, not exactly 1, so a kernel that ignores them fails
        else:
            x = x * std
        # V3 keeps the routing bias in float32 (transformers pins it there too).
        tensors[name] = x if name.endswith("e_score_correction_bias") else x.to(dtype)
    return tensors


def fingerprint(name: str, quant: QuantOptions | None = None) -> str:
    """Hash of everything a build depends on: the preset, the recipe, and the versions that feed it."""
    deps = {
        "preset": name,
        **({} if quant is None else {"quant": asdict(quant)}),
        "fields": asdict(PRESETS[name]),
        "builder": BUILDER_VERSION,
        "python": platform.python_version(),  # the tokenizer corpus is this Python's stdlib
        "torch": torch.__version__.split("+")[0],
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()


def _read_config(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def is_complete(folder: Path, name: str, quant: QuantOptions | None = None) -> bool:
    """True if folder holds all output files of a build of this preset with the current fingerprint."""
    cfg = _read_config(folder)
    return (
        cfg is not None
        and cfg.get(FINGERPRINT_KEY) == fingerprint(name, quant)
        and all((folder / f).is_file() for f in OUTPUT_FILES)
    )


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _build(name: str, folder: Path, quant: QuantOptions | None) -> None:
    p = PRESETS[name]
    tok = train_tokenizer(p.vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(p.max_position_embeddings))
    _write_json(folder / "generation_config.json", generation_config())
    if isinstance(p, V4Preset):
        weights, config = make_v4_weights(p), v4_config(p, fingerprint(name, quant), name)
    else:
        weights, config = make_weights(p), hf_config(p, fingerprint(name, quant), name)
    if quant is not None:  # the same weights, as DeepSeek's quantized checkpoints store them
        from modelkit.quantize import quantize_tensor  # it reads this module's FINGERPRINT_KEY

        v4 = isinstance(p, V4Preset)
        weights = dict(item for n, w in weights.items() for item in quantize_tensor(n, w, quant, v4))
        config = quant.config(config)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # config.json last: it carries the fingerprint that marks the folder complete.
    _write_json(folder / "config.json", config)
    # mkdtemp makes the folder 0700 and safetensors writes 0600; give the usual umask modes so a
    # server running as another user can read the model.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in OUTPUT_FILES:
        (folder / f).chmod(0o666 & ~umask)


def _check_replaceable(out: Path) -> None:
    """Refuse to delete anything but an empty folder or an earlier pdserve build."""
    if not out.exists():
        return
    cfg = _read_config(out)
    if not out.is_dir() or not ((cfg is not None and PRESET_KEY in cfg) or not any(out.iterdir())):
        raise ValueError(f"out_dir={out} exists and is not a pdserve model build; refusing to overwrite it")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished tmp folder to out, moving aside (then deleting) an old build there."""
    if not out.exists():
        os.rename(tmp, out)
        return
    _check_replaceable(out)
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, trash / out.name)
    os.rename(tmp, out)
    shutil.rmtree(trash)


def make_model(
    name: str, out_dir: str | Path, *, force: bool = False, quant: QuantOptions | None = None
) -> Path:
    """Build preset `name` into out_dir (HF format) unless a complete build is already there; with
    quant, its weights quantized as DeepSeek's checkpoints are (modelkit/quantize.py).

    The build goes into a temporary folder beside out_dir that is renamed at the end, so out_dir is
    never seen half-written. force=True rebuilds even over a complete build.
    """
    if name not in PRESETS:
        raise ValueError(f"name={name!r} is not a preset; choose one of {sorted(PRESETS)}")
    out = Path(out_dir).absolute()
    if not force and is_complete(out, name, quant):
        logger.info("reusing %s model at %s", name, out)
        return out
    _check_replaceable(out)  # fail before spending seconds on a build we could not install
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    start = time.perf_counter()
    try:
        _build(name, tmp, quant)
        try:
            _replace(tmp, out)
        except OSError:
            # Another process may have finished the same build between our check and our rename.
            if not is_complete(out, name, quant):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    logger.info("built %s model at %s in %.1fs", name, out, time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m modelkit.make_model tiny models/tiny [--force]`."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(PRESETS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="rebuild even if out_dir holds a complete build")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_model(args.name, args.out_dir, force=args.force)


if __name__ == "__main__":
    main()
