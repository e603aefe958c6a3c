"""The transformers side of the logits-parity tests: tiny random DeepSeek checkpoints and their references.

`VARIANTS` spans the config axes that change the math (V2 vs V3 routing, YaRN, q-LoRA, expert groups,
top-k renormalisation, dense-then-MoE layouts) plus the two checkpoint spellings the engine must read
(transformers 5 `rope_parameters` and the 4.x / DeepSeek-original `rope_theta` + `rope_scaling`, single file
and sharded). `build_hf_checkpoint` writes a folder the engine loads like a hub download;
`hf_reference` runs transformers on it, eager attention and eager experts in float32, and returns the
log-probabilities the engine must reproduce.

transformers is the reference only: the engine never imports it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

logger = logging.getLogger(__name__)

BOS, EOS, UNK = "<|bos|>", "<|eos|>", "<|unk|>"
"""Special tokens of the generated tokenizer; they take ids 0, 1, 2 and the configs say so."""

LOGIT_STD = 4.0
"""Spread of the random checkpoints' logits: greedy tokens vary and top-1 is rarely a near-tie."""

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,  # dense MLP of the first_k_dense_replace layers
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,  # MLA: every head has its own K/V, expanded from the shared latent
    kv_lora_rank=32,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    tie_word_embeddings=False,
    max_position_embeddings=256,
)

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _yarn(factor: float, mscale: float, mscale_all_dim: float, original: int, **extra: float) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": factor,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
        "original_max_position_embeddings": original,
        **extra,
    }


def _variant(model_type: str, legacy_config_json: bool = False, max_shard_size: str | None = None, **config):
    """One checkpoint recipe, wrapped in a pytest.param whose id is derived from the recipe itself."""
    v = {
        "model_type": model_type,  # "deepseek_v2", "deepseek_v3" or "deepseek_v32"
        "config": {**_COMMON, **config},  # keyword arguments of DeepseekV{2,3,32}Config
        "legacy_config_json": legacy_config_json,  # rewrite config.json in the transformers 4.x spelling
        "max_shard_size": max_shard_size,  # e.g. "100KB": write shards + model.safetensors.index.json
    }
    return pytest.param(v, id=variant_id(v))


def variant_id(v: dict) -> str:
    """A readable id such as `v3-yarn-qlora-g4-norm-dense1` that says what the variant exercises."""
    c = v["config"]
    v3 = v["model_type"] in ("deepseek_v3", "deepseek_v32")
    parts = [{"deepseek_v2": "v2", "deepseek_v3": "v3", "deepseek_v32": "v32"}[v["model_type"]]]
    if "index_topk" in c:
        parts.append(f"idx{c['index_n_heads']}x{c['index_head_dim']}-top{c['index_topk']}")
    parts.append("yarn" if c["rope_parameters"]["rope_type"] == "yarn" else "noyarn")
    if v["legacy_config_json"]:
        parts.append("legacy")
    parts.append("qlora" if c.get("q_lora_rank") else "noqlora")
    if not v3:
        parts.append({"greedy": "greedy", "group_limited_greedy": "glg"}[c["topk_method"]])
    if v3 or c["topk_method"] == "group_limited_greedy":
        parts.append(f"g{c['n_group']}")
    if v3:  # transformers' V2 router never renormalises, whatever norm_topk_prob says
        parts.append("norm" if c["norm_topk_prob"] else "nonorm")
    parts.append(f"dense{c['first_k_dense_replace']}")
    if v["max_shard_size"]:
        parts.append("sharded")
    return "-".join(parts)


