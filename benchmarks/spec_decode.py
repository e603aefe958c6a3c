"""MTP speculative decoding: decode speed at batch 1, 8 and 32 with k = 0 (off), 1, 2, 3 drafts,
in one run, on a model with an MTP layer (the trained default model).

For each (batch, k): `batch` requests with prompts from the model's own training-style text are
generated greedily to `--max-tokens` tokens; decode tokens/s and ms/token exclude the prefill
(the time to the last request's first token). `--repeats` rounds run the k values interleaved;
the medians are reported, and each speedup is the median of the per-round ratios to k = 0.
Acceptance per draft position and the mean accept length come from the engine's counters. The
time to first token of a `--prompt-tokens` prompt, per k in interleaved rounds as well, shows
what the MTP layer's pass over a prompt adds. `--step-by-step` adds each k > 0 again with the
one-call greedy speculative step off (rows "k s": the forward, the verification and the drafter's
passes one by one), the baseline of that step in the same run. `--draft-vocab FILE` adds each
k > 0 again drafting from that draft vocabulary's tokens alone (rows "k v"; `pdserve draft-vocab`
writes the file). Saves JSON under benchmarks/results/.

    python benchmarks/spec_decode.py --model assets/pdserve-tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.spec_decode.stats import SpecStats  # noqa: E402

PROMPTS = [
    "The module provides",
    "This function returns",
    "If the argument is",
    "The following example shows",
    "Return a new",
    "This class is used",
    "The default value is",
    "Raise an exception if",
]


def run(llm: LLM, batch: int, max_tokens: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, llm.tokenizer.encode(p), params)
    first_all, outputs = None, 0
    started = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs += len(out.new_token_ids)
            tokens[out.request_id] += out.new_token_ids
            started.add(out.request_id)
            if first_all is None and len(started) == batch:
                first_all = time.perf_counter()
    end = time.perf_counter()
    decode_tokens = outputs - batch  # the first token of each request comes with its prefill
    decode_s = end - (first_all or start)
    return {
        "batch": batch,
        "decode_tok_per_s": decode_tokens / decode_s,
        "ms_per_token": 1000 * decode_s / (max_tokens - 1),
        "total_s": end - start,
        "tokens": [tokens[rid] for rid in ids],
    }


def time_to_first_token(llm: LLM, prompt_tokens: int, tag: str) -> float:
    """Seconds from adding one prompt of about prompt_tokens tokens (its first block unique to
    `tag`, so nothing comes from the prefix cache) to its first token."""
    text = " ".join(f"{PROMPTS[i % len(PROMPTS)]} {tag}-{i}." for i in range(prompt_tokens))
    ids = llm.tokenizer.encode(text)[:prompt_tokens]
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(f"ttft-{tag}-{time.monotonic_ns()}", ids, SamplingParams(max_tokens=1))
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    return first - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/pdserve-tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--ks", default="0,1,2,3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--repeats", type=int, default=5, help="interleaved rounds per batch size; medians reported"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=1000,
        help="prompt length of the time-to-first-token rows (the MTP layer's prompt pass); 0: none",
    )
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config's disable_by_batch_size for every k > 0 (results saved apart)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--step-by-step",
        action="store_true",
        help="also run each k > 0 with the one-call greedy speculative step off (the forward, the "
        "verification and the drafter's passes one by one: the baseline of that step)",
    )
    p.add_argument(
        "--draft-vocab",
        default=None,
        help="also run each k > 0 drafting from this draft vocabulary file's tokens alone",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="results file (default: results/spec_decode_<hw>_<date>.json)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="batch 1, k 0 and 1, 8 tokens, one round; nothing saved"
    )
    args = p.parse_args(argv)
    batches = [1] if args.smoke else [int(b) for b in args.batches.split(",")]
    ks = [0, 1] if args.smoke else [int(k) for k in args.ks.split(",")]
    max_tokens = 8 if args.smoke else args.max_tokens
    repeats = 1 if args.smoke else args.repeats
    # Each variant: (k, whether greedy speculative steps may run as one native call, whether the
    # drafts come from the draft vocabulary).
    variants = [(k, True, False) for k in ks]
    variants += [(k, False, False) for k in ks if k and args.step_by_step]
    variants += [(k, True, True) for k in ks if k and args.draft_vocab]
    llms = {}
    for k, one_call, vocab in variants:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        if spec and args.disable_by_batch_size:
            spec["disable_by_batch_size"] = args.disable_by_batch_size
        if vocab:
            spec["draft_vocab"] = args.draft_vocab
        llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, speculative_config=spec)
        if not one_call:
            llm.engine.runner._greedy_spec_step = lambda *a: None  # every step through the Python path
        llms[k, one_call, vocab] = llm
        run(llm, 1, 4)  # warm-up
    rows = []
    for batch in batches:
        # Rounds interleave the k values, so drift in the machine's speed (it is shared) hits every
        # k alike; each speedup is the median of the per-round ratios to k = 0.
        runs: dict[tuple[int, bool, bool], list[dict]] = {v: [] for v in variants}
        for v in variants:  # counters of this batch size only
            llms[v].engine.spec_stats = SpecStats(v[0])
        for _ in range(repeats):
            for v in variants:
                runs[v].append(run(llms[v], batch, max_tokens))
        for v in variants:
            k, one_call, vocab = v
            st = llms[v].engine.spec_stats
            tps = [r["decode_tok_per_s"] for r in runs[v]]
            row = {
                "batch": batch,
                "k": k,
                "one_call_step": one_call,
                "draft_vocab": args.draft_vocab if vocab else None,
                "decode_tok_per_s": statistics.median(tps),
                "decode_tok_per_s_min_max": [min(tps), max(tps)],
                "ms_per_token": statistics.median(r["ms_per_token"] for r in runs[v]),
                "rounds": repeats,
                "verifications": st.num_drafts,
                "mean_accept_length": st.mean_accept_length if st.num_drafts else 1.0,
                "acceptance_per_position": st.per_position(),
            }
            if (0, True, False) in runs:
                # Greedy: drafts only change how many tokens a step yields, never which.
                base = runs[0, True, False]
                row["same_tokens_as_k0"] = all(
                    r["tokens"] == b["tokens"] for r, b in zip(runs[v], base, strict=True)
                )
                row["speedup"] = statistics.median(
                    r["decode_tok_per_s"] / b["decode_tok_per_s"] for r, b in zip(runs[v], base, strict=True)
                )
            rows.append(row)
    ttft_rows = []
    if args.prompt_tokens and not args.smoke:
        ttfts: dict[int, list[float]] = {k: [] for k in ks}
        for r in range(repeats):
            for k in ks:
                ttfts[k].append(time_to_first_token(llms[k, True, False], args.prompt_tokens, f"{r}-{k}"))
        for k in ks:
            row = {"k": k, "prompt_tokens": args.prompt_tokens, "ttft_ms": 1000 * statistics.median(ttfts[k])}
            if 0 in ttfts:
                row["vs_k0"] = statistics.median(a / b for a, b in zip(ttfts[k], ttfts[0], strict=True))
            ttft_rows.append(row)
    print(
        f"{'batch':>5} {'k':>3} {'decode tok/s':>13} {'ms/token':>9} {'vs k=0':>7} {'accept len':>10} {'same tokens':>11}  per-position acceptance"
    )
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) if r["verifications"] else "-"
        print(
            f"{r['batch']:>5} {_label(r):>3} {r['decode_tok_per_s']:>13.1f} {r['ms_per_token']:>9.1f} "
            f"{(r.get('speedup') or 0):>6.2f}x {r['mean_accept_length']:>10.2f} {str(r.get('same_tokens_as_k0', '-')):>11}  {pos}"
        )
    for r in ttft_rows:
        print(
            f"TTFT, {r['prompt_tokens']}-token prompt, k={r['k']}: {r['ttft_ms']:.1f} ms ({r.get('vs_k0', 0):.2f}x k=0)"
        )
    if not args.smoke:
        result = {
            "model": args.model,
            "dtype": args.dtype,
            "max_tokens": max_tokens,
            "disable_by_batch_size": args.disable_by_batch_size,
            "draft_vocab": args.draft_vocab,
            "rows": rows,
            "ttft": ttft_rows,
        }
        name = "spec_decode_disable_by_batch" if args.disable_by_batch_size else "spec_decode"
        print(f"saved {save(name, result, args.output)}")
    return 0


def _label(row: dict) -> str:
    """k, then s (step by step) or v (drafts from the draft vocabulary)."""
    return f"{row['k']}{'' if row['one_call_step'] else 's'}{'v' if row['draft_vocab'] else ''}"


if __name__ == "__main__":
    sys.exit(main())
