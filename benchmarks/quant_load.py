"""Loading a checkpoint per format: time to a ready engine, the weights it keeps, and the peak RSS
while loading, for the same model in bf16 and quantized (`pdserve quantize`: FP8 128 x 128, FP8
with MXFP4 experts).

Each folder loads in a fresh process (`--one`), so a peak belongs to one load: the process's peak
RSS (ru_maxrss) less its RSS before the load (Python, torch, the kernels) against the engine's
resident weights, their bytes plus 10 % plus the largest tensor read (the issue's bound). The KV
cache is kept small (64 blocks) so the weights dominate.

    python benchmarks/quant_load.py bf16=models/pdserve-bench fp8=models/pdserve-bench-fp8 \
        fp4=models/pdserve-bench-fp4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def largest_tensor_bytes(folder: Path) -> int:
    from engine.safetensors_io import SafetensorsFile

    largest = 0
    for path in sorted(folder.glob("*.safetensors")):
        with SafetensorsFile(path) as f:
            largest = max([largest, *(t.nbytes for t in f.tensors.values())])
    return largest


def one(folder: str, threads: int) -> dict:
    """Load folder in this process -> its figures."""
    import torch

    torch.set_num_threads(threads)
    from engine import LLM
    from engine.platform import load_native

    load_native()
    before = rss_mib()
    start = time.perf_counter()
    llm = LLM(folder, dtype="bfloat16", num_kv_blocks=64)
    seconds = time.perf_counter() - start
    weights = llm.engine.runner.weight_bytes  # the checkpoint's and those derived at load
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    largest = largest_tensor_bytes(Path(folder))
    bound = (weights * 1.1 + largest) / 2**20
    return {
        "folder": folder,
        "load_s": round(seconds, 3),
        "weights_mib": round(weights / 2**20, 1),
        "largest_tensor_mib": round(largest / 2**20, 1),
        "peak_load_mib": round(peak - before, 1),
        "bound_mib": round(bound, 1),
        "within_bound": peak - before <= bound,
        "rss_after_mib": round(rss_mib(), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", help="NAME=FOLDER, the first the baseline")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.threads)))
        return
    named = [f.split("=", 1) for f in args.folders]
    results: dict[str, list[dict]] = {name: [] for name, _ in named}
    for _ in range(args.rounds):  # alternating, so a slow minute lands on every format
        for name, folder in named:
            out = subprocess.run(
                [sys.executable, __file__, "--one", folder, "--threads", str(args.threads)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = named[0][0]
    summary = {}
    for name, runs in results.items():
        load = sorted(r["load_s"] for r in runs)[len(runs) // 2]
        first = runs[0]
        summary[name] = {
            "load_s_median": load,
            "weights_mib": first["weights_mib"],
            "peak_load_mib_max": max(r["peak_load_mib"] for r in runs),
            "bound_mib": first["bound_mib"],
            "within_bound": all(r["within_bound"] for r in runs),
            "weights_vs_" + base: round(first["weights_mib"] / results[base][0]["weights_mib"], 3),
        }
        s = summary[name]
        print(
            f"{name:>6}: load {load:.2f} s, weights {s['weights_mib']:.1f} MiB "
            f"({s['weights_vs_' + base]:.2f}x {base}), peak while loading {s['peak_load_mib_max']:.1f} MiB "
            f"(bound {s['bound_mib']:.1f}: {'ok' if s['within_bound'] else 'OVER'})"
        )
    print("saved", save("quant_load", {"runs": results, "summary": summary, "threads": args.threads}))


if __name__ == "__main__":
    main()
