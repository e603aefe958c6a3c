"""DeepSeek-V4 against transformers' `DeepseekV4ForCausalLM` on tiny random checkpoints, in float32.

Each variant mixes the attention layer types (sliding window; CSA: overlapping 4-token entries picked
by the lightning indexer, `index_topk` below the entries a prompt makes; HCA) with hash-routed and
score-routed MoE layers, and sets what transformers starts at zero (sinks, position biases,
hyper-connection biases, correction biases, the hash table). Prompts cross the window, 4-, 8- and
128-token entry boundaries. The checks are tests/test_parity_hf.py's: greedy tokens exactly, every
logprob the engine returns (prompt and generated) within 1e-4 -- through one pass, chunked prefill at
unaligned splits, prefix-cache hits (aligned and unaligned, after the window's blocks were freed) and
preemption. The last checks the window table's blocks while a long request decodes: O(window).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache.cache_group import CacheKind
from modelkit.quantize import QuantOptions, quantize_folder
from tests.hf_reference import Reference, build_hf_v4_checkpoint, decisive_references, hf_reference
from tests.test_parity_hf import SEED, STEPS, TOP_N, assert_logprobs_match, assert_parity, one_torch_thread
from tests.test_quant_parity import dequantized_folder

MIXED = dict(
    num_hidden_layers=4,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    index_topk=3,
)
"""Every layer type; an 8-token window and 8-token HCA entries, so short prompts cross everything."""

RELEASED_RATES = dict(
    num_hidden_layers=3,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=32,
    index_topk=5,
)
"""V4-Flash's rates (4 and 128) under a 32-token window: prompts past 128 tokens."""

PROMPTS = {"mixed": (1, 7, 13, 37), "released-rates": (5, 131, 150)}


