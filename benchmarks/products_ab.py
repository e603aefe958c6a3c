"""A decode step's products through two revisions' native kernels, in one process, interleaved.

    python benchmarks/products_ab.py --baseline e7420c2 --rows 1,4,32
    python benchmarks/products_ab.py --baseline e7420c2 --emulated   # the build without AVX512-BF16
    python benchmarks/products_ab.py --baseline e7420c2 --avx2       # the build for AVX2 (no AVX-512)

Each side's kernels (kernels/native: a git checkout of `--baseline`, and the working tree or
`--candidate REV`) are built by that side's own loader in a subprocess, then both libraries are
loaded here and called directly: one sweep is every product of one decode step of the model (per
layer the attention's projections, the absorbed per-head products, and the dense MLP or the routed
and shared experts; then the LM head), each through its own weight, so the weights come from
memory as in a step. The sides alternate sweep by sweep, which goes first swapping each round, and
a 64 MB buffer is rewritten before each sweep (not with `--warm`: a small model's weights stay in
cache from step to step, and its products are bound by the core, not the memory). Reported per
row count: each side's median ms a sweep and baseline / candidate (> 1: the candidate is
faster). This isolates the products from the rest of a step (Python, attention, the scheduler),
whose noise on a shared VM is larger than a kernel change's effect.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ab_revisions import checkouts  # noqa: E402
from benchmarks.common import save  # noqa: E402
from kernels import native  # noqa: E402

# The loaded library's file, through the private module attribute: the baseline's own loader
# prints it, and an older revision has no public accessor to ask.
LIBRARY_PATH = r"""
from pathlib import Path
from engine import env
from kernels import native
try:
    from engine.platform import load_native
except ImportError:  # a revision before it (and before the AVX2 build)
    load_native = lambda: native.load(Path(env.native_build_dir()), bf16=env.native_bf16())
assert load_native(), "the native kernels did not load"
print(native._library.__file__)
"""


def build(tree: Path, emulated: bool, avx2: bool = False) -> Path:
    """Path of `tree`'s native library, built by its own loader (in the shared build cache)."""
    env = {
        **os.environ,
        "PDSERVE_NATIVE_BF16": "0" if emulated else "1",
        "PDSERVE_NATIVE_AVX512": "0" if avx2 else "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", LIBRARY_PATH], cwd=tree, env=env, check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1]).resolve()  # a seeded library: this checkout's file


def load_library(path: Path, threads: int):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(library)
    library.use_pool(threads if threads > 1 else 0)  # as the engine's decode steps
    return library


def step_products(config: dict) -> list[tuple[int, int, int]]:
    """(batch, out_features, in_features) of each product of one decode step, in step order."""
    h, heads, lora = config["hidden_size"], config["num_attention_heads"], config["kv_lora_rank"]
    qk, rope = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["qk_rope_head_dim"]
    q_a = (
        [(1, config["q_lora_rank"], h), (1, heads * qk, config["q_lora_rank"])]
        if config.get("q_lora_rank")
        else []
    )
    dense = [(1, 2 * config["intermediate_size"], h), (1, h, config["intermediate_size"])]
    expert = [(1, 2 * config["moe_intermediate_size"], h), (1, h, config["moe_intermediate_size"])]
    experts = expert * (config["num_experts_per_tok"] + config.get("n_shared_experts", 0))
    shapes = []
    for layer in range(config["num_hidden_layers"]):
        shapes += q_a or [(1, heads * qk, h)]
        shapes += [(1, lora + rope, h), (heads, lora, config["qk_nope_head_dim"])]
        shapes += [(heads, config["v_head_dim"], lora), (1, h, heads * config["v_head_dim"])]
        shapes += dense if layer < config.get("first_k_dense_replace", 0) else experts
    return shapes + [(1, config["vocab_size"], h)]


