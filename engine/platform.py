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

    CPUs without native bf16/fp16 arithmetic (no AVX512-BF16/AMX) run torch's half-precision GEMMs
    through an emulation (~10x slower than float32 on AVX2, 1.2-1.75x with AVX512F), so there the
    checkpoint's half-precision weights are widened to float32 -- exactly, every bf16 value is a
    float32 value -- and the model computes in float32, as llama.cpp does on such machines. Except
    a bf16 model where the native kernels load, which compute in bf16 without those instructions
    (their bits; the AVX2 build's products in an order of their own) and read the weights in bf16,
    half the bytes:
    - with AVX512F/BW/VL/DQ (Skylake-SP to Ice Lake): on a 2-core Zen 4 built as such a CPU,
      against float32 through torch, decode 3.2x faster at batch 1 and 2.5-4.9x at 8-256,
      offline throughput 1.8x (README);
    - with AVX2 and FMA only (AMD Zen 1 to 3, Intel client cores): the same Zen 4 built as such a
      CPU, torch capped at AVX2 as well, decode 3.96x faster at batch 1 and 1.11-3.27x at 8-256,
      offline throughput 1.15x, 0.57x the memory (README, at 568ea82; the AVX2 products' own
      order then took B = 64-256 another 1.4-1.5x and offline 1.5x).
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    if any(flag in native.cpu_flags() for flag in _NATIVE_HALF_FLAGS.get(dtype, ())):
        return dtype
    if dtype == torch.bfloat16 and native.supported() and use_native_kernels(dtype, device):
        logger.info("this CPU has no AVX512-BF16: computing in bf16 through the native kernels' emulation")
        return dtype
    logger.warning("this CPU has no native %s arithmetic: computing in float32 on %s weights", dtype, dtype)
    return torch.float32


def use_native_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """Load the native CPU kernels (kernels/native) for a model computing in `dtype` on `device`:
    bf16 on a CPU with AVX512F/BW/VL/DQ (the AVX512-BF16 instructions where it has them, their
    emulation elsewhere) or AVX2 and FMA, unless PDSERVE_NATIVE_KERNELS=0. True when they are
    loaded; the engine otherwise runs torch's."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not env.native_kernels():
        return False
    return load_native()


def load_native() -> bool:
    """native.load as the environment sets it up (engine/env.py: the build folder, PDSERVE_NATIVE_AMX,
    _AMX_ATTENTION, _BF16 and _AVX512), whether or not a model would use the kernels: the engine's,
    the tests' and the benchmarks' one way in. -> whether they are loaded."""
    return native.load(
        Path(env.native_build_dir()),
        amx=env.native_amx(),
        bf16=env.native_bf16(),
        avx512=env.native_avx512(),
        amx_attention=env.native_amx_attention() != "vdpbf16ps",
    )


ATTENTION_CONTEXT = 256
"""Cached tokens a sequence of pick_decode_attention's timed step holds."""
TILES_MARGIN = 1.1
"""pick_decode_attention leaves the attention on the tiles unless VDPBF16PS takes at most
1 / TILES_MARGIN of their time: a near tie is the hour's noise, and keeps the default."""


def pick_decode_attention(heads: int, kv_lora_rank: int, rope: int, block_size: int, batch: int) -> None:
    """Where the native products run on the AMX tile unit and PDSERVE_NATIVE_AMX_ATTENTION is "auto"
    (the default), put the decode attention on the faster of the tiles and VDPBF16PS for this
    model's attention (heads, kv_lora_rank, rope) and cache blocks: measured once per process and
    shape, on `batch` (the engine's most) sequences of ATTENTION_CONTEXT tokens, the cache from
    memory. Which one wins depends on the CPU and the hour, not on a rule: with the cache warm the
    tile path does less work besides its tile operations than the VDPBF16PS path does in all, with
    it from memory more (measured on a 2-core Zen 4 with those operations made no-ops: the README's
    Xeon section). The two differ only in the order of the float32 sums; the choice is logged, and
    PDSERVE_NATIVE_AMX_ATTENTION=1 or 0 pins it (no timing)."""
    if env.native_amx_attention() != "auto" or not native.uses_amx() or native.amx_emulated():
        return
    native.use_amx_attention(
        _attention_on_tiles(heads, kv_lora_rank, rope, block_size, min(batch, native.AMX_ROWS))
    )


@functools.cache  # one measurement per process and shape: engines built after it take its answer
def _attention_on_tiles(heads: int, kv_lora_rank: int, rope: int, block_size: int, batch: int) -> bool:
    case = native.attention_case(batch, ATTENTION_CONTEXT, heads, kv_lora_rank, rope, block_size)
    seconds = native.time_attention_paths(case, kv_lora_rank)
    tiles = seconds["tiles"] <= TILES_MARGIN * seconds["vdpbf16ps"]
    logger.info(
        "decode attention on %s: one layer of %d sequences x %d tokens took %.2f ms on the AMX tiles, "
        "%.2f ms through VDPBF16PS (PDSERVE_NATIVE_AMX_ATTENTION=1 or 0 pins it)",
        "the AMX tiles" if tiles else "VDPBF16PS",
        batch,
        ATTENTION_CONTEXT,
        seconds["tiles"] * 1e3,
        seconds["vdpbf16ps"] * 1e3,
    )
    return tiles
