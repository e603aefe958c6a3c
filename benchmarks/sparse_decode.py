"""DeepSeek-V3.2's sparse attention against dense MLA: decode step time of the same model as V3.2
(indexer + top-k) and as V3 (its weights without the indexer), at long contexts.

For each context C and batch B, both models decode one token for B sequences whose caches hold C
tokens each, filled with random values: prefilling 16k-token prompts on a CPU would take hours,
and the cost of a decode step does not depend on what the cache holds (the indexer scores every
token and sorts whatever it finds). The model's forward and LM head are timed, alternating the two
models round by round, the median of `--rounds` reported per model. Once C exceeds index_topk the
sparse step must cost less, more so as C grows. Both run a decode step's whole stack as one native
call (V3.2's with its indexer inside); the per-layer arms run each model's layers one by one
through the Python path (V3.2's indexer, top-k and sparse attention as separate native calls), as
V3.2 ran before its one-call decode.

    python benchmarks/sparse_decode.py --model models/pdserve-bench-v32
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import hardware, save  # noqa: E402
from engine import LLM  # noqa: E402
from engine.forward_batch import DecodeGroup, ForwardBatch  # noqa: E402
from engine.safetensors_io import SafetensorsFile  # noqa: E402


def dense_twin(model_dir: Path, out: Path) -> Path:
    """The V3.2 folder as a DeepSeek-V3 one: config.json without the indexer keys, the weights
    without the indexer's tensors (written once; reused while the source is unchanged)."""
    from safetensors.torch import save_file

    stamp = str((model_dir / "config.json").stat().st_mtime_ns)
    if (out / "stamp").is_file() and (out / "stamp").read_text() == stamp:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        cfg.pop(key, None)
    cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        f = SafetensorsFile(path)
        tensors |= {n: f.read(n) for n in f.keys() if ".indexer." not in n}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "stamp").write_text(stamp)
    return out


