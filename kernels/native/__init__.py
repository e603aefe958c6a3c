"""Native CPU kernels: C++ sources in this folder, one library per ISA level, built when the
package is installed (kernels/native/build.py) and picked when an engine starts.

Why native code: at decode's few rows a product is bound by reading its weight, but each call
through torch costs more than the bytes do (kernels/linear.py has the figures); a kernel that only
reads the weight and multiplies gets ~2.5x closer to the memory. The source links against ATen's
thread pool only (not torch's tensor headers, which take four times as long to compile).

Process-wide, like torch.ops: `load` is called once by the engine (engine/engine_core.py, with the
build folder and switch from engine/env.py), and the kernels (kernels/linear.py) ask `linear_bf16`
only when `loaded()`. The library is the AVX-512 + BF16 one where the CPU has those instructions
(with the AMX tile paths inside, taken where the CPU has the unit), else the AVX-512 one (BF16
emulated), else the AVX2 and FMA one (the same source on pairs of 256-bit registers: avx2.h). A
machine with none of them keeps the torch path; the engine logs which it runs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels.dispatch import check_extend
from kernels.native import build
from kernels.quant import QuantWeight

logger = logging.getLogger(__name__)

REQUIRED_FLAGS = build.AVX512_FLAGS
AVX2_FLAGS = build.AVX2_FLAGS
"""A CPU with these but not REQUIRED_FLAGS (AMD Zen 1 to 3, Intel client cores) gets the AVX2
build: the same source, each 512-bit vector a pair of 256-bit registers (kernels/native/avx2.h),
the same bits as the AVX-512 build with AVX512-BF16 emulated, except the products: they sum in
an order of their own that fits AVX2's 16 registers (kernels/native/products_avx2.h)."""
BF16_FLAG = build.BF16_FLAG
"""Where the CPU has it, the library is the one built with `-mavx512bf16`: VDPBF16PS and
VCVTNEPS2BF16. Without it (Skylake-SP to Ice Lake) the kernels compute the same bits from AVX512F
instructions, each VDPBF16PS as two multiply-adds (kernels/native/common.h dot_bf16)."""

FEW_ROWS = 128
"""Products of up to this many rows take the native kernel through VDPBF16PS (CPUs without AMX),
and so a decode step of up to this many tokens runs as one native call (runs_in_one_call). The
kernel reads each weight row once for all the rows; per product, 2 threads, weights out of cache
on huge pages, 2-core AMD EPYC (Zen 4), 2026-12-03, native against torch's oneDNN: the LM head
(32000 x 512) at 1 / 4 / 8 / 16 / 32 rows 1.0 / 1.3 / 1.8 / 3.2 / 5.9 ms against 2.1 / 3.2 /
2.6 / 4.1 / 5.6; a 1536 x 512 weight 61 / 106 / 149 / 199 / 331 µs against 154 / 236 / 220 /
252 / 345. From 32 rows a product alone costs what oneDNN's does, but the step in one call still
gains (no Python between the products, no oneDNN primitive per batch size): bench-model decode
steps at 32 / 64 / 128 sequences 31-38 / 60 / 130-140 ms against 59-68 / 91 / 143-144 with the
products through torch. At 256 sequences the one call took 256 ms against 234 layer by layer, so
there the products stay torch's."""
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
AMX_ROWS = 256
"""Where the CPU has AMX-BF16 (and PDSERVE_NATIVE_AMX is not 0), the products run on the tile
unit, whose cost is reading the weight up to 32 rows (a 1024 x 512 weight: 33-37 µs at 1 to 16
rows, against 30 / 51 / 96 / 190 µs at 1 / 2 / 4 / 8 rows through VDPBF16PS, one core, weight in
cache): products of up to AMX_ROWS rows through any weight then go native. Beyond 32 rows each
further pass of 32 costs arithmetic; per product against torch's, 2 threads, weights out of cache
(2-core Xeon, 2026-12-03), at 64 / 128 / 256 rows: 1024 x 512 140 / 144 / 239 µs against 177 /
185 / 257, the LM head (32000 x 512) 2.1 / 3.9 / 7.7 ms against 2.9 / 4.2 / 6.4. A whole decode
step in one native call (engine/models/deepseek_v2.py runs_in_one_call) gains more: no Python
between the products, and no oneDNN primitive created and cached per batch size (~1.5 ms and
~170 KiB each): a 256-sequence decode runs as fast and peaks ~200 MiB lower, 64 sequences 15%
faster."""
EMULATED_ROWS = sys.maxsize
"""Where the kernels emulate AVX512-BF16 (a CPU without it), so do torch's bf16 products (oneDNN on
AVX512F), and the emulation is the faster: there every product goes native (in blocks of 256 rows,
products.h ROW_BLOCK), a prefill's too, and a decode step of any batch runs as one call. 2-core Zen
4 built as such a CPU (oneDNN capped at AVX512_CORE_VNNI), 2026-12-04: 2048 rows through a 1536 x
512 / 512 x 1536 weight 12.0 / 13.4 ms against torch's 65.0 / 21.0; a bench-model prefill of 64
x 128-token prompts 2.50 s against 2.83 with products of up to 256 rows native (medians of 6
alternating rounds in one process); decode steps (256-token contexts) at 192 / 256 sequences
126-137 / 178-187 ms against 204-226 / 258-270 with FEW_ROWS."""
_max_rows = FEW_ROWS
_machine_rows = FEW_ROWS  # max_rows() outside batch-invariant steps (use_amx sets it)
_batch_invariant = False

