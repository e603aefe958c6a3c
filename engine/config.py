"""Frozen, typed configuration: the model (parsed from an HF config.json) and the engine.

Both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings of
the rotary settings are accepted. Derived values are properties; nothing here reads the
environment (that is `engine/env.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from engine.quant import QuantConfig
from engine.spec_decode.config import SpeculativeConfig
from kernels.rotary import yarn_mscale

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4")
_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    """Base wavelength of the rotary frequencies."""
    type: str = "default"
    """"default" or "yarn"."""
    factor: float = 1.0
    """YaRN context-extension factor."""
    original_max_position_embeddings: int = 4096
    """Pre-training context length YaRN extends from."""
    beta_fast: float = 32.0
    """YaRN: rotations above which frequencies are extrapolated."""
    beta_slow: float = 1.0
    """YaRN: rotations below which frequencies are interpolated."""
    mscale: float | None = None
    """YaRN: numerator scale of the cos/sin attention factor."""
    mscale_all_dim: float | None = None
    """YaRN: denominator scale of the attention factor; also squares into the softmax scale."""
    attention_factor: float | None = None
    """Explicit cos/sin scale; derived from mscale/mscale_all_dim when None."""
    truncate: bool = True
    """YaRN: round the correction range to whole dimensions (DeepSeek's behaviour)."""

    @staticmethod
    def from_hf(raw: dict, max_position_embeddings: int) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: 'default', 'yarn')")
        if rope_type == "default":
            return RopeConfig(theta=float(theta))
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        factor = params.get("factor") or max_position_embeddings / original
        return RopeConfig(
            theta=float(theta),
            type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): per layer it scores every
    earlier token and MLA attends only to the best `topk` of them."""

    n_heads: int
    """`index_n_heads`: query heads of the indexer (one shared key per token)."""
    head_dim: int
    """`index_head_dim`: width of an indexer query head and key; its leading qk_rope_head_dim
    elements are rotary (half-split pairs)."""
    topk: int
    """`index_topk`: tokens each query attends to once its context is longer."""

    @staticmethod
    def from_hf(raw: dict) -> IndexerConfig:
        values = {}
        for key, default in (("index_n_heads", 64), ("index_head_dim", 128), ("index_topk", 2048)):
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
            values[key] = value
        return IndexerConfig(values["index_n_heads"], values["index_head_dim"], values["index_topk"])


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_V4_RATIO_TYPES = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


def _positive(raw: dict, key: str, default):
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class V4Config:
    """What DeepSeek-V4 adds to the config: its attention layout, compression, hyper-connections
    and routing. Read from transformers' spelling (`layer_types`, `mlp_layer_types`,
    `compress_rates`, `rope_parameters` nested as main / compress, `partial_rotary_factor`) or the
    released checkpoints' (`compress_ratios`, `num_hash_layers`, `rope_scaling`,
    `qk_rope_head_dim`)."""

    head_dim: int
    """The one K = V head's width (512)."""
    rope_dim: int
    """Its trailing rotary elements (64)."""
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    """Tokens a query sees in the window, itself included."""
    layer_types: tuple[str, ...]
    """Per layer one of V4_LAYER_TYPES."""
    hash_layers: tuple[bool, ...]
    """Per layer: its experts picked by the token id (`hash_moe`), not by score."""
    csa_rate: int
    hca_rate: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope: RopeConfig
    """The sliding layers' table."""
    compress_rope: RopeConfig
    """The CSA and HCA layers' table (every rope of the layer: queries, window, entries)."""

    @staticmethod
    def from_hf(raw: dict, num_layers: int, max_pos: int) -> V4Config:
        head_dim = _positive(raw, "head_dim", 512)
        if raw.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
        else:
            rope_dim = _positive(raw, "qk_rope_head_dim", 64)
        rates = dict(raw.get("compress_rates") or {})
        csa_rate = int(rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4)))
        hca_rate = int(rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128)))
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            by_ratio = {0: V4_LAYER_TYPES[0], csa_rate: V4_LAYER_TYPES[1], hca_rate: V4_LAYER_TYPES[2]}
            bad = [r for r in raw["compress_ratios"] if r not in by_ratio]
            if bad:
                raise ValueError(
                    f"config.json compress_ratios entries must be 0, {csa_rate} (CSA) or {hca_rate} (HCA), got {bad}"
                )
            layer_types = [by_ratio[r] for r in raw["compress_ratios"]]
        if layer_types is None:  # transformers' default: the V4-Pro pattern
            layer_types = ["heavily_compressed_attention"] * min(num_layers, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(num_layers - 2, 0))
            ]
        layer_types = tuple(layer_types[:num_layers])
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(num_layers, n_hash) + ["moe"] * max(0, num_layers - n_hash)
        mlp_types = tuple(mlp_types[:num_layers])
        for name, types, allowed in (
            ("layer_types", layer_types, V4_LAYER_TYPES),
            ("mlp_layer_types", mlp_types, ("hash_moe", "moe")),
        ):
            if len(types) != num_layers or any(t not in allowed for t in types):
                raise ValueError(
                    f"config.json {name} must name one of {allowed} for each of the {num_layers} layers, got {list(types)}"
                )
        main, compress = _v4_ropes(raw, max_pos)
        cfg = V4Config(
            head_dim=head_dim,
            rope_dim=rope_dim,
            o_groups=_positive(raw, "o_groups", 8),
            o_lora_rank=_positive(raw, "o_lora_rank", 1024),
            sliding_window=_positive(raw, "sliding_window", 128),
            layer_types=layer_types,
            hash_layers=tuple(t == "hash_moe" for t in mlp_types),
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            hc_mult=_positive(raw, "hc_mult", 4),
            hc_sinkhorn_iters=_positive(raw, "hc_sinkhorn_iters", 20),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            index_n_heads=_positive(raw, "index_n_heads", 64),
            index_head_dim=_positive(raw, "index_head_dim", 128),
            index_topk=_positive(raw, "index_topk", 512),
            rope=main,
            compress_rope=compress,
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.rope_dim % 2 or not 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"DeepSeek-V4 rope dims ({self.rope_dim}) must be even and at most head_dim ({self.head_dim}) "
                f"and index_head_dim ({self.index_head_dim})"
            )
        if self.csa_rate < 1 or self.hca_rate < 1:
            raise ValueError(f"config.json compress_rates must be >= 1, got {self.csa_rate}, {self.hca_rate}")


