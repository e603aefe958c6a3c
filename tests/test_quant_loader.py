"""Quantized checkpoints: what the loader keeps in memory, what it refuses (naming the tensor, before
anything is copied), and the converter that writes them (`pdserve quantize`, modelkit/quantize.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.loader import deepseek_to_hf, hf_to_deepseek
from kernels.quant import QuantWeight, e8m0_to_float, float_to_e8m0, unpack_e2m1
from modelkit.make_model import PRESETS, hf_config, make_weights
from modelkit.quantize import QuantOptions, quantize_folder, quantize_fp8, quantize_mxfp4
from services.cli import main as cli


@pytest.fixture(scope="module")
def fp8_model(tiny_model, tmp_path_factory) -> Path:
    return quantize_folder(tiny_model, tmp_path_factory.mktemp("q") / "fp8", QuantOptions())


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _variant(folder: Path, out: Path, edit) -> Path:
    """A copy of folder with its tensors edited by edit(dict) (in place)."""
    shutil.copytree(folder, out)
    tensors = _tensors(folder)
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _edit_config(folder: Path, out: Path, edit) -> Path:
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_weights_stay_quantized_in_memory(tiny_model, tmp_path) -> None:
    plain = LLM(model=tiny_model, dtype="bfloat16").engine.runner.model
    fp8 = LLM(model=str(quantize_folder(tiny_model, tmp_path / "fp8", QuantOptions())), dtype="bfloat16")
    fp4 = LLM(
        model=str(quantize_folder(tiny_model, tmp_path / "fp4", QuantOptions(experts_fp4=True))),
        dtype="bfloat16",
    )
    for llm, experts_dtype in ((fp8, torch.float8_e4m3fn), (fp4, torch.uint8)):
        model = llm.engine.runner.model
        attn, moe = model.layers[1].self_attn, model.layers[1].mlp
        assert (
            attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
            and attn.o_proj.weight.dtype == torch.float8_e4m3fn
        )
        assert moe.shared_experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        assert moe.experts.w13.dtype == experts_dtype and moe.experts.w2.dtype == experts_dtype
        compute = llm.engine.runner.dtype  # bf16, or float32 where the CPU has no fast bf16 products
        assert model.lm_head.weight.dtype == compute and moe.gate.weight.dtype != torch.float8_e4m3fn
        # FP8: a byte a weight and a float32 scale per row per 128 of K; MXFP4 half a byte
        bf16_bytes = plain.layers[1].mlp.experts.w13.nbytes
        w13 = moe.experts.w13.nbytes + moe.experts.w13_scale.nbytes
        assert w13 < (0.54 if experts_dtype == torch.float8_e4m3fn else 0.29) * bf16_bytes
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert fp8.generate([prompt], params)[0].text  # serves


def test_dequantize_and_the_quantizers_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)  # partial edge blocks both ways
    q, grid = quantize_fp8(w, (128, 128), ue8m0=False)
    assert q.dtype == torch.float8_e4m3fn and grid.shape == (2, 3)
    rows = grid.repeat_interleave(128, 0)[:200]
    deq = QuantWeight("fp8", q, rows, 128).dequantize()
    scale = rows.repeat_interleave(128, 1)[:, :300]
    # e4m3 rounds to nearest: within half a step, 2^-4 relative (3 mantissa bits), 2^-10 x scale
    # among the subnormals; and each block's largest value is 448 x its scale
    assert ((deq - w).abs() <= torch.maximum(w.abs() / 16, scale * 2.0**-10) * 1.0001).all()
    assert torch.allclose(scale.amax(), w.abs().amax() / 448)
    _, pow2 = quantize_fp8(w, (32, 32), ue8m0=True)
    assert torch.equal(e8m0_to_float(float_to_e8m0(pow2)), pow2)  # powers of two survive the bytes
    with pytest.raises(ValueError, match="powers of two"):
        float_to_e8m0(torch.tensor([3.0]))
    packed, scales = quantize_mxfp4(w[:, :288])
    values = unpack_e2m1(packed)
    assert packed.shape == (200, 144) and scales.shape == (200, 9)
    assert set(values.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    deq4 = QuantWeight("mxfp4", packed, scales, 32).dequantize()
    scale4 = e8m0_to_float(scales).repeat_interleave(32, 1)
    err, x = (deq4 - w[:, :288]).abs(), w[:, :288].abs()
    # within half e2m1's widest gap (4 -> 6) below 6 x scale; past it (up to 8 x scale) clamped to 6
    assert (err[x <= 6 * scale4] <= scale4[x <= 6 * scale4]).all()
    assert (err <= 2 * scale4).all() and (x < 8 * scale4).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(w[:, :100])


def test_deepseek_names_translate_both_ways() -> None:
    pairs = {
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv": "layers.3.attn.wkv_a.scale",
        "model.layers.3.mlp.experts.7.down_proj.weight": "layers.3.ffn.experts.7.w2.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight": "layers.3.ffn.shared_experts.w3.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias": "layers.3.ffn.gate.bias",
        "model.layers.3.post_attention_layernorm.weight": "layers.3.ffn_norm.weight",
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "head.weight",
    }
    for hf, ds in pairs.items():
        assert hf_to_deepseek(hf) == ds and deepseek_to_hf(ds) == hf and deepseek_to_hf(hf) == hf


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c["quantization_config"].update(quant_method="awq"),
            "quant_method 'awq' is not supported",
        ),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), "fmt 'e5m2' is not supported"),
        (lambda c: c["quantization_config"].update(scale_fmt="ue4m3"), "scale_fmt 'ue4m3' is not supported"),
        (lambda c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme 'static'"),
        (lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size must be"),
        (lambda c: c.update(expert_dtype="int4"), "expert_dtype 'int4' is not supported"),
    ],
)
def test_unknown_quantization_is_refused_naming_the_key(fp8_model, tmp_path, edit, message) -> None:
    folder = _edit_config(fp8_model, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder))


W = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [80, 128]: one partial 128 x 128 block
S = W + "_scale_inv"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({S: torch.ones(2, 1)}),
            f"'{S}' has a scale grid \\[2, 1\\]; a \\[80, 128\\] weight .* needs \\[1, 1\\]",
        ),
        (lambda t: t.pop(S), f"'{W}' is quantized but its scales \\('{S}'\\) are missing"),
        (lambda t: t.pop(W), f"'{S}' is the scales of '{W}', which is missing"),
        (
            lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
            "is the scales of 'model.norm.weight', which the model keeps unquantized",
        ),
        (
            lambda t: t.update({W: t[W].to(torch.bfloat16)}),
            f"'{W}' has dtype BF16; the model keeps it as FP8",
        ),
        (lambda t: t.update({S: t[S].to(torch.bfloat16)}), f"'{S}' has dtype BF16"),
        (
            lambda t: t.update({"lm_head.weight": t["lm_head.weight"].to(torch.float8_e4m3fn)}),
            "'lm_head.weight' has dtype F8_E4M3; the model keeps it unquantized",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_copied(
    fp8_model, tmp_path, monkeypatch, edit, message
) -> None:
    folder = _variant(fp8_model, tmp_path / "m", edit)
    copies = []
    monkeypatch.setattr("engine.loader._copy", lambda *a: copies.append(a))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(folder))
    assert copies == []


def test_a_quantized_tensor_without_a_quantization_config_is_refused(fp8_model, tmp_path) -> None:
    folder = _edit_config(fp8_model, tmp_path / "m", lambda c: c.pop("quantization_config"))
    with pytest.raises(
        ValueError, match="quantized \\(F8_E4M3\\) but config.json has no quantization_config"
    ):
        LLM(model=str(folder))


def test_e8m0_scales_are_read_as_bytes(tiny_model, tmp_path) -> None:
    """2^-120 as an e8m0 byte stays 2^-120 (a numeric cast through a narrower type would flush it)."""
    folder = quantize_folder(
        tiny_model, tmp_path / "m", QuantOptions(block=32, ue8m0=True, scale_dtype="e8m0")
    )
    tensors = _tensors(folder)
    assert tensors[S].dtype == torch.float8_e8m0fnu
    tensors[S] = torch.full(tensors[S].shape, 7, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    save_file(tensors, str(folder / "model.safetensors"))
    attn = LLM(model=str(folder), dtype="float32").engine.runner.model.layers[1].self_attn
    assert torch.equal(attn.kv_a_proj_with_mqa.weight_scale, torch.full((80, 4), 2.0**-120))


def test_quantize_cli_writes_deepseek_names_and_refuses_to_overwrite(tiny_model, tmp_path, capsys) -> None:
    out = tmp_path / "q"
    argv = [
        "quantize",
        tiny_model,
        "--out",
        str(out),
        "--block",
        "32",
        "--ue8m0",
        "--names",
        "deepseek",
        "--experts",
        "fp4",
    ]
    assert cli(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    }
    assert config["expert_dtype"] == "fp4" and "pdserve_build_fingerprint" not in config
    tensors = _tensors(out)
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8  # two e2m1 a byte
    assert tensors["layers.1.ffn.experts.0.w1.scale"].shape == (64, 4)  # a scale per 32 of K
    assert tensors["layers.1.attn.wkv_a.scale"].dtype == torch.float8_e8m0fnu
    assert (
        tensors["head.weight"].dtype == torch.bfloat16
        and tensors["layers.1.ffn.gate.bias"].dtype == torch.float32
    )
    assert cli(argv) == 2 and "exists and is not empty" in capsys.readouterr().err
    assert cli(["quantize", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err


PEAK_PROBE = """
import gc, json, sys, torch
torch.set_num_threads(1)
from pathlib import Path
from engine import LLM
from engine.safetensors_io import SafetensorsFile

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)