def write_released_format(model_dir: Path) -> None:
    """Rewrite the checkpoint as DeepSeek ships V4: its tensor names without transformers' `model.`
    prefix (`embed.weight`, `hc_head_fn`, `layers.N.attn.wkv.weight`, ...) and config.json in the
    release's spelling (compress_ratios, num_hash_layers, rope_theta + rope_scaling,
    qk_rope_head_dim)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        bare = name.removeprefix("model.")
        bare = {"embed_tokens.weight": "embed.weight"}.get(bare, bare)
        if bare.startswith("hc_head."):
            bare = "hc_head_" + bare.removeprefix("hc_head.hc_")
        renamed[bare] = t
    (model_dir / "model.safetensors").unlink()
    save_file(renamed, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    rates = {"sliding_attention": 0, **cfg.pop("compress_rates")}
    cfg["compress_ratios"] = [rates[t] for t in cfg.pop("layer_types")]
    cfg["num_hash_layers"] = cfg.pop("mlp_layer_types").count("hash_moe")
    compress = cfg.pop("rope_parameters")["compress"]
    cfg["rope_scaling"] = {
        k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")
    }
    cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")
    cfg["qk_rope_head_dim"] = int(cfg.pop("partial_rotary_factor") * cfg["head_dim"])
    path.write_text(json.dumps(cfg, indent=2) + "\n")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, list[Reference]]:
    with one_torch_thread():
        model_dir = build_hf_v4_checkpoint(MIXED, tmp_path_factory.mktemp("v4"), seed=SEED)
        return model_dir, decisive_references(model_dir, PROMPTS["mixed"], steps=STEPS, seed=SEED)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> tuple[Path, list[Reference]]:
    """The released rates, the references from transformers' own folder, then that folder rewritten
    in the released format."""
    with one_torch_thread():
        model_dir = build_hf_v4_checkpoint(RELEASED_RATES, tmp_path_factory.mktemp("v4r"), seed=SEED + 1)
        refs = decisive_references(model_dir, PROMPTS["released-rates"], steps=STEPS, seed=SEED)
        write_released_format(model_dir)
        return model_dir, refs


def test_every_layer_type_matches_transformers(mixed) -> None:
    model_dir, refs = mixed
    index_topk = MIXED["index_topk"]
    assert max(len(r.prompt_ids) for r in refs) // 4 > index_topk  # the indexer picks among more entries
    assert_parity(model_dir, refs, block_size=8)


def test_the_one_call_attention_path_matches_transformers(mixed, monkeypatch) -> None:
    """The path the native and Triton kernels take (every token's rows at once, the one-token
    requests of a step together: ring writes, the indexer's scores and top-k), here on the
    PyTorch reference of the attention, for the four prompts decoding side by side."""
    import kernels.v4

    monkeypatch.setattr(kernels.v4, "attends_by_slots", lambda q, window: True)
    model_dir, refs = mixed
    assert_parity(model_dir, refs, block_size=8)


def test_the_released_format_and_rates_match_transformers(released) -> None:
    model_dir, refs = released
    names = load_file(str(model_dir / "model.safetensors")).keys()
    assert "embed.weight" in names and "layers.0.attn.wkv.weight" in names and "hc_head_fn" in names
    assert "compress_ratios" in json.loads((model_dir / "config.json").read_text())
    assert_parity(model_dir, refs, block_size=16)  # engine blocks of 128 tokens (the HCA rate)


def test_the_released_quantized_format_matches_transformers_on_its_dequantized_weights(
    mixed, tmp_path
) -> None:
    """V4-Flash's format: FP8 projections in 128 x 128 blocks with e8m0 scales, MXFP4 routed experts,
    DeepSeek's names (`<module>.scale`); the reference is transformers on the weights dequantized
    in float64 from the stored bytes (tests/test_quant_parity.py), not by the engine."""
    model_dir, _ = mixed
    opts = QuantOptions(block=128, ue8m0=True, scale_dtype="e8m0", experts_fp4=True)
    quantized = quantize_folder(model_dir, tmp_path / "quantized", opts)
    with safe_open(quantized / "model.safetensors", framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert (
        dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    )
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.ffn.experts.3.w1.weight"] == "I8"  # two e2m1 a byte
    assert dtypes["layers.1.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert (
        dtypes["layers.1.attn.compressor.wkv.weight"] == "F32"
        and "layers.1.attn.compressor.wkv.scale" not in dtypes
    )
    with one_torch_thread():
        reference_dir = dequantized_folder(
            quantized, tmp_path / "dequantized", rename=str, scale_suffix="scale"
        )
        refs = decisive_references(reference_dir, PROMPTS["mixed"][1:], steps=STEPS, seed=SEED)
    assert_parity(quantized, refs, block_size=8)
    layer = LLM(model=str(quantized), dtype="float32", num_threads=1).engine.runner.model.layers[1]
    assert layer.mlp.experts.w13.dtype == torch.uint8 and layer.mlp.experts.w13_scale.dtype == torch.uint8
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn  # kept 8- and 4-bit


@pytest.mark.parametrize("chunk", [3, 5, 11])
def test_chunked_prefill_at_unaligned_splits_matches_one_pass(mixed, chunk: int) -> None:
    model_dir, refs = mixed
    assert_parity(model_dir, refs, block_size=8, max_num_batched_tokens=max(chunk, 4), max_num_seqs=1)


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP_N)
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def _assert_matches(outs, refs: list[Reference]) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert list(out.token_ids) == ref.greedy_tokens, f"{len(ref.prompt_ids)}-token prompt"
        for step, got in enumerate(out.logprobs):
            assert_logprobs_match(got, ref.step_logprobs[step], ref.greedy_tokens[step], f"step {step}")


def test_prefix_hits_give_what_computing_the_prefix_gives(mixed) -> None:
    """The 37-token prompt twice (a hit of 4 blocks, 32 tokens: its window blocks were freed while it
    ran and are still cached), then a prompt sharing its first 21 tokens (an unaligned prefix: 2
    blocks hit, the rest computed): every run as transformers computes it."""
    model_dir, refs = mixed
    long = refs[-1]
    with one_torch_thread():
        branch = hf_reference(model_dir, long.prompt_ids[:21] + [5, 9, 200, 17, 3], steps=STEPS)
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, num_threads=1, max_num_seqs=1)
    first = _greedy(llm, [long.prompt_ids])[0]
    assert first.num_cached_tokens == 0
    again, other = _greedy(llm, [long.prompt_ids, branch.prompt_ids])
    assert again.num_cached_tokens == 32 and other.num_cached_tokens == 16
    _assert_matches([first, again, other], [long, long, branch])


def test_preempted_requests_resume_exactly(mixed) -> None:
    model_dir, refs = mixed
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, num_threads=1, num_kv_blocks=9)
    outs = _greedy(llm, [r.prompt_ids for r in refs])
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _assert_matches(outs, refs)


def test_the_window_table_holds_a_window_however_long_the_request(mixed) -> None:
    """A 37-token prompt decoding 200 tokens with an 8-token window in 8-token blocks: at every decode
    step the request holds at most the blocks of the 7 tokens before its next one and its new
    token's (2, 3 where they straddle), while the compressed tables grow with the sequence."""
    model_dir, refs = mixed
    engine = EngineCore(EngineConfig(model=str(model_dir), dtype="float32", block_size=8, num_threads=1))
    spec = engine.kv_spec
    window = spec.table_index(CacheKind.SLIDING_WINDOW)
    compressed = spec.table_index(CacheKind.COMPRESSED)
    req = engine.add_request(
        "r", refs[-1].prompt_ids, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    )
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if req.block_ids:
            counts = engine.kv.num_held(req)
            held.append((req.num_computed_tokens, counts[window], counts[compressed]))
    decoding = [(n, w, c) for n, w, c in held if n > len(refs[-1].prompt_ids)]
    assert len(decoding) >= 198 and decoding[-1][0] > 200
    assert max(w for _, w, _ in decoding) <= 3, decoding
    assert [c for n, _, c in decoding] == [-(-n // 8) for n, _, _ in decoding]  # the whole history