class Bench:
    """One model with caches for B sequences of C tokens; `step()` times one decode step."""

    def __init__(self, model_dir: Path, dtype: str, block_size: int, one_call: bool = True):
        """one_call=False: the model's layers one by one, as DeepSeek-V3.2's run, where a few
        decode tokens of V3 run its whole stack as one native call (native.decode_stack)."""
        self.llm = LLM(model=str(model_dir), dtype=dtype, block_size=block_size, num_kv_blocks=4)
        runner = self.llm.engine.runner
        self.model, self.spec, self.block_size = runner.model, runner.kv_spec, block_size
        if not one_call:
            self.model.native_stack = None
            for layer in self.model.layers:
                layer.self_attn.native_weights = None
        self.caches = None

    def fill(self, batch: int, context: int) -> None:
        blocks_per_seq = -(-(context + 1) // self.block_size)
        self.caches = None
        self.caches = self.spec.allocate(batch * blocks_per_seq, "cpu")
        gen = torch.Generator().manual_seed(0)
        for cache in self.caches:  # random rows, written a block-group at a time (bounded memory)
            rows = cache.view(-1, cache.shape[-1])
            for s in range(0, rows.shape[0], 1 << 16):
                chunk = rows[s : s + (1 << 16)]
                chunk.copy_(torch.randn(chunk.shape, generator=gen))
        tables = [list(range(d * blocks_per_seq, (d + 1) * blocks_per_seq)) for d in range(batch)]
        seq_lens = [context + 1] * batch
        slots = [t[context // self.block_size] * self.block_size + context % self.block_size for t in tables]
        ids = torch.randint(3, self.model.cfg.vocab_size, (batch,), generator=gen)
        self.batch = ForwardBatch(
            input_ids=ids,
            positions=torch.full((batch,), context, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            decodes=[DecodeGroup.of(0, 1, tables, seq_lens, "cpu")],
            prefills=[],
            logits_indices=torch.arange(batch),
        )

    @torch.inference_mode()
    def step(self) -> float:
        start = time.perf_counter()
        hidden = self.model.forward(self.batch, self.caches)
        self.model.compute_logits(hidden[self.batch.logits_indices])
        return time.perf_counter() - start

    def release(self) -> None:
        self.caches = None


def step_medians(benches: dict, batch: int, context: int, rounds: int) -> dict[str, float]:
    """Each bench filled with `batch` sequences of `context` tokens and warmed up, then stepped
    `rounds` times, the benches alternating round by round -> median ms per step by name."""
    times: dict[str, list[float]] = {name: [] for name in benches}
    for name, bench in benches.items():
        bench.fill(batch, context)
        bench.step()  # warm-up
        times[name].append(bench.step())
    for _ in range(rounds - 1):
        for name, bench in benches.items():
            times[name].append(bench.step())
    for bench in benches.values():
        bench.release()
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def add_step_args(p: argparse.ArgumentParser) -> None:
    """The flags of a decode-step benchmark: the points, the rounds, the engine's settings."""
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", type=Path, default=None)


def plot(rows: list[dict], png: Path) -> Path:
    """The curve: V3.2's decode step time over V3's against context, a line per batch (one call
    solid, layer by layer dashed), 1.0 where sparse and dense cost the same. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == batch]
        xs = [r["context"] for r in mine]
        ax.plot(xs, [r["sparse_over_dense_time"] for r in mine], marker="o", label=f"B={batch}, one call")
        ax.plot(
            xs, [r["sparse_over_dense_per_layer_time"] for r in mine], marker="x", linestyle="--",
            label=f"B={batch}, layer by layer",
        )  # fmt: skip
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens in each sequence's cache)")
    ax.set_ylabel("step time, V3.2 sparse / V3 dense")
    ax.set_title(f"DeepSeek-V3.2 vs V3 decode, top-{rows[0].get('index_topk', '')} ({hardware()['cpu']})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench-v32", help="a DeepSeek-V3.2 model folder")
    add_step_args(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model).absolute()
    topk = json.loads((model_dir / "config.json").read_text())["index_topk"]
    twin = dense_twin(model_dir, model_dir.parent / f".{model_dir.name}-dense-twin")
    benches = {
        "v32-sparse": Bench(model_dir, args.dtype, args.block_size),
        "v3-dense": Bench(twin, args.dtype, args.block_size),
        "v32-sparse-per-layer": Bench(model_dir, args.dtype, args.block_size, one_call=False),
        "v3-dense-per-layer": Bench(twin, args.dtype, args.block_size, one_call=False),
    }
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            ms = step_medians(benches, batch, context, args.rounds)
            row = {
                "context": context,
                "batch": batch,
                "ms_per_step": ms,
                "tok_per_s": {name: batch * 1000 / v for name, v in ms.items()},
                "sparse_over_dense_time": ms["v32-sparse"] / ms["v3-dense"],
                "sparse_over_dense_per_layer_time": ms["v32-sparse-per-layer"] / ms["v3-dense-per-layer"],
                "one_call_over_per_layer_sparse_time": ms["v32-sparse"] / ms["v32-sparse-per-layer"],
            }
            rows.append(row)
            print(
                f"C={context:6d} B={batch:3d}  sparse {ms['v32-sparse']:8.1f} ms  dense {ms['v3-dense']:8.1f} ms"
                f"  per layer: sparse {ms['v32-sparse-per-layer']:8.1f} ms  dense {ms['v3-dense-per-layer']:8.1f} ms"
                f"  sparse/dense {row['sparse_over_dense_time']:.2f}x (per layer "
                f"{row['sparse_over_dense_per_layer_time']:.2f}x)",
                flush=True,
            )
    payload = {
        "hardware": hardware(),
        "model": str(model_dir),
        "index_topk": topk,
        "args": vars(args) | {"output": None},
        "rows": rows,
    }
    path = save("sparse_decode", payload, args.output)
    print(path)
    print(plot([r | {"index_topk": topk} for r in rows], path.with_suffix(".png")))


if __name__ == "__main__":
    main()
