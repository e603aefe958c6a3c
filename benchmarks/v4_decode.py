"""DeepSeek-V4 against DeepSeek-V3 at the same hidden size: KV bytes per request and decode speed
at long contexts.

1. KV bytes a request holds at C tokens of context (4k, 32k, 128k), from the spec -- the window's
   blocks (a fixed number, whatever C), one compressed entry per 4 tokens (CSA, with its indexer
   key) or per 128 (HCA), the compressor states -- and checked against the KV cache manager: a
   C-token request admitted and grown, the blocks it holds per table counted.
2. Decode step time (the model's forward and LM head) for B sequences whose caches hold C tokens,
   filled with random values as benchmarks/sparse_decode.py does (prefilling 16k-token prompts on
   a CPU would take hours; a step's cost does not depend on what the cache holds), the V4 bench
   model against the V3 bench model, alternating round by round, medians reported.

    python benchmarks/v4_decode.py --v4 models/bench-v4 --v3 models/pdserve-bench
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import hardware, save  # noqa: E402
from benchmarks.sparse_decode import Bench as V3Bench  # noqa: E402
from benchmarks.sparse_decode import add_step_args, step_medians  # noqa: E402
from engine import LLM  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.forward_batch import DecodeGroup, ForwardBatch, TableInputs, block_table  # noqa: E402
from engine.kv_cache.manager import KVCacheManager  # noqa: E402
from engine.kv_cache.spec import KVCacheSpec  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.runner import kv_cache_spec  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def long_twin(model_dir: Path, positions: int) -> Path:
    """The folder with max_position_embeddings raised to `positions` (the bench V3 model says 4096;
    its weights and rotary settings unchanged: the engine only sizes its rope tables by it), its
    weights linked, not copied."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("max_position_embeddings", 0) >= positions:
        return model_dir
    out = model_dir.parent / f".{model_dir.name}-{positions}"
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": positions}, indent=2))
    return out


def spec_of(model_dir: Path, block_size: int) -> KVCacheSpec:
    cfg = EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=block_size)
    return kv_cache_spec(ModelConfig.from_pretrained(model_dir), cfg)