folder = Path(sys.argv[1])
largest = 0
for path in folder.glob("*.safetensors"):
    with SafetensorsFile(path) as f:
        largest = max([largest, *(t.nbytes for t in f.tensors.values())])
first = LLM(str(folder), dtype="bfloat16", num_kv_blocks=16)  # what a load imports and caches
del first
gc.collect()
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=16)
print(json.dumps({"peak": status("VmHWM") - before, "weights": llm.engine.runner.weight_bytes,
                  "largest": largest}))
"""


@pytest.fixture(scope="module")
def wide_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with 4096-wide experts (~120 MB of bf16 weights, 1 MiB at most a tensor):
    weights that dominate what else an engine allocates, and its 2 MiB pages (at 2048 wide, FP8's
    10 % was ~3 MB, a page or two, and a run on torch's path went over by a page)."""
    p = dataclasses.replace(PRESETS["tiny"], moe_intermediate_size=4096, intermediate_size=4096)
    folder = tmp_path_factory.mktemp("wide") / "wide"
    shutil.copytree(tiny_model, folder)
    save_file(make_weights(p), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(p, "wide", "tiny")))
    return folder


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset is Linux's")
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
def test_loading_holds_the_weights_once(wide_model, tmp_path, quantized) -> None:
    """Peak RSS while the engine loads <= its weights + 10% + the checkpoint's largest tensor (the
    checkpoint's pages are read, not mapped; the parameters are filled where they will live)."""
    folder = quantize_folder(wide_model, tmp_path / "fp8", QuantOptions()) if quantized else wide_model
    out = subprocess.run(
        [sys.executable, "-c", PEAK_PROBE, str(folder)], capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["weights"] > 4 * got["largest"]  # a model whose weights dominate the bound
    assert got["peak"] <= got["weights"] * 1.1 + got["largest"], got