VARIANTS = [
    # YaRN with mscale != mscale_all_dim, so the cos/sin attention factor is not 1 and the softmax scale
    # changes too; 16 experts in 4 groups, top-4, renormalised.
    _variant(
        "deepseek_v3",
        vocab_size=512,
        num_hidden_layers=3,
        q_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=16,
        v_head_dim=20,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=_yarn(4.0, 1.0, 0.8, 32),
    ),
    # No groups, no renormalisation, every layer MoE, an odd vocabulary.
    _variant(
        "deepseek_v3",
        vocab_size=301,
        num_hidden_layers=2,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        first_k_dense_replace=0,
        rope_parameters=_ROPE,
    ),
    # The DeepSeek-V3 release's own spelling: rope_theta + rope_scaling {"type": "yarn", ...} with
    # mscale == mscale_all_dim (cos/sin factor 1, softmax scale still x mscale^2), plus its legacy fields.
    _variant(
        "deepseek_v3",
        legacy_config_json=True,
        vocab_size=384,
        num_hidden_layers=3,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=2,
        max_position_embeddings=128,
        rope_parameters=_yarn(4.0, 1.0, 1.0, 32, beta_fast=32, beta_slow=1),
    ),
    # Sharded checkpoint with an index; top-4 of 16 inside one of two groups.
    _variant(
        "deepseek_v3",
        max_shard_size="100KB",
        vocab_size=448,
        num_hidden_layers=2,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=16,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=4,
        n_shared_experts=1,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_parameters=_ROPE,
    ),
    # DeepSeek-V2: softmax gating, plain top-k.
    _variant(
        "deepseek_v2",
        vocab_size=320,
        num_hidden_layers=2,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        topk_method="greedy",
        n_group=None,
        topk_group=None,
        num_experts_per_tok=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        rope_parameters=_ROPE,
    ),
    # DeepSeek-V2 group-limited top-k (max score per group), YaRN with a cos/sin factor != 1.
    _variant(
        "deepseek_v2",
        vocab_size=500,
        num_hidden_layers=2,
        q_lora_rank=None,
        qk_nope_head_dim=24,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=16,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        norm_topk_prob=False,
        routed_scaling_factor=2.0,
        first_k_dense_replace=0,
        max_position_embeddings=256,
        rope_parameters=_yarn(8.0, 1.0, 0.5, 32),
    ),
    # The DeepSeek-V2(-Lite) release's own spelling, YaRN with mscale == mscale_all_dim == 0.707.
    _variant(
        "deepseek_v2",
        legacy_config_json=True,
        vocab_size=400,
        num_hidden_layers=3,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=2,
        max_position_embeddings=128,
        rope_parameters=_yarn(4.0, 0.707, 0.707, 32, beta_fast=32, beta_slow=1),
    ),
]

V32_VARIANTS = [
    # DeepSeek-V3.2: the indexer keeps index_topk (< the prompts and the 32 steps after them) of
    # each query's tokens. 16 indexer heads, so exact ReLU ties (every head's dot negative) are
    # rare; YaRN, a dense first layer, groups and renormalised routing as in the release.
    _variant(
        "deepseek_v32",
        vocab_size=384,
        num_hidden_layers=3,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=5,
        rope_parameters=_yarn(4.0, 1.0, 1.0, 64, beta_fast=32, beta_slow=1),
    ),
    # A wider indexer head (rope 16 of 32 dims), top-12, every layer MoE, no YaRN.
    _variant(
        "deepseek_v32",
        vocab_size=320,
        num_hidden_layers=2,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=12,
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=0,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=12,
        rope_parameters=_ROPE,
    ),
]
"""DeepSeek-V3.2 checkpoints (tests/test_parity_v32.py)."""

_LEGACY_FIELDS = {
    # Fields the DeepSeek releases carry that transformers 5 neither needs nor writes.
    "deepseek_v3": {
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "ep_size": 1,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
    },
    "deepseek_v2": {
        "scoring_func": "softmax",
        "moe_layer_freq": 1,
        "ep_size": 1,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
    },
}


