"""What the hardware can do, asked once: which dtype the model actually computes in."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from engine import env
from kernels import native

logger = logging.getLogger(__name__)

_NATIVE_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.cache  # the answer is fixed per machine; the warning below is logged once
def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype weights, activations and KV cache use on `device` for a model requested in `dtype`.

    CPUs without native bf16/fp16 arithmetic (no AVX512-BF16/AMX) run half-precision GEMMs through
    a slow emulation (~10x slower than float32 here), so there the checkpoint's half-precision
    weights are widened to float32 -- exactly, every bf16 value is a float32 value -- and the
    model computes in float32, as llama.cpp does on such machines.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    if any(flag in native.cpu_flags() for flag in _NATIVE_HALF_FLAGS.get(dtype, ())):
        return dtype
    logger.warning("this CPU has no native %s arithmetic: computing in float32 on %s weights", dtype, dtype)
    return torch.float32


def use_native_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Build (once per machine) and load the native CPU kernels (kernels/native) for a model
    computing in `dtype` on `device`: bf16 on a CPU with AVX512-BF16, unless PDSERVE_NATIVE_KERNELS=0.
    True when they are loaded; the engine otherwise runs torch's."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not env.native_kernels():
        return False
    return native.load(Path(env.native_build_dir()), amx=env.native_amx())
