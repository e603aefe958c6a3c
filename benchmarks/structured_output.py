"""What a structured-output constraint costs: decode tok/s with every request under a JSON-schema
constraint against the same requests unconstrained, at batch 1 and 32, in one run; and the
schema's compile time, cold and cached.

    python benchmarks/structured_output.py --model models/pdserve-bench --batches 1,32

For each batch B (after one untimed run at that size), `--rounds` rounds alternate the two sides
(which goes first alternates too, so a shared VM's drift falls on both; the prefix cache is reset
before each, so both prefill alike). A side is B greedy requests with random prompt ids, each
decoding `--max-tokens` tokens (ignore_eos): decode tok/s excludes the prefill (from the last
request's first token on). The constraint is an object whose one string property must be at
least `--min-length` characters long, so no request completes it within max_tokens: every step
of every request is masked, the case that costs most. The ratio reported per batch is the median
of the per-round ratios (constrained / unconstrained, < 1 is slower); the same is reported per
CPU second of the process (all its threads, the mask thread's included), the steadier figure on a
shared VM whose other tenants take wall time. Compile times are for a
schema the compiler has not seen (cold) and the same one again (cached), medians of `--rounds`.
Saves JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.structured import StructuredOutputsParams  # noqa: E402


def schema(min_length: int, tag: str = "") -> str:
    return json.dumps(
        {
            "type": "object",
            "title": f"Note{tag}",
            "properties": {"text": {"type": "string", "minLength": min_length}},
            "required": ["text"],
        }
    )


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, float]:
    """Decode tokens per second and per CPU second of the prompts run together, from the last
    request's first token on."""
    engine = llm.engine
    engine.kv.reset_prefix_cache()  # both sides prefill the same way
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}-{time.monotonic_ns()}", ids, params)
    started: set[str] = set()
    first_all, first_cpu, outputs = None, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs += len(out.new_token_ids)
            started.add(out.request_id)
            if first_all is None and len(started) == len(prompts):
                first_all, first_cpu = time.perf_counter(), time.process_time()
            assert out.finish_reason in (None, "length"), f"{out.request_id} ended {out.finish_reason}"
    tokens = outputs - len(prompts)
    return tokens / (time.perf_counter() - first_all), tokens / (time.process_time() - first_cpu)


def compile_seconds(llm: LLM, constraint: StructuredOutputsParams) -> float:
    compiler = llm.engine.structured.compiler
    start = time.perf_counter()
    compiler.submit(constraint).result()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-length", type=int, default=2000, help="the constrained string's minLength")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)

    engine_args = {"dtype": args.dtype, "kv_cache_memory_gib": args.kv_cache_gib}
    if args.threads:
        engine_args["num_threads"] = args.threads
    llm = LLM(args.model, **engine_args)
    vocab = llm.engine.model_cfg.vocab_size
    rng = random.Random(0)
    constraint = StructuredOutputsParams(json=schema(args.min_length))
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, structured_outputs=constraint
    )
    llm.engine.structured.check(constraint)  # the tokenizer's vocabulary and this schema, once
    warm = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(2)]
    decode_rate(llm, warm, constrained, "warm-c")

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        warm = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        decode_rate(llm, warm, plain, f"warm-{batch}")  # this batch size's shapes once, untimed
        rates: dict[str, list[tuple[float, float]]] = {"unconstrained": [], "json_schema": []}
        for r in range(args.rounds):
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            sides = [("unconstrained", plain), ("json_schema", constrained)]
            for name, params in sides if r % 2 == 0 else sides[::-1]:
                rates[name].append(decode_rate(llm, prompts, params, f"{name}-{batch}-{r}"))
        row: dict = {"batch": batch}
        for i, unit in enumerate(("tok_per_s", "tok_per_cpu_s")):
            plain_rates = [x[i] for x in rates["unconstrained"]]
            json_rates = [x[i] for x in rates["json_schema"]]
            ratios = [c / u for c, u in zip(json_rates, plain_rates, strict=True)]
            suffix = "" if i == 0 else "_cpu"
            row[f"unconstrained_{unit}"] = statistics.median(plain_rates)
            row[f"json_schema_{unit}"] = statistics.median(json_rates)
            row[f"ratio{suffix}"] = statistics.median(ratios)
            row[f"ratios{suffix}"] = ratios
        rows.append(row)
        print(
            f"B={batch}: unconstrained {row['unconstrained_tok_per_s']:.1f} tok/s, "
            f"JSON schema {row['json_schema_tok_per_s']:.1f} tok/s, ratio {row['ratio']:.3f} "
            f"(per CPU second: {row['ratio_cpu']:.3f})"
        )

    cold, cached = [], []
    for r in range(args.rounds):
        fresh = StructuredOutputsParams(json=schema(args.min_length, tag=f"{r}-{time.monotonic_ns()}"))
        cold.append(compile_seconds(llm, fresh))
        cached.append(compile_seconds(llm, fresh))
    compile_ms = {"cold": 1000 * statistics.median(cold), "cached": 1000 * statistics.median(cached)}
    print(f"compile: cold {compile_ms['cold']:.2f} ms, cached {compile_ms['cached']:.3f} ms")
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "schema": json.loads(schema(args.min_length)),
        "rounds": args.rounds,
        "rows": rows,
        "compile_ms": compile_ms,
    }
    print(f"saved {save('structured_output', result, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
