"""Steady-state decode throughput of the engine at batch 8 ... 256, context 256.

For each batch size B: B requests with 256-token random prompts are prefilled, then N decode
steps are timed (every request in the batch decodes one token per step); tokens/s = B * N / time.
Saves JSON and a PNG plot under benchmarks/results/ (named by hardware and date).

    python benchmarks/decode_curve.py --model models/pdserve-bench
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import hardware_slug, plot_decode_curves, result_path, save  # noqa: E402
from benchmarks.offline_throughput import random_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PREFILL_BUDGET = 4096


def headroom(batch: int, context: int) -> int:
    """Tokens the first-prefilled requests decode while the rest of the batch is still prefilling."""
    return batch * context // PREFILL_BUDGET + 4


def decode_rate(llm: LLM, batch: int, context: int, steps: int, vocab: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + headroom(batch, context), ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=batch)):
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()  # prefill (chunked) until every request has its first token
    start = time.perf_counter()
    for _ in range(steps):
        outs = engine.step()
        assert len(outs) == batch, f"every request must decode in every timed step ({len(outs)} of {batch})"
    seconds = time.perf_counter() - start
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "seconds": seconds,
        "tok_per_s": batch * steps / seconds,
        "ms_per_step": seconds / steps * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="8,16,32,64,128,256")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    import json

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_num_seqs=max(batches),
        max_num_batched_tokens=PREFILL_BUDGET,
        kv_cache_memory_gib=1.5
        * max(batches)
        * (args.context + args.steps + headroom(max(batches), args.context))
        * 20e3
        / 2**30,
    )
    decode_rate(llm, 4, 32, 2, vocab)  # warm-up
    rows = []
    for batch in batches:
        row = decode_rate(llm, batch, args.context, args.steps, vocab)
        rows.append(row)
        print(f"batch {batch:4d}: {row['tok_per_s']:8.1f} tok/s ({row['ms_per_step']:.1f} ms/step)")
    path = save(
        "decode_curve", {"model": args.model, "dtype": args.dtype, "context": args.context, "rows": rows}
    )
    print(f"saved {path}")
    title = (
        f"pdserve decode, context {args.context}, {args.dtype}\n{hardware_slug()}, torch {torch.__version__}"
    )
    try:
        png = plot_decode_curves(
            {"pdserve": [(r["batch"], r["tok_per_s"]) for r in rows]},
            title,
            result_path("decode_curve", "png"),
        )
    except ImportError:
        return
    print(f"saved {png}")


if __name__ == "__main__":
    main()