def _v4_ropes(raw: dict, max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) tables: transformers' nested `rope_parameters` {main, compress}, or the
    flat form -- the main table plain at rope_theta, the compress table with the YaRN settings at
    compress_rope_theta (attention factor 1 unless given)."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = (
            RopeConfig.from_hf({"rope_parameters": params[k]}, max_pos) for k in ("main", "compress")
        )
        return main, compress
    flat = dict(params or raw.get("rope_scaling") or {})
    main = RopeConfig(theta=float(raw.get("rope_theta", 10000.0)))
    flat["rope_theta"] = float(raw.get("compress_rope_theta", 160000.0))
    if flat.get("rope_type", flat.get("type", "default")) == "yarn":
        flat.setdefault("attention_factor", 1.0)
    return main, RopeConfig.from_hf({"rope_parameters": flat}, max_pos)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek-V2/V3/V3.2 checkpoint, as its config.json describes it."""

    model_type: str
    """"deepseek_v2", "deepseek_v3" or "deepseek_v32"."""
    architecture: str
    """The `architectures[0]` entry; selects the model class in the registry."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the dense MLP layers."""
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    """Width of the compressed latent c_kv, cached per token."""
    q_lora_rank: int | None
    """Width of the query compression; None means a direct q_proj."""
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool
    """Rotary pairs are (x0, x1), (x2, x3), ... rather than the two halves of the head."""
    n_routed_experts: int | None
    """None for a dense model."""
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    """Layers below this index use the dense MLP."""
    n_group: int
    topk_group: int
    topk_method: str
    """"greedy", "group_limited_greedy" (V2, softmax) or "noaux_tc" (V3, sigmoid + correction bias)."""
    scoring_func: str
    """"softmax" or "sigmoid"."""
    norm_topk_prob: bool
    routed_scaling_factor: float
    attention_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    num_nextn_predict_layers: int
    """MTP layers stored after the main layers in the checkpoint."""
    hidden_act: str = "silu"
    quant: QuantConfig | None = None
    """How the checkpoint's linears are quantized (engine/quant.py); None: kept as stored, bf16 or wider."""
    indexer: IndexerConfig | None = None
    """DeepSeek-V3.2's sparse-attention indexer; None: dense MLA (V2/V3)."""
    v4: V4Config | None = None
    """DeepSeek-V4's own settings (the MLA fields then describe its one K = V head)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Per token per layer: the latent c_kv followed by the rotary key k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace

    @staticmethod
    def from_dict(raw: dict) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if model_type == "deepseek_v4":
            return ModelConfig._from_v4(raw)
        archs = raw.get("architectures") or [_ARCHITECTURES[model_type]]
        v3 = model_type in ("deepseek_v3", "deepseek_v32")  # V3.2 is V3 plus the indexer
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = int(raw.get("max_position_embeddings", 4096 if v3 else 2048))
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act {hidden_act!r} is not supported (supported: 'silu')")
        n_routed = raw.get("n_routed_experts", 256 if v3 else 64)
        cfg = ModelConfig(
            model_type=model_type,
            architecture=archs[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
            q_lora_rank=raw.get("q_lora_rank", 1536),
            qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)),
            v_head_dim=int(raw.get("v_head_dim", 128)),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(raw, max_pos),
            # HF's V2 applies rotary as complex pairs, i.e. always interleaved.
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            n_routed_experts=None if n_routed is None else int(n_routed),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 1),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048 if v3 else 1407)),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 3 if v3 else 0)),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            topk_method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            hidden_act=hidden_act,
            quant=QuantConfig.from_hf(raw),
            indexer=IndexerConfig.from_hf(raw) if model_type == "deepseek_v32" else None,
        )
        cfg.check()
        return cfg

    @staticmethod
    def _from_v4(raw: dict) -> ModelConfig:
        """DeepSeek-V4: every layer MoE (sqrt-softplus scores, the first layers hash-routed), one
        K = V head of head_dim per layer, the rest in `v4`."""
        num_layers = int(raw["num_hidden_layers"])
        max_pos = int(raw.get("max_position_embeddings", 1048576))
        v4 = V4Config.from_hf(raw, num_layers, max_pos)
        eos = raw.get("eos_token_id", 1)
        scoring = raw.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ValueError(
                f"config.json scoring_func {scoring!r} is not supported for deepseek_v4 (supported: 'sqrtsoftplus')"
            )
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act {hidden_act!r} is not supported (supported: 'silu')")
        inter = int(raw.get("moe_intermediate_size", raw.get("intermediate_size", 2048)))
        cfg = ModelConfig(
            model_type="deepseek_v4",
            architecture=(raw.get("architectures") or ["DeepseekV4ForCausalLM"])[0],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=inter,
            num_hidden_layers=num_layers,
            num_attention_heads=int(raw.get("num_attention_heads", 64)),
            kv_lora_rank=v4.head_dim - v4.rope_dim,
            q_lora_rank=int(raw.get("q_lora_rank", 1024)),
            qk_nope_head_dim=v4.head_dim - v4.rope_dim,
            qk_rope_head_dim=v4.rope_dim,
            v_head_dim=v4.head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=v4.rope,
            rope_interleave=True,
            n_routed_experts=int(raw.get("n_routed_experts", 256)),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
            moe_intermediate_size=inter,
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func=scoring,
            norm_topk_prob=True,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            attention_bias=False,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", 0),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
            hidden_act=hidden_act,
            quant=QuantConfig.from_hf(raw),
            v4=v4,
        )
        if cfg.n_shared_experts != 1:
            raise ValueError(
                f"config.json n_shared_experts must be 1 for deepseek_v4, got {cfg.n_shared_experts}"
            )
        if cfg.num_attention_heads * v4.head_dim % v4.o_groups:
            raise ValueError(
                f"config.json o_groups ({v4.o_groups}) must divide num_attention_heads x head_dim "
                f"({cfg.num_attention_heads * v4.head_dim})"
            )
        return cfg

    def check(self) -> None:
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"config.json topk_method {self.topk_method!r} is not supported")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"config.json scoring_func {self.scoring_func!r} is not supported")
        if self.n_routed_experts is not None and self.n_routed_experts % self.n_group:
            raise ValueError(
                f"config.json n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.json qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.indexer is not None:
            if self.indexer.head_dim < self.qk_rope_head_dim:
                raise ValueError(
                    f"config.json index_head_dim ({self.indexer.head_dim}) must be at least "
                    f"qk_rope_head_dim ({self.qk_rope_head_dim}): the indexer ropes its leading dims"
                )
            if self.q_lora_rank is None:
                raise ValueError(
                    "config.json q_lora_rank must be set for deepseek_v32: its indexer reads the query latent"
                )

    @staticmethod
    def from_pretrained(path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model folder {path} has no config.json")
        with open(config_path) as f:
            return ModelConfig.from_dict(json.load(f))


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: precision, cache geometry and batching limits."""

    model: str
    """Path of an HF-format model folder."""
    dtype: str = "bfloat16"
    """Weights, activations and KV cache: "bfloat16", "float16" or "float32"."""
    block_size: int = 16
    """Tokens per KV-cache block (64 matches FlashMLA on GPUs; small blocks suit tests)."""
    max_num_seqs: int = 256
    """Most requests in one batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks and decode tokens together)."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    num_kv_blocks: int | None = None
    """KV-cache blocks; derived from kv_cache_memory_gib when None."""
    kv_cache_memory_gib: float = 1.0
    """KV-cache size used when num_kv_blocks is None."""
    kv_prefault: bool = False
    """Make the whole KV cache resident at start (a server's: steady latency, and memory the
    machine lacks fails then) instead of block by block as requests first write them."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks of identical prefixes across requests."""
    device: str = "cpu"
    """Torch device for weights and cache."""
    seed: int = 0
    """Seed of the generator used by unseeded sampled requests."""
    num_threads: int | None = None
    """CPU threads for torch; None uses the PDSERVE_NUM_THREADS environment variable or the core count."""
    data_parallel_size: int = 1
    """Engine ranks (processes), each with its own scheduler, batch and KV cache (DP attention)."""
    enable_expert_parallel: bool = False
    """Spread the routed experts over the data-parallel ranks (EP size = DP size, "DEP")."""
    num_redundant_experts: int = 0
    """Extra physical expert slots (replicas of hot experts) over the EP group."""
    expert_placement_file: str | None = None
    """JSON {"phy2log": [[...] per MoE layer]}: a static expert placement instead of round-robin."""
    eplb_interval: int = 0
    """Rebalance the expert placement every this many steps from the observed load (0: never)."""
    eplb_window: int = 0
    """Steps of load history a rebalance looks at (0: since the previous rebalance)."""
    dist_master_addr: str = "127.0.0.1"
    """Address of rank 0 for torch.distributed."""
    dist_master_port: int = 0
    """Port of rank 0 for torch.distributed (0: a free one, single machine only)."""
    dist_timeout_s: float = 60.0
    """A collective waiting longer (a rank died or hangs) fails instead of hanging the group."""
    kv_offload: str | None = None
    """KV offload tiers for evicted prefix blocks: "host", "redis" or "host,redis" (None: off)."""
    kv_host_blocks: int = 4096
    """Blocks the host-memory tier keeps (LRU)."""
    kv_redis_url: str | None = None
    """redis://host:port/db of the shared Redis tier."""
    kv_redis_ttl_s: int = 3600
    """Lifetime of a block in Redis."""
    heap_free_limit_mib: int = 256
    """Free host heap kept for reuse between steps; above it the allocator's free pages go back to
    the system after a step (0: never). See engine/heap.py."""
    batch_invariant: bool = False
    """Each request's tokens independent of what else its steps hold (vLLM's batch-invariant mode):
    every product and MoE in the native kernels, whose rows never depend on each other, at any
    batch size and in prefill chunks. Needs the native bf16 kernels (dtype bfloat16 on a CPU with
    AVX512F or AVX2). Off (default): steps of up to 128 decodes (256 on AMX) and verifications
    are invariant, but larger steps and prefill chunks take torch's oneDNN products, whose bits
    depend on the batch (README: Batch invariance)."""
    speculative_config: dict | None = None
    """{"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": n (optional),
    "draft_vocab": path (optional)}: draft k tokens per step with the checkpoint's MTP layer (from
    the draft vocabulary's tokens alone, where one is given) and verify them in one forward, except
    in steps that run n or more requests (None: off). See engine/spec_decode/config.py."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.batch_invariant and self.enable_expert_parallel:
            raise ValueError("batch_invariant with enable_expert_parallel is not supported (not checked yet)")
        tiers = self.offload_tiers
        if "redis" in tiers and not self.kv_redis_url:
            raise ValueError("kv_offload 'redis' needs kv_redis_url")
        if tiers and not self.enable_prefix_caching:
            raise ValueError("kv_offload needs enable_prefix_caching (blocks are found by their prefix hash)")
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        for name in ("num_redundant_experts", "eplb_interval", "eplb_window", "heap_free_limit_mib"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if not self.enable_expert_parallel and (
            self.num_redundant_experts or self.eplb_interval or self.expert_placement_file
        ):
            raise ValueError(
                "num_redundant_experts, eplb_interval and expert_placement_file need enable_expert_parallel"
            )

    @property
    def offload_tiers(self) -> list[str]:
        tiers = [t.strip() for t in (self.kv_offload or "").split(",") if t.strip()]
        for t in tiers:
            if t not in ("host", "redis"):
                raise ValueError(f"kv_offload tiers must be 'host' and/or 'redis', got {t!r}")
        return tiers

    @property
    def spec(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
