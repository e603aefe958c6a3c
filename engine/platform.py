"""What the hardware can do, asked once: which dtype the model actually computes in."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_NATIVE_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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
    if any(flag in _cpu_flags() for flag in _NATIVE_HALF_FLAGS.get(dtype, ())):
        return dtype
    logger.warning("this CPU has no native %s arithmetic: computing in float32 on %s weights", dtype, dtype)
    return torch.float32
