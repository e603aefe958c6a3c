"""The default-model builder: transformers loads its output, the tokenizer round-trips, builds are
byte-identical and a complete folder is reused. `tiny` is built once per module (~2 s)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from modelkit.bpe_tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN
from modelkit.make_model import FINGERPRINT_KEY, OUTPUT_FILES, PRESETS, make_model, weight_specs

transformers = pytest.importorskip("transformers")

TEXT = "Grüße, naïve café — 日本語テキスト 🙂\n\tdef f(x):  return x  .  "
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again?"},
]
CHAT_RENDERED = (
    f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi{ASSISTANT_TOKEN}Hello{EOS_TOKEN}{USER_TOKEN}Again?{ASSISTANT_TOKEN}"
)


def _sha256(folder: Path) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in OUTPUT_FILES}


def _mtimes(folder: Path) -> dict[str, int]:
    return {f: (folder / f).stat().st_mtime_ns for f in OUTPUT_FILES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path):
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def test_output_folder_holds_exactly_the_hf_files(tiny_dir: Path) -> None:
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(OUTPUT_FILES)


def test_transformers_loads_every_tensor(hf_model) -> None:
    _, info = hf_model
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert info["error_msgs"] == []


def test_forward_gives_finite_logits(hf_model) -> None:
    model, _ = hf_model
    ids = torch.tensor([[0, 17, 300, 4000, 5, 99, 1234]])  # [B=1, T=7]
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, 7, PRESETS["tiny"].vocab_size)
    assert torch.isfinite(logits).all()
    # Logits of O(1) that depend on the position: the weights are neither exploding nor collapsed.
    assert 0.3 < logits.std().item() < 10.0
    assert not torch.allclose(logits[0, -1], logits[0, -2], atol=1e-2)


def test_greedy_decoding_is_not_one_repeated_token(hf_model) -> None:
    model, _ = hf_model
    prompt = torch.tensor([[0, 512, 77, 1024, 2048]])
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    new = out[0, prompt.shape[1] :].tolist()
    assert len(new) == 8
    assert len(set(new)) >= 4, new


def test_checkpoint_uses_real_deepseek_v3_names_and_dtypes(tiny_dir: Path) -> None:
    preset = PRESETS["tiny"]
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert names == {name for name, _, _ in weight_specs(preset)}
        # Per-expert names as on the Hub, not transformers' in-memory fused `experts.gate_up_proj`.
        assert "model.layers.1.mlp.experts.15.gate_proj.weight" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace = 1
        assert not any("gate_up_proj" in n for n in names)
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32
        assert bias.min() < 0 < bias.max()
        assert f.get_tensor("model.layers.2.self_attn.kv_b_proj.weight").dtype == torch.bfloat16
        norm = f.get_tensor("model.norm.weight").float()
        assert (norm - 1).abs().max() < 0.2


def test_config_matches_preset_and_tokenizer(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert cfg["vocab_size"] == tok.get_vocab_size() == 4096
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["num_nextn_predict_layers"]) == (
        "noaux_tc",
        "sigmoid",
        0,
    )
    hf_cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert hf_cfg.rope_parameters["rope_type"] == "yarn"
    assert hf_cfg.num_mtp_layers == 0
    assert (hf_cfg.n_routed_experts, hf_cfg.num_experts_per_tok, hf_cfg.q_lora_rank) == (16, 4, 64)


def test_special_token_ids(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)]
    assert ids == [0, 1, 2, 3, 4]
    # A marker inside text is one token, not a spelling of its bytes.
    assert tok.encode(f"a{USER_TOKEN}b", add_special_tokens=False).ids[1] == 3


def test_tokenizer_round_trips_with_tokenizers_and_transformers(tiny_dir: Path) -> None:
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    enc = raw.encode(TEXT)
    assert enc.ids[0] == 0 and enc.ids.count(0) == 1  # bos prepended once
    assert raw.decode(enc.ids) == TEXT
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ids = hf(TEXT).input_ids
    assert ids == enc.ids
    assert hf.decode(ids, skip_special_tokens=True) == TEXT
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)


def test_chat_template_renders_deepseek_markers(tiny_dir: Path) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == CHAT_RENDERED
    no_prompt = hf.apply_chat_template(CHAT[:3], add_generation_prompt=False, tokenize=False)
    assert no_prompt == f"{BOS_TOKEN}Be brief.{USER_TOKEN}Hi{ASSISTANT_TOKEN}Hello{EOS_TOKEN}"
    # The engine renders with plain jinja2; it must give the same text.
    template = json.loads((tiny_dir / "tokenizer_config.json").read_text())["chat_template"]
    plain = jinja2.Environment().from_string(template)
    assert plain.render(messages=CHAT, bos_token=BOS_TOKEN, add_generation_prompt=True) == CHAT_RENDERED
    # The rendered prompt already starts with bos, so it is encoded without adding another.
    ids = hf(rendered, add_special_tokens=False).input_ids
    assert ids[0] == 0 and ids.count(0) == 1 and ids[-1] == 4


def test_two_builds_are_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_model("tiny", tmp_path / "again")
    assert _sha256(again) == _sha256(tiny_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temp folder left behind


def test_complete_build_is_reused(tiny_dir: Path) -> None:
    before = _mtimes(tiny_dir)
    assert make_model("tiny", tiny_dir) == tiny_dir
    assert _mtimes(tiny_dir) == before


def test_stale_or_forced_build_is_rebuilt(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    shutil.copytree(tiny_dir, out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[FINGERPRINT_KEY] = "stale"
    cfg_path.write_text(json.dumps(cfg))
    make_model("tiny", out)
    assert _sha256(out) == _sha256(tiny_dir)  # the stale marker was noticed and the folder rebuilt
    before = _mtimes(out)
    make_model("tiny", out, force=True)
    assert _mtimes(out) != before


def test_refuses_to_overwrite_a_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a pdserve model build"):
        make_model("tiny", tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name='huge'"):
        make_model("huge", tmp_path / "x")


def test_full_rank_query_uses_q_proj() -> None:
    preset = dataclasses.replace(PRESETS["tiny"], q_lora_rank=None)
    shapes = {name: shape for name, shape, _ in weight_specs(preset)}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 48, 128)  # [H * qk_head_dim, hidden]
    assert not any(".q_a_" in n or ".q_b_" in n for n in shapes)
