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

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")
_ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
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
