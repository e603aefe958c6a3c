"""The decode attention through two revisions' native kernels, in one process, interleaved.

    python benchmarks/attention_ab.py --baseline e66c77b --batches 64,256 --context 290
    # on an AMX CPU, one build's two paths: the tiles (amx_attend) against VDPBF16PS (attend)
    python benchmarks/attention_ab.py --baseline HEAD --baseline-path tiles --candidate-path vdpbf16ps
    python benchmarks/attention_ab.py --baseline e66c77b --avx2   # the build for AVX2 (no AVX-512)

Each side's kernels (kernels/native: a git checkout of `--baseline`, and the working tree or
`--candidate REV`) are built by that side's own loader in a subprocess, as products_ab.py does,
then both libraries are loaded here and their `mla_decode` called directly: one sweep is one
layer's decode attention (the model's heads, kv_lora_rank and rope width) for `batch` sequences
of `context` cached tokens each, over a paged cache of 16-token blocks in shuffled order. Each
side's attention runs on the AMX tile unit where the CPU has it (amx_attend; `--*-path tiles`, the
default), or through VDPBF16PS (attend; `--*-path vdpbf16ps`, and on a CPU without the unit). The
sides alternate sweep by sweep, which goes first
swapping each round, and a 64 MB buffer is rewritten before each sweep, so the cache comes from
memory as in a step. Reported per batch: each side's median ms a sweep and baseline / candidate
(> 1: the candidate is faster).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ab_revisions import checkouts  # noqa: E402
from benchmarks.common import save  # noqa: E402
from benchmarks.products_ab import build, build_name, load_library, revisions_parser  # noqa: E402
from kernels import native  # noqa: E402

BLOCK = 16  # the engine's default block size: whole 16-row tiles


def use_tiles(library, on: bool) -> bool:
    """The tile unit on or off in `library`; -> whether it is on (never the software tiles)."""
    try:
        return bool(library.use_amx(on, False))
    except TypeError:  # a revision before the software tiles (e66c77b): use_amx(on)
        return bool(library.use_amx(on))


def sweep(library, tiles: bool, q, cache, table, lens, out, lat: int, flush: torch.Tensor) -> float:
    """Seconds for one layer's attention through `library` (on the tiles or not: both sides may
    be one library), after rewriting `flush`."""
    use_tiles(library, tiles)
    flush.add_(1)
    time.sleep(0.003)  # past the other library's pool spinning (kernels/native/pool.h SPIN_NS)
    batch, heads, width = q.shape
    start = time.perf_counter()
    bad = library.mla_decode(
        q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(), cache.stride(0), cache.stride(1),
        cache.shape[0], cache.shape[1], table.data_ptr(), table.stride(0), table.shape[1], lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1), batch, heads, width, lat, 0.1,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert bad == 0
    return seconds


def main() -> int:
    p = revisions_parser(__doc__)
    p.add_argument("--batches", default="64,256", help="sequences in the step")
    p.add_argument("--context", type=int, default=290, help="cached tokens per sequence")
    for side in ("baseline", "candidate"):
        p.add_argument(
            f"--{side}-path",
            choices=("tiles", "vdpbf16ps"),
            default="tiles",
            help=f"the {side}'s attention: on the AMX tiles where the CPU has them, or VDPBF16PS",
        )
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if not native.supported():
        print(f"the native kernels do not run on this CPU (it lacks {'/'.join(native.REQUIRED_FLAGS)})")
        return 1
    torch.set_num_threads(args.threads)  # the attention shares its sequences over OpenMP's threads
    with checkouts(args.baseline, args.candidate, prefix="pdserve-attention-ab-") as (base_tree, cand_tree):
        paths = {
            side: build(tree, args.emulated, args.avx2)
            for side, tree in (("baseline", base_tree), ("candidate", cand_tree))
        }
    libraries = {side: load_library(path, 1) for side, path in paths.items()}  # use_pool(0): OpenMP
    # The tiles only in the build with this CPU's instructions (as native.use_amx).
    own = not (args.avx2 or args.emulated)
    wants = {
        "baseline": own and args.baseline_path == "tiles",
        "candidate": own and args.candidate_path == "tiles",
    }
    on_tiles = {side: use_tiles(libraries[side], wants[side]) for side in libraries}
    config = json.loads((Path(args.model) / "config.json").read_text())
    heads, lat, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(64 << 20, dtype=torch.uint8)
    table_rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        q, cache, table, lens = native.attention_case(batch, args.context, heads, lat, rope, BLOCK, gen)
        outs = {side: torch.empty(batch, heads, lat, dtype=torch.bfloat16) for side in libraries}
        times: dict[str, list[float]] = {side: [] for side in libraries}
        for r in range(args.rounds):
            order = list(libraries.items())
            for side, library in order if r % 2 == 0 else order[::-1]:
                times[side].append(
                    sweep(library, on_tiles[side], q, cache, table, lens, outs[side], lat, flush)
                )
        base_ms, cand_ms = (statistics.median(times[s]) * 1e3 for s in ("baseline", "candidate"))
        agree = torch.equal(outs["baseline"], outs["candidate"])
        table_rows.append(
            {
                "batch": batch,
                "baseline_ms": base_ms,
                "candidate_ms": cand_ms,
                "speedup": base_ms / cand_ms,
                "same_bits": agree,
            }
        )
        print(
            f"B = {batch:4d}: baseline {base_ms:7.3f} ms  candidate {cand_ms:7.3f} ms  "
            f"{base_ms / cand_ms:.3f}x  {'same bits' if agree else 'bits differ'}"
        )
    paths = {side: "tiles" if on else "vdpbf16ps" for side, on in on_tiles.items()}
    kind = (
        "avx2" if args.avx2 else "emulated" if args.emulated else f"{paths['baseline']}_{paths['candidate']}"
    )
    path = save(
        f"attention_ab_{kind}",
        {
            "baseline": args.baseline,
            "candidate": args.candidate or "working tree",
            "build": build_name(args),
            "baseline_path": paths["baseline"],
            "candidate_path": paths["candidate"],
            "heads": heads,
            "kv_lora_rank": lat,
            "rope": rope,
            "context": args.context,
            "block_size": BLOCK,
            "threads": args.threads,
            "rounds": args.rounds,
            "results": table_rows,
        },
        Path(args.output) if args.output else None,
    )
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