_library: ModuleType | None = None
_bf16_instructions = False
_avx512 = False
_amx = False
_amx_emulated = False
_amx_attention = True  # use_amx_attention's setting


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_avx512() -> bool:
    """Whether this CPU runs the AVX-512 build."""
    return all(flag in cpu_flags() for flag in REQUIRED_FLAGS)


def supported() -> bool:
    """Whether this CPU runs a build: the AVX-512 one, else the AVX2 one."""
    return has_avx512() or all(flag in cpu_flags() for flag in AVX2_FLAGS)


def load(
    build_dir: Path, amx: bool = True, bf16: bool = True, avx512: bool = True, amx_attention: bool = True
) -> bool:
    """Load the native kernels built for this CPU (kernels/native/build.py: the library `pip
    install` built, else one built into `build_dir` before, else built there now, which only a
    development checkout whose sources changed needs); True when they are loaded. False, with a
    line naming why, on a CPU with neither AVX512F/BW/VL/DQ nor AVX2 and FMA, or when the library
    is missing and cannot be built (no compiler). amx: products on the AMX tile unit where the
    CPU has it (see use_amx); bf16: the AVX512-BF16 instructions where the CPU has them (False
    takes the library that emulates them, as a CPU without them runs); avx512: the AVX-512
    libraries where the CPU runs them (False takes the AVX2 one). The last two for tests and
    measurements; amx_attention: see use_amx_attention."""
    global _library, _bf16_instructions, _avx512
    if _library is not None:
        return True
    variant = build.choose(cpu_flags(), avx512=avx512, bf16=bf16)
    if variant is None:
        logger.info(
            "native CPU kernels: this CPU lacks %s and %s; using torch's",
            *map("/".join, (REQUIRED_FLAGS, AVX2_FLAGS)),
        )
        return False
    try:
        path = build.find_or_build(
            build.kernels(variant), Path(build_dir), f"native CPU kernels ({variant.name})"
        )
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        library = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(library)
    except Exception as e:  # no compiler, no Python headers: the torch path still works
        detail = getattr(e, "stderr", None) or str(e)
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else detail
        logger.warning(
            "native CPU kernels (%s): not built (%s); using torch's", variant.name, detail.strip()[-300:]
        )
        return False
    _library = library
    _bf16_instructions, _avx512 = variant.name == "avx512_bf16", variant.name != "avx2"
    amx = use_amx(amx)
    use_amx_attention(amx_attention)
    products = "AMX" if amx else "AVX512-BF16" if _bf16_instructions else "AVX512F" if _avx512 else "AVX2"
    products += "" if _bf16_instructions else " (AVX512-BF16 emulated)"
    products += "" if amx_attention or not amx else ", the decode attention through VDPBF16PS"
    logger.info("native CPU kernels loaded from %s (%s products)", path, products)
    return True


def library_path() -> Path | None:
    """The file of the loaded kernels' library (None: not loaded)."""
    return None if _library is None else Path(_library.__file__)


def avx512() -> bool:
    """Whether the loaded kernels are the AVX-512 build (False: the AVX2 one)."""
    return _avx512


def bf16_instructions() -> bool:
    """Whether the loaded kernels use the AVX512-BF16 instructions (False: their emulation)."""
    return _bf16_instructions


def use_amx(on: bool, emulated: bool = False) -> bool:
    """Products (and the decode attention) on the AMX tile unit (where the CPU has it and Linux
    grants it) or with VDPBF16PS; -> whether they now take the tile paths. emulated: the tile
    paths with their tiles in software (kernels/native/tiles.h), on any CPU, for tests: the same
    logic, float32 sums in the order of their own. Requires `loaded()`."""
    global _machine_rows, _amx, _amx_emulated
    assert _library is not None, "kernels.native.load() first"
    on = on and (emulated or (_bf16_instructions and AMX_FLAGS <= cpu_flags()))
    amx = bool(_library.use_amx(on, emulated))
    _machine_rows = AMX_ROWS if amx else FEW_ROWS if _bf16_instructions else EMULATED_ROWS
    _amx, _amx_emulated = amx, amx and emulated
    set_batch_invariant(_batch_invariant)
    return amx


def set_batch_invariant(on: bool) -> None:
    """Batch invariance (EngineConfig.batch_invariant): every product here, whatever its number of
    rows, and every MoE in the native kernel (kernels/moe.py), so each row of a step gets the
    operations it would get alone, whatever else the step holds (the native kernels' rows never
    depend on each other). Off: products of up to the machine's limit (AMX_ROWS, FEW_ROWS or
    EMULATED_ROWS), torch's oneDNN beyond, where a row's bits depend on the rows beside it.
    Process-wide; the runner sets it every step, so engines sharing a process each get theirs."""
    global _max_rows, _batch_invariant
    _batch_invariant = on
    _max_rows = EMULATED_ROWS if on else _machine_rows


def batch_invariant() -> bool:
    """Whether steps run batch-invariant now (set_batch_invariant)."""
    return _batch_invariant


def use_amx_attention(on: bool) -> bool:
    """The decode attention (mla_decode) on the tile path wherever the products take it (on, the
    default) or always through VDPBF16PS (off); -> whether it now takes the tile path (for shapes
    of whole tiles). Requires `loaded()`."""
    global _amx_attention
    assert _library is not None, "kernels.native.load() first"
    _amx_attention = on
    return bool(_library.use_amx_attention(on))