def _classes(model_type: str):
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
    )

    return {
        "deepseek_v2": (DeepseekV2Config, DeepseekV2ForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
        "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM),
    }[model_type]


def load_hf_model(model_dir: Path):
    """The checkpoint as a transformers model: float32, eager attention, eager (per-expert loop) MoE."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def _reinit_(model, generator: torch.Generator) -> None:
    """Replace transformers' std-0.02 init (near-uniform logits) with one whose logits have a real spread.

    Matrices get N(0, 1/fan_in) so every activation stays O(1) through the residual stream; norms get
    1 + N(0, 0.1^2) so a loader that skips them (or reads the wrong one) shows; embeddings get N(0, 1);
    lm_head is scaled up so the logits have std ~LOGIT_STD.
    """
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            new = torch.randn(p.shape, generator=generator)
        elif name == "lm_head.weight":  # [V, H]; logits of std ~4 give a peaked, well-separated top-1
            new = torch.randn(p.shape, generator=generator) * (LOGIT_STD / math.sqrt(p.shape[1]))
        elif name.endswith("k_norm.bias"):  # the V3.2 indexer's LayerNorm
            new = 0.1 * torch.randn(p.shape, generator=generator)
        elif p.ndim == 1:  # norm weights
            new = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
        elif name.endswith("experts.gate_up_proj"):  # [E, 2 * I, H]
            new = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1])
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            new = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1])
        elif p.ndim == 2:  # nn.Linear [out, in], the routers' [E, H] included
            new = torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[1])
        else:
            raise AssertionError(f"no re-initialisation rule for parameter {name} of shape {tuple(p.shape)}")
        p.copy_(new)


@torch.no_grad()
def _set_correction_bias_(model, generator: torch.Generator) -> None:
    """Give every V3 router a partly negative e_score_correction_bias that changes which experts win."""
    hidden = model.config.hidden_size
    for layer in model.model.layers[model.config.first_k_dense_replace :]:  # the MoE layers
        router = layer.mlp.gate
        e = router.e_score_correction_bias.shape[0]
        # Sigmoid scores spread by ~0.2 for these weights; a bias of the same size reorders the choice.
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=generator) - 0.05)
        # [N, H] stand-ins for normalised hidden states
        x = torch.randn(256, hidden, generator=generator)
        chosen = router(x)[2].sort(dim=-1).values
        bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        unbiased = router(x)[2].sort(dim=-1).values
        router.e_score_correction_bias.copy_(bias)
        changed = (chosen != unbiased).any(dim=-1).float().mean().item()
        assert (bias < 0).any() and (bias > 0).any(), "correction bias must have both signs"
        assert changed > 0.3, f"correction bias changes the experts of only {changed:.0%} of tokens"


def _write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """A WordLevel tokenizer with exactly vocab_size ids: <|bos|>=0, <|eos|>=1, <|unk|>=2, then w3, w4, ..."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {BOS: 0, EOS: 1, UNK: 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, UNK)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}"
        ),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _rewrite_config_legacy(out_dir: Path, model_type: str) -> None:
    """Rewrite config.json the way the DeepSeek releases (and transformers 4.x) spell it.

    rope_parameters becomes top-level rope_theta plus rope_scaling {"type": ...} (null without scaling);
    the derived head_dim / qk_head_dim go, and so does rope_interleave (the releases lack it; absent means
    interleaved), dtype is torch_dtype, and the releases' extra fields appear.
    """
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    for derived in ("head_dim", "qk_head_dim", "rope_interleave"):
        cfg.pop(derived, None)
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.update(_LEGACY_FIELDS[model_type])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_hf_checkpoint(variant: dict, out_dir: Path, seed: int) -> Path:
    """Write a random checkpoint for `variant` to out_dir and return out_dir.

    The folder holds config.json, model.safetensors (or shards + index), generation_config.json,
    tokenizer.json and tokenizer_config.json, all float32. Before returning it checks that transformers
    reloads the folder to the same config and the same logits, so a parity failure is never the
    checkpoint's fault.
    """
    config_cls, model_cls = _classes(variant["model_type"])
    config = config_cls(**copy.deepcopy(variant["config"]))  # the config fills rope dicts in place
    generator = torch.Generator().manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    _reinit_(model, generator)
    if variant["model_type"] in ("deepseek_v3", "deepseek_v32"):
        _set_correction_bias_(model, generator)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": variant["max_shard_size"]} if variant["max_shard_size"] else {}
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    _write_tokenizer(out_dir, config.vocab_size, config.max_position_embeddings)
    if variant["legacy_config_json"]:
        _rewrite_config_legacy(out_dir, variant["model_type"])

    # The folder must reproduce the in-memory model exactly, in whichever spelling it was written.
    reloaded = load_hf_model(out_dir)
    rope_saved = {k: v for k, v in reloaded.config.rope_parameters.items() if k != "type"}
    assert rope_saved == config.rope_parameters, (rope_saved, config.rope_parameters)
    ids = torch.randint(0, config.vocab_size, (1, 11), generator=generator)  # [1, T]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits), (
            f"{out_dir} does not reload to the same logits"
        )
    logger.info("wrote %s checkpoint to %s", variant_id(variant), out_dir)
    return out_dir


