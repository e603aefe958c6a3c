"""Quantized checkpoints as DeepSeek releases them, kept quantized in memory.

Formats (`quantization_config` in config.json, and V4's top-level `expert_dtype`):
- FP8 block-scaled (V3, R1, V3.1+, V3.2, V4): `quant_method: fp8`, `fmt: e4m3`,
  `weight_block_size: [bn, bk]` (128 x 128; V4.1 32 x 32). A quantized linear stores its weight as
  float8 e4m3 [N, K] and a scale per block, `weight_scale_inv` (HF names) or `scale` (DeepSeek's
  names), [ceil(N / bn), ceil(K / bk)]: W[i, j] = float(w[i, j]) * scale[i // bn, j // bk]; the edge
  blocks are partial. The scales are float32, or with `scale_fmt: ue8m0` powers of two, stored as
  float32 or as float8 e8m0 bytes (2^(b - 127)).
- MXFP4 experts (V4 with `expert_dtype: fp4`): the routed experts' weights are two e2m1 values
  per byte [N, K / 2] (the even column in the low nibble) with one e8m0 scale per 32 of K
  [N, K / 32].

In memory a quantized weight keeps its bytes and one scale per row per block of K (a
`QuantWeight`): the row blocks expanded to rows, so gate and up rows of any height can sit in one
fused tensor (3% more than the grid for 128-wide blocks: 4 bytes of scale per 128 weights).
Kernels widen the weights as they read them (kernels/quant.py, whose `dequantize` is the
reference); modelkit/quantize.py writes such checkpoints (`pdserve quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import MXFP4_BLOCK, QuantWeight

E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization, from its config.json."""

    block_n: int
    block_k: int
    ue8m0: bool
    """Scales are powers of two (scale_fmt ue8m0)."""
    experts_fp4: bool
    """The routed experts are MXFP4 (expert_dtype fp4)."""

    @staticmethod
    def from_hf(raw: dict) -> QuantConfig | None:
        """config.json's quantization_config (None: a model not quantized); ValueError naming the
        key for a method, format or block the engine does not read."""
        q = raw.get("quantization_config")
        expert_dtype = raw.get("expert_dtype")
        if expert_dtype not in (None, "fp8", "fp4"):
            raise ValueError(
                f"config.json expert_dtype {expert_dtype!r} is not supported (supported: 'fp8', 'fp4')"
            )
        if q is None:
            if expert_dtype == "fp4":
                raise ValueError("config.json expert_dtype 'fp4' needs a quantization_config")
            return None
        if not isinstance(q, dict):
            raise ValueError("config.json quantization_config must be an object")
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"config.json quantization_config.quant_method {method!r} is not supported (supported: 'fp8')"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"config.json quantization_config.fmt {fmt!r} is not supported (supported: 'e4m3')"
            )
        scale_fmt = q.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(
                f"config.json quantization_config.scale_fmt {scale_fmt!r} is not supported (supported: 'ue8m0')"
            )
        activation = q.get("activation_scheme", "dynamic")
        if activation != "dynamic":
            raise ValueError(
                f"config.json quantization_config.activation_scheme {activation!r} is not supported "
                "(supported: 'dynamic')"
            )
        block = q.get("weight_block_size")
        if not (
            isinstance(block, list)
            and len(block) == 2
            and all(isinstance(b, int) and 1 <= b <= 4096 for b in block)
        ):
            raise ValueError(
                f"config.json quantization_config.weight_block_size must be [rows, columns] of 1 to 4096, got {block!r}"
            )
        return QuantConfig(block[0], block[1], scale_fmt == "ue8m0", expert_dtype == "fp4")


@dataclass(frozen=True)
class QuantSpec:
    """How a model's layer keeps a weight: "fp8" (e4m3, a float32 scale per row per block_k of K) or
    "mxfp4" (two e2m1 a byte, an e8m0 scale per row per 32 of K)."""

    fmt: str
    block_k: int

    @staticmethod
    def of(quant: QuantConfig | None, experts: bool = False) -> QuantSpec | None:
        """The spec of a quantized model's linears (experts: its routed experts'); None unquantized."""
        if quant is None:
            return None
        if experts and quant.experts_fp4:
            return QuantSpec("mxfp4", MXFP4_BLOCK)
        return QuantSpec("fp8", quant.block_k)

    @property
    def data_dtype(self) -> torch.dtype:
        return E4M3 if self.fmt == "fp8" else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.fmt == "fp8" else torch.uint8

    def shapes(self, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(data shape, scale shape) of a [rows, cols] weight."""
        data = (rows, cols if self.fmt == "fp8" else cols // 2)
        return data, (rows, -(-cols // self.block_k))

    def weight(self, data: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
        return QuantWeight(self.fmt, data, scale, self.block_k)


def expand_scale_rows(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """A checkpoint's block grid [ceil(N / bn), nk] -> one scale per row [rows, nk]."""
    return scale.repeat_interleave(block_n, dim=0)[:rows]
