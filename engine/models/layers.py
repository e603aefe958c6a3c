"""Small building blocks shared by the model files: linear (its weight plain or kept quantized),
RMSNorm, LayerNorm and the SwiGLU MLP.

Parameters are allocated uninitialised (`torch.empty`) because the loader fills every one of
them; nothing is randomly initialised and then overwritten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant import QuantSpec
from kernels import native
from kernels.linear import linear
from kernels.moe import swiglu
from kernels.norm import rms_norm
from kernels.quant import QuantWeight


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        quant: QuantSpec | None = None,
    ):
        """quant: the weight kept as the checkpoint stores it (FP8 or MXFP4 and its scales,
        `weight` and `weight_scale`); None: a plain `weight` in dtype."""
        super().__init__()
        self.quant = quant
        if quant is None:
            self.weight = _param(out_features, in_features, dtype=dtype)
        else:
            data_shape, scale_shape = quant.shapes(out_features, in_features)
            self.weight = _param(*data_shape, dtype=quant.data_dtype)
            self.weight_scale = _param(*scale_shape, dtype=quant.scale_dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    @property
    def w(self) -> torch.Tensor | QuantWeight:
        """The weight as the kernels take it: the tensor, or a QuantWeight over data and scales."""
        return self.weight if self.quant is None else self.quant.weight(self.weight, self.weight_scale)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values in dtype [out, in] (a new tensor when quantized)."""
        return self.weight if self.quant is None else self.w.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(num_embeddings, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> y [N, D]; with a residual [N, D], -> (y of x + residual, x + residual), one kernel."""
        return rms_norm(x, self.weight, self.eps, residual=residual)


class LayerNorm(nn.Module):
    """LayerNorm with a bias (DeepSeek-V3.2's indexer keys), computed in float32: bf16 rows through
    the native kernel where it is loaded (the one-call decode's, so both paths share its bits)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.bias = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and native.loaded() and native.takes(x, self.weight, self.bias):
            return native.layer_norm(x, self.weight, self.bias, self.eps)
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one [2I, H] weight."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, quant: QuantSpec | None = None
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, dtype=dtype, quant=quant)
        self.down_proj = Linear(intermediate_size, hidden_size, dtype=dtype, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up_proj.w, self.down_proj.w)
