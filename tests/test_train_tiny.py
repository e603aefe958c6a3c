"""The CPU training recipe (modelkit/training) and the checkpoint it shipped (assets/pdserve-tiny).

A smoke run (a tiny config, a few steps, one thread) must lower the loss, repeat itself exactly, and
write a folder that the engine and transformers load, with the MTP layer under DeepSeek-V3's names.
The MTP head must compute what the plain PyTorch reference computes from the saved tensors. The
shipped model must say it has one MTP layer and write mostly English words, which the random
`make_model` tiny model must not.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from modelkit.make_model import ModelPreset
from modelkit.training.data import docstring_documents, topic_documents
from modelkit.training.mtp import mtp_logits, mtp_reference_logits
from modelkit.training.train_tiny import (
    TrainConfig,
    TrainResult,
    checkpoint_tensors,
    load_trained,
    train,
    write_folder,
)

ASSET = Path(__file__).resolve().parents[1] / "assets" / "pdserve-tiny"
MAX_CHECKPOINT_BYTES = 25 * 1024 * 1024

SMALL = ModelPreset(
    vocab_size=4096,
    hidden_size=48,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=2,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_intermediate_size=16,
    intermediate_size=64,
    max_position_embeddings=4096,
)
SMOKE = TrainConfig(
    model=SMALL,
    steps=16,
    batch_size=4,
    seq_len=32,
    lr=1e-2,
    warmup_steps=2,
    eval_every=8,
    val_windows=4,
    bias_update_speed=1e-2,  # large enough that the biases visibly move in 16 steps
    threads=1,
    max_files=12,
)

# DeepSeek-V3's names of the MTP layer's own tensors, besides the decoder layer's.
MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


@pytest.fixture(scope="module")
def tokenizer():
    from modelkit.bpe_tokenizer import train_tokenizer

    return train_tokenizer(SMALL.vocab_size)


@pytest.fixture(scope="module")
def smoke(tokenizer) -> TrainResult:
    return train(SMOKE, tokenizer)


@pytest.fixture(scope="module")
def smoke_folder(smoke, tmp_path_factory) -> Path:
    return write_folder(smoke, tmp_path_factory.mktemp("trained") / "smoke", "pytest")


def test_smoke_run_lowers_the_loss_and_repeats_exactly(smoke, tokenizer):
    h, v = smoke.record["history"], smoke.record["val"]
    assert h["step"] == list(range(1, SMOKE.steps + 1))
    assert v["step"] == [8, 16]
    assert sum(h["train_main"][-4:]) / 4 < h["train_main"][0] - 1.0
    assert sum(h["train_mtp"][-4:]) / 4 < h["train_mtp"][0] - 1.0
    assert v["main"][-1] < h["train_main"][0] - 0.5 and v["mtp"][-1] < h["train_mtp"][0] - 0.5
    assert any(abs(x) > 0 for lo_hi in smoke.record["expert_bias_range"] for x in lo_hi), "biases never moved"

    again = train(SMOKE, tokenizer)
    assert again.record["history"]["train_main"] == h["train_main"]
    assert again.record["val"] == v
    first, second = checkpoint_tensors(smoke.model, smoke.mtp), checkpoint_tensors(again.model, again.mtp)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_smoke_folder_holds_the_mtp_layer_under_deepseek_names(smoke_folder, smoke):
    files = sorted(p.name for p in smoke_folder.iterdir())
    assert files == sorted(
        [
            "config.json",
            "generation_config.json",
            "loss.png",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "training.json",
        ]
    )
    cfg = json.loads((smoke_folder / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    tensors = load_file(str(smoke_folder / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    mtp = {k.removeprefix(f"model.layers.{n}.") for k in tensors if k.startswith(f"model.layers.{n}.")}
    main_moe = {k.removeprefix("model.layers.1.") for k in tensors if k.startswith("model.layers.1.")}
    assert mtp == main_moe | set(MTP_EXTRA)  # a full MoE decoder layer plus the MTP parts
    assert "mlp.experts.7.gate_proj.weight" in mtp and "mlp.gate.e_score_correction_bias" in mtp
    assert not any("shared_head.head" in k or k.endswith(f"{n}.embed_tokens.weight") for k in tensors)
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in tensors)
    assert {t.dtype for k, t in tensors.items() if not k.endswith("e_score_correction_bias")} == {
        torch.bfloat16
    }
    assert {t.dtype for k, t in tensors.items() if k.endswith("e_score_correction_bias")} == {torch.float32}
    # Saving then loading gives the trained weights back (rounded to bf16).
    model, mtp_layer, _ = load_trained(smoke_folder)
    reloaded = checkpoint_tensors(model, mtp_layer)
    assert reloaded.keys() == tensors.keys() and all(torch.equal(reloaded[k], tensors[k]) for k in tensors)
    record = json.loads((smoke_folder / "training.json").read_text())
    assert record["command"] == "pytest" and record["steps"] == SMOKE.steps and not record["stopped_early"]


def test_smoke_folder_loads_in_the_engine_and_in_transformers(smoke_folder):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(smoke_folder), dtype="float32", num_kv_blocks=16)
    out = llm.generate("The module", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4

    hf, info = AutoModelForCausalLM.from_pretrained(
        smoke_folder, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(k.startswith(f"model.layers.{hf.config.num_hidden_layers}.") for k in info["unexpected_keys"])
    model, _, _ = load_trained(smoke_folder)
    ids = torch.tensor([[0, 1731, 669, 17, 300]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["smoke", "shipped"])
def test_mtp_head_matches_the_plain_torch_reference(which, request):
    folder = request.getfixturevalue("smoke_folder") if which == "smoke" else _shipped()
    model, mtp, cfg = load_trained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    ids = torch.randint(0, cfg["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, H], after the final norm
        got = mtp_logits(model, mtp, ids, hidden)  # [B, T - 1, V]
    want = mtp_reference_logits(tensors, cfg, ids, hidden)
    assert got.shape == want.shape == (2, 18, cfg["vocab_size"])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    # One unbatched sequence gives the first row of the batch.
    torch.testing.assert_close(
        mtp_reference_logits(tensors, cfg, ids[0], hidden[0]), want[0], atol=1e-5, rtol=0
    )


def _shipped() -> Path:
    if not (ASSET / "model.safetensors").is_file():
        pytest.fail(f"{ASSET} has no trained checkpoint; run `pdserve train-tiny --out {ASSET}`")
    return ASSET


def test_shipped_checkpoint_is_the_project_model_with_one_mtp_layer(tokenizer):
    from modelkit.bpe_tokenizer import tokenizer_config

    folder = _shipped()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 1
    assert cfg["q_lora_rank"] and cfg["scoring_func"] == "sigmoid" and cfg["first_k_dense_replace"] == 1
    assert (folder / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    assert json.loads((folder / "tokenizer.json").read_text()) == json.loads(tokenizer.to_str())
    assert json.loads((folder / "tokenizer_config.json").read_text()) == tokenizer_config(
        cfg["max_position_embeddings"]
    )
    record = json.loads((folder / "training.json").read_text())
    assert record["val"]["main"][-1] < record["val"]["main"][0] - 1.0 and not record["stopped_early"]
    assert (folder / "loss.png").stat().st_size > 10_000


@pytest.fixture(scope="module")
def english_words() -> set[str]:
    """Words of (part of) the training text, plus the system dictionary where there is one."""
    text = [d.text for d in topic_documents()] + [d.text for f in docstring_documents(150) for d in f]
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", "\n".join(text))}
    dict_words = Path("/usr/share/dict/words")
    if dict_words.is_file():
        words |= {w.strip().lower() for w in dict_words.read_text(errors="ignore").split()}
    return words


def english_fraction(text: str, words: set[str]) -> float:
    """Share of the whitespace-separated alphabetic tokens (surrounding punctuation stripped) that are words."""
    tokens = [t.strip(string.punctuation).lower() for t in text.split()]
    tokens = [t for t in tokens if t.isalpha()]
    return sum(t in words for t in tokens) / len(tokens) if tokens else 0.0


def _complete(folder: str | Path) -> str:
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return llm.generate("The module", params)[0].text


def test_shipped_model_writes_english_and_the_random_model_does_not(english_words, tiny_model):
    trained = _complete(_shipped())
    assert english_fraction(trained, english_words) >= 0.6, trained
    assert len([t for t in trained.split() if t.strip(string.punctuation).isalpha()]) >= 10, trained
    random = _complete(tiny_model)
    assert english_fraction(random, english_words) < 0.6, random
