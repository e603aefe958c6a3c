"""KV transfer between a prefill and a decode worker: NIXL against the gRPC chunk stream, in one
run, with the raw NIXL READ rate of the same bytes as the ceiling; or (--baseline REV) NIXL on this
tree against NIXL on another revision, interleaved.

For each prompt length and transport, --rounds fresh prompts (random token ids: no prefix hits
on either worker) go Prefill (max_tokens 2) on the prefill worker, then Decode with its handle
on a decode worker that moves KV over that transport. Reported per row (medians):
- kv_transfer_ms and pull_gbps: the decode worker's own measure (Timings.kv_transfer_ns and
  Usage.kv_transfer_bytes): from allocation to the last block in, checks included;
- ttft_ms: the Prefill call as the router sees it (the first token of a disaggregated request);
- second_token_ms: the Decode call until its first message (transfer, import, one decode step);
- transfer_share: kv_transfer_ms / ttft_ms (the issue's goal: <= 10 % at 2k tokens);
- phases_ms (NIXL, where the worker has pdserve_kv_transfer_phase_seconds): the mean time of a
  pull in each phase (BeginRead, descriptors, the transfer, checksums, handle release, the
  hand-off to the read thread and back), from the decode worker's /metrics.
The ceiling: two processes with NIXL agents over KV caches of the same spec and size, one READs
the other's blocks through the same descriptors the workers use (engine/kv_cache/nixl.py), no
checksum; and the CRC-32C checksum rate of the same bytes (what verification costs).

Two stacks run one after the other (a prefill and a decode worker, called directly: no router;
the second with the decode worker at --kv-transport grpc), each process with --threads threads.
With --baseline REV, a stack of this tree and one of a git worktree of REV are up together, both
over NIXL, and every round sends the same fresh prompt to each, alternating which goes first, so
a shared machine's drift falls on both alike; the raw ceiling is skipped. The load average is
recorded before and after. Results go to benchmarks/results/kv_transfer[_ab]_<hardware>_<date>.json.

    python benchmarks/kv_transfer.py --model models/pdserve-bench
    python benchmarks/kv_transfer.py --model models/pdserve-bench --baseline HEAD~3 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ab_revisions import add_worktree  # noqa: E402
from benchmarks.common import save  # noqa: E402

FIRST_TOKEN_ID = 16
REPO = Path(__file__).resolve().parents[1]
PHASE_METRIC = "pdserve_kv_transfer_phase_seconds"


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


class Side:
    """One stack (a prefill and a decode worker) and the way to send it one handover."""

    def __init__(self, args, transport: str, lengths: list[int], tree: Path | None = None):
        from services.launcher import Stack, StackConfig
        from tests.service_testing import worker

        engine_args = ["--dtype", args.dtype, "--num-kv-blocks", str(args.num_kv_blocks)]
        engine_args += ["--max-num-batched-tokens", str(max(lengths) + 16)]
        self.transport = transport
        self.log_dir = tempfile.mkdtemp(prefix=f"kv-transfer-{transport}-")
        cfg = StackConfig(
            model=str(Path(args.model).resolve()),
            engine_args=engine_args,
            worker_args={"decode": ["--kv-transport", transport]},
            threads_per_worker=args.threads,
            log_dir=self.log_dir,
            http_port=None,
            worker_metrics=True,
            cwd=str(tree) if tree is not None else None,
            env={"PYTHONPATH": str(tree)} if tree is not None else {},
        )
        # The workers alone: every call here goes to a worker directly, and a router would be one
        # more process to start and wait for, probing the workers twice a second while they are measured.
        self.stack = Stack(cfg).start(router=False)
        self.prefill = worker(self.stack.workers("prefill")[0].endpoint, self.stack.token)
        self.decode = worker(self.stack.workers("decode")[0].endpoint, self.stack.token)
        self.metrics_url = self.stack.workers("decode")[0].metrics_url

    def one(self, prompt: list[int]) -> dict:
        from pdserve.v1 import inference_pb2 as pb
        from pdserve.v1 import worker_pb2 as wpb
        from services.common.security import handle_mac

        sampling = pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        start = time.perf_counter()
        first = self.prefill.Prefill(
            wpb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling), timeout=600
        )
        ttft = time.perf_counter() - start
        request = wpb.DecodeRequest(
            prompt_token_ids=prompt,
            sampling=sampling,
            output_token_ids=first.output.token_ids,
            kv_handle=first.kv_handle,
            kv_handle_mac=handle_mac(self.stack.token, first.kv_handle),
        )
        start = time.perf_counter()
        second = None
        for msg in self.decode.Decode(request, timeout=600):
            second = second or time.perf_counter() - start
            last = msg
        return {
            "ttft_s": ttft,
            "second_token_s": second,
            "kv_bytes": last.usage.kv_transfer_bytes,
            "kv_transfer_s": last.timings.kv_transfer_ns / 1e9,
        }

    def phases(self) -> dict[str, tuple[float, float]]:
        """phase -> (sum, count) of the decode worker's phase histogram (empty when it has none)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        out: dict[str, list[float]] = {}
        for line in text.splitlines():
            for part, i in ((f"{PHASE_METRIC}_sum{{", 0), (f"{PHASE_METRIC}_count{{", 1)):
                if line.startswith(part):
                    phase = line.split('phase="', 1)[1].split('"', 1)[0]
                    out.setdefault(phase, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
        return {k: (v[0], v[1]) for k, v in out.items()}

    def moved_over_nixl(self) -> bool:
        return "moves over NIXL" in (Path(self.log_dir) / "decode-0.log").read_text()

    def stop(self) -> None:
        self.stack.stop()


def _phase_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per pull in each phase between two scrapes."""
    out = {}
    for phase, (total, count) in after.items():
        b_total, b_count = before.get(phase, (0.0, 0.0))
        if count > b_count:
            out[phase] = round((total - b_total) / (count - b_count) * 1e3, 3)
    return out


def _row(n: int, label: str, runs: list[dict], rounds: int, phases: dict[str, float]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    row = {
        "prompt_tokens": n,
        "transport": label,
        "kv_bytes": int(med["kv_bytes"]),
        "kv_transfer_ms": round(med["kv_transfer_s"] * 1e3, 2),
        "pull_gbps": round(med["kv_bytes"] / med["kv_transfer_s"] / 1e9, 3),
        "ttft_ms": round(med["ttft_s"] * 1e3, 1),
        "second_token_ms": round(med["second_token_s"] * 1e3, 1),
        "transfer_share": round(med["kv_transfer_s"] / med["ttft_s"], 4),
        "rounds": rounds,
        "kv_transfer_ms_each": [round(r["kv_transfer_s"] * 1e3, 2) for r in runs],
    }
    if phases:
        row["phases_ms"] = phases
    return row


def served(args, transport: str, lengths: list[int], vocab: int) -> list[dict]:
    side = Side(args, transport, lengths)
    rng = random.Random(f"{args.seed}-{transport}")
    rows = []
    try:
        side.one(_prompt(rng, min(lengths), vocab))  # connections, agents, first-call costs
        for n in lengths:
            before = side.phases()
            runs = [side.one(_prompt(rng, n, vocab)) for _ in range(args.rounds)]
            assert all(r["kv_bytes"] > 0 for r in runs), "no KV moved: prefix hits?"
            rows.append(_row(n, transport, runs, args.rounds, _phase_means(before, side.phases())))
            print(json.dumps(rows[-1]), flush=True)
        assert side.moved_over_nixl() == (transport != "grpc"), (
            f"the {transport} decode worker did not move KV as asked"
        )
    finally:
        side.stop()
    return rows


def ab(args, lengths: list[int], vocab: int) -> list[dict]:
    """NIXL pulls on this tree (candidate) against a worktree of args.baseline, interleaved."""
    with tempfile.TemporaryDirectory(prefix="kv-transfer-ab-") as tmp:
        tree = Path(tmp) / "baseline"
        add_worktree(tree, args.baseline)
        sides: dict[str, Side] = {}
        try:
            sides["baseline"] = Side(args, "nixl", lengths, tree)
            sides["candidate"] = Side(args, "nixl", lengths)
            rng = random.Random(f"{args.seed}-ab")
            for side in sides.values():
                side.one(_prompt(rng, min(lengths), vocab))
            rows = []
            for n in lengths:
                runs: dict[str, list[dict]] = {k: [] for k in sides}
                before = {k: s.phases() for k, s in sides.items()}
                for r in range(args.rounds):
                    prompt = _prompt(rng, n, vocab)  # the same on both sides: separate stacks, no hits
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for k in order:
                        runs[k].append(sides[k].one(prompt))
                for k, side in sides.items():
                    rows.append(_row(n, k, runs[k], args.rounds, _phase_means(before[k], side.phases())))
                    print(json.dumps(rows[-1]), flush=True)
            assert all(s.moved_over_nixl() for s in sides.values()), (
                "a decode worker did not move KV over NIXL"
            )
        finally:
            for side in sides.values():
                side.stop()
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    return rows


def _spec(args):
    import torch

    from engine.config import ModelConfig
    from engine.kv_cache.spec import mla_spec

    cfg = ModelConfig.from_pretrained(args.model)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    return mla_spec(
        num_layers=cfg.num_hidden_layers,
        num_mtp_layers=0,
        block_size=16,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        dtype=dtype,
        fingerprint="kv-transfer-bench",
    )


def _raw_producer(args, num_blocks: int, conn) -> None:
    import torch

    from engine.kv_cache.nixl import NixlAgent
    from engine.kv_cache.transfer import KVPort

    spec = _spec(args)
    caches = spec.allocate(num_blocks, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape))
    agent = NixlAgent("raw-producer", KVPort(spec, caches))
    conn.send((agent.metadata, [(r.addr, r.length, r.device) for r in agent.regions], agent.num_blocks))
    conn.recv()


def raw(args, lengths: list[int]) -> list[dict]:
    from engine.kv_cache.nixl import NixlAgent
    from engine.kv_cache.transfer import KVPort, MemoryRegion

    spec = _spec(args)
    num_blocks = -(-max(lengths) // spec.block_size)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_raw_producer, args=(args, num_blocks, there), daemon=True)
    proc.start()
    # The child holds its own end now: with ours closed, recv() fails (EOFError) when the child
    # dies before it sends, instead of waiting for ever.
    there.close()
    rows = []
    try:
        metadata, regions, n = here.recv()
        port = KVPort(spec, spec.allocate(num_blocks, "cpu"))
        agent = NixlAgent("raw-consumer", port)
        peer = agent.add_peer("raw-producer", metadata, [MemoryRegion(*r) for r in regions], n, "DRAM")
        for tokens in lengths:
            blocks = -(-tokens // spec.block_size)
            ids = list(range(blocks))
            reads, digests = [], []
            for i in range(args.rounds + 1):
                sink = port.sink(f"raw-{tokens}-{i}", [ids])
                start = time.perf_counter()
                nbytes = agent.read(peer, sink, 0, ids, 600.0, threading.Event())
                reads.append(time.perf_counter() - start)
                start = time.perf_counter()
                sink.checksums(0)  # what the consumer's verification costs
                digests.append(time.perf_counter() - start)
                sink.close()
            read_s, digest_s = statistics.median(reads[1:]), statistics.median(digests[1:])
            row = {
                "prompt_tokens": tokens,
                "kv_bytes": nbytes,
                "nixl_read_ms": round(read_s * 1e3, 2),
                "nixl_read_gbps": round(nbytes / read_s / 1e9, 3),
                "checksum_gbps": round(nbytes / digest_s / 1e9, 3),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        agent.close()
    finally:
        with contextlib.suppress(BrokenPipeError):  # a child that died first reads nothing
            here.send("done")
        proc.join(30)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--lengths",
        default="512,2048,4064",
        help="prompt lengths in tokens (the bench model's max_position_embeddings is 4096: 4064 is its "
        "largest prompt here; the raw ceiling also reads 8192 tokens' worth)",
    )
    p.add_argument("--raw-lengths", default=None, help="default: --lengths plus 8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--num-kv-blocks", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        default=None,
        help="git revision: NIXL pulls on this tree against NIXL pulls on that revision, interleaved "
        "(no gRPC stack, no raw ceiling)",
    )
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    raw_lengths = [int(x) for x in args.raw_lengths.split(",")] if args.raw_lengths else [*lengths, 8192]

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    load_before = os.getloadavg()
    if args.baseline is not None:
        rows = ab(args, lengths, vocab)
        by = {(r["prompt_tokens"], r["transport"]): r for r in rows}
        ratios = {
            str(n): {
                "pull_gbps": round(by[(n, "candidate")]["pull_gbps"] / by[(n, "baseline")]["pull_gbps"], 3),
                "second_token_ms": round(
                    by[(n, "baseline")]["second_token_ms"] / by[(n, "candidate")]["second_token_ms"], 3
                ),
            }
            for n in lengths
        }
        baseline = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], capture_output=True, text=True
        ).stdout.strip()
        payload = {
            "model": Path(args.model).name,
            "dtype": args.dtype,
            "threads_per_worker": args.threads,
            "baseline": baseline,
            "candidate": "working tree",
            "load_avg_1_5_15": {"before": load_before, "after": os.getloadavg()},
            "rows": rows,
            "candidate_over_baseline": ratios,
        }
        path = save("kv_transfer_ab", payload, Path(args.output) if args.output else None)
        print(f"candidate / baseline (> 1 is better): {json.dumps(ratios)}")
        print(f"saved {path}")
        return 0
    rows = served(args, "auto", lengths, vocab) + served(args, "grpc", lengths, vocab)
    for r in rows:
        r["transport"] = "nixl" if r["transport"] == "auto" else r["transport"]
    ceiling = raw(args, raw_lengths)
    by = {(r["prompt_tokens"], r["transport"]): r for r in rows}
    speedup = {
        str(n): round(by[(n, "nixl")]["pull_gbps"] / by[(n, "grpc")]["pull_gbps"], 2)
        for n in lengths
        if (n, "nixl") in by and (n, "grpc") in by
    }
    payload = {
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "threads_per_worker": args.threads,
        "load_avg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "rows": rows,
        "raw_nixl": ceiling,
        "nixl_over_grpc_pull_gbps": speedup,
    }
    path = save("kv_transfer", payload, Path(args.output) if args.output else None)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
