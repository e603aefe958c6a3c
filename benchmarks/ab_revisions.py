"""Is a change slower? The offline or the serving workload on two revisions, interleaved, in one run.

    python benchmarks/ab_revisions.py --baseline dea7569 --model models/pdserve-bench --rounds 3
    python benchmarks/ab_revisions.py --baseline dea7569 --workload serving --rounds 2

Each round runs the same driver once against each side -- a git checkout of `--baseline` and the
working tree (or `--candidate REV`) -- in fresh processes with this interpreter, alternating
which side goes first so the drift of a shared VM falls on both alike. The driver is the offline
throughput workload (issue 2: `--num-prompts` prompts of `--prompt-len` random ids, `--output-len`
new tokens each, greedy, ignore_eos) plus batch-1 decode (median of 3 requests), through the
offline `LLM` API, so any revision that has that API can be measured. Reported per side: the
medians of output tok/s, batch-1 ms/token and the process's CPU seconds (user + system, the
steadier figure on a noisy VM); and candidate / baseline ratios (> 1 is better: rates as they
are, times inverted).

`--workload serving` runs each side's own `benchmarks/serving.py` instead (a router, a prefill and
a decode worker as processes, Poisson arrivals at `--rate`, `--num-requests` per mode, both
disaggregated and colocated) and compares each mode's output tok/s and TTFT and inter-token p50.
Results go to benchmarks/results/ab_revisions[_serving]_<hardware>_<date>.json unless `--output`
says otherwise.

Compare like with like: the baseline runs from a worktree in a temporary folder, the default
candidate from this checkout, and on the 2-core EPYC (2026-12-07) that alone made the candidate
5-10 % slower in every round (the same code from a worktree beside the baseline's was not):
commit and pass `--candidate REV` for figures you report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import result_path, save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
import json, random, statistics, sys, time
from engine import LLM, SamplingParams
model, dtype, n, plen, olen, threads, gib = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]), float(sys.argv[7])
vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
rng = random.Random(0)
prompts = [[rng.randrange(10, vocab) for _ in range(plen)] for _ in range(n)]
llm = LLM(model, dtype=dtype, num_threads=threads, kv_cache_memory_gib=gib)
llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
start = time.perf_counter()
outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True))
seconds = time.perf_counter() - start
assert sum(len(o.token_ids) for o in outs) == n * olen
runs = []
# Revisions before the KV cache manager (issue 52) reset through the block manager's pool.
kv = llm.engine.kv if hasattr(llm.engine, "kv") else llm.engine.block_manager.pool
for r in range(3):
    kv.reset_prefix_cache()
    one = llm.generate(prompt_token_ids=[prompts[r % n][::-1]], sampling_params=SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))[0]
    runs.append((one.metrics.finished_time - one.metrics.first_token_time) / 64 * 1000)
print("RESULT " + json.dumps({"tok_per_s": n * olen / seconds, "batch1_ms_per_token": statistics.median(runs)}))
"""


def add_worktree(tree: Path, rev: str) -> None:
    """A git worktree of rev at tree, given this checkout's built native kernels (links to them,
    which outlive the worktree): a library is named by a key over its sources, flags and torch,
    so the revision loads one of them only where it would have built the very same file, and
    compiles the others at first use as before."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    built = REPO / "kernels" / "native" / "prebuilt"
    libraries = sorted(built.glob("*.so")) if built.is_dir() else []
    if libraries:
        (tree / "kernels" / "native" / "prebuilt").mkdir(parents=True, exist_ok=True)
        for lib in libraries:
            (tree / "kernels" / "native" / "prebuilt" / lib.name).symlink_to(lib.resolve())


@contextlib.contextmanager
def checkouts(
    baseline: str, candidate: str | None, prefix: str = "pdserve-ab-"
) -> Iterator[tuple[Path, Path]]:
    """(baseline tree, candidate tree): git worktrees of the revisions in a temporary folder (the
    candidate None: this working tree itself), removed again on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        trees: list[Path] = []
        try:
            for side, rev in (("baseline", baseline), ("candidate", candidate)):
                if rev is None:
                    continue
                tree = Path(tmp) / side
                add_worktree(tree, rev)
                trees.append(tree)
            yield trees[0], trees[1] if candidate is not None else REPO
        finally:
            for tree in trees:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
                )


