"""Weights kept as quantized checkpoints store them, and the products that widen them.

A `QuantWeight` is a weight's stored values and scales, [..., N, K] as the product sees it:
- "fp8": e4m3 values [..., N, K] and a float32 scale per row per `block_k` of K (DeepSeek's block
  scales, 128 x 128 or 32 x 32, their row blocks expanded to rows: engine/quant.py);
- "mxfp4": two e2m1 values a byte [..., N, K / 2], the even column in the low nibble, and an e8m0
  scale (2^(b - 127)) per row per 32 of K.

`dequantize` is the reference every kernel is held to; `linear` here is the torch path (a weight
widened per call; kernels/moe.py's `fused_moe_quant` the experts'), for devices and batches no native
or Triton kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""An e2m1 nibble's magnitude by its low three bits; bit 3 is the sign."""
MXFP4_BLOCK = 32


@dataclass(frozen=True)
class QuantWeight:
    """A weight kept as stored, [..., N, K] as the product sees it: `fmt` "fp8" (data float8 e4m3
    [..., N, K], scale float32 [..., N, ceil(K / block_k)]) or "mxfp4" (data uint8 [..., N, K / 2],
    two e2m1 values a byte, the even column low; scale uint8 e8m0 [..., N, K / 32])."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    block_k: int

    @property
    def shape(self) -> torch.Size:
        *lead, n, k = self.data.shape
        return torch.Size([*lead, n, k * 2 if self.fmt == "mxfp4" else k])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index) -> QuantWeight:
        """The same leading-dimension index of data and scale (an expert's weights: w13[e])."""
        return QuantWeight(self.fmt, self.data[index], self.scale[index], self.block_k)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values [..., N, K] in dtype: each stored value times its block's scale,
        computed in float32 (exact products of an e4m3 or e2m1 value and a power of two; for
        float32 scales one rounding, as a float32 reference computes it)."""
        k = self.shape[-1]
        if self.fmt == "fp8":
            values = self.data.float()
            scales = self.scale
        else:
            values = unpack_e2m1(self.data)
            scales = e8m0_to_float(self.scale)
        scales = scales.repeat_interleave(self.block_k, dim=-1)[..., :k]
        return (values * scales).to(dtype)


def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (uint8) -> float32 2^(b - 127), exactly (2^-127 is a float32 denormal; 255 NaN)."""
    out = torch.ldexp(torch.ones(b.shape), b.to(torch.int32) - 127)
    return out.masked_fill_(b == 255, float("nan"))


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Powers of two (float32) -> e8m0 bytes; ValueError for anything else."""
    mantissa, exponent = torch.frexp(x)
    if not bool(((mantissa == 0.5) & (exponent - 1 >= -127) & (exponent - 1 <= 127)).all()):
        raise ValueError("e8m0 scales must be powers of two in [2^-127, 2^127]")
    return (exponent - 1 + 127).to(torch.uint8)


_E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> float32 [..., K]: the low nibble is the even column."""
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack((_E2M1[low], _E2M1[high]), dim=-1).flatten(-2)


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N]: the weight widened to x's dtype (float32 scales applied in float32)."""
    return F.linear(x, w.dequantize(x.dtype), bias)