def bytes_from_spec(spec: KVCacheSpec, context: int) -> int:
    """What a request at `context` tokens (about to decode the next) holds, from the spec alone."""
    bs, total = spec.block_size, 0
    for t in spec.tables:
        blocks = -(-(context + 1) // bs)
        if t.windowed:
            blocks -= t.first_needed(context, bs)
        total += blocks * spec.table_bytes_per_block(t)
    return total + sum(s.slot_bytes for s in spec.states)


def bytes_held(spec: KVCacheSpec, context: int) -> int:
    """The same, counted on a KV cache manager: a request of context + 1 tokens admitted with its
    prompt, grown to decode, its blocks per table (window blocks behind it given back)."""
    blocks = -(-(context + 2) // spec.block_size) + 2
    kv = KVCacheManager(spec, blocks, enable_prefix_caching=False, num_state_slots=1)
    req = Request("r", [7] * (context + 1), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(req, context)
    req.num_computed_tokens = context
    assert kv.allocate_slots(req, 1)  # the decode step: blocks behind the window go back
    held = kv.num_held(req)
    state = sum(s.slot_bytes for s in spec.states)
    return sum(n * spec.table_bytes_per_block(t) for n, t in zip(held, spec.tables, strict=True)) + state


class V4Bench:
    """The V4 model with caches for B sequences of C tokens: the window's last blocks, every
    compressed entry, the states, all random."""

    def __init__(self, model_dir: Path, dtype: str, block_size: int):
        self.llm = LLM(model=str(model_dir), dtype=dtype, block_size=block_size, num_kv_blocks=4)
        runner = self.llm.engine.runner
        self.model, self.spec = runner.model, runner.kv_spec
        self.block_size = self.spec.block_size
        self.caches = None

    def fill(self, batch: int, context: int) -> None:
        spec, bs = self.spec, self.block_size
        blocks_per_seq = -(-(context + 1) // bs)
        self.caches = None
        counts = []
        tables = []  # per table: each sequence's block ids
        for t in spec.tables:
            if t.windowed:  # the blocks its next token reads; the rest of its table the null block 0
                first = t.first_needed(context, bs)
                per = blocks_per_seq - first
                counts.append(batch * per + 1)
                tables.append(
                    [[0] * first + list(range(1 + d * per, 1 + (d + 1) * per)) for d in range(batch)]
                )
            else:
                counts.append(batch * blocks_per_seq)
                tables.append(
                    [list(range(d * blocks_per_seq, (d + 1) * blocks_per_seq)) for d in range(batch)]
                )
        self.caches = spec.allocate(counts, "cpu")
        gen = torch.Generator().manual_seed(0)
        for cache in self.caches:
            rows = cache.view(-1, cache.shape[-1])
            for s in range(0, rows.shape[0], 1 << 16):
                chunk = rows[s : s + (1 << 16)]
                chunk.copy_(torch.randn(chunk.shape, generator=gen) * 0.1)
        states = {s.name: torch.randn(batch, len(s.layers), *s.shape, generator=gen) for s in spec.states}
        base = spec.table_index(spec.groups[0].kind)
        other = [i for i in range(len(spec.tables)) if i != base]
        slots = [tb[context // bs] * bs + context % bs for tb in tables[base]]
        self.batch = ForwardBatch(
            input_ids=torch.randint(3, self.model.cfg.vocab_size, (batch,), generator=gen),
            positions=torch.full((batch,), context, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            decodes=[DecodeGroup.of(0, 1, tables[base], [context + 1] * batch, "cpu")],
            prefills=[],
            logits_indices=torch.arange(batch),
            tables=tuple(
                TableInputs(
                    i, torch.full((batch,), -1, dtype=torch.long), [block_table(tables[i], "cpu")], []
                )
                for i in other
            ),
            state_rows=torch.arange(batch),
            states=states,
            snapshots=[[] for _ in range(batch)],
        )

    @torch.inference_mode()
    def step(self) -> float:
        start = time.perf_counter()
        hidden = self.model.forward(self.batch, self.caches)
        self.model.compute_logits(hidden[self.batch.logits_indices])
        return time.perf_counter() - start

    def release(self) -> None:
        self.caches = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--v4", default="models/bench-v4", help="a DeepSeek-V4 model folder (make-model bench-v4)")
    p.add_argument(
        "--v3", default="models/pdserve-bench", help="a DeepSeek-V3 model folder (make-model bench)"
    )
    p.add_argument("--kv-contexts", default="4096,32768,131072")
    add_step_args(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    v4_dir, v3_dir = Path(args.v4).absolute(), Path(args.v3).absolute()

    kv_rows = []
    specs = {"v4": spec_of(v4_dir, args.block_size), "v3": spec_of(v3_dir, args.block_size)}
    for context in (int(c) for c in args.kv_contexts.split(",")):
        row = {"context": context}
        for name, spec in specs.items():
            row[f"{name}_bytes"] = bytes_from_spec(spec, context)
            row[f"{name}_bytes_held"] = bytes_held(spec, context)
            assert row[f"{name}_bytes"] == row[f"{name}_bytes_held"], (name, row)
        row["v4_over_v3"] = row["v4_bytes"] / row["v3_bytes"]
        kv_rows.append(row)
        print(
            f"C={context:7d}  V4 {row['v4_bytes'] / 2**20:9.2f} MiB  V3 {row['v3_bytes'] / 2**20:9.2f} MiB"
            f"  V4/V3 {row['v4_over_v3']:.3f}  (per token of context: V4 {row['v4_bytes'] / context:.0f} B,"
            f" V3 {row['v3_bytes'] / context:.0f} B)",
            flush=True,
        )

    longest = max(int(c) for c in args.contexts.split(",")) + 1
    benches = {
        "v4": V4Bench(long_twin(v4_dir, longest), args.dtype, args.block_size),
        "v3": V3Bench(long_twin(v3_dir, longest), args.dtype, args.block_size),
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
                "v4_over_v3_tok_per_s": ms["v3"] / ms["v4"],
            }
            rows.append(row)
            print(
                f"C={context:6d} B={batch:3d}  V4 {ms['v4']:8.1f} ms ({row['tok_per_s']['v4']:7.1f} tok/s)"
                f"  V3 {ms['v3']:8.1f} ms ({row['tok_per_s']['v3']:7.1f} tok/s)  V4/V3 tok/s {row['v4_over_v3_tok_per_s']:.2f}",
                flush=True,
            )
    payload = {
        "hardware": hardware(),
        "models": {"v4": str(v4_dir), "v3": str(v3_dir)},
        "args": vars(args) | {"output": None},
        "kv_bytes": kv_rows,
        "decode": rows,
    }
    print(save("v4_decode", payload, args.output))


if __name__ == "__main__":
    main()
