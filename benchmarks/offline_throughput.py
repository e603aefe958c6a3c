"""Offline throughput and batch-1 decode latency of the engine vs HF transformers, in one run.

Workload (issue 2): 64 prompts of 128 random token ids, 128 output tokens each (ignore_eos),
greedy. Baseline: transformers `generate()` on the same checkpoint, batch 8 equal-length prompts,
greedy, min_new_tokens = max_new_tokens = 128. Both are timed here, back to back, and reported
as ratios. Results go to benchmarks/results/offline_throughput_<hardware>_<date>.json.

    python benchmarks/offline_throughput.py --model models/pdserve-bench
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, save  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

REPEATS = 3


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def bench_engine(args, prompts: list[list[int]]) -> dict:
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory_gib=2.0)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=warm)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with Timer() as t:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    total = sum(len(o.token_ids) for o in outs)
    assert total == len(prompts) * args.output_len
    # Batch-1 decode: time between the first and the last token of one request, the median of
    # REPEATS requests (a shared 2-core VM is noisy).
    runs = []
    for r in range(REPEATS):
        llm.engine.kv.reset_prefix_cache()
        one = llm.generate(
            prompt_token_ids=[prompts[r][::-1]],
            sampling_params=SamplingParams(
                temperature=0.0, max_tokens=args.batch1_tokens + 1, ignore_eos=True
            ),
        )[0]
        m = one.metrics
        runs.append((m.finished_time - m.first_token_time) / args.batch1_tokens * 1000)
    return {
        "output_tokens": total,
        "seconds": t.seconds,
        "tok_per_s": total / t.seconds,
        "batch1_ms_per_token": statistics.median(runs),
        "batch1_runs_ms": runs,
    }


def bench_hf(args, prompts: list[list[int]], dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).eval()
    gen = dict(do_sample=False, pad_token_id=0)
    batch = torch.tensor(prompts[: args.hf_batch])
    with torch.inference_mode():
        model.generate(batch[:, :16], max_new_tokens=2, min_new_tokens=2, **gen)  # warm-up
        with Timer() as t:
            out = model.generate(batch, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **gen)
        assert out.shape[1] == batch.shape[1] + args.output_len
        runs = []
        for r in range(REPEATS):
            one = batch[r : r + 1].flip(1)
            with Timer() as t1:
                model.generate(one, max_new_tokens=1, min_new_tokens=1, **gen)
            n = args.batch1_tokens + 1
            with Timer() as tn:
                model.generate(one, max_new_tokens=n, min_new_tokens=n, **gen)
            runs.append((tn.seconds - t1.seconds) / args.batch1_tokens * 1000)
    total = batch.shape[0] * args.output_len
    return {
        "dtype": dtype,
        "batch": batch.shape[0],
        "output_tokens": total,
        "seconds": t.seconds,
        "tok_per_s": total / t.seconds,
        "batch1_ms_per_token": statistics.median(runs),
        "batch1_runs_ms": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-tokens", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--hf-dtypes", default="bfloat16,float32", help="comma-separated; empty skips HF")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import json

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab)

    engine = bench_engine(args, prompts)
    print(
        f"pdserve ({args.dtype}): {engine['tok_per_s']:.1f} output tok/s, batch-1 decode {engine['batch1_ms_per_token']:.2f} ms/token"
    )
    baselines = []
    for dtype in filter(None, args.hf_dtypes.split(",")):
        hf = bench_hf(args, prompts, dtype)
        hf["throughput_ratio"] = engine["tok_per_s"] / hf["tok_per_s"]
        hf["batch1_ratio"] = hf["batch1_ms_per_token"] / engine["batch1_ms_per_token"]
        baselines.append(hf)
        print(
            f"HF transformers ({dtype}, batch {hf['batch']}): {hf['tok_per_s']:.1f} output tok/s, "
            f"batch-1 decode {hf['batch1_ms_per_token']:.2f} ms/token -> pdserve is "
            f"{hf['throughput_ratio']:.1f}x throughput, {hf['batch1_ratio']:.1f}x faster batch-1 decode"
        )
    path = save(
        "offline_throughput",
        {
            "model": args.model,
            "workload": {
                k: getattr(args, k)
                for k in ("num_prompts", "prompt_len", "output_len", "batch1_tokens", "dtype")
            },
            "pdserve": engine,
            "hf_transformers": baselines,
        },
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
