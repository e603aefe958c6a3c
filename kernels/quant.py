"""Weights kept as quantized checkpoints store them, and the products that widen them.

A `QuantWeight` is a weight's stored values and scales, [..., N, K] as the product sees it:
- "fp8": e4m3 values [..., N, K] and a float32 scale per row per `block_k` of K (DeepSeek's block
  scales, 128 x 128 or 32 x 32, their row blocks expanded to rows: engine/quant.py);
- "mxfp4": two e2m1 values a byte [..., N, K / 2], the even column in the low nibble, and an e8m0
  scale (2^(b - 127)) per row per 32 of K.

`dequantize` is the reference every kernel is held to. `linear` takes an FP8 weight on a GPU
through Triton's block-FP8 GEMM (`w8a8_linear`: the activations quantized per token per block of
K, as DeepSeek's inference and vLLM's Triton path run it; `act_quant`), elsewhere widens the
weight per call in torch (kernels/moe.py's `fused_moe_quant` the experts'), for the devices and
batches the native kernels do not take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.dispatch import cdiv, next_power_of_2, resolve_impl

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


def linear(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N]: an FP8 weight through `w8a8_linear` where Triton runs (a GPU),
    else the weight widened to x's dtype (float32 scales applied in float32)."""
    if w.fmt == "fp8" and resolve_impl(impl, x, has_triton=True) == "triton":
        return w8a8_linear(x, w, bias, impl="triton")
    return F.linear(x, w.dequantize(x.dtype), bias)


E4M3_MAX = 448.0


def act_quant_ref(x: torch.Tensor, group: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): per row and group of K,
    scale = max(amax, 1e-10) / 448 (with ue8m0 rounded up to a power of two), values x / scale
    rounded to e4m3 (DeepSeek's act_quant, vLLM's per_token_group_quant_fp8)."""
    m, k = x.shape
    groups = cdiv(k, group)
    padded = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=-1).clamp_min(1e-10) / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (padded / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def act_quant(
    x: torch.Tensor, group: int, ue8m0: bool = False, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant_ref's values; through Triton on a GPU (one program per row and group)."""
    if resolve_impl(impl, x, has_triton=True) == "torch":
        return act_quant_ref(x, group, ue8m0)
    from kernels.jit import quant as jit

    if x.dim() != 2 or x.stride(1) != 1 or group != next_power_of_2(group):
        raise ValueError(f"x must be [M, K] with unit stride along K and group a power of two, got {group}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, cdiv(k, group), dtype=torch.float32, device=x.device)
    if m and k:
        jit.act_quant_kernel[(m, scale.shape[1])](
            x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, UE8M0=ue8m0
        )
    return q, scale


def w8a8_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w^T with x quantized as act_quant_ref (groups of w.block_k) -> [M, N] in x's
    dtype: both widened in float32, the product in float32."""
    q, scale = act_quant_ref(x, w.block_k)
    k = x.shape[1]
    xd = q.float() * scale.repeat_interleave(w.block_k, dim=1)[:, :k]
    return F.linear(xd, w.dequantize(torch.float32), None if bias is None else bias.float()).to(x.dtype)


def w8a8_linear(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, impl: str = "auto"
) -> torch.Tensor:
    """w8a8_linear_ref's product through Triton's block-FP8 GEMM on a GPU: x quantized per row
    per block of K (act_quant), each K block's e4m3 product scaled by the row's and the weight
    row's scales into float32 sums."""
    if w.fmt != "fp8" or w.data.dim() != 2:
        raise ValueError(f"w8a8_linear takes an FP8 weight [N, K], got {w.fmt} {tuple(w.shape)}")
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K={w.shape[1]}], got {tuple(x.shape)}")
    if resolve_impl(impl, x, has_triton=True) == "torch":
        return w8a8_linear_ref(x, w, bias)
    from kernels.jit import quant as jit

    if w.block_k != next_power_of_2(w.block_k) or w.block_k < 16 or w.data.stride(1) != 1:
        raise ValueError(
            f"the Triton GEMM takes power-of-two blocks of at least 16 along unit-stride K, got {w.block_k}"
        )
    x = x.contiguous()
    q, scale = act_quant(x, w.block_k, impl="triton")
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m = min(64, max(16, next_power_of_2(m)))
        grid = (cdiv(m, block_m), cdiv(n, 64))
        jit.w8a8_block_gemm_kernel[grid](
            q, scale, w.data, w.scale, y, m, n, k, q.stride(0), scale.stride(0), w.data.stride(0),
            w.scale.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=w.block_k,
            WIDEN=not x.is_cuda,
        )  # fmt: skip
    return y if bias is None else y + bias
