"""Quantized checkpoints as DeepSeek releases them, against transformers on the same weights.

A random DeepSeek-V3 checkpoint (tests/hf_reference.py) is written by `pdserve quantize` in each format
the loader reads: FP8 with 128 x 128 float32 scales under HF names; FP8 with 32 x 32 power-of-two
scales stored as e8m0 bytes under DeepSeek's own names (V4.1's layout); MXFP4 routed experts with
ue8m0 float32 scales elsewhere (V4's). The reference is transformers on a float32 folder this test
dequantizes itself, in float64 from the stored bytes (its own e4m3 / e2m1 / e8m0 decoding, not the
engine's). The engine, in float32 on the quantized folder, keeps the weights quantized and must give
the reference's greedy tokens over 32 steps and its logprobs within 1e-4 (test_parity_hf's checks).
Every dimension of these models is below 128 and several are not multiples of 32 (kv_a_proj 48 rows,
o_proj 80 columns), so edge blocks are partial.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import deepseek_to_hf
from modelkit.quantize import QuantOptions, quantize_folder
from tests.hf_reference import VARIANTS, build_hf_checkpoint, decisive_references
from tests.test_parity_hf import assert_parity, one_torch_thread

FORMATS = {
    "fp8-128-f32-hf": QuantOptions(block=128),
    "fp8-32-e8m0-deepseek": QuantOptions(block=32, ue8m0=True, scale_dtype="e8m0", names="deepseek"),
    "mxfp4-experts-ue8m0": QuantOptions(block=128, ue8m0=True, experts_fp4=True),
}
PROMPT_LENS = (1, 7, 23)

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3(bytes_: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> float64, from the bit fields (sign, 4 exponent bits biased 7, 3 mantissa bits)."""
    b = bytes_.to(torch.int64)
    sign = torch.where(b & 0x80 != 0, -1.0, 1.0).double()
    exp, man = (b >> 3) & 0xF, (b & 0x7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    value = torch.where(exp == 0, man / 8 * 2.0**-6, normal)
    assert not bool(((b & 0x7F) == 0x7F).any()), "e4m3 NaN in a checkpoint"
    return sign * value


def _e8m0(bytes_: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, bytes_.to(torch.int64).double() - 127)


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values a byte, the even column in the low nibble -> float64 [..., 2 * K/2]."""
    b = packed.to(torch.int64)
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64)
    return torch.stack((table[b & 0xF], table[b >> 4]), dim=-1).flatten(-2)


def dequantized_folder(
    quantized: Path, out: Path, rename=deepseek_to_hf, scale_suffix: str = "weight_scale_inv"
) -> Path:
    """The quantized folder's weights in float32 under HF names (rename: a stored name -> the one
    written; DeepSeek-V4's are kept, with their `scale`), each weight times its block's scale
    computed in float64 from the stored bytes, with config.json lacking the quantization."""
    out.mkdir()
    config = json.loads((quantized / "config.json").read_text())
    block_n, block_k = config.pop("quantization_config")["weight_block_size"]
    fp4 = config.pop("expert_dtype", None) == "fp4"
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(quantized.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            stored |= {rename(name): f.get_tensor(name) for name in f.keys()}
    tensors = {}
    for name, t in stored.items():
        if name.endswith("." + scale_suffix):
            continue
        scale = stored.get(name.removesuffix("weight") + scale_suffix)
        if scale is None:
            tensors[name] = t.float()
            continue
        if t.dtype == torch.int8:  # MXFP4: one e8m0 scale per row per 32 columns
            assert fp4 and ".experts." in name
            values = _e2m1(t.view(torch.uint8))
            scales = _e8m0(scale.view(torch.uint8)).repeat_interleave(32, dim=1)
        else:  # FP8: a scale per block_n x block_k block
            values = _e4m3(t.view(torch.uint8))
            grid = _e8m0(scale.view(torch.uint8)) if scale.dtype == torch.float8_e8m0fnu else scale.double()
            scales = grid.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)
        rows, cols = values.shape
        tensors[name] = (values * scales[:rows, :cols]).float()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(quantized / name, out / name)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A float32 DeepSeek-V3 checkpoint with q-LoRA, YaRN and grouped routing (VARIANTS[0])."""
    with one_torch_thread():
        return build_hf_checkpoint(VARIANTS[0].values[0], tmp_path_factory.mktemp("src"), seed=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(source, tmp_path, fmt) -> None:
    quantized = quantize_folder(source, tmp_path / "quantized", FORMATS[fmt], shard_bytes=64 << 10)
    names = [n for f in quantized.glob("*.safetensors") for n in safe_open(f, framework="pt").keys()]
    assert len(list(quantized.glob("*.safetensors"))) > 1  # sharded, with an index
    if FORMATS[fmt].names == "deepseek":
        assert "layers.0.attn.wq_a.scale" in names and not any(n.startswith("model.") for n in names)
    with one_torch_thread():
        reference_dir = dequantized_folder(quantized, tmp_path / "dequantized")
        refs = decisive_references(reference_dir, PROMPT_LENS, steps=32, seed=0)
    assert_parity(quantized, refs, block_size=16)