def sweep(library, shapes, weights, xs, ys, rows: int, flush: torch.Tensor | None) -> float:
    """Seconds for every product of one step through `library`, after rewriting `flush` (if any)."""
    if flush is not None:
        flush.add_(1)
    time.sleep(0.003)  # past the other library's pool spinning (kernels/native/pool.h SPIN_NS)
    start = time.perf_counter()
    for (b, n, k), w, x, y in zip(shapes, weights, xs, ys, strict=True):
        library.linear_bf16(
            x.data_ptr(), rows * k, k, w.data_ptr(), n * k, k, y.data_ptr(), rows * n, n, b, rows, n, k
        )
    return time.perf_counter() - start


def revisions_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every kernel A/B here takes: the two revisions, the build, and the model
    whose config.json gives the shapes."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--candidate", default=None, help="git revision (default: the working tree)")
    p.add_argument("--emulated", action="store_true", help="both sides built without AVX512-BF16")
    p.add_argument("--avx2", action="store_true", help="both sides built for AVX2 (no AVX-512)")
    p.add_argument("--model", default="models/pdserve-bench", help="its config.json gives the shapes")
    return p


def build_name(args: argparse.Namespace) -> str:
    """The build both sides ran (revisions_parser's --avx2 / --emulated), for the results file."""
    return "AVX2" if args.avx2 else "AVX512-BF16 emulated" if args.emulated else "this CPU's instructions"


def main() -> int:
    p = revisions_parser(__doc__)
    p.add_argument("--rows", default="1,4,32", help="rows of x (tokens in the step)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--warm",
        action="store_true",
        help="no buffer rewritten between sweeps: the weights stay in cache, as a small model's do "
        "(pdserve-tiny's whole step fits in this CPU's L3)",
    )
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if not native.supported():
        print(f"the native kernels do not run on this CPU (it lacks {'/'.join(native.REQUIRED_FLAGS)})")
        return 1
    torch.set_num_threads(1)  # the kernels' own pool shares the work (use_pool)
    torch.manual_seed(0)
    with checkouts(args.baseline, args.candidate, prefix="pdserve-products-ab-") as (base_tree, cand_tree):
        paths = {
            side: build(tree, args.emulated, args.avx2)
            for side, tree in (("baseline", base_tree), ("candidate", cand_tree))
        }
    libraries = {side: load_library(path, args.threads) for side, path in paths.items()}
    shapes = step_products(json.loads((Path(args.model) / "config.json").read_text()))
    weights = [(torch.randn(b, n, k) * k**-0.5).bfloat16() for b, n, k in shapes]
    megabytes = sum(w.numel() * 2 for w in weights) / 1e6
    flush = None if args.warm else torch.zeros(64 << 20, dtype=torch.uint8)
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [torch.randn(b, rows, k).bfloat16() for b, _, k in shapes]
        ys = [torch.empty(b, rows, n, dtype=torch.bfloat16) for b, n, _ in shapes]

        times: dict[str, list[float]] = {side: [] for side in libraries}
        for r in range(args.rounds):
            order = list(libraries.items())
            for side, library in order if r % 2 == 0 else order[::-1]:
                times[side].append(sweep(library, shapes, weights, xs, ys, rows, flush))
        base_ms, cand_ms = (statistics.median(times[s]) * 1e3 for s in ("baseline", "candidate"))
        table.append(
            {"rows": rows, "baseline_ms": base_ms, "candidate_ms": cand_ms, "speedup": base_ms / cand_ms}
        )
        print(
            f"{rows:4d} rows: baseline {base_ms:7.3f} ms  candidate {cand_ms:7.3f} ms  {base_ms / cand_ms:.3f}x"
        )
    kind = ("avx2" if args.avx2 else "emulated" if args.emulated else "native") + (
        "_warm" if args.warm else ""
    )
    path = save(
        f"products_ab_{kind}",
        {
            "baseline": args.baseline,
            "candidate": args.candidate or "working tree",
            "build": build_name(args),
            "weights_mb": megabytes,
            "threads": args.threads,
            "weights_in_cache": args.warm,
            "rounds": args.rounds,
            "results": table,
        },
        Path(args.output) if args.output else None,
    )
    print(f"{megabytes:.1f} MB of weights a sweep")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
