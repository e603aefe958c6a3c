"""Where a decode step's time goes, per batch size: a torch.profiler trace of steady-state decode
steps, summarised by module region (attention, MoE, dense MLP, norms, LM head, sampling, the
runner's batch building) and by op, with the part no op accounts for (Python, dispatch).

    python benchmarks/step_profile.py --model models/pdserve-bench --batches 1,8,64,256

For each batch B: B requests with `--context`-token random prompts are prefilled, then
`--steps` decode steps run under the profiler (after `--warmup` untimed ones). Writes JSON and a
readable table under benchmarks/results/ (named by hardware and date).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import result_path, save  # noqa: E402
from benchmarks.offline_throughput import random_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

REGIONS = {
    "attention": ("MLAttention",),
    "moe": ("MoE", "SparseMoe", "Experts"),
    "dense_mlp": ("MLP",),
    "norm": ("RMSNorm",),
    "embed": ("Embedding",),
}


def _region_of(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    for region, keys in REGIONS.items():
        if any(k in name for k in keys):
            return region
    return None


def _label_modules(model: torch.nn.Module) -> list:
    """Wrap the forward of every top-most module of a region in a record_function range."""
    handles = []

    def wrap(module: torch.nn.Module, region: str) -> None:
        def pre(mod, args):
            mod._pdserve_range = record_function(f"region::{region}")
            mod._pdserve_range.__enter__()

        def post(mod, args, out):
            mod._pdserve_range.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    def visit(module: torch.nn.Module) -> None:
        region = _region_of(module)
        if region is not None:
            wrap(module, region)
            return  # nested modules count in their outermost region
        for child in module.children():
            visit(child)

    visit(model)
    return handles


def profile_batch(llm: LLM, batch: int, context: int, steps: int, warmup: int, vocab: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 64, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=batch)):
        engine.add_request(f"p{batch}-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(warmup):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function("step"):
                engine.step()
        wall = time.perf_counter() - start
    for request_id in list(engine.requests):
        engine.abort_request(request_id)

    events = prof.key_averages()
    regions = {
        e.key.split("::", 1)[1]: e.cpu_time_total / 1e3 / steps
        for e in events
        if e.key.startswith("region::")
    }
    ops = sorted(
        (e for e in events if not e.key.startswith(("region::", "step"))),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    op_self_ms = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    num_ops = sum(e.count for e in ops if e.key.startswith("aten::")) / steps
    step_ms = wall / steps * 1000
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "ms_per_step": step_ms,
        "tok_per_s": batch / (step_ms / 1000),
        "regions_ms": dict(sorted(regions.items(), key=lambda kv: -kv[1])),
        "outside_regions_ms": step_ms - sum(regions.values()),
        "op_self_ms": op_self_ms,
        "aten_ops_per_step": num_ops,
        "top_ops": [
            {"op": e.key, "calls": e.count / steps, "self_ms": e.self_cpu_time_total / 1e3 / steps}
            for e in ops[:15]
        ],
    }


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(
            f"B={r['batch']}: {r['ms_per_step']:.2f} ms/step ({r['tok_per_s']:.0f} tok/s), "
            f"{r['aten_ops_per_step']:.0f} aten ops/step, op self time {r['op_self_ms']:.2f} ms"
        )
        lines.append(
            "  regions (ms/step, inclusive): " + ", ".join(f"{k} {v:.2f}" for k, v in r["regions_ms"].items())
        )
        lines.append(
            f"  outside regions (runner, LM head, sampling, scheduler, update): {r['outside_regions_ms']:.2f}"
        )
        for op in r["top_ops"][:10]:
            lines.append(f"    {op['op']:<40} {op['calls']:>7.1f} calls {op['self_ms']:>8.3f} ms")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tag", default="", help="suffix of the result name (e.g. a change being measured)")
    p.add_argument(
        "--output", default=None, help="JSON path (default: benchmarks/results/, by hardware and date)"
    )
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(batches),
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        kv_cache_memory_gib=args.kv_cache_gib,
    )
    handles = _label_modules(llm.engine.runner.model)
    rows = [profile_batch(llm, b, args.context, args.steps, args.warmup, vocab) for b in batches]
    for h in handles:
        h.remove()
    text = table(rows)
    print(text)
    name = "step_profile" + (f"_{args.tag}" if args.tag else "")
    path = Path(args.output) if args.output else result_path(name)
    save(name, {"model": args.model, "dtype": args.dtype, "context": args.context, "rows": rows}, path)
    path.with_suffix(".txt").write_text(text + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
