"""Few-row products on CPU: `kernels.linear.linear` (w @ x^T) against `F.linear` (x @ w^T), in one run.

For each weight shape of a model (LM head, dense MLP, routed expert, attention projections) and
each row count M, both forms are timed with the weight out of cache, as in decoding: the timing
loop cycles through enough copies of the weight to overflow the last-level cache. Rounds
alternate the two forms (and which goes first); the table reports medians in µs and the ratio F.linear / linear.
Saves JSON under benchmarks/results/.

    python benchmarks/linear_orientation.py --model assets/pdserve-tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from kernels.linear import linear  # noqa: E402

COLD_BYTES = 96 << 20  # more than the development VM's 32 MiB L3


def model_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of the products a decode step runs."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return {
        "lm_head": (config["vocab_size"], h),
        "dense gate_up": (2 * config["intermediate_size"], h),
        "dense down": (h, config["intermediate_size"]),
        "expert gate_up": (2 * config["moe_intermediate_size"], h),
        "expert down": (h, config["moe_intermediate_size"]),
        "q_b_proj": (heads * qk, config["q_lora_rank"]),
        "kv_a_proj": (config["kv_lora_rank"] + config["qk_rope_head_dim"], h),
        "o_proj": (h, heads * config["v_head_dim"]),
    }


def time_cold(fn, weights: list[torch.Tensor], x: torch.Tensor, calls: int) -> float:
    """Median µs of fn(x, w) over `calls` calls, each on the next (cold) copy of the weight."""
    for w in weights:
        fn(x, w)
    times = []
    for i in range(calls):
        w = weights[i % len(weights)]
        start = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/pdserve-tiny")
    p.add_argument("--rows", default="1,2,3,4,8,16,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="timed calls per form and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--smoke", action="store_true", help="two shapes, two row counts, one round; nothing saved"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = model_shapes(json.loads((Path(args.model) / "config.json").read_text()))
    rows_list = [1, 3] if args.smoke else [int(r) for r in args.rows.split(",")]
    if args.smoke:
        shapes = {name: shapes[name] for name in ("lm_head", "expert down")}
    rounds, calls = (1, 4) if args.smoke else (args.rounds, args.calls)
    cold_bytes = (8 << 20) if args.smoke else COLD_BYTES
    table = []
    for name, (n, k) in shapes.items():
        copies = max(2, cold_bytes // (n * k * 4))
        weights = [torch.randn(n, k) * k**-0.5 for _ in range(copies)]
        for rows in rows_list:
            x = torch.randn(rows, k)
            torch.testing.assert_close(linear(x, weights[0]), F.linear(x, weights[0]), atol=1e-4, rtol=1e-4)
            base, new = [], []
            for r in range(rounds):  # alternate which form goes first
                for fn, times in ((F.linear, base), (linear, new))[:: 1 if r % 2 else -1]:
                    times.append(time_cold(fn, weights, x, calls))
            table.append(
                {
                    "shape": name,
                    "out_features": n,
                    "in_features": k,
                    "rows": rows,
                    "f_linear_us": statistics.median(base),
                    "linear_us": statistics.median(new),
                    "speedup": statistics.median(b / a for b, a in zip(base, new, strict=True)),
                }
            )
            r = table[-1]
            print(
                f"{name:>15} {n:>5}x{k:<4} M={rows:<3} F.linear {r['f_linear_us']:8.1f} µs"
                f"  linear {r['linear_us']:8.1f} µs  {r['speedup']:5.2f}x",
                flush=True,
            )
    if not args.smoke:
        result = {"model": args.model, "threads": args.threads, "rounds": rounds, "rows": table}
        print(f"saved {save('linear_orientation', result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