def _run_side(tree: Path, args) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(Path(args.model).resolve()), args.dtype]
        + [
            str(x)
            for x in (args.num_prompts, args.prompt_len, args.output_len, args.threads, args.kv_cache_gib)
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"driver failed in {tree}:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def _run_serving(tree: Path, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="pdserve-ab-serving-") as tmp:
        out = Path(tmp) / "serving.json"
        cmd = [sys.executable, "benchmarks/serving.py", "--model", str(Path(args.model).resolve())]
        cmd += ["--dtype", args.dtype, "--rates", str(args.rate), "--num-requests", str(args.num_requests)]
        cmd += [
            "--input-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--output",
            str(out),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise RuntimeError(f"serving benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
        [row] = json.loads(out.read_text())["results"]
    result = {}
    for mode in ("disaggregated", "colocated"):
        r = row[mode]
        if r["failures"]:
            raise RuntimeError(f"{r['failures']} {mode} requests failed in {tree}: {r['errors']}")
        result[f"{mode}_tok_per_s"] = r["output_tok_per_s"]
        result[f"{mode}_ttft_p50_ms"] = r["ttft_ms"]["p50"]
        result[f"{mode}_itl_p50_ms"] = r["itl_ms"]["p50"]
    return result


def _summary(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _ratios(base: dict, cand: dict) -> dict:
    """candidate / baseline, > 1 is better: rates as they are, times (ms, CPU seconds) inverted."""
    return {key: cand[key] / base[key] if "per_s" in key else base[key] / cand[key] for key in base}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--workload", choices=["offline", "serving"], default="offline")
    p.add_argument("--rate", type=float, default=2.0, help="serving: requests/s (Poisson arrivals)")
    p.add_argument("--num-requests", type=int, default=16, help="serving: requests per mode")
    p.add_argument("--candidate", default=None, help="git revision (default: the working tree)")
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="the offline benchmark's KV cache size")
    p.add_argument(
        "--output", default=None, help="JSON path (default: benchmarks/results/, by hardware and date)"
    )
    args = p.parse_args()
    with checkouts(args.baseline, args.candidate) as (base, cand):
        runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
        for r in range(args.rounds):
            order = [("baseline", base), ("candidate", cand)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                run = _run_side if args.workload == "offline" else _run_serving
                runs[side].append(run(tree, args))
                print(f"round {r + 1} {side}: {runs[side][-1]}", flush=True)
    summary = {side: _summary(rs) for side, rs in runs.items()}
    ratios = _ratios(summary["baseline"], summary["candidate"])
    for side, values in summary.items():
        print(f"{side}: " + ", ".join(f"{k} {v:.2f}" for k, v in values.items()))
    print("candidate / baseline (> 1 is better): " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    candidate = (
        args.candidate
        or subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        + " + working tree"
    )
    name = "ab_revisions" + ("" if args.workload == "offline" else f"_{args.workload}")
    path = Path(args.output) if args.output else result_path(name)
    per_workload = (
        ("num_prompts", "threads", "kv_cache_gib") if args.workload == "offline" else ("rate", "num_requests")
    )
    keys = ("workload", "model", "dtype", "prompt_len", "output_len", "rounds") + per_workload
    save(
        name,
        {
            "baseline": args.baseline,
            "candidate": candidate,
            "workload": {k: getattr(args, k) for k in keys},
            "runs": runs,
            "median": summary,
            "ratios": ratios,
        },
        path,
    )
    print(f"saved {path}")


if __name__ == "__main__":
    main()
