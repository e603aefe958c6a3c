"""The Triton kernels on one CUDA GPU in bfloat16: correctness against PyTorch, then speed.

One prepared run for a lent H200 (a few minutes, no autotuning):

1. every Triton kernel (impl="triton") against its PyTorch reference on representative shapes,
   PASS/FAIL per case; a failure or an exception is recorded and the run goes on;
2. timings with triton.testing.do_bench (median, L2 flushed between runs):
   mla_decode at B in {1, 8, 64, 256}, context 4096, H in {16, 128}, L+R = 512+64, block 64,
   in ms and GB/s against HBM; fused_moe with DeepSeek-V3's experts (H 7168, I 2048, 256
   experts, top 8) in TFLOP/s against the bf16 peak; extend_attention at n = ctx = 4096; the
   block-FP8 GEMM (w8a8) at V3's o_proj shape and the fused MoE with FP8 and MXFP4 experts at V3's
   expert shape; each beside the PyTorch path's (or the bf16 kernel's) time;
3. everything (hardware, date, git revision, per-case max error and verdict, timings) to
   benchmarks/results/kernels_gpu_<hardware>_<date>.json (or --out), and a compact table.

Goals printed beside the numbers: mla_decode >= 60% of HBM bandwidth at B >= 64, fused_moe >= 50%
of the bf16 peak at M >= 1024. "%roof" is the time a perfect kernel would need (bytes / bandwidth
or flops / peak, whichever is larger) over the measured time; where that roofline alone caps a
goal's metric below its threshold, a note says so.

    python3 benchmarks/kernels_gpu.py --out "$OUT/"       # on the lent GPU machine (repo root)
    python benchmarks/kernels_gpu.py --smoke --out /tmp/  # tiny shapes, CPU, Triton interpreter

On the lent machine only what lands under $OUT comes back, hence --out "$OUT/" there (a folder
gets the usual kernels_gpu_<hardware>_<date>.json name); copy the file into benchmarks/results/.
It runs under that machine's own python3, torch and triton (no installs). --only picks families
for a rerun of part of it.

--smoke runs the same code on CPU under the Triton interpreter with tiny shapes and times with
time.perf_counter (its numbers mean nothing). Exit status: 0 when every check passed and nothing
raised, 1 otherwise, 2 when there is no GPU and --smoke was not given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:  # must precede the first import of triton (and of any kernel)
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.common import git_revision, hardware, hardware_slug, save  # noqa: E402
from kernels import v4 as v4k  # noqa: E402
from kernels.attention import extend_attention, extend_attention_ref, merge_attn_states  # noqa: E402
from kernels.gate import grouped_topk  # noqa: E402
from kernels.kv_store import store_kv  # noqa: E402
from kernels.mla import BLOCK_M as MLA_BLOCK_M  # noqa: E402
from kernels.mla import default_num_splits, mla_decode, mla_decode_ref  # noqa: E402
from kernels.moe import fused_moe, fused_moe_quant_ref, fused_moe_quant_triton, fused_moe_ref  # noqa: E402
from kernels.norm import rms_norm  # noqa: E402
from kernels.quant import QuantWeight, act_quant, act_quant_ref, w8a8_linear, w8a8_linear_ref  # noqa: E402
from kernels.rotary import apply_rotary, apply_rotary_ref  # noqa: E402

NAME = "kernels_gpu"
HBM_GBS = 4800.0  # H200 HBM3e datasheet, GB/s
BF16_TFLOPS = 790.0  # an 8192^3 bf16 torch matmul measured on an H200 (datasheet dense: ~990)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # fp32 arithmetic, one rounding to bf16 vs the reference's
LSE_TOL = dict(atol=1e-3, rtol=1e-3)  # the LSE stays float32
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)


@dataclass(frozen=True)
class Goal:
    metric: str  # "pct_hbm" or "pct_peak"
    threshold: float  # percent
    param: str  # applies where params[param] >= least
    least: int

    def applies(self, params: dict) -> bool:
        return params.get(self.param, -1) >= self.least

    def label(self) -> str:
        what = "HBM" if self.metric == "pct_hbm" else "peak"
        return f">={self.threshold:.0f}% {what} at {self.param}>={self.least}"


# --- shapes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    # mla_decode: latent L, rotary R, cache block size
    lat: int
    rope: int
    block: int
    mla_checks: tuple  # (case, seq_lens, heads, s_q, num_splits or None for the default)
    mla_batches: tuple
    mla_ctx: int
    mla_heads: tuple
    mla_ref_cap: int  # time the float32 reference (with LSE) only while B * ctx <= this
    # fused_moe (and the router): DeepSeek-V3's routed experts
    hidden: int
    inter: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    moe_checks: tuple  # (tokens, fraction of pairs routed to -1, i.e. to another rank)
    moe_tokens: tuple
    # extend_attention: (n, ctx, heads, d_qk, d_v)
    ext_checks: tuple
    ext_times: tuple
    ext_ref_cap: int  # time the float32 reference only while H * n * ctx <= this
    # the small kernels
    tokens: int
    rot_heads: int
    # calibration: a square bf16 matmul and a device-to-device copy
    gemm: int
    copy_mib: int
    # the goals apply from this batch (mla_decode) and this many tokens (fused_moe)
    mla_goal_batch: int
    moe_goal_tokens: int

    def goals(self) -> dict[str, Goal]:
        return {
            "mla_decode": Goal("pct_hbm", 60.0, "batch", self.mla_goal_batch),
            "fused_moe": Goal("pct_peak", 50.0, "tokens", self.moe_goal_tokens),
        }


GPU = Shapes(
    lat=512,
    rope=64,
    block=64,
    mla_checks=(
        ("B8-H128-mixed", (0, 1, 63, 64, 65, 1000, 2049, 4096), 128, 1, None),
        ("B4-H16-sq2-mtp", (1, 130, 2048, 4000), 16, 2, None),
        ("B3-H128-1split", (5, 777, 4096), 128, 1, 1),
    ),
    mla_batches=(1, 8, 64, 256),
    mla_ctx=4096,
    mla_heads=(16, 128),
    mla_ref_cap=64 * 4096,
    hidden=7168,
    inter=2048,
    experts=256,
    top_k=8,
    n_group=8,
    topk_group=4,
    moe_checks=((3, 0.0), (1024, 0.1)),
    moe_tokens=(1, 16, 128, 1024, 8192),  # 8192: ~256 tokens per expert, past the roofline ridge
    ext_checks=((300, 1000, 16, 192, 128), (512, 512, 128, 192, 128)),
    ext_times=((4096, 4096, 16, 192, 128), (4096, 4096, 128, 192, 128)),
    ext_ref_cap=16 * 4096 * 4096,
    tokens=1024,
    rot_heads=128,
    gemm=8192,
    copy_mib=2048,
    mla_goal_batch=64,
    moe_goal_tokens=1024,
)

SMOKE_SHAPES = Shapes(
    lat=32,
    rope=16,
    block=16,
    mla_checks=(("B3-H4-mixed", (0, 5, 33), 4, 1, None), ("B2-H3-sq2-2split", (1, 40), 3, 2, 2)),
    mla_batches=(1, 2),
    mla_ctx=32,
    mla_heads=(4,),
    mla_ref_cap=32,  # B=2 is skipped: exercises the skip
    hidden=64,
    inter=32,
    experts=8,
    top_k=2,
    n_group=4,
    topk_group=2,
    moe_checks=((3, 0.0), (12, 0.2)),  # 12 > 8 experts: the 64-row block configuration
    moe_tokens=(1, 12),
    ext_checks=((5, 9, 2, 24, 16),),
    ext_times=((8, 8, 2, 24, 16),),
    ext_ref_cap=2 * 8 * 8,
    tokens=6,
    rot_heads=3,
    gemm=64,
    copy_mib=1,
    mla_goal_batch=2,  # the goal logic runs on tiny shapes too (its verdict is n/a there)
    moe_goal_tokens=12,
)


# --- the harness ------------------------------------------------------------------------------------


@dataclass
class Cmp:
    """One output of one check: its max abs error and whether it is within tolerance."""

    name: str
    max_abs_err: float
    ok: bool
    tol: str


def close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> Cmp:
    """|got - ref| <= atol + rtol |ref| elementwise; equal infinities agree, NaN never does."""
    if got.shape != ref.shape:
        return Cmp(name, math.inf, False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    got, ref = got.double(), ref.double()
    diff = torch.where(got == ref, 0.0, (got - ref).abs()).nan_to_num(nan=math.inf)
    bound = torch.where(ref.isfinite(), atol + rtol * ref.abs(), 0.0)
    err = float(diff.max()) if diff.numel() else 0.0
    return Cmp(name, err, bool((diff <= bound).all()), f"atol={atol:g} rtol={rtol:g}")


def _num(x):
    """JSON-safe: non-finite floats become strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _num(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_num(v) for v in x]
    return x


