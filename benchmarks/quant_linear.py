"""One linear through the native kernels, the weight in bf16 and in FP8 (128 x 128 block scales),
side by side in one process, alternating rounds, weights out of cache (a set of layers cycled, as
a decode step reads them); 1 to 32 rows of x. The work is shared over the kernels' own pool, as
in the engine's decode steps (--omp: over torch's OpenMP threads, from 4 MB of weight).
Optionally against another checkout's kernels (--baseline-tree: a worktree of an earlier revision
with its kernels built), in alternating processes.

    python benchmarks/quant_linear.py [--shape 2048x7168] [--baseline-tree /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(shape: tuple[int, int], rows: list[int], layers: int, rounds: int, threads: int, omp: bool) -> dict:
    """ms per product for bf16 and FP8 at each row count, in this process's kernels."""
    import torch

    torch.set_num_threads(threads)
    from engine.platform import load_native
    from engine.quant import expand_scale_rows
    from kernels import native
    from kernels.quant import QuantWeight
    from modelkit.quantize import quantize_fp8

    load_native()
    native.use_pool(0 if omp else threads)
    n, k = shape
    g = torch.Generator().manual_seed(0)
    weights = {"bf16": [], "fp8": []}
    for _ in range(layers):
        w = torch.randn(n, k, generator=g) * k**-0.5
        q, grid = quantize_fp8(w, (128, 128), False)
        weights["fp8"].append(QuantWeight("fp8", q, expand_scale_rows(grid, n, 128).contiguous(), 128))
        weights["bf16"].append(w.bfloat16())
    run = {"bf16": native.few_rows_linear, "fp8": native.few_rows_quant_linear}
    out: dict[str, dict[int, float]] = {fmt: {} for fmt in run}
    for m in rows:
        x = torch.randn(m, k, generator=g).bfloat16()
        best = {fmt: float("inf") for fmt in run}
        for _ in range(rounds):
            for fmt, f in run.items():  # alternating, so a slow moment lands on both
                start = time.perf_counter()
                for w in weights[fmt]:
                    assert f(x, w) is not None
                best[fmt] = min(best[fmt], (time.perf_counter() - start) / layers)
        for fmt in run:
            out[fmt][m] = best[fmt] * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2048x7168", help="N x K (V3's expert gate/up: 2048 x 7168)")
    p.add_argument("--rows", default="1,2,4,8,32")
    p.add_argument("--layers", type=int, default=6, help="weights cycled (6 x 14 MiB FP8: out of L3)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline-tree", default=None, help="a checkout of the baseline revision, kernels built")
    p.add_argument("--alternations", type=int, default=3)
    p.add_argument("--omp", action="store_true", help="share the work over OpenMP's threads, not the pool")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    if args.one:
        print(json.dumps(one(shape, rows, args.layers, args.rounds, args.threads, args.omp)))
        return
    trees = {"candidate": ROOT} | ({"baseline": Path(args.baseline_tree)} if args.baseline_tree else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.alternations):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
            # This file's --one, on the tree's kernels (PYTHONPATH).
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--shape", args.shape]
            cmd += ["--rows", args.rows, "--layers", str(args.layers), "--rounds", str(args.rounds)]
            cmd += ["--threads", str(args.threads)] + (["--omp"] if args.omp else [])
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def best(name: str, fmt: str, m: int) -> float:
        return min(r[fmt][str(m)] for r in runs[name])

    n, k = shape
    summary: dict[str, dict] = {}
    for m in rows:
        line = {fmt: best("candidate", fmt, m) for fmt in ("bf16", "fp8")}
        line["fp8_speed_vs_bf16"] = line["bf16"] / line["fp8"]
        text = (
            f"rows {m:3d}: bf16 {line['bf16']:.3f} ms ({n * k * 2 / line['bf16'] / 1e6:.1f} GB/s)  "
            f"fp8 {line['fp8']:.3f} ms ({n * k / line['fp8'] / 1e6:.1f} GB/s)  fp8 {line['fp8_speed_vs_bf16']:.2f}x bf16"
        )
        if "baseline" in runs:
            line["baseline_fp8"] = best("baseline", "fp8", m)
            line["baseline_bf16"] = best("baseline", "bf16", m)
            line["fp8_speed_vs_baseline_fp8"] = line["baseline_fp8"] / line["fp8"]
            text += (
                f"  | baseline fp8 {line['baseline_fp8']:.3f} ms: {line['fp8_speed_vs_baseline_fp8']:.2f}x"
            )
        summary[str(m)] = line
        print(text)
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import save

    payload = {
        "shape": list(shape),
        "threads": args.threads,
        "layers": args.layers,
        "omp": args.omp,
        "runs": runs,
    }
    payload |= {"summary": summary, "baseline_tree": args.baseline_tree}
    print("saved", save("quant_linear", payload))


if __name__ == "__main__":
    main()
