"""What serving costs: the same concurrent decode workload through a running stack and through the
offline engine, in one run, reported as a ratio.

C prompts of --input-len random token ids each generate exactly --output-len tokens (greedy,
ignore_eos). Offline: one `LLM.generate` call over all C prompts (the engine batches them).
Served: a stack (router + prefill worker + decode worker, as `pdserve serve` starts it) and C
concurrent streams through the router, with the gRPC client or the `openai` client; every
stream opens at once. Output tok/s = C * output_len / wall time of the whole workload, for both;
served / offline is what the services cost (KV transfer, per-token messages, the router's
re-streaming, the processes sharing the CPU). Each side runs --rounds times; the medians are
compared. Results go to benchmarks/results/served_vs_offline_<hardware>_<date>.json.

    python benchmarks/served_vs_offline.py --model models/pdserve-bench --concurrency 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402

FIRST_TOKEN_ID = 16


def prompts_for(concurrency: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(input_len)] for _ in range(concurrency)]


def offline_rates(args, prompts: list[list[int]]) -> list[float]:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=2, temperature=0))
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == args.output_len for o in outs)
        rates.append(len(prompts) * args.output_len / seconds)
    del llm
    gc.collect()
    return rates


def _grpc_stream(endpoint: str, prompt: list[int], output_len: int) -> int:
    import grpc

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        )
        return sum(len(m.token_ids) for m in pb_grpc.InferenceStub(ch).Generate(request, timeout=600))


def _openai_stream(url: str, model: str, prompt: list[int], output_len: int) -> int:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces += 1
    return pieces


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_rates(args, prompts: list[list[int]]) -> tuple[list[float], list[int], dict[str, float]]:
    """-> (output tok/s per round, pieces per round, CPU seconds per output token of each stack
    process and of the client, over all rounds)."""
    from services.launcher import Stack, StackConfig
    from services.worker.server import model_name

    cfg = StackConfig(
        model=args.model,
        engine_args=["--dtype", args.dtype, "--num-kv-blocks", str(args.num_kv_blocks)],
        threads_per_worker=args.threads,
        router_args=["--colocate-max-tokens", "0"],
        log_dir=args.log_dir or tempfile.mkdtemp(prefix="pdserve-served-"),
    )
    name = model_name(args.model)
    rates, counts = [], []
    cpu: dict[str, float] = {}
    with Stack(cfg) as stack:

        def one(prompt: list[int]) -> int:
            if args.client == "openai":
                return _openai_stream(stack.http_url, name, prompt, args.output_len)
            return _grpc_stream(stack.grpc_endpoint, prompt, args.output_len)

        one(prompts[0][:8])  # warm-up: channels, the workers' first batch
        pids = {proc.name: proc.popen.pid for proc in stack.procs} | {"client": os.getpid()}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(args.rounds):
                start = time.perf_counter()
                got = list(pool.map(one, prompts))
                seconds = time.perf_counter() - start
                counts.append(sum(got))
                rates.append(len(prompts) * args.output_len / seconds)
        tokens = args.rounds * len(prompts) * args.output_len
        cpu = {name: (cpu_seconds(pid) - before[name]) / tokens for name, pid in pids.items()}
    return rates, counts, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine and of each worker")
    p.add_argument("--client", default="grpc", choices=["grpc", "openai"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="results JSON (default: benchmarks/results/...)")
    p.add_argument("--log-dir", default=None, help="stack process logs (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.rounds < 1 or args.output_len < 1 or args.input_len < 1:
        raise SystemExit("--concurrency, --rounds, --input-len and --output-len must be >= 1")
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(args.concurrency, args.input_len, vocab, args.seed)
    offline = offline_rates(args, prompts)
    served, counts, cpu = served_rates(args, prompts)
    ratio = statistics.median(served) / statistics.median(offline)
    print(
        f"offline  {statistics.median(offline):8.1f} output tok/s  (rounds: {', '.join(f'{r:.1f}' for r in offline)})"
    )
    print(
        f"served   {statistics.median(served):8.1f} output tok/s  (rounds: {', '.join(f'{r:.1f}' for r in served)})"
    )
    print(f"served / offline {ratio:.2f}x ({args.client} client, {args.concurrency} streams)")
    print("CPU ms per output token: " + ", ".join(f"{name} {1000 * s:.2f}" for name, s in cpu.items()))
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "log_dir")}
    payload = {"settings": settings, "offline_tok_s": offline, "served_tok_s": served, "ratio": ratio}
    payload["served_pieces"] = counts  # tokens (gRPC) or text chunks (openai) the client saw
    payload["served_cpu_s_per_token"] = cpu
    path = save("served_vs_offline", payload, Path(args.output) if args.output else None)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
