"""`pdserve train-tiny --arch v4` (modelkit/training/train_tiny_v4.py) and the DeepSeek-V4 checkpoint it
shipped (assets/pdserve-tiny-v4).

A smoke run (a few steps, one thread) must lower the loss and write a folder -- DeepSeek's V4
tensor names, as transformers writes them -- that the engine serves as transformers computes it.
The shipped model must be the V4 recipe's, trained to a loss well below its start, and write
mostly English words, which the random tiny-v4 model must not.
"""

from __future__ import annotations

import json
import string
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors import safe_open

from modelkit.make_model import V4Preset, make_model
from modelkit.training.train_tiny import TrainConfig
from modelkit.training.train_tiny_v4 import V4TrainConfig, train, write_folder
from tests.hf_reference import hf_reference
from tests.test_parity_hf import one_torch_thread
from tests.test_train_tiny import _complete, english_fraction, english_words  # noqa: F401

ASSET = Path(__file__).resolve().parents[1] / "assets" / "pdserve-tiny-v4"
MAX_CHECKPOINT_BYTES = 25 * 1024 * 1024

SMALL = V4Preset(
    vocab_size=4096,
    hidden_size=48,
    compress_ratios=(0, 4, 8),
    hca_rate=8,
    num_attention_heads=2,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    sliding_window=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=4,
    max_position_embeddings=4096,
)


def test_smoke_run_lowers_the_loss_and_serves_as_transformers(tmp_path):
    base = replace(
        TrainConfig(), steps=8, batch_size=2, seq_len=48, eval_every=4, val_windows=4, threads=1, max_files=40
    )
    with one_torch_thread():
        model, tokenizer, raw, record = train(V4TrainConfig(base=base, model=SMALL))
    assert record["val"]["val"][-1] < record["val"]["val"][0]
    folder = write_folder(model, tokenizer, raw, record, tmp_path / "v4", "test")
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert (
        "model.layers.1.attn.indexer.compressor.wkv.weight" in names
        and "model.layers.0.ffn.gate.tid2eid" in names
    )
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["pdserve_preset"] == "trained-tiny-v4"
    prompt = tokenizer.encode("The module returns a list of").ids
    with one_torch_thread():
        want = hf_reference(folder, prompt, steps=8).greedy_tokens
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16, num_threads=1)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )
    assert list(out[0].token_ids) == want


def _shipped() -> Path:
    if not (ASSET / "model.safetensors").is_file():
        pytest.fail(f"{ASSET} has no trained checkpoint; run `pdserve train-tiny --arch v4 --out {ASSET}`")
    return ASSET


def test_shipped_v4_checkpoint_is_the_recipes_and_writes_english(english_words, tmp_path):  # noqa: F811
    folder = _shipped()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and set(cfg["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert (folder / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    record = json.loads((folder / "training.json").read_text())
    assert record["val"]["val"][-1] < record["val"]["val"][0] - 1.0 and not record["stopped_early"]
    text = _complete(folder)
    assert english_fraction(text, english_words) >= 0.6, text
    assert len([t for t in text.split() if t.strip(string.punctuation).isalpha()]) >= 10, text
    random = _complete(make_model("tiny-v4", tmp_path / "tiny-v4"))
    assert english_fraction(random, english_words) < 0.6, random