def amx_attention() -> bool:
    """use_amx_attention's setting: whether the decode attention may take the tile path."""
    return _amx_attention


def attention_case(
    batch: int, context: int, heads: int, kv_lora_rank: int, rope: int, block_size: int, generator=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs of one layer's decode attention, to time it: `batch` sequences of `context`
    cached tokens each, over a paged cache of whole `block_size`-row blocks in shuffled order.
    -> (q [batch, heads, L+R], kv_cache, block_table, seq_lens), as mla_decode takes them."""
    per_seq = -(-context // block_size)
    blocks = batch * per_seq
    width = kv_lora_rank + rope
    cache = torch.empty(blocks, block_size, width, dtype=torch.bfloat16).uniform_(-1, 1, generator=generator)
    table = torch.randperm(blocks, generator=generator).view(batch, per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.empty(batch, heads, width, dtype=torch.bfloat16).uniform_(-1, 1, generator=generator)
    return q, cache, table, lens


def time_attention_paths(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], kv_lora_rank: int, rounds: int = 7
) -> dict[str, float]:
    """Median seconds of mla_decode on `case` (attention_case's) on the tile path ("tiles") and
    through VDPBF16PS ("vdpbf16ps"), alternating, which goes first swapping each round, with a
    64 MB buffer rewritten before each call so the cache comes from memory, as in a step. Requires
    the products on the tiles (uses_amx); use_amx_attention's setting is restored after."""
    assert _amx, "use_amx(True) first"
    before = _amx_attention
    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    times: dict[str, list[float]] = {"tiles": [], "vdpbf16ps": []}
    try:
        for r in range(rounds):
            for path in ("tiles", "vdpbf16ps") if r % 2 == 0 else ("vdpbf16ps", "tiles"):
                use_amx_attention(path == "tiles")
                flush.add_(1)
                start = time.perf_counter()
                mla_decode(*case, 0.1, kv_lora_rank)
                times[path].append(time.perf_counter() - start)
    finally:
        use_amx_attention(before)
    return {path: statistics.median(seconds) for path, seconds in times.items()}


def uses_amx() -> bool:
    """Whether the products take the tile paths now (see use_amx), on the unit or emulated."""
    return _amx


def amx_emulated() -> bool:
    """Whether the tile paths run on software tiles now (use_amx(True, emulated=True))."""
    return _amx_emulated


def use_pool(threads: int) -> int:
    """threads >= 1: the kernels share each call's work over their own pool of that many threads
    (the caller's included; kernels/native/pool.h), from 128 KB of weight; 0: over torch's OpenMP
    threads, from 4 MB (the default). Their helpers spin between calls, as OpenMP's do, so the
    pool is for stretches whose work is all native: the engine's few-token decode steps
    (engine/runner.py). -> the setting it replaces. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    return int(_library.use_pool(threads))


def pool_min_bytes(bytes_: int | None) -> int:
    """Calls reading at least this many bytes (of weight, or of cache for attention) are shared
    over the pool; None restores the default. -> the threshold it replaces. For tests and
    benchmarks: the default is measured (see common.h). Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    return int(_library.set_pool_min_bytes(-1 if bytes_ is None else bytes_))


def loaded() -> bool:
    return _library is not None


def max_rows() -> int:
    """The most rows a product takes natively: AMX_ROWS on the tile unit, FEW_ROWS through
    VDPBF16PS, EMULATED_ROWS (sys.maxsize: any) through its emulation."""
    return _max_rows


_BF16 = torch.bfloat16
# The wrappers below sit on a decode step's hot path (a hundred calls a step at batch 1): their
# checks use the cheapest tensor attributes (`is_cpu`, not `device.type`; no generators), which
# keeps a call's Python cost near torch's own dispatch (~4 µs against ~16 before).


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels here take these operands as they are: each CPU bf16 with unit stride
    along its last dimension (None, an absent optional operand, always passes)."""
    for t in tensors:
        if t is not None and not (t.dtype is _BF16 and t.is_cpu and t.stride(-1) == 1):
            return False
    return True


def _few_enough(rows: int) -> bool:
    """Whether a product of `rows` rows runs here: up to max_rows()."""
    return 0 < rows <= _max_rows


def takes_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product of x's rows (the second-last dimension) with weight should run here:
    loaded, the operands taken as they are, and few enough rows."""
    return _library is not None and _few_enough(x.shape[-2]) and takes(x, weight)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K]^T -> [M, N] here when `takes_rows` (checked once, in few steps:
    this is the hot path of a decode step's products); None: the caller takes torch's path."""
    (rows, k), (n, k_w) = x.shape, weight.shape
    if (
        _library is None
        or k != k_w
        or not (x.dtype is _BF16 and weight.dtype is _BF16 and x.is_cpu and weight.is_cpu)
        or x.stride(1) != 1
        or weight.stride(1) != 1
        or not _few_enough(rows)
    ):
        return None
    y = torch.empty((rows, n), dtype=_BF16)
    if n:
        _library.linear_bf16(
            x.data_ptr(), 0, x.stride(0), weight.data_ptr(), 0, weight.stride(0), y.data_ptr(), 0, n, 1, rows, n, k
        )  # fmt: skip
    return y


WEIGHT_FORMATS = {"fp8": 1, "mxfp4": 2}
"""The kernels' codes of a QuantWeight's formats (quantized.h; 0: a plain bf16 weight)."""


def takes_weight(w: torch.Tensor | QuantWeight) -> bool:
    """Whether the kernels take this weight as it is: a CPU bf16 tensor with unit stride along its
    last dimension (`takes`), or a QuantWeight on the CPU, unit stride along K in its values and
    scales, in blocks of a multiple of 32 of K (DeepSeek's 128 and 32; MXFP4's 32)."""
    if not isinstance(w, QuantWeight):
        return takes(w)
    return (
        w.data.is_cpu
        and w.data.stride(-1) == 1
        and w.scale.stride(-1) == 1
        and w.block_k % 32 == 0
        and (w.fmt == "fp8" or w.shape[-1] % 32 == 0)
    )


def weight_args(w: torch.Tensor | QuantWeight | None) -> tuple[int, int, int, int, int, int]:
    """A weight [..., N, K] as the kernels take one (quantized.h QW): its data and row stride (bf16
    values, or bytes), its scales and their row stride, block_k and format (0 for bf16); None: all
    zeros (no weight)."""
    if w is None:
        return 0, 0, 0, 0, 0, 0
    if not isinstance(w, QuantWeight):
        return w.data_ptr(), w.stride(-2), 0, 0, 0, 0
    return (
        w.data.data_ptr(), w.data.stride(-2), w.scale.data_ptr(), w.scale.stride(-2), w.block_k,
        WEIGHT_FORMATS[w.fmt],
    )  # fmt: skip


def few_rows_quant_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor | None:
    """x [M, K] @ w^T -> [M, N] with w kept quantized (FP8 or MXFP4, widened as it is read), here
    where `few_rows_linear` would take a bf16 weight of the same shape and `takes_weight`; None:
    the caller takes torch's path."""
    (rows, k), (n, k_w) = x.shape, w.shape
    if (
        _library is None
        or k != k_w
        or not (x.dtype is _BF16 and x.is_cpu and x.stride(1) == 1)
        or not _few_enough(rows)
        or not takes_weight(w)
    ):
        return None
    return _quant_products(x.unsqueeze(0), w, 0, 0, n)[0]


def _quant_products(x: torch.Tensor, w: QuantWeight, w_batch: int, s_batch: int, n: int) -> torch.Tensor:
    """y[b] = x[b] @ w[b]^T through the kernels' linear_q: x [B, M, K] bf16 (unit stride along K),
    w[b] w_batch data units and s_batch scales on from w's start -> [B, M, n] bf16."""
    b, rows, k = x.shape
    y = torch.empty(b, rows, n, dtype=_BF16)
    if b and rows and n:
        _library.linear_q(
            x.data_ptr(), x.stride(0), x.stride(1), weight_args(w), w_batch, s_batch,
            y.data_ptr(), y.stride(0), y.stride(1), b, rows, n, k,
        )  # fmt: skip
    return y


def batch_strides(w: torch.Tensor | QuantWeight) -> tuple[int, int]:
    """A batched weight [B, N, K]'s strides from one product's weight to the next, in data units
    (bf16 values, or bytes) and in scales (0 for bf16)."""
    if not isinstance(w, QuantWeight):
        return w.stride(0), 0
    return w.data.stride(0), w.scale.stride(0)


def linear_heads(x: torch.Tensor, w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """x [B, M, K] @ w[b]^T per b -> [B, M, N], w [B, N, K] bf16 (linear_bf16's batched product) or
    kept quantized (FP8 or MXFP4, widened as it is read): MLA's absorbed per-head products. x bf16
    with unit stride along K; as many rows as the native products take (`_few_enough`). Requires
    `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if not isinstance(w, QuantWeight):
        return linear_bf16(x, w)
    (b, _, k), (b_w, n, k_w) = x.shape, w.shape
    if b != b_w or k != k_w:
        raise ValueError(
            f"x [B, M, K] and w [B, N, K] must share B and K, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if not (x.dtype is _BF16 and x.is_cpu and x.stride(2) == 1 and takes_weight(w)):
        raise ValueError(
            f"x must be CPU bfloat16 with unit stride along K and w a CPU QuantWeight the kernels take, "
            f"got {x.dtype} {tuple(x.stride())} on {x.device}"
        )
    return _quant_products(x, w, *batch_strides(w), n)


def use_quant_generic(on: bool) -> bool:
    """The AVX2 build's quantized products through the AVX-512 builds' code on its emulation
    (quantized.h qcolumns_512), for tests; -> the setting it replaces. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    return bool(_library.use_quant_generic(on))


def use_attend_generic(on: bool) -> bool:
    """The AVX2 build's decode attention through the AVX-512 builds' loops on its emulation
    (attention.h attend_scores / attend_output), for tests; -> the setting it replaces. The AVX-512
    builds have the one form. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    return bool(_library.use_attend_generic(on))


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """e^x of a CPU float32 tensor through the kernels' 16-lane exp (the one their softmaxes and
    SiLUs use; within 2 ulp of std::exp, exactly 0 below -104). Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be CPU float32, got {x.dtype} on {x.device}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _library.exp_f32(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def dot_bf16_lanes(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The kernels' VDPBF16PS step (common.h dot_bf16; emulated where the build lacks the
    instruction), lane by lane: acc [16n] float32, a and b [32n] bf16 -> acc[i] + a[2i + 1]
    b[2i + 1] + a[2i] b[2i] in the instruction's roundings. For tests. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    n = acc.numel()
    if not (acc.dtype == torch.float32 and a.dtype == b.dtype == _BF16 and n % 16 == 0):
        raise ValueError("acc must be float32 of a multiple of 16 lanes, a and b bf16")
    if a.numel() != 2 * n or b.numel() != 2 * n:
        raise ValueError(f"a and b must hold 2 * {n} values, got {a.numel()} and {b.numel()}")
    out, a, b = acc.contiguous().clone(), a.contiguous(), b.contiguous()
    _library.dot_bf16_lanes(out.data_ptr(), a.data_ptr(), b.data_ptr(), n)
    return out


def narrow_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as the kernels round (common.h narrow16: VCVTNEPS2BF16 or its emulation;
    denormals become signed zeros). For tests. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if x.dtype != torch.float32 or x.numel() % 16:
        raise ValueError("x must be float32 of a multiple of 16 values")
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=_BF16)
    _library.narrow_f32(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def argmax_bf16(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] CPU bf16 (unit stride along V) -> each row's index of its largest value, int64
    [R]: torch.max(dim=-1)'s, the first of equal ones and a NaN counting as largest. Requires
    `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if x.dim() != 2 or not takes(x):
        raise ValueError(
            f"x must be [R, V] CPU bfloat16 with unit stride along V, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0] and x.shape[1]:
        _library.argmax_bf16(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    elif x.shape[0]:
        raise ValueError("x must have at least one column")
    return out


def linear_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]; or batched, x [B, M, K] and weight [B, N, K] -> [B, M, N]
    (y[b] = x[b] @ weight[b]^T). bf16 in and out, unit stride along K, float32 sums rounded to
    nearest even. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if x.dim() == 2 and weight.dim() == 2 and (y := few_rows_linear(x, weight)) is not None:
        return y
    batched = x.dim() == 3
    if x.dim() not in (2, 3) or weight.dim() != x.dim() or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"x [M, K] and weight [N, K] (or [B, M, K] and [B, N, K]) must share B and K, "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if batched and x.shape[0] != weight.shape[0]:
        raise ValueError(
            f"x [B, M, K] and weight [B, N, K] must share B, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not takes(x, weight):
        raise ValueError(
            f"x and weight must be CPU bfloat16 with unit stride along K, got {x.dtype} {tuple(x.stride())} "
            f"on {x.device} and {weight.dtype} {tuple(weight.stride())} on {weight.device}"
        )
    x3 = x if batched else x.unsqueeze(0)  # [B, M, K]
    w3 = weight if batched else weight.unsqueeze(0)  # [B, N, K]
    b, rows, k = x3.shape
    n = w3.shape[1]
    y = torch.empty(b, rows, n, dtype=torch.bfloat16)  # [B, M, N]
    if b and rows and n:
        _library.linear_bf16(
            x3.data_ptr(), x3.stride(0), x3.stride(1),
            w3.data_ptr(), w3.stride(0), w3.stride(1),
            y.data_ptr(), y.stride(0), y.stride(1),
            b, rows, n, k,
        )  # fmt: skip
    return y if batched else y.squeeze(0)


def _check_latent(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, rows: str) -> None:
    """q [rows, H, L+R] against the latent cache [blocks, block_size, L+R] (bf16, contiguous)."""
    width = q.shape[-1]
    if kv_cache.shape[-1] != width or not 0 < kv_lora_rank <= width:
        raise ValueError(
            f"q [{rows}, H, L+R] and kv_cache [blocks, block_size, L+R] must share L+R > L={kv_lora_rank}, "
            f"got {tuple(q.shape)} and {tuple(kv_cache.shape)}"
        )
    if not (takes(q, kv_cache) and kv_cache.is_contiguous()):
        raise ValueError("q and kv_cache must be CPU bfloat16, the cache contiguous")


def _check_tables(block_table: torch.Tensor, lens: torch.Tensor, n: int, rows: str, lens_name: str) -> None:
    """Per-row block tables [n, max_blocks] and context lengths [n], both int32."""
    if block_table.dtype != torch.int32 or lens.dtype != torch.int32 or block_table.shape[0] != n:
        raise ValueError(
            f"block_table [{rows}={n}, max_blocks] and {lens_name} [{rows}] must be int32, got "
            f"{tuple(block_table.shape)} {block_table.dtype} and {tuple(lens.shape)} {lens.dtype}"
        )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One query token per sequence: q [B, H, L+R], kv_cache [num_blocks, block_size, L+R] (CPU
    bf16), block_table [B, max_blocks] int32, seq_lens [B] int32 -> o [B, H, L] bf16, the math of
    kernels/mla.py with _mla_decode_fast's roundings, the cache read in place. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    batch, heads, width = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    _check_latent(q, kv_cache, kv_lora_rank, "B")
    _check_tables(block_table, seq_lens, batch, "B", "seq_lens")
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()
    o = torch.empty(batch, heads, kv_lora_rank, dtype=torch.bfloat16)
    if batch and heads:
        bad = _library.mla_decode(
            q.data_ptr(), q.stride(0), q.stride(1),
            kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), num_blocks, block_size,
            block_table.data_ptr(), block_table.stride(0), block_table.shape[1],
            seq_lens.data_ptr(), o.data_ptr(), o.stride(0), o.stride(1),
            batch, heads, width, kv_lora_rank, scale,
        )  # fmt: skip
        if bad:
            raise ValueError(f"block_table holds {bad} block ids outside [0, {num_blocks})")
    return o


def takes_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether extend_attention takes these operands: loaded, CPU bf16 with unit stride along the
    head size, v's a multiple of 16."""
    return _library is not None and takes(q, k, v) and v.shape[-1] % 16 == 0


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk's causal attention, kernels/attention.py extend_attention without the LSE:
    q [n, H, Dqk] (positions ctx - n .. ctx - 1), k [ctx, H, Dqk], v [ctx, H, Dv] (CPU bf16, unit
    stride along the last dimension, Dv a multiple of 16) -> o [n, H, Dv] bf16. Float32 inside;
    a query's bits are the same in any chunking of its prompt (extend.h). Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    n, heads, d_qk, ctx, d_v = check_extend(q, k, v)
    if not takes_extend(q, k, v):
        raise ValueError(
            f"q, k, v must be CPU bf16 with unit stride along the last dimension and Dv a multiple of 16, "
            f"got {q.dtype}/{k.dtype}/{v.dtype}, Dv={d_v}"
        )
    o = torch.empty(n, heads, d_v, dtype=torch.bfloat16)
    if n and heads:
        _library.extend_attention(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), o.data_ptr(), o.stride(0), o.stride(1),
            n, ctx, heads, d_qk, d_v, scale,
        )  # fmt: skip
    return o


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's indexer for T query tokens: q [T, nI, dI] bf16 (unit stride along dI),
    weights [T, nI] float32, key_cache [num_blocks, block_size, dI] bf16 (contiguous), block_table
    [T, max_blocks] int32 and lens [T] int32 (token t sees its first lens[t] keys) -> slots
    [T, topk] int64: the cache slots of its best min(topk, lens[t]) keys (any order), -1 after
    them; kernels/sparse_mla.py's scores in float32. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    tokens, heads, dim = q.shape
    num_blocks, block_size, key_dim = key_cache.shape
    if key_dim != dim or weights.shape != (tokens, heads) or weights.dtype != torch.float32:
        raise ValueError(
            f"q [T, nI, dI], weights [T, nI] float32 and key_cache [blocks, block_size, dI] must agree, got "
            f"{tuple(q.shape)}, {tuple(weights.shape)} {weights.dtype} and {tuple(key_cache.shape)}"
        )
    _check_tables(block_table, lens, tokens, "T", "lens")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if not (takes(q, key_cache) and key_cache.is_contiguous()):
        raise ValueError("q and key_cache must be CPU bfloat16, the cache contiguous")
    weights, block_table, lens = weights.contiguous(), block_table.contiguous(), lens.contiguous()
    out = torch.empty(tokens, topk, dtype=torch.long)
    if tokens:
        bad = _library.indexer_topk(
            q.data_ptr(), q.stride(0), q.stride(1), weights.data_ptr(), weights.stride(0),
            key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1), num_blocks, block_size,
            block_table.data_ptr(), block_table.stride(0), block_table.shape[1], lens.data_ptr(),
            out.data_ptr(), out.stride(0), tokens, heads, dim, topk, scale,
        )  # fmt: skip
        if bad:
            raise ValueError(f"block_table holds {bad} block ids outside [0, {num_blocks})")
    return out


def sparse_mla_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """MLA decode attention over chosen cache rows: q [T, H, L+R] bf16, kv_cache [num_blocks,
    block_size, L+R] bf16 (contiguous), slots [T, K] int64 (block * block_size + row; -1: none)
    -> o [T, H, L] bf16, mla_decode's math and roundings over each token's chosen rows (zeros
    where it has none). Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    tokens, heads, width = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    _check_latent(q, kv_cache, kv_lora_rank, "T")
    if slots.dtype != torch.long or slots.dim() != 2 or slots.shape[0] != tokens:
        raise ValueError(f"slots must be int64 [T={tokens}, K], got {tuple(slots.shape)} {slots.dtype}")
    slots = slots.contiguous()
    o = torch.empty(tokens, heads, kv_lora_rank, dtype=torch.bfloat16)
    if tokens and heads:
        bad = _library.sparse_mla_decode(
            q.data_ptr(), q.stride(0), q.stride(1),
            kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), num_blocks, block_size,
            slots.data_ptr(), slots.stride(0), slots.shape[1], o.data_ptr(), o.stride(0), o.stride(1),
            tokens, heads, width, kv_lora_rank, scale,
        )  # fmt: skip
        if bad:
            raise ValueError(f"slots holds {bad} entries outside the cache's {num_blocks * block_size} slots")
    return o


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] bf16 (unit stride along D), weight [D] bf16, residual like x or None -> y [M, D],
    or (y, x + residual): kernels/norm.py's rms_norm with its roundings. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    rows, dim = x.shape
    if weight.shape != (dim,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"weight must be [D={dim}] and residual like x {tuple(x.shape)}, got {tuple(weight.shape)} "
            f"and {None if residual is None else tuple(residual.shape)}"
        )
    if not takes(x, weight, residual):
        raise ValueError("x, weight and residual must be CPU bfloat16 with unit stride along D")
    weight = weight.contiguous()
    y = torch.empty(rows, dim, dtype=torch.bfloat16)
    summed = torch.empty(rows, dim, dtype=torch.bfloat16) if residual is not None else None
    if rows and dim:
        _library.rms_norm(
            x.data_ptr(), x.stride(0),
            residual.data_ptr() if residual is not None else 0, residual.stride(0) if residual is not None else 0,
            weight.data_ptr(), y.data_ptr(), y.stride(0),
            summed.data_ptr() if summed is not None else 0, dim,
            rows, dim, eps,
        )  # fmt: skip
    return y if summed is None else (y, summed)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, D] bf16 (unit stride along D), weight and bias [D] bf16 -> LayerNorm(x) [M, D] bf16,
    in float32 (layer.h layer_norm: within one bf16 rounding of torch's float32 layer_norm).
    Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    if x.dim() != 2 or weight.shape != (x.shape[1],) or bias.shape != weight.shape:
        raise ValueError(
            f"x must be [M, D] with weight and bias [D], got {tuple(x.shape)}, {tuple(weight.shape)} "
            f"and {tuple(bias.shape)}"
        )
    if not takes(x, weight, bias):
        raise ValueError("x, weight and bias must be CPU bfloat16 with unit stride along D")
    rows, dim = x.shape
    weight, bias = weight.contiguous(), bias.contiguous()
    y = torch.empty(rows, dim, dtype=_BF16)
    if rows and dim:
        _library.layer_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), dim, rows, dim, eps
        )  # fmt: skip
    return y


def v4_attention(
    q: torch.Tensor,
    window: torch.Tensor,
    wslots: torch.Tensor,
    entries: torch.Tensor | None,
    eslots: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """DeepSeek-V4 attention in one call: q [T, H, D] bf16, each token over the rows `wslots` [T,
    Kw] int64 of the window cache (any [..., D] bf16 tensor, contiguous, read as rows) and
    `eslots` [T, Kc] of the entries cache (None: none), -1 for none, K = V, with a sink logit per
    head (sinks [H] float32) -> [T, H, D] bf16 (kernels/native/v4.h has the roundings). Requires
    `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    t, h, d = q.shape
    caches = [window] + ([entries] if entries is not None else [])
    if any(c.shape[-1] != d or not c.is_contiguous() for c in caches) or sinks.shape != (h,):
        raise ValueError(
            f"the caches must be contiguous rows of D={d} and sinks [H={h}], got "
            f"{[tuple(c.shape) for c in caches]} and {tuple(sinks.shape)}"
        )
    slots = [wslots] + ([eslots] if entries is not None else [])
    if any(sl.dim() != 2 or sl.shape[0] != t or sl.dtype != torch.int64 for sl in slots):
        raise ValueError(
            f"the slots must be [T={t}, K] int64, got {[(tuple(sl.shape), sl.dtype) for sl in slots]}"
        )
    if not takes(q, *caches):
        raise ValueError("q and the caches must be CPU bfloat16 with unit stride along D")
    wslots = wslots.contiguous()
    eslots = eslots.contiguous() if entries is not None else wslots
    sinks = sinks.float().contiguous()
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    if t:
        bad = _library.v4_attention(
            q.data_ptr(), q.stride(0), q.stride(1), window.data_ptr(), window.numel() // d,
            entries.data_ptr() if entries is not None else 0, entries.numel() // d if entries is not None else 0,
            wslots.data_ptr(), wslots.stride(0), wslots.shape[1], eslots.data_ptr(), eslots.stride(0),
            eslots.shape[1] if entries is not None else 0, sinks.data_ptr(), out.data_ptr(), out.stride(0),
            out.stride(1), t, h, d, scale,
        )  # fmt: skip
        if bad:
            raise ValueError(f"{bad} slots lie outside their cache")
    return out


def compress_pool(kv: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's compressor pooling in one call: kv, gate [E, S, W] float32 (-inf gates: empty
    slots), weight [W] -> [E, W] float32 (kernels/v4.py compress_pool_ref's, in float32, to the
    order of its sums). Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    e, s, w = kv.shape
    if gate.shape != kv.shape or weight.shape != (w,):
        raise ValueError(
            f"gate must be like kv {tuple(kv.shape)} and weight [{w}], got {tuple(gate.shape)}, {tuple(weight.shape)}"
        )
    if any(t.dtype != torch.float32 or not t.is_cpu for t in (kv, gate, weight)):
        raise ValueError("kv, gate and weight must be CPU float32")
    kv, gate, weight = kv.contiguous(), gate.contiguous(), weight.contiguous()
    out = torch.empty(e, w, dtype=torch.float32)
    if e:
        _library.compress_pool(
            kv.data_ptr(), gate.data_ptr(), weight.data_ptr(), out.data_ptr(), e, s, w, eps
        )
    return out


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hyper-connection weights and block input in one call: streams [N, hc, H] bf16
    (each token's streams contiguous), fn [(2 + hc) hc, hc H], base [(2 + hc) hc], scale [3] float32
    -> (post [N, hc], comb [N, hc, hc] float32, u [N, H] bf16): engine/models/deepseek_v4.py
    HyperConnection's, to a bf16 rounding of u. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    n, hc, h = streams.shape
    k = (2 + hc) * hc
    if fn.shape != (k, hc * h) or base.shape != (k,) or scale.shape != (3,):
        raise ValueError(
            f"fn must be [{k}, {hc * h}], base [{k}] and scale [3] for streams {tuple(streams.shape)}, got "
            f"{tuple(fn.shape)}, {tuple(base.shape)} and {tuple(scale.shape)}"
        )
    if not takes(streams) or streams[0].numel() and not streams[0].is_contiguous():
        raise ValueError("streams must be CPU bfloat16, each token's [hc, H] contiguous")
    fn, base, scale = (t.float().contiguous() for t in (fn, base, scale))
    post = torch.empty(n, hc, dtype=torch.float32)
    comb = torch.empty(n, hc, hc, dtype=torch.float32)
    u = torch.empty(n, h, dtype=torch.bfloat16)
    if n:
        _library.hc_pre(
            streams.data_ptr(), streams.stride(0), fn.data_ptr(), base.data_ptr(), scale.data_ptr(),
            post.data_ptr(), comb.data_ptr(), u.data_ptr(), h, n, hc, h, iters, eps, norm_eps,
        )  # fmt: skip
    return post, comb, u


def hc_merge(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: streams [N, hc, H] bf16 (each token's contiguous), post [N, hc],
    comb [N, hc, hc] float32 (hc_pre's), out [N, H] bf16 (the block's output) -> [N, hc, H] bf16,
    post_j out + sum_i comb[i, j] streams_i in HyperConnection.merge's roundings. Requires `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    n, hc, h = streams.shape
    if post.shape != (n, hc) or comb.shape != (n, hc, hc) or out.shape != (n, h):
        raise ValueError(
            f"post must be [{n}, {hc}], comb [{n}, {hc}, {hc}] and out [{n}, {h}], got {tuple(post.shape)}, "
            f"{tuple(comb.shape)} and {tuple(out.shape)}"
        )
    if not takes(streams, out) or streams[0].numel() and not streams[0].is_contiguous():
        raise ValueError("streams and out must be CPU bfloat16, each token's streams contiguous")
    post, comb = post.float().contiguous(), comb.float().contiguous()
    y = torch.empty(n, hc, h, dtype=torch.bfloat16)
    if n:
        _library.hc_merge(
            streams.data_ptr(), streams.stride(0), post.data_ptr(), comb.data_ptr(), out.data_ptr(), out.stride(0),
            y.data_ptr(), n, hc, h,
        )  # fmt: skip
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [N, R] or [N, G, R] bf16 (unit stride along R), cos/sin [N, R/2] float32 -> a new tensor
    shaped as x, contiguous: kernels/rotary.py's apply_rotary_ref with its roundings. Requires
    `loaded()`."""
    assert _library is not None, "kernels.native.load() first"
    x3 = x.unsqueeze(1) if x.dim() == 2 else x  # [N, G, R]
    if (
        x3.dim() != 3
        or x3.shape[-1] % 2
        or cos.shape != (x3.shape[0], x3.shape[-1] // 2)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"x must be [N, R] or [N, G, R] with R even and cos/sin [N, R/2], got {tuple(x.shape)}, "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.device.type != "cpu":
        raise ValueError(
            f"x must be CPU bfloat16 with unit stride along R, got {x.dtype} {tuple(x.stride())}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    cos, sin = cos.contiguous(), sin.contiguous()
    n, g, r = x3.shape
    out = torch.empty(n, g, r, dtype=torch.bfloat16)
    if out.numel():
        _library.rotary(
            x3.data_ptr(), x3.stride(0), x3.stride(1), cos.data_ptr(), sin.data_ptr(), r // 2,
            out.data_ptr(), n, g, r, interleaved,
        )  # fmt: skip
    return out.view(x.shape)


def mtp_input(
    ids: torch.Tensor,
    embed: torch.Tensor,
    hidden: torch.Tensor,
    norms: tuple[torch.Tensor, float, torch.Tensor, float],
    eh_proj: torch.Tensor,
) -> torch.Tensor | None:
    """The MTP layer's input in one call: ids [M] int64 (t_{i+1}), embed [V, H], hidden [M, H] (h_i),
    norms (enorm's weight [H] and eps, hnorm's) and eh_proj [H, 2H] (bf16) -> eh_proj([enorm(embed[ids]);
    hnorm(hidden)]) [M, H] bf16, the bits of those calls one by one (engine/models/mtp.py). None
    (the caller runs them) unless loaded and the product is few rows through eh_proj (`takes_rows`)."""
    rows, dim = hidden.shape
    enorm, e_eps, hnorm, h_eps = norms
    if (
        _library is None
        or not _few_enough(rows)
        or not takes(embed, hidden, enorm, hnorm, eh_proj)
        or ids.dtype != torch.int64
    ):
        return None
    if (
        ids.shape != (rows,)
        or embed.shape[1] != dim
        or enorm.shape != (dim,)
        or hnorm.shape != (dim,)
        or eh_proj.shape != (dim, 2 * dim)
    ):
        raise ValueError(
            f"ids [M={rows}], embed [V, H={dim}], the norms [H] and eh_proj [H, 2H] must match hidden "
            f"[M, H], got {tuple(ids.shape)}, {tuple(embed.shape)}, {tuple(enorm.shape)}, "
            f"{tuple(hnorm.shape)} and {tuple(eh_proj.shape)}"
        )
    ids, enorm, hnorm, eh_proj = (t.contiguous() for t in (ids, enorm, hnorm, eh_proj))
    y = torch.empty(rows, dim, dtype=_BF16)
    if rows:
        bad = _library.mtp_input(
            ids.data_ptr(), embed.data_ptr(), embed.stride(0), embed.shape[0],
            hidden.data_ptr(), hidden.stride(0), enorm.data_ptr(), e_eps, hnorm.data_ptr(), h_eps,
            eh_proj.data_ptr(), y.data_ptr(), rows, dim,
        )  # fmt: skip
        if bad:
            raise ValueError(f"{bad} token ids lie outside [0, {embed.shape[0]})")
    return y


# The calls that take a whole block of a layer (its attention, its routing, its experts).
from kernels.native.blocks import (  # noqa: E402, F401
    DecodeStack,
    IndexerWeights,
    MLAWeights,
    MoEWeights,
    MTPDrafter,
    StackLayer,
    decode_stack,
    greedy_spec_step,
    mla_attention,
    moe_block,
    moe_pairs,
    moe_topk,
    route,
)
