"""How long torch's OpenMP threads spin after a parallel region, measured: the same offline
workloads in processes started with each setting, alternating, reported as ratios to the first.

The engine's decode steps run on the native kernels' own thread pool (kernels/native/pool.h);
torch's OpenMP threads run the prefill's products and attention. After each of its parallel
regions libgomp keeps its threads spinning (GOMP_SPINCOUNT rounds; 300,000 unless the environment
says otherwise), so the steps right after a prefill share the cores with a spinning thread.
Importing engine asks for 30,000 (engine/__init__.py). Settings (--settings, comma-separated):
a number is GOMP_SPINCOUNT, `passive` is OMP_WAIT_POLICY=PASSIVE (no spin).

Workloads, per process, --rounds each: `offline`, C prompts of --prompt-len random ids, all at
once, --output-len tokens each (output tok/s); `arriving`, C prompts arriving two every three
engine steps, so that prefill chunks and decode steps alternate (output tok/s). Each process
reports its rounds' medians; the medians over --pairs processes per setting are compared.

    python benchmarks/openmp_spin.py --model models/pdserve-bench --pairs 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LIBGOMP_DEFAULT = "300000"


def child(args: argparse.Namespace) -> None:
    """One process's workloads, its setting in the environment it started with (libgomp reads it
    when torch loads it, whatever is imported first)."""
    from benchmarks.offline_throughput import random_prompts
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory_gib=1.0)
    vocab = llm.engine.model_cfg.vocab_size

    def prompts(seed: int) -> list[list[int]]:
        return random_prompts(args.concurrency, args.prompt_len, vocab, seed)

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts(10_000)[:8], sampling_params=params)  # warm-up
    engine, rates = llm.engine, {"offline": [], "arriving": []}
    for r in range(args.rounds):
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts(2 * r), sampling_params=params)
        rates["offline"].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        waiting, steps, tokens = prompts(2 * r + 1), 0, 0
        start = time.perf_counter()
        while waiting or engine.has_unfinished_requests():
            if waiting and steps % 3 == 0:
                for _ in range(min(2, len(waiting))):
                    engine.add_request(f"arriving-{r}-{len(waiting)}", waiting.pop(), params)
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            steps += 1
        rates["arriving"].append(tokens / (time.perf_counter() - start))
    print(json.dumps({name: statistics.median(v) for name, v in rates.items()}))


def environment(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = setting
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3, help="processes per setting, the settings alternating")
    p.add_argument("--settings", default=f"{LIBGOMP_DEFAULT},30000,passive")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    settings = args.settings.split(",")
    if any(s != "passive" and not s.isdigit() for s in settings) or min(args.pairs, args.rounds) < 1:
        raise SystemExit("--settings: numbers (GOMP_SPINCOUNT) or passive; --pairs and --rounds >= 1")
    from benchmarks.common import ratios, save

    forwarded = argv if argv is not None else sys.argv[1:]  # a child ignores --output
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for pair in range(args.pairs):
        for setting in settings:
            proc = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child"],
                env=environment(setting),
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise SystemExit(f"setting {setting}: the child failed\n{proc.stdout}\n{proc.stderr}")
            runs[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(
                f"pair {pair}, {setting}: "
                + ", ".join(f"{k} {v:.1f} tok/s" for k, v in runs[setting][-1].items())
            )
    first = settings[0]
    results = []
    for setting in settings:
        row = {"setting": setting, "runs": runs[setting]}
        for workload in ("offline", "arriving"):
            mine = [run[workload] for run in runs[setting]]
            base = [run[workload] for run in runs[first]]
            row[f"{workload}_tok_s"] = statistics.median(mine)
            row[f"{workload}_ratio"], row[f"{workload}_paired_ratio"] = ratios(mine, base)
        results.append(row)
        print(
            f"{setting:>8}: offline {row['offline_tok_s']:.1f} tok/s ({row['offline_ratio']:.3f}x, "
            f"{row['offline_paired_ratio']:.3f}x by pair), arriving {row['arriving_tok_s']:.1f} "
            f"({row['arriving_ratio']:.3f}x, {row['arriving_paired_ratio']:.3f}x by pair)"
        )
    settings_out = {k: v for k, v in vars(args).items() if k not in ("child", "output")}
    path = save(
        "openmp_spin",
        {"settings": settings_out, "results": results},
        Path(args.output) if args.output else None,
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
