"""Decode's one-row bf16 products: the native kernel (kernels/native) against torch's path
(`kernels.linear.linear_torch`), in one run.

For each weight of a decode step (the shapes of benchmarks/linear_orientation.py, plus the
per-head absorbed-attention products as one batched call) both are timed with the weight out of
cache, in alternating rounds; the table reports medians in µs, the native kernel's GB/s of weight
read, and the speedup (torch / native). Needs a CPU with AVX512F (AVX512-BF16 emulated where it lacks it). Saves JSON under
benchmarks/results/.

    python benchmarks/linear_native.py --model models/pdserve-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from benchmarks.linear_orientation import COLD_BYTES, model_shapes, time_cold  # noqa: E402
from engine.platform import load_native  # noqa: E402
from kernels import native  # noqa: E402
from kernels.linear import linear_torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="timed calls per side and round")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if not load_native():
        print("the native kernels do not run on this CPU (neither AVX512F nor AVX2) or did not build")
        return 1
    config = json.loads((Path(args.model) / "config.json").read_text())
    shapes = {name: (1, n, k) for name, (n, k) in model_shapes(config).items()}
    heads, lat = config["num_attention_heads"], config["kv_lora_rank"]
    shapes["absorbed q (per head)"] = (heads, lat, config["qk_nope_head_dim"])
    shapes["absorbed out (per head)"] = (heads, config["v_head_dim"], lat)
    table = []
    for name, (b, n, k) in shapes.items():
        copies = max(2, COLD_BYTES // (b * n * k * 2))
        weights = [(torch.randn(b, n, k) * k**-0.5).bfloat16().squeeze(0) for _ in range(copies)]
        for rows in [int(r) for r in args.rows.split(",")]:
            if b > 1 and rows > 1:
                continue  # the per-head products go native for one token only
            x = torch.randn(b, rows, k).bfloat16().squeeze(0)
            if b == 1:
                base_fn = linear_torch
            else:
                base_fn = lambda x, w: torch.bmm(x, w.transpose(1, 2))  # noqa: E731 (MLAttention's form)
            want = base_fn(x, weights[0]).float()
            torch.testing.assert_close(native.linear_bf16(x, weights[0]).float(), want, rtol=2**-7, atol=1e-2)
            base, new = [], []
            for r in range(args.rounds):  # alternate which side goes first
                for fn, times in ((base_fn, base), (native.linear_bf16, new))[:: 1 if r % 2 else -1]:
                    times.append(time_cold(fn, weights, x, args.calls))
            row = {
                "shape": name,
                "batch": b,
                "out_features": n,
                "in_features": k,
                "rows": rows,
                "torch_us": statistics.median(base),
                "native_us": statistics.median(new),
                "native_gb_per_s": b * n * k * 2 / statistics.median(new) / 1e3,
                "speedup": statistics.median(t / a for t, a in zip(base, new, strict=True)),
            }
            table.append(row)
            print(
                f"{name:>24} {b}x{n:>5}x{k:<4} M={rows:<2} torch {row['torch_us']:8.1f} µs"
                f"  native {row['native_us']:8.1f} µs ({row['native_gb_per_s']:4.1f} GB/s)  {row['speedup']:5.2f}x",
                flush=True,
            )
    result = {"model": args.model, "threads": args.threads, "rounds": args.rounds, "rows": table}
    print(f"saved {save('linear_native', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