@dataclass(frozen=True)
class Reference:
    """What transformers computes for one prompt; logprobs are log_softmax of the float32 logits."""

    prompt_ids: list[int]
    """The prompt, T tokens."""
    prompt_logprobs: torch.Tensor
    """[T - 1, V]: row i is the distribution at prompt position i, which predicts prompt token i + 1."""
    greedy_tokens: list[int]
    """`steps` tokens from greedy decoding with the KV cache."""
    step_logprobs: torch.Tensor
    """[steps, V]: row s is the distribution greedy token s was the argmax of."""

    @property
    def min_margin(self) -> float:
        """Smallest gap between the best and second-best logprob over the greedy steps.

        A tiny gap means a legitimately different float32 summation order could pick another token, so a
        parity test on such a reference would test luck, not the engine.
        """
        top2 = self.step_logprobs.topk(2, dim=-1).values  # [steps, 2]
        return (top2[:, 0] - top2[:, 1]).min().item()


@torch.no_grad()
def hf_reference(model_dir: Path, prompt_ids: list[int], steps: int = 32, model=None) -> Reference:
    """Prompt logprobs and `steps` greedy tokens with their logprobs, from transformers on model_dir.

    Decodes token by token through the KV cache (the path the engine takes), then checks the result
    against one cache-free forward over prompt + generated tokens. `model` may be passed to skip the load.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = load_hf_model(model_dir) if model is None else model

    prompt = torch.tensor([prompt_ids])  # [1, T]
    out = model(input_ids=prompt, use_cache=True)
    logits = out.logits[0].float()  # [T, V]
    prompt_logprobs = torch.log_softmax(logits[:-1], dim=-1)  # [T - 1, V]
    cache = out.past_key_values
    next_logits = logits[-1]  # [V]

    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for step in range(steps):
        rows.append(torch.log_softmax(next_logits, dim=-1))
        tokens.append(int(next_logits.argmax()))
        if step + 1 == steps:
            break
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        next_logits = out.logits[0, -1].float()
    step_logprobs = torch.stack(rows)  # [steps, V]

    # Self-consistency: the same sequence through one cache-free forward.
    full = torch.tensor([prompt_ids + tokens[:-1]])  # [1, T + steps - 1]
    full_logprobs = torch.log_softmax(model(input_ids=full, use_cache=False).logits[0].float(), dim=-1)
    t = len(prompt_ids)
    torch.testing.assert_close(full_logprobs[: t - 1], prompt_logprobs, atol=5e-5, rtol=0)
    # Cached decode and one long forward differ by ~1e-5 in float32 (different matmul shapes).
    torch.testing.assert_close(full_logprobs[t - 1 :], step_logprobs, atol=5e-5, rtol=0)
    assert full_logprobs[t - 1 :].argmax(dim=-1).tolist() == tokens, (
        "cached and cache-free greedy tokens differ"
    )

    return Reference(list(prompt_ids), prompt_logprobs, tokens, step_logprobs)


def decisive_references(
    model_dir: Path,
    prompt_lens: tuple[int, ...],
    steps: int = 32,
    seed: int = 0,
    min_margin: float = 1e-3,
    max_tries: int = 20,
) -> list[Reference]:
    """One reference per prompt length, on seeded random prompts whose greedy path has no near-tie.

    Prompt ids are drawn uniformly over the whole vocabulary (special ids included). A candidate whose
    `min_margin` is below min_margin is redrawn, so a parity failure on greedy tokens is the engine's and
    not a coin flip between two float32 summation orders.
    """
    model = load_hf_model(model_dir)
    vocab_size = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    refs = []
    for n in prompt_lens:
        for _ in range(max_tries):
            prompt = torch.randint(0, vocab_size, (n,), generator=generator).tolist()
            ref = hf_reference(model_dir, prompt, steps, model=model)
            if ref.min_margin >= min_margin:
                refs.append(ref)
                break
        else:
            raise AssertionError(
                f"no {n}-token prompt in {max_tries} draws has a greedy margin >= {min_margin}"
            )
    return refs


# ---- DeepSeek-V4 ---------------------------------------------------------------------------------

V4_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,  # >= 16 heads: the indexer's ReLU scores almost never tie at 0
    index_head_dim=32,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


@torch.no_grad()
def _reinit_v4_(model, generator: torch.Generator) -> None:
    """_reinit_ for DeepSeek-V4, and the parameters transformers starts at zero (sinks, position
    biases, hyper-connection bases, correction biases, the hash table) made to matter."""
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("embed_tokens.weight"):
            new = torch.randn(shape, generator=generator)
        elif name == "lm_head.weight":
            new = torch.randn(shape, generator=generator) * (LOGIT_STD / math.sqrt(shape[1]))
        elif name.endswith(("sinks", "position_bias", "base", "hc_base")):
            new = 0.5 * torch.randn(shape, generator=generator)
        elif name.endswith(("scale", "hc_scale")):  # the hyper-connections' logit scales
            new = 1.0 + 0.3 * torch.randn(shape, generator=generator)
        elif name.endswith(("fn", "hc_fn")):
            new = torch.randn(shape, generator=generator) / math.sqrt(shape[1])
        elif p.ndim == 1:  # norm weights
            new = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif p.ndim == 3 or p.ndim == 2:  # experts [E, out, in] and linears [out, in]
            new = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
        else:
            raise AssertionError(f"no re-initialisation rule for parameter {name} of shape {tuple(shape)}")
        p.copy_(new)
    experts = model.config.n_routed_experts
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):  # distinct experts per token
            rows = torch.rand(gate.tid2eid.shape[0], experts, generator=generator).argsort(dim=-1)
            gate.tid2eid.copy_(rows[:, : gate.tid2eid.shape[1]])
        else:
            gate.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=generator))


def build_hf_v4_checkpoint(config: dict, out_dir: Path, seed: int) -> Path:
    """A random DeepSeek-V4 checkpoint (DeepseekV4Config keywords over V4_COMMON) in out_dir, float32,
    with the tokenizer files; checked to reload to the same logits."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(**copy.deepcopy({**V4_COMMON, **config}))
    generator = torch.Generator().manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).to(torch.float32).eval()
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")
    _reinit_v4_(model, generator)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(out_dir, cfg.vocab_size, cfg.max_position_embeddings)
    reloaded = load_hf_model(out_dir)
    ids = torch.randint(0, cfg.vocab_size, (1, 19), generator=generator)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits), (
            f"{out_dir} does not reload to the same logits"
        )
    return out_dir
