"""y = x @ w^T for the few-row products of decoding, in the orientation the CPU BLAS runs best.

With a handful of rows (a decode step, or a speculative verification of k + 1 tokens), the
product is bound by reading the weight. For [M, K] @ [K, N] with M < 16, MKL's CPU sgemm reads
the weight once per row (M = 2 costs twice M = 1) and its single-row GEMV streams a large weight
slowly from memory. The same product taken as w @ x^T ([N, K] @ [K, M], then transposed) reads the
weight once for all rows. Measured on the 2-core development VM with weights out of cache
(benchmarks/linear_orientation.py): the 4096 x 256 LM head at M = 1 / 2 / 3 costs 777 / 1227 /
1389 µs as x @ w^T and 394 / 500 / 535 µs as w @ x^T (M = 1 padded to 2 rows); a routed expert's
256 x 256 gate_up at M = 2 / 3, 59 / 73 µs against 36 / 34 µs. From 16 rows on the two forms
are close for the layer weights; the wide LM head still reads faster as w @ x^T for a batch's
logits, which DeepseekV2ForCausalLM.compute_logits keeps. GPUs always take x @ w^T (cuBLAS has its
own small-M kernels).

A single bf16 row, where the native kernels are loaded (kernels/native: AVX512F CPUs), takes
neither: their product reads the weight once, at 7-8 GB/s on one thread for a layer's 0.25-1 MB
weights and ~17 GB/s on two for the LM head, against 4-5 and ~17 through torch (2-core Xeon,
benchmarks/linear_native.py). Up to native.max_rows() rows the product stays native: AMX_ROWS
on the AMX tile unit, FEW_ROWS through VDPBF16PS (from there torch's oneDNN, with the same
instructions, is as fast or faster), any number where the kernels emulate AVX512-BF16 (there
torch's bf16 products are emulated too, and slower; native.EMULATED_ROWS has the figures).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native, quant
from kernels.quant import QuantWeight

FEW_ROWS = 16  # from 2 rows to below this many, CPU products are taken as w @ x^T
PAD_ONE_ROW_MIN = 1 << 18  # a single row through a weight this large is padded to 2 rows: the
# GEMV streams it ~1.5x slower; through smaller weights the GEMV is as fast or faster


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K], weight [N, K] (or kept quantized: kernels/quant.py), bias [N] | None -> [M, N]
    (contiguous), any device."""
    if isinstance(weight, QuantWeight):
        if x.dim() == 2 and (y := native.few_rows_quant_linear(x, weight)) is not None:
            return y if bias is None else y.add_(bias)
        return quant.linear(x, weight, bias)
    if x.dim() == 2 and (y := native.few_rows_linear(x, weight)) is not None:
        return y if bias is None else y.add_(bias)
    return linear_torch(x, weight, bias)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` through torch's products only (the native kernels' baseline)."""
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or not 0 < rows < FEW_ROWS:
        return F.linear(x, weight, bias)
    if rows > 1:
        y = torch.mm(weight, x.t())
    elif weight.numel() >= PAD_ONE_ROW_MIN:
        y = torch.mm(weight, x.expand(2, -1).contiguous().t())[:, :1]
    else:  # a single row through a small weight: the GEMV is fine
        return F.linear(x, weight, bias)
    y = y.t().contiguous()
    return y if bias is None else y.add_(bias)
