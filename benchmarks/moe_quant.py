"""One MoE layer's routed + shared experts in the native kernels (native.moe_topk) with the experts
in bf16, FP8 (128 x 128 block scales, DeepSeek's) and MXFP4, side by side in one run, alternating
rounds, weights out of cache (a set of layers cycled, as a decode step reads them).

Shapes: the bench model's (32 experts of H 512 x I 256, top 4, one shared expert), and DeepSeek-V3's
(H 7168, I 2048 per expert, top 8 + one shared), with 64 of its 256 experts so bf16 fits beside
FP8 in memory (a token's work is the same: 8 routed experts and the shared one), then FP8 alone
with all 256; 1 to 256 tokens.

    python benchmarks/moe_quant.py [--v3] [--kt-python /tmp/ktvenv/bin/python]

--v3 adds the V3 shapes (~20 GB, minutes). --kt-python runs kt-kernel's FP8 MoE (its CPUInfer API,
benchmarks/moe_ktkernel.py, in the scratch venv that python belongs to) on each shape's routed
experts, after pdserve's, against pdserve's FP8 routed experts alone (kt-kernel runs no shared
expert); its error is recorded where it cannot run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from kernels import native  # noqa: E402
from kernels.quant import QuantWeight  # noqa: E402


def make_experts(fmt: str, e: int, n: int, k: int, g: torch.Generator):
    """Random experts [e, n, k] in fmt, magnitudes ~1/sqrt(k) (bytes drawn directly: quantizing
    V3's 15 G values would take minutes)."""
    if fmt == "bf16":
        return (torch.randn(e, n, k, generator=g) * k**-0.5).bfloat16()
    if fmt == "fp8":
        data = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)
        for i in range(e):
            data[i] = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448)
        return QuantWeight("fp8", data, torch.full((e, n, -(-k // 128)), k**-0.5 / 64), 128)
    data = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    return QuantWeight("mxfp4", data, torch.full((e, n, k // 32), 124, dtype=torch.uint8), 32)


def layers(fmt: str, count: int, experts: int, hidden: int, inter: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        w13 = make_experts(fmt, experts, 2 * inter, hidden, g)
        w2 = make_experts(fmt, experts, hidden, inter, g)
        shared_fmt = "fp8" if fmt == "mxfp4" else fmt  # V4 keeps its shared expert FP8
        s13, s2 = (
            make_experts(shared_fmt, 1, 2 * inter, hidden, g),
            make_experts(shared_fmt, 1, hidden, inter, g),
        )
        out.append((w13, w2, (s13[0], s2[0])))
    return out


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()


def time_layers(
    stack: list, tokens: int, experts: int, top_k: int, hidden: int, steps: int, shared: bool = True
) -> float:
    """Milliseconds per layer, a random routing per step, the layers cycled (shared: with the
    shared expert, else the routed ones alone)."""
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=g)).bfloat16()
    out = torch.empty_like(x)
    routes = [
        (torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices, torch.rand(tokens, top_k))
        for _ in range(steps)
    ]
    native.moe_topk(x, *stack[0][:2], out, *routes[0], stack[0][2])  # warm
    start = time.perf_counter()
    for ids, weights in routes:
        for w13, w2, shared_expert in stack:
            out.zero_()
            native.moe_topk(x, w13, w2, out, ids, weights, shared_expert if shared else None)
    return (time.perf_counter() - start) * 1e3 / (steps * len(stack))


def kt_kernel(python: str, count, experts, hidden, inter, top_k, tokens, steps, rounds, threads) -> dict:
    """kt-kernel's FP8 MoE on the same shape in its own venv -> {"ms": {tokens: ms}} or {"error": ...}."""
    cmd = [
        python, str(Path(__file__).with_name("moe_ktkernel.py")), "--experts", str(experts), "--hidden", str(hidden),
        "--inter", str(inter), "--top-k", str(top_k), "--tokens", ",".join(map(str, tokens)), "--layers", str(count),
        "--steps", str(steps), "--rounds", str(rounds), "--threads", str(threads),
    ]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = [
        line for line in out.stdout.splitlines() if line.startswith('{"engine"')
    ]  # it prints its own lines
    if not lines:
        return {
            "error": f"exit {out.returncode}, no result",
            "stderr": out.stderr[-1500:],
            "stdout": out.stdout[-500:],
        }
    return json.loads(lines[-1])


def run_shape(
    name, formats, count, experts, hidden, inter, top_k, tokens, steps, rounds, kt=None
) -> list[dict]:
    stacks = {fmt: layers(fmt, count, experts, hidden, inter, seed=1) for fmt in formats}
    rows = []
    for t in tokens:
        times: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for _ in range(rounds):
            for fmt in formats:
                times[fmt].append(time_layers(stacks[fmt], t, experts, top_k, hidden, steps))
        med = {fmt: sorted(v)[len(v) // 2] for fmt, v in times.items()}
        w13, w2, (s13, s2) = stacks[formats[0]][0]
        row = {"shape": name, "tokens": t, "ms": med}
        touched = min(experts, t * top_k)
        for fmt in formats:
            w13, w2, (s13, s2) = stacks[fmt][0]
            per_expert = (nbytes(w13) + nbytes(w2)) / experts
            row.setdefault("gb_s", {})[fmt] = round(
                (touched * per_expert + nbytes(s13) + nbytes(s2)) / med[fmt] / 1e6, 1
            )
        if "bf16" in med:
            row["speedup_vs_bf16"] = {fmt: round(med["bf16"] / med[fmt], 2) for fmt in formats}
        if kt is not None and "fp8" in stacks:
            routed = sorted(
                time_layers(stacks["fp8"], t, experts, top_k, hidden, steps, False) for _ in range(rounds)
            )
            row["fp8_routed_ms"] = routed[len(routed) // 2]
        rows.append(row)
        print(
            f"{name:<10} T={t:<4} "
            + "  ".join(f"{fmt} {med[fmt]:7.3f} ms ({row['gb_s'][fmt]:5.1f} GB/s)" for fmt in formats)
            + (
                "  "
                + " ".join(f"{k} {v:.2f}x" for k, v in row.get("speedup_vs_bf16", {}).items() if k != "bf16")
            ),
            flush=True,
        )
    if kt is not None:
        del stacks, w13, w2, s13, s2  # the peer's own copy of the weights needs the memory
        peer = kt_kernel(
            kt, count, experts, hidden, inter, top_k, tokens, steps, rounds, torch.get_num_threads()
        )
        for row in rows:
            row["kt_kernel"] = {k: v for k, v in peer.items() if k != "ms"}
            if "ms" in peer and "fp8_routed_ms" in row:
                kt_ms = peer["ms"][str(row["tokens"])]
                row["kt_kernel"]["ms"] = kt_ms
                row["fp8_routed_vs_kt"] = round(kt_ms / row["fp8_routed_ms"], 2)
            print(
                f"{name:<10} T={row['tokens']:<4} routed only: pdserve fp8 {row.get('fp8_routed_ms', 0):7.3f} ms, "
                + (
                    f"kt-kernel {row['kt_kernel']['ms']:7.3f} ms ({row['fp8_routed_vs_kt']:.2f}x)"
                    if "ms" in row["kt_kernel"]
                    else f"kt-kernel: {peer.get('error')}"
                ),
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--v3", action="store_true", help="the V3 shapes too")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kt-python", default=None, help="python of a venv with kt-kernel 0.7.2")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from engine.platform import load_native

    if not load_native():
        raise SystemExit("the native kernels do not load on this CPU")
    tokens = [1, 4, 16, 64, 256]
    kt = args.kt_python
    rows = run_shape("bench", ["bf16", "fp8", "mxfp4"], 7, 32, 512, 256, 4, tokens, 8, args.rounds, kt)
    if args.v3:
        rows += run_shape("v3-e64", ["bf16", "fp8", "mxfp4"], 1, 64, 7168, 2048, 8, tokens, 3, args.rounds)
        rows += run_shape("v3-e256", ["fp8"], 1, 256, 7168, 2048, 8, tokens, 3, 3, kt)
    print(
        "saved",
        save("moe_quant", {"rows": rows, "threads": args.threads, "library": str(native.library_path())}),
    )


if __name__ == "__main__":
    main()