class Run:
    """Shared state: device, dtype, timing method, and what every check and timing recorded."""

    def __init__(self, args: argparse.Namespace, shapes: Shapes) -> None:
        self.smoke = args.smoke
        self.goals = shapes.goals()
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.bfloat16
        self.rep, self.ref_rep = args.rep, args.ref_rep
        self.hbm_gbs, self.peak_tflops = args.hbm_gbs, args.peak_tflops
        self.checks: list[dict] = []
        self.timings: list[dict] = []
        self.errors: list[dict] = []
        self.notes: list[str] = []
        self.calibration: dict = {}

    # tensors
    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape, g: torch.Generator, std: float = 1.0, dtype=None) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        return out.normal_(0.0, std, generator=g)

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001 - after a device fault; the fault itself is recorded
                pass

    def error(self, kernel: str, case: str, stage: str, exc: BaseException) -> str:
        msg = f"{type(exc).__name__}: {exc}".strip()[:500]
        self.errors.append(
            {
                "kernel": kernel,
                "case": case,
                "stage": stage,
                "error": msg,
                "trace": traceback.format_exc()[-2000:],
            }
        )
        print(f"ERROR {kernel:<18} {case:<22} {stage}: {msg.splitlines()[0] if msg else ''}", flush=True)
        self.free()
        return msg

    # 1. correctness
    def check(self, kernel: str, case: str, compute: Callable[[], list[Cmp]]) -> None:
        start = time.perf_counter()
        record = {"kernel": kernel, "case": case, "pass": False, "max_abs_err": None, "outputs": {}}
        try:
            cmps = compute()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            record["outputs"] = {
                c.name: {"max_abs_err": c.max_abs_err, "pass": c.ok, "tol": c.tol} for c in cmps
            }
            record["max_abs_err"] = max((c.max_abs_err for c in cmps), default=0.0)
            record["pass"] = bool(cmps) and all(c.ok for c in cmps)
            detail = "  ".join(f"{c.name} {c.max_abs_err:.2e}{'' if c.ok else '!'}" for c in cmps)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            record["error"] = detail = self.error(kernel, case, "check", exc)
        record["seconds"] = round(time.perf_counter() - start, 3)
        self.checks.append(record)
        verdict = "PASS" if record["pass"] else "FAIL"
        print(f"{verdict}  {kernel:<18} {case:<22} {detail}", flush=True)

    # 2. speed
    def ms(self, fn: Callable[[], object], rep: int) -> float:
        """Median milliseconds per call: do_bench on CUDA, one perf_counter call under --smoke."""
        if self.smoke:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return float(triton.testing.do_bench(fn, warmup=max(1, rep // 4), rep=rep, return_mode="median"))

    def time(
        self,
        kernel: str,
        case: str,
        params: dict,
        triton_fn: Callable[[], object],
        baselines: dict[str, Callable[[], object] | str],
        bytes_: float,
        flops: float,
    ) -> None:
        """Times the Triton path and each PyTorch baseline (a string instead of a function says why
        that baseline is skipped), and derives GB/s, TFLOP/s, the roofline and the goal."""
        row = {"kernel": kernel, "case": case, "params": params, "bytes": bytes_, "flops": flops}
        try:
            row["triton_ms"] = ms = self.ms(triton_fn, self.rep)
        except Exception as exc:  # noqa: BLE001
            row["error"] = self.error(kernel, case, "time triton", exc)
            self.timings.append(row)
            return
        row["baselines"], row["skipped"] = {}, {}
        for name, fn in baselines.items():
            if isinstance(fn, str):
                row["skipped"][name] = fn
                continue
            try:
                row["baselines"][name] = self.ms(fn, self.ref_rep)
            except Exception as exc:  # noqa: BLE001 - a baseline that fails (e.g. OOM) is skipped
                row["skipped"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                self.free()
        bw, peak = self.hbm_gbs * 1e6, self.peak_tflops * 1e9  # bytes and flops per ms
        bound_ms = max(bytes_ / bw, flops / peak)
        row.update(
            gb_s=bytes_ / ms / 1e6,
            tflops=flops / ms / 1e9,
            pct_hbm=100 * bytes_ / bw / ms,
            pct_peak=100 * flops / peak / ms,
            pct_roofline=100 * bound_ms / ms,
            # the most a kernel at the roofline could reach of each:
            roof_pct_hbm=100 * bytes_ / bw / bound_ms,
            roof_pct_peak=100 * flops / peak / bound_ms,
        )
        goal = self.goals.get(kernel)
        if goal and goal.applies(params):
            row["goal"] = goal.label()
            row["goal_met"] = None if self.smoke else bool(row[goal.metric] >= goal.threshold)
            roof_cap = row["roof_" + goal.metric]
            if roof_cap < goal.threshold:
                self.notes.append(
                    f"{kernel} {case}: the roofline alone caps {goal.metric} at {roof_cap:.0f}% "
                    f"(intensity {flops / bytes_:.0f} flop/B, ridge {peak / bw:.0f}), below the goal's "
                    f"{goal.threshold:.0f}%"
                )
        self.timings.append(row)
        base = "  ".join(f"{k} {v:.3f} ms" for k, v in row["baselines"].items())
        print(f"TIME  {kernel:<18} {case:<22} triton {ms:.3f} ms  {base}", flush=True)


# --- inputs ------------------------------------------------------------------------------------------


def mla_cache(run: Run, s: Shapes, seq_lens, seed: int):
    """-> (kv_cache [blocks, bs, L+R], block_table [B, max_blocks] int32 over shuffled blocks,
    seq_lens [B] int32). A sequence owns ceil(len / bs) blocks; table padding points at block 0."""
    g = run.gen(seed)
    per_seq = [max(1, math.ceil(n / s.block)) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    kv_cache = run.randn(num_blocks, s.block, s.lat + s.rope, g=g)
    perm = torch.randperm(num_blocks, generator=g, device=run.device).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=run.device)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb]
        used += nb
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=run.device)
    return kv_cache, table, lens


def moe_weights(run: Run, s: Shapes, seed: int):
    """-> (w13 [E, 2I, H], w2 [E, H, I]) scaled so activations stay O(1)."""
    g = run.gen(seed)
    w13 = run.randn(s.experts, 2 * s.inter, s.hidden, g=g, std=s.hidden**-0.5)
    w2 = run.randn(s.experts, s.hidden, s.inter, g=g, std=s.inter**-0.5)
    return w13, w2


def moe_routing(run: Run, s: Shapes, tokens: int, off_rank: float, seed: int):
    """-> (x [M, H], topk_weights [M, K] float32, topk_ids [M, K] int64): K distinct experts per
    token drawn uniformly, a fraction off_rank of the pairs routed to -1."""
    g = run.gen(seed)
    x = run.randn(tokens, s.hidden, g=g)
    ids = torch.rand(tokens, s.experts, generator=g, device=run.device).topk(s.top_k, dim=-1).indices
    if off_rank:
        ids = ids.masked_fill(torch.rand(ids.shape, generator=g, device=run.device) < off_rank, -1)
    weights = torch.randn(tokens, s.top_k, generator=g, device=run.device).softmax(dim=-1)
    return x, weights, ids


def extend_inputs(run: Run, n: int, ctx: int, heads: int, d_qk: int, d_v: int, seed: int):
    g = run.gen(seed)
    return run.randn(n, heads, d_qk, g=g), run.randn(ctx, heads, d_qk, g=g), run.randn(ctx, heads, d_v, g=g)


# --- kernel families ---------------------------------------------------------------------------------


def bench_mla(run: Run, s: Shapes) -> None:
    scale = (128 + s.rope) ** -0.5  # DeepSeek's q head dim: nope 128 + rope 64

    for case, lens, heads, s_q, splits in s.mla_checks:

        def compute(lens=lens, heads=heads, s_q=s_q, splits=splits) -> list[Cmp]:
            kv, table, seq_lens = mla_cache(run, s, lens, seed=1)
            q = run.randn(len(lens), s_q, heads, s.lat + s.rope, g=run.gen(2))
            args = (q, kv, table, seq_lens, scale, s.lat)
            o, lse = mla_decode(*args, impl="triton", num_splits=splits)
            o_ref, lse_ref = mla_decode_ref(*args)
            return [close("o", o, o_ref, **BF16_TOL), close("lse", lse, lse_ref, **LSE_TOL)]

        run.check("mla_decode", case, compute)

    num_sms = torch.cuda.get_device_properties(run.device).multi_processor_count if not run.smoke else 1
    width, ctx = s.lat + s.rope, s.mla_ctx
    for batch in s.mla_batches:
        try:
            kv, table, seq_lens = mla_cache(run, s, [ctx] * batch, seed=batch)
        except Exception as exc:  # noqa: BLE001
            run.error("mla_decode", f"B{batch}", "inputs", exc)
            continue
        for heads in s.mla_heads:
            q = run.randn(batch, 1, heads, width, g=run.gen(heads))
            args = (q, kv, table, seq_lens, scale, s.lat)
            cap = f"B*ctx = {batch * ctx} > {s.mla_ref_cap}: float32 reference too large"
            rows = heads  # s_q = 1
            splits = default_num_splits(
                batch, triton.cdiv(rows, MLA_BLOCK_M), table.shape[1] * s.block, num_sms
            )
            run.time(
                "mla_decode",
                f"B{batch}-H{heads}-ctx{ctx}",
                {"batch": batch, "heads": heads, "ctx": ctx, "num_splits": splits},
                lambda args=args: mla_decode(*args, impl="triton", return_lse=False),
                {
                    "torch": lambda args=args: mla_decode(*args, impl="torch", return_lse=False),
                    "torch_ref": (lambda args=args: mla_decode_ref(*args))
                    if batch * ctx <= s.mla_ref_cap
                    else cap,
                },
                bytes_=2 * (batch * ctx * width + batch * heads * (width + s.lat)),  # KV + q + o
                flops=2 * batch * heads * ctx * (width + s.lat),  # q.k and p @ v
            )
            del q, args
        del kv, table, seq_lens
        run.free()


def bench_moe(run: Run, s: Shapes) -> None:
    w13, w2 = moe_weights(run, s, seed=3)

    for tokens, off_rank in s.moe_checks:

        def compute(tokens=tokens, off_rank=off_rank) -> list[Cmp]:
            x, weights, ids = moe_routing(run, s, tokens, off_rank, seed=tokens)
            out = fused_moe(x, w13, w2, weights, ids, impl="triton")
            return [close("out", out, fused_moe_ref(x, w13, w2, weights, ids), **BF16_TOL)]

        case = f"M{tokens}-E{s.experts}-K{s.top_k}" + (f"-ep{off_rank:g}" if off_rank else "")
        run.check("fused_moe", case, compute)

    expert_bytes = 3 * s.hidden * s.inter * w13.element_size()  # w13 + w2 of one expert
    for tokens in s.moe_tokens:
        x, weights, ids = moe_routing(run, s, tokens, 0.0, seed=tokens)
        args = (x, w13, w2, weights, ids)
        touched = int(ids.unique().numel())
        run.time(
            "fused_moe",
            f"M{tokens}-H{s.hidden}-I{s.inter}",
            {"tokens": tokens, "experts_touched": touched, "top_k": s.top_k},
            lambda args=args: fused_moe(*args, impl="triton"),
            {"torch": lambda args=args: fused_moe_ref(*args)},
            bytes_=touched * expert_bytes + 2 * x.numel() * x.element_size(),  # weights + x + out
            flops=2 * tokens * s.top_k * (s.hidden * 2 * s.inter + s.inter * s.hidden),
        )
        del x, weights, ids, args
    run.free()


def quant_experts(run: Run, s: Shapes, fmt: str, seed: int) -> tuple[QuantWeight, QuantWeight]:
    """V3's routed experts kept as released: FP8 e4m3 with a float32 scale per row per 128 of K
    (values drawn in range, scales ~1/sqrt(K)), or MXFP4 bytes with e8m0 scales per 32."""
    g = run.gen(seed)

    def one(n: int, k: int) -> QuantWeight:
        if fmt == "fp8":  # an expert at a time: V3's float32 draws whole would take 30 GB
            data = torch.empty(s.experts, n, k, dtype=torch.float8_e4m3fn, device=run.device)
            for e in range(s.experts):
                data[e] = run.randn(n, k, g=g, std=64.0, dtype=torch.float32).clamp(-448, 448)
            scale = torch.full((s.experts, n, -(-k // 128)), k**-0.5 / 64, device=run.device)
            return QuantWeight("fp8", data, scale, 128)
        data = torch.randint(
            0, 256, (s.experts, n, k // 2), generator=g, device=run.device, dtype=torch.uint8
        )
        scale = torch.full((s.experts, n, k // 32), 127 - max(1, round(math.log2(k) / 2)), device=run.device)
        return QuantWeight("mxfp4", data, scale.to(torch.uint8), 32)

    return one(2 * s.inter, s.hidden), one(s.hidden, s.inter)


def bench_quant(run: Run, s: Shapes) -> None:
    """The kernels for checkpoints kept quantized: activation quantization, the block-FP8 GEMM
    (w8a8) at V3's o_proj shape, the fused MoE with FP8 and MXFP4 experts; timed beside bf16."""
    g = run.gen(11)
    for rows in (3, 33):

        def compute_act(rows=rows) -> list[Cmp]:
            x = run.randn(rows, s.hidden, g=g)
            q, scale = act_quant(x, 128, impl="triton")
            q_ref, scale_ref = act_quant_ref(x, 128)
            return [close("q", q.float(), q_ref.float(), **EXACT), close("scale", scale, scale_ref, **EXACT)]

        run.check("act_quant", f"M{rows}-K{s.hidden}", compute_act)
    _bench_w8a8(run, s, g)
    run.free()
    bf16 = moe_weights(run, s, seed=3)
    for fmt in ("fp8", "mxfp4"):
        _bench_quant_moe(run, s, fmt, bf16)
        run.free()


def _bench_w8a8(run: Run, s: Shapes, g: torch.Generator) -> None:
    k = 2 * s.inter
    data = run.randn(s.hidden, k, g=g, std=64.0, dtype=torch.float32).clamp(-448, 448)
    scale = torch.full((s.hidden, -(-k // 128)), k**-0.5 / 64, device=run.device)
    w = QuantWeight("fp8", data.to(torch.float8_e4m3fn), scale, 128)
    dense = w.dequantize(run.dtype)
    for rows in (1, 77):

        def compute(rows=rows) -> list[Cmp]:
            x = run.randn(rows, k, g=g)
            return [close("y", w8a8_linear(x, w, impl="triton"), w8a8_linear_ref(x, w), **BF16_TOL)]

        run.check("w8a8_linear", f"M{rows}-N{s.hidden}-K{k}", compute)
    for tokens in s.moe_tokens:
        x = run.randn(tokens, k, g=g)
        run.time(
            "w8a8_linear",
            f"M{tokens}-N{s.hidden}-K{k}",
            {"tokens": tokens},
            lambda x=x: w8a8_linear(x, w, impl="triton"),
            {"bf16 torch": lambda x=x: torch.nn.functional.linear(x, dense)},
            bytes_=w.nbytes + 2 * x.numel() * x.element_size(),
            flops=2 * tokens * s.hidden * k,
        )


def _bench_quant_moe(run: Run, s: Shapes, fmt: str, bf16: tuple[torch.Tensor, torch.Tensor]) -> None:
    w13, w2 = quant_experts(run, s, fmt, seed=4)
    for tokens, off_rank in s.moe_checks:

        def compute(tokens=tokens, off_rank=off_rank) -> list[Cmp]:
            x, weights, ids = moe_routing(run, s, tokens, off_rank, seed=tokens)
            out = fused_moe_quant_triton(x, w13, w2, weights, ids)
            ref = fused_moe_quant_ref(x, w13, w2, weights, ids)
            # A bf16 rounding of gate_up that differs moves the activations' quantization and
            # everything after it: the tolerance scales with the output (float32: ~1e-6).
            return [close("out", out, ref, atol=0.03 * ref.abs().max().item(), rtol=0.02)]

        if tokens <= 64 or not run.smoke:  # the reference loops over pairs in Python
            run.check(f"fused_moe_{fmt}", f"M{tokens}-E{s.experts}-K{s.top_k}", compute)
    expert_bytes = (w13.nbytes + w2.nbytes) / s.experts
    for tokens in s.moe_tokens:
        x, weights, ids = moe_routing(run, s, tokens, 0.0, seed=tokens)
        args = (x, weights, ids)
        touched = int(ids.unique().numel())
        run.time(
            f"fused_moe_{fmt}",
            f"M{tokens}-H{s.hidden}-I{s.inter}",
            {"tokens": tokens, "experts_touched": touched, "top_k": s.top_k},
            lambda args=args: fused_moe_quant_triton(args[0], w13, w2, *args[1:]),
            {"bf16 triton": lambda args=args: fused_moe(args[0], *bf16, *args[1:], impl="triton")},
            bytes_=touched * expert_bytes + 2 * x.numel() * x.element_size(),
            flops=2 * tokens * s.top_k * 3 * s.hidden * s.inter,
        )


def bench_attention(run: Run, s: Shapes) -> None:
    for n, ctx, heads, d_qk, d_v in s.ext_checks:

        def compute(n=n, ctx=ctx, heads=heads, d_qk=d_qk, d_v=d_v) -> list[Cmp]:
            q, k, v = extend_inputs(run, n, ctx, heads, d_qk, d_v, seed=5)
            o, lse = extend_attention(q, k, v, d_qk**-0.5, impl="triton")
            o_ref, lse_ref = extend_attention_ref(q, k, v, d_qk**-0.5)
            return [close("o", o, o_ref, **BF16_TOL), close("lse", lse, lse_ref, **LSE_TOL)]

        run.check("extend_attention", f"n{n}-ctx{ctx}-H{heads}-D{d_qk}/{d_v}", compute)

    def merge() -> list[Cmp]:
        g = run.gen(6)
        rows, heads, d = s.tokens, s.rot_heads, s.lat
        o1, o2 = run.randn(rows, heads, d, g=g), run.randn(rows, heads, d, g=g)
        lse1 = torch.randn(rows, heads, generator=g, device=run.device) * 3
        lse2 = torch.randn(rows, heads, generator=g, device=run.device) * 3
        lse1[0], lse2[1] = -math.inf, -math.inf  # one side empty
        lse1[2, 0] = lse2[2, 0] = -math.inf  # both empty
        o, lse = merge_attn_states(o1, lse1, o2, lse2, impl="triton")
        o_ref, lse_ref = merge_attn_states(o1, lse1, o2, lse2, impl="torch")
        return [close("o", o, o_ref, **BF16_TOL), close("lse", lse, lse_ref, **FP32_TOL)]

    run.check("merge_attn_states", f"T{s.tokens}-H{s.rot_heads}-D{s.lat}", merge)

    for n, ctx, heads, d_qk, d_v in s.ext_times:
        q, k, v = extend_inputs(run, n, ctx, heads, d_qk, d_v, seed=7)
        args = (q, k, v, d_qk**-0.5)
        pairs = n * (ctx - n) + n * (n + 1) // 2  # (query, visible key) pairs under the causal mask
        big = heads * n * ctx > s.ext_ref_cap
        run.time(
            "extend_attention",
            f"n{n}-ctx{ctx}-H{heads}-D{d_qk}/{d_v}",
            {"n": n, "ctx": ctx, "heads": heads, "d_qk": d_qk, "d_v": d_v},
            lambda args=args: extend_attention(*args, impl="triton", return_lse=False),
            {
                "torch_sdpa": lambda args=args: extend_attention(*args, impl="torch", return_lse=False),
                "torch_ref": f"H*n*ctx > {s.ext_ref_cap}: float32 scores too large"
                if big
                else lambda args=args: extend_attention_ref(*args),
            },
            bytes_=sum(t.numel() * t.element_size() for t in (q, k, v)) + n * heads * d_v * q.element_size(),
            flops=2 * heads * pairs * (d_qk + d_v),
        )
        del q, k, v, args
        run.free()


def check_small(run: Run, s: Shapes) -> None:
    """grouped_topk, rms_norm (plain and with the residual), apply_rotary (both layouts), store_kv."""
    g = run.gen(8)
    tokens = s.tokens

    def routing(bias: bool, scoring: str, top_k: int, topk_group: int) -> list[Cmp]:
        # float32 logits: bf16 ones tie often, and tie order is unspecified (kernels/gate.py).
        logits = torch.randn(tokens, s.experts, generator=g, device=run.device)
        b = 0.1 * torch.randn(s.experts, generator=g, device=run.device) if bias else None
        args = (logits, b, s.n_group, topk_group, top_k, True, 2.5, scoring)
        w, ids = grouped_topk(*args, impl="triton")
        w_ref, ids_ref = grouped_topk(*args, impl="torch")
        ids, order = ids.sort(dim=-1)  # the order of the k picks is unspecified
        ids_ref, order_ref = ids_ref.sort(dim=-1)
        same = (ids == ids_ref).all(dim=-1)
        # A 1-ulp difference in the score can flip a near-tie: allow one row in a thousand.
        mismatched = int((~same).sum())
        cmp_ids = Cmp("ids_rows_differ", float(mismatched), mismatched <= tokens // 1000, "<= 0.1% rows")
        w, w_ref = w.gather(1, order)[same], w_ref.gather(1, order_ref)[same]
        return [cmp_ids, close("weights", w, w_ref, **FP32_TOL)]

    k2, tg2 = min(s.top_k, 6), max(1, s.topk_group - 1)
    run.check(
        "grouped_topk",
        f"T{tokens}-E{s.experts}-v3-sigmoid-bias",
        lambda: routing(True, "sigmoid", s.top_k, s.topk_group),
    )
    run.check(
        "grouped_topk", f"T{tokens}-E{s.experts}-v2-softmax", lambda: routing(False, "softmax", k2, tg2)
    )

    def norm(residual: bool) -> list[Cmp]:
        x = run.randn(tokens, s.hidden, g=g)
        w = 1 + run.randn(s.hidden, g=g, std=0.1)
        r = run.randn(tokens, s.hidden, g=g) if residual else None
        got = rms_norm(x, w, 1e-6, residual=r, impl="triton")
        ref = rms_norm(x, w, 1e-6, residual=r, impl="torch")
        if not residual:
            return [close("y", got, ref, **BF16_TOL)]
        return [close("y", got[0], ref[0], **BF16_TOL), close("sum", got[1], ref[1], **BF16_TOL)]

    run.check("rms_norm", f"T{tokens}-D{s.hidden}", lambda: norm(False))
    run.check("rms_norm", f"T{tokens}-D{s.hidden}-residual", lambda: norm(True))

    def rotary(interleaved: bool) -> list[Cmp]:
        x = run.randn(tokens, s.rot_heads, s.rope, g=g)
        pos = torch.randint(0, 32768, (tokens, 1), generator=g, device=run.device).float()
        angle = pos * 10000.0 ** (-torch.arange(s.rope // 2, device=run.device) / (s.rope // 2))
        cos, sin = angle.cos(), angle.sin()
        got = apply_rotary(x, cos, sin, interleaved, impl="triton")
        return [close("out", got, apply_rotary_ref(x, cos, sin, interleaved), **BF16_TOL)]

    for interleaved in (True, False):
        layout = "interleaved" if interleaved else "halves"
        run.check(
            "apply_rotary", f"T{tokens}-H{s.rot_heads}-R{s.rope}-{layout}", lambda i=interleaved: rotary(i)
        )

    def kv_store() -> list[Cmp]:
        num_blocks = tokens // s.block + 2
        cache = torch.zeros(num_blocks, s.block, s.lat + s.rope, dtype=run.dtype, device=run.device)
        latent, k_pe = run.randn(tokens, s.lat, g=g), run.randn(tokens, s.rope, g=g)
        slots = torch.randperm(num_blocks * s.block, generator=g, device=run.device)[:tokens]
        slots[::5] = -1  # padding tokens: no cache row
        got, ref = cache.clone(), cache.clone()
        store_kv(latent, k_pe, got, slots, impl="triton")
        store_kv(latent, k_pe, ref, slots, impl="torch")
        return [close("cache", got, ref, **EXACT)]

    run.check("store_kv", f"N{tokens}-L{s.lat}-R{s.rope}-bs{s.block}", kv_store)


def bench_v4(run: Run, s: Shapes) -> None:
    """DeepSeek-V4's kernels (kernels/v4.py): the hyper-connections at V4-Flash's width (4 streams
    of 4096), the compressors' pooling (CSA: 8 slots, HCA: 128, of 512), and its attention (64
    heads of 512 over a 128-token window and 512 picked entries, with sinks); checks against the
    PyTorch references, then timings beside them."""
    gpu = run.device.type == "cuda"
    hc, hidden = 4, (4096 if gpu else s.hidden)
    heads, dim, kw, kc = (64, 512, 128, 512) if gpu else (4, s.lat, 8, 6)
    g = run.gen(11)
    fn = run.randn((2 + hc) * hc, hc * hidden, g=g, std=(hc * hidden) ** -0.5, dtype=torch.float32)
    base = run.randn((2 + hc) * hc, g=g, std=0.5, dtype=torch.float32)
    scale = 1 + run.randn(3, g=g, std=0.3, dtype=torch.float32)

    def hyper(n: int) -> list[Cmp]:
        x, out = run.randn(n, hc, hidden, g=g), run.randn(n, hidden, g=g)
        post, comb, u = v4k.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, impl="triton")
        rp, rc, ru = v4k.hc_pre_ref(x, fn, base, scale, 20, 1e-6, 1e-6)
        merged = v4k.hc_merge(x, post, comb, out, impl="triton")
        return [
            close("post", post, rp, **FP32_TOL),
            close("comb", comb, rc, **FP32_TOL),
            close("u", u, ru, **BF16_TOL),
            close("merged", merged, v4k.hc_merge_ref(x, rp, rc, out), **BF16_TOL),
        ]

    def pool(entries: int, slots: int) -> list[Cmp]:
        kv = run.randn(entries, slots, dim, g=g, dtype=torch.float32)
        gate = run.randn(entries, slots, dim, g=g, dtype=torch.float32)
        w = 1 + run.randn(dim, g=g, std=0.1, dtype=torch.float32)
        got = v4k.compress_pool(kv, gate, w, 1e-6, impl="triton")
        return [close("entries", got, v4k.compress_pool_ref(kv, gate, w, 1e-6), **FP32_TOL)]

    def attention_inputs(t: int):
        window = run.randn(t * kw // 4 + 8, 4, dim, g=g)
        entries = run.randn(t * kc // 2 + 4, 2, dim, g=g)
        q = run.randn(t, heads, dim, g=g, std=dim**-0.25)
        wslots = torch.randint(-1, window.shape[0] * 4, (t, kw), generator=g, device=run.device)
        eslots = torch.randint(-1, entries.shape[0] * 2, (t, kc), generator=g, device=run.device)
        sinks = run.randn(heads, g=g, dtype=torch.float32)
        return q, window, wslots, entries, eslots, sinks, dim**-0.5

    def attention(t: int) -> list[Cmp]:
        args = attention_inputs(t)
        return [close("o", v4k.v4_attention(*args, impl="triton"), v4k.v4_attention_ref(*args), **BF16_TOL)]

    for n in (1, 33):
        run.check("v4_hc", f"N{n}-hc{hc}-H{hidden}", lambda n=n: hyper(n))
    for e, sl in ((16, 8), (3, 128 if gpu else 16)):
        run.check("v4_compress_pool", f"E{e}-S{sl}-W{dim}", lambda e=e, sl=sl: pool(e, sl))
    for t in (1, 5):
        run.check("v4_attention", f"T{t}-H{heads}-D{dim}-K{kw}+{kc}", lambda t=t: attention(t))

    for n in (1, 64, 256) if gpu else (2,):
        x = run.randn(n, hc, hidden, g=g)
        bytes_ = fn.numel() * 4 + 2 * x.numel() * 2
        run.time(
            "v4_hc", f"N{n}", {"tokens": n},
            lambda x=x: v4k.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, impl="triton"),
            {"torch": lambda x=x: v4k.hc_pre_ref(x, fn, base, scale, 20, 1e-6, 1e-6)},
            bytes_, 2.0 * n * fn.numel(),
        )  # fmt: skip
    for t in (1, 64, 256) if gpu else (2,):
        args = attention_inputs(t)
        run.time(
            "v4_attention", f"T{t}", {"tokens": t},
            lambda args=args: v4k.v4_attention(*args, impl="triton"),
            {"torch": lambda args=args: v4k.v4_attention_ref(*args)},
            t * (kw + kc) * dim * 2.0, 4.0 * t * heads * (kw + kc) * dim,
        )  # fmt: skip


def calibrate(run: Run, s: Shapes) -> None:
    """The ceilings as this machine reaches them: a bf16 matmul and a device copy."""
    g = run.gen(9)
    a, b = run.randn(s.gemm, s.gemm, g=g), run.randn(s.gemm, s.gemm, g=g)
    ms = run.ms(lambda: a @ b, run.rep)
    run.calibration["matmul"] = {"n": s.gemm, "ms": ms, "tflops": 2 * s.gemm**3 / ms / 1e9}
    src = torch.empty(s.copy_mib << 20, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    ms = run.ms(lambda: dst.copy_(src), run.rep)
    run.calibration["copy"] = {"mib": s.copy_mib, "ms": ms, "gb_s": 2 * src.numel() / ms / 1e6}
    run.free()
    print(
        f"CALIB matmul {s.gemm}^3 bf16 {run.calibration['matmul']['tflops']:.0f} TFLOP/s, "
        f"copy {s.copy_mib} MiB {run.calibration['copy']['gb_s']:.0f} GB/s (read + write)",
        flush=True,
    )


FAMILIES = (
    ("calibration", calibrate),
    ("mla", bench_mla),
    ("moe", bench_moe),
    ("attention", bench_attention),
    ("small", check_small),
    ("quant", bench_quant),
    ("v4", bench_v4),
)


# --- report ------------------------------------------------------------------------------------------


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def report(run: Run) -> str:
    lines = [f"\n== correctness ({run.dtype}, {run.device.type}) =="]
    kernels: dict[str, list[bool]] = {}
    for c in run.checks:
        kernels.setdefault(c["kernel"], []).append(c["pass"])
    rows = [["kernel", "verdict", "cases", "max |err|"]]
    for k, verdicts in kernels.items():
        errs = [c["max_abs_err"] for c in run.checks if c["kernel"] == k and c["max_abs_err"] is not None]
        rows.append(
            [
                k,
                "PASS" if all(verdicts) else "FAIL",
                f"{sum(verdicts)}/{len(verdicts)}",
                f"{max(errs):.2e}" if errs else "-",
            ]
        )
    lines.append(table(rows))

    lines.append(f"\n== timings (ms; vs {run.hbm_gbs:.0f} GB/s and {run.peak_tflops:.0f} bf16 TFLOP/s) ==")
    rows = ["kernel case triton torch torch_ref speedup GB/s %HBM TFLOP/s %peak %roof goal".split()]
    for t in run.timings:
        if "triton_ms" not in t:
            rows.append([t["kernel"], t["case"], "ERROR"] + [""] * 9)
            continue
        base = t.get("baselines", {})
        names = list(base) + list(t.get("skipped", {}))
        torch_name = next((n for n in names if n != "torch_ref"), None)
        cell = lambda name, base=base: f"{base[name]:.3f}" if name in base else ("skip" if name else "")
        speedup = f"{base[torch_name] / t['triton_ms']:.1f}x" if torch_name in base else ""
        goal = ""
        if "goal" in t:
            met = t["goal_met"]
            goal = f"{t['goal']}: " + ("n/a (smoke)" if met is None else "met" if met else "MISSED")
        rows.append(
            [
                t["kernel"],
                t["case"],
                f"{t['triton_ms']:.3f}",
                cell(torch_name),
                cell("torch_ref" if "torch_ref" in names else None),
                speedup,
                f"{t['gb_s']:.0f}",
                f"{t['pct_hbm']:.0f}",
                f"{t['tflops']:.1f}",
                f"{t['pct_peak']:.0f}",
                f"{t['pct_roofline']:.0f}",
                goal,
            ]
        )
    lines.append(table(rows))
    skipped = sorted(
        {f"{t['kernel']} {name}: {why}" for t in run.timings for name, why in t.get("skipped", {}).items()}
    )
    lines += ["\nskipped baselines:"] + [f"  {s}" for s in skipped] if skipped else []
    lines += ["\nnotes:"] + [f"  {n}" for n in run.notes]
    lines.append(
        "  %roof uses the bf16 peak; kernels whose tl.dot takes float32 tiles (input_precision='tf32') "
        "run on Hopper's tensor cores at about half of it."
    )
    if run.errors:
        lines += ["\nerrors:"] + [
            f"  {e['kernel']} {e['case']} {e['stage']}: {e['error'].splitlines()[0]}" for e in run.errors
        ]
    return "\n".join(lines)


def write(payload: dict, out: str | None) -> Path:
    if out is None:
        return save(NAME, _num(payload))
    path = Path(out)
    if out.endswith(os.sep) or path.is_dir():
        path = path / f"{NAME}_{hardware_slug()}_{_dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "git": git_revision(),
        "hardware": hardware(),
    }
    path.write_text(json.dumps(_num({**full, **payload}), indent=2) + "\n")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument("--out", default=None, help="result file or folder (default: benchmarks/results/)")
    p.add_argument("--rep", type=int, default=50, help="do_bench milliseconds per Triton timing")
    p.add_argument("--ref-rep", type=int, default=20, help="do_bench milliseconds per PyTorch timing")
    p.add_argument("--hbm-gbs", type=float, default=HBM_GBS)
    p.add_argument("--peak-tflops", type=float, default=BF16_TFLOPS)
    p.add_argument(
        "--only", default=None, help="comma-separated families: " + ",".join(n for n, _ in FAMILIES)
    )
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print(
            "kernels_gpu.py needs a CUDA GPU (none visible); use --smoke for the CPU interpreter run.",
            file=sys.stderr,
        )
        return 2

    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if args.smoke else GPU
    run = Run(args, shapes)
    only = set(args.only.split(",")) if args.only else None
    start = time.perf_counter()
    print(
        f"{NAME}: {'smoke (CPU, Triton interpreter)' if args.smoke else torch.cuda.get_device_name()}, bf16",
        flush=True,
    )
    for name, family in FAMILIES:
        if only and name not in only:
            continue
        try:
            family(run, shapes)
        except Exception as exc:  # noqa: BLE001 - one family's failure must not stop the others
            run.error(name, "-", "family", exc)
        run.free()
    elapsed = time.perf_counter() - start

    failed = [f"{c['kernel']} {c['case']}" for c in run.checks if not c["pass"]]
    payload = {
        "mode": "smoke" if args.smoke else "cuda",
        "device": "cpu (Triton interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "dtype": "bfloat16",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "peaks": {"hbm_gbs": run.hbm_gbs, "bf16_tflops": run.peak_tflops},
        "goals": {k: asdict(g) | {"label": g.label()} for k, g in run.goals.items()},
        "shapes": asdict(shapes),
        "calibration": run.calibration,
        "checks": run.checks,
        "timings": run.timings,
        "errors": run.errors,
        "notes": run.notes,
        "summary": {
            "checks": len(run.checks),
            "passed": len(run.checks) - len(failed),
            "failed": failed,
            "errors": len(run.errors),
        },
        "elapsed_s": round(elapsed, 1),
    }
    print(report(run))
    path = write(payload, args.out)
    print(
        f"\n{len(run.checks) - len(failed)}/{len(run.checks)} checks passed, {len(run.errors)} errors, {elapsed:.1f} s -> {path}"
    )
    return 0 if not failed and not run.errors else 1


if __name__ == "__main__":
    sys.exit(main())
