"""What serving costs: the same concurrent decode workload through a running stack and through the
offline engine, in one run, reported as a ratio.

C prompts of --input-len random token ids each generate exactly --output-len tokens (greedy,
ignore_eos). Offline: one `LLM.generate` call over all C prompts (the engine batches them).
Served: a stack (router + prefill worker + decode worker, as `pdserve serve` starts it) and C
concurrent streams through the router, every stream opened at once, with one of these clients:
- `grpc`: the gRPC client, a thread per stream;
- `openai`: `openai.AsyncOpenAI`, every stream a task of one event loop;
- `openai-threads`: the synchronous `openai` client, a thread per stream;
- `http`: aiohttp reading the SSE lines and parsing each with `json.loads`, one event loop, as
  vLLM's and SGLang's serving benchmarks drive an OpenAI-compatible server. The `openai` library
  builds a typed object per chunk: on the 2-core Zen 4 its client spent 0.30 ms of CPU per token
  where this one spends 0.06, more than the router's 0.12, on the cores the stack is measured on.
Each side first runs the workload once untimed (batch shapes, channels, client threads). Every
round then has prompts of its own, the same on both sides, so each served round goes the whole
way (the prefill worker, the KV transfer, the decode worker: a prompt the decode worker already
holds would run colocated there) and neither side decodes from cached prefixes.
Output tok/s = C * output_len / wall time of the whole workload, for both; served / offline is
what the services cost (KV transfer, per-token messages, the router's re-streaming, the processes
sharing the CPU). Each side runs --rounds times; the medians are compared; with --interleave both
stay up and their rounds alternate, so a shared machine's drift over the run falls on both alike.
Results go to benchmarks/results/served_vs_offline_<hardware>_<date>.json.

    python benchmarks/served_vs_offline.py --model models/pdserve-bench --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import sse_chunks  # noqa: E402
from engine.gc_heap import freeze_startup_heap  # noqa: E402

FIRST_TOKEN_ID = 16


def prompts_for(concurrency: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(input_len)] for _ in range(concurrency)]


@dataclass
class Rates:
    """One side's rounds: whole-workload output tok/s, and decode tok/s at the workload's batch."""

    tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)


class Offline:
    """The offline engine's side. Each round runs twice: the prefill and first token of as many
    other prompts of the same length (max_tokens 1), then the round's workload whole; decode
    tok/s = C * (output_len - 1) / the difference of their wall times. Other prompts, so that
    both runs prefill from an empty prefix cache."""

    def __init__(self, args, prompts: list[list[int]]):
        self.args, self.prompts = args, prompts  # the warm-up's
        self.rates = Rates()
        self.cpu_s = 0.0  # this process's CPU over the whole runs of the rounds

    def __enter__(self) -> Offline:
        from engine import LLM, SamplingParams

        args = self.args
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks,
            num_threads=args.threads,
            kv_prefault=args.kv_prefault,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.llm.generate(
            prompt_token_ids=self.prompts, sampling_params=self.params
        )  # warm-up: the whole workload once
        freeze_startup_heap()  # as the stack's processes do theirs once started
        return self

    def round(self, prompts: list[list[int]], others: list[list[int]]) -> None:
        output_len = self.args.output_len
        start = time.perf_counter()
        self.llm.generate(prompt_token_ids=others, sampling_params=self.first)
        prefill_s = time.perf_counter() - start
        start, cpu = time.perf_counter(), time.process_time()
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=self.params)
        seconds = time.perf_counter() - start
        self.cpu_s += time.process_time() - cpu
        assert all(len(o.token_ids) == output_len for o in outs)
        self.rates.tok_s.append(len(prompts) * output_len / seconds)
        self.rates.decode_tok_s.append(len(prompts) * (output_len - 1) / max(seconds - prefill_s, 1e-9))

    def cpu_per_token(self) -> float:
        """CPU seconds per output token of the engine (all its threads), over the rounds' whole runs."""
        return self.cpu_s / (len(self.rates.tok_s) * len(self.prompts) * self.args.output_len)

    def __exit__(self, *exc) -> None:
        gc.unfreeze()  # the engine's reference cycles go too
        del self.llm
        gc.collect()


@dataclass
class Stream:
    """What one stream's client saw: pieces (tokens over gRPC, text chunks over HTTP), when the
    first, the second and the last arrived, and the longest wait between two pieces after the
    second (a stall of the stack: a long step, a garbage collection)."""

    pieces: int = 0
    first: float = 0.0
    second: float = 0.0
    last: float = 0.0
    longest_gap: float = 0.0

    def seen(self) -> None:
        now = time.perf_counter()
        if self.pieces == 1:
            self.second = now
        elif self.pieces > 1:
            self.longest_gap = max(self.longest_gap, now - self.last)
        self.first = self.first or now
        self.last = now
        self.pieces += 1

    def pause(self) -> float | None:
        """Seconds between the first piece and the second: in a disaggregated stack the prefill
        worker's token, then the decode worker's first (the handover of the KV between them)."""
        return self.second - self.first if self.pieces > 1 else None

    def tpot(self, tokens: int) -> float:
        """Seconds per token after the first piece, of a stream of `tokens` tokens whose first piece
        held one (a piece may hold several: the router's --stream-interval)."""
        return (self.last - self.first) / max(tokens - 1, 1)


def _grpc_stream(endpoint: str, prompt: list[int], output_len: int) -> Stream:
    import grpc

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        )
        stream = Stream()
        for m in pb_grpc.InferenceStub(ch).Generate(request, timeout=600):
            for _ in m.token_ids:
                stream.seen()
        return stream


def _openai_client(url: str, streams: int, asynchronous: bool):
    """One client for every stream, as a load generator keeps one (building one per request costs
    the client ~30 ms of CPU each, on the cores the stack is measured on), with a connection per
    stream. Asynchronous: `openai.AsyncOpenAI`, every stream a task of one event loop, as serving
    benchmarks drive a server (vLLM's and SGLang's both stream from one asyncio loop). Otherwise
    the synchronous client, shared by a thread per stream (it is safe to share between threads);
    its 32 threads taking turns at the GIL cost the stack 3-6% of its decode rate on 2 cores
    (2026-12-03, the same client CPU per token)."""
    import httpx
    import openai

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    kind, http = (
        (openai.AsyncOpenAI, openai.DefaultAsyncHttpxClient)
        if asynchronous
        else (openai.OpenAI, openai.DefaultHttpxClient)
    )
    return kind(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600, http_client=http(limits=limits)
    )


async def _http_session(streams: int):
    """One aiohttp session for every stream, a connection each (made inside the loop it runs on)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=streams)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))


def _openai_request(model: str, prompt: list[int], output_len: int) -> dict:
    return dict(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def _openai_stream(client, model: str, prompt: list[int], output_len: int) -> Stream:
    seen = Stream()
    for chunk in client.completions.create(**_openai_request(model, prompt, output_len)):
        if chunk.choices and chunk.choices[0].text:
            seen.seen()
    return seen


async def _openai_streams(client, model: str, prompts: list[list[int]], output_len: int) -> list[Stream]:
    import asyncio

    async def one(prompt: list[int]) -> Stream:
        seen = Stream()
        async for chunk in await client.completions.create(**_openai_request(model, prompt, output_len)):
            if chunk.choices and chunk.choices[0].text:
                seen.seen()
        return seen

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _http_streams(
    session, url: str, model: str, prompts: list[list[int]], output_len: int
) -> list[Stream]:
    """Every stream a POST to /v1/completions on one aiohttp session, its SSE lines parsed with
    json.loads, as vLLM's serving benchmark reads an OpenAI-compatible server."""

    async def one(prompt: list[int]) -> Stream:
        seen = Stream()
        body = _openai_request(model, prompt, output_len)
        body |= body.pop("extra_body")
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for chunk in sse_chunks(resp.content):
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    seen.seen()
        return seen

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Served:
    """The stack's side. Decode tok/s of a round = C / the streams' median time per token after
    their first piece (the batch the decode worker runs once every stream is in; the
    whole-workload rate also counts the prefill worker taking the C prompts in). Also kept: pieces
    per round, and the CPU seconds of each stack process and of the client (this process) over the
    served rounds only. `stack`: more StackConfig fields (benchmarks/served_ab.py's arms)."""

    def __init__(self, args, prompts: list[list[int]], **stack):
        self.args, self.prompts, self.stack_fields = args, prompts, stack
        self.rates, self.counts = Rates(), []
        self.pauses: list[float | None] = []  # per round, the streams' median Stream.pause()
        self.longest_gaps: list[float] = []  # per round, the longest Stream.longest_gap
        self.cpu_s: dict[str, float] = {}

    def __enter__(self) -> Served:
        from services.cli import model_name
        from services.launcher import Stack, StackConfig

        args = self.args
        fields = dict(
            model=args.model,
            engine_args=["--dtype", args.dtype, "--num-kv-blocks", str(args.num_kv_blocks)]
            + (["--kv-transport", args.kv_transport] if args.kv_transport else [])
            + (["--kv-prefault"] if args.kv_prefault else []),
            threads_per_worker=args.threads,
            router_args=["--colocate-max-tokens", "0", "--stream-interval", str(args.stream_interval)],
            log_dir=args.log_dir or tempfile.mkdtemp(prefix="pdserve-served-"),
        )
        cfg = StackConfig(**(fields | self.stack_fields))
        self.name = model_name(args.model)
        asynchronous = args.client in ("openai", "http")
        self.loop = asyncio.new_event_loop() if asynchronous else None
        self.pool = None if asynchronous else futures.ThreadPoolExecutor(len(self.prompts))
        self.client = None
        self.stack = Stack(cfg).__enter__()
        try:
            if args.client == "http":
                self.client = self.loop.run_until_complete(_http_session(len(self.prompts)))
            elif args.client.startswith("openai"):
                self.client = _openai_client(self.stack.http_url, len(self.prompts), asynchronous)
            self._streams(self.prompts)  # warm-up: the workload once, as offline
        except BaseException:
            self.__exit__(None, None, None)
            raise
        # As vLLM's benchmark client does once set up; this process may also hold the offline
        # engine, which every full collection of the client's would walk and no real client has.
        freeze_startup_heap()
        self.pids = {proc.name: proc.popen.pid for proc in self.stack.procs} | {"client": os.getpid()}
        return self

    def _streams(self, prompts: list[list[int]]) -> list[Stream]:
        """The workload once, every stream opened at once."""
        output_len, client = self.args.output_len, self.args.client
        if client == "http":
            url = self.stack.http_url
            return self.loop.run_until_complete(
                _http_streams(self.client, url, self.name, prompts, output_len)
            )
        if client == "openai":
            return self.loop.run_until_complete(_openai_streams(self.client, self.name, prompts, output_len))

        def one(prompt: list[int]) -> Stream:
            if self.client is not None:
                return _openai_stream(self.client, self.name, prompt, output_len)
            return _grpc_stream(self.stack.grpc_endpoint, prompt, output_len)

        return list(self.pool.map(one, prompts))

    def round(self, prompts: list[list[int]]) -> None:
        before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        start = time.perf_counter()
        streams = self._streams(prompts)
        seconds = time.perf_counter() - start
        for name, pid in self.pids.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + cpu_seconds(pid) - before[name]
        self.counts.append(sum(s.pieces for s in streams))
        pauses = [p for s in streams if (p := s.pause()) is not None]
        self.pauses.append(statistics.median(pauses) if pauses else None)
        self.longest_gaps.append(max(s.longest_gap for s in streams))
        self.rates.tok_s.append(len(prompts) * self.args.output_len / seconds)
        tpot = statistics.median(s.tpot(self.args.output_len) for s in streams)
        self.rates.decode_tok_s.append(len(prompts) / tpot)

    def median_pause(self) -> float | None:
        """The rounds' median Stream.pause() (None when no stream had a second piece)."""
        pauses = [p for p in self.pauses if p is not None]
        return statistics.median(pauses) if pauses else None

    def cpu_per_token(self) -> dict[str, float]:
        """CPU seconds per output token of each process, over the served rounds."""
        tokens = len(self.rates.tok_s) * len(self.prompts) * self.args.output_len
        return {name: seconds / tokens for name, seconds in self.cpu_s.items()}

    def __exit__(self, *exc) -> None:
        if self.loop is not None:
            if self.client is not None:  # AsyncOpenAI and aiohttp's session both close this way
                self.loop.run_until_complete(self.client.close())
            self.loop.close()
        if self.pool is not None:
            self.pool.shutdown()
        self.stack.__exit__(*exc)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's and the stack's flags (this benchmark's and served_ab.py's)."""
    p.add_argument("--model", default="models/pdserve-bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine and of each worker")
    p.add_argument(
        "--client",
        default="grpc",
        choices=["grpc", "openai", "openai-threads", "http"],
        help="grpc: a thread per stream; openai: AsyncOpenAI, one event loop; "
        "openai-threads: the synchronous client, a thread per stream; http: aiohttp and json.loads, "
        "one event loop",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--kv-transport",
        default=None,
        choices=["auto", "nixl", "grpc"],
        help="the workers' (default: theirs)",
    )
    p.add_argument(
        "--stream-interval", type=int, default=1, help="the router's: tokens a stream's message gathers"
    )
    p.add_argument(
        "--kv-prefault",
        action="store_true",
        help="every engine's KV cache resident from the start (the offline one's and the workers')",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="results JSON (default: benchmarks/results/...)")
    p.add_argument("--log-dir", default=None, help="stack process logs (default: a temporary folder)")


def check_workload_args(args: argparse.Namespace) -> None:
    if min(args.concurrency, args.rounds, args.output_len, args.input_len, args.stream_interval) < 1:
        raise SystemExit(
            "--concurrency, --rounds, --input-len, --output-len and --stream-interval must be >= 1"
        )


def workload(args: argparse.Namespace):
    """index -> C prompts of the run: the warm-up's (0), then each round's workload (odd) and the
    offline side's first-token prompts (even)."""
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    return lambda index: prompts_for(args.concurrency, args.input_len, vocab, args.seed + index)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_workload_args(p)
    p.add_argument(
        "--interleave",
        action="store_true",
        help="keep the offline engine and the stack up together and alternate their rounds",
    )
    args = p.parse_args(argv)
    check_workload_args(args)
    # Only once the arguments are good: benchmarks.common loads torch, seconds of a bad call's time
    # (served_ab.py reads the workload's flags from here too).
    from benchmarks.common import save

    prompts = workload(args)
    if args.interleave:  # both up at once, a round of each in turn: the machine's drift falls on both
        with Offline(args, prompts(0)) as off, Served(args, prompts(0)) as srv:
            for r in range(args.rounds):
                off.round(prompts(2 * r + 1), prompts(2 * r + 2))
                srv.round(prompts(2 * r + 1))
    else:
        with Offline(args, prompts(0)) as off:
            for r in range(args.rounds):
                off.round(prompts(2 * r + 1), prompts(2 * r + 2))
        with Served(args, prompts(0)) as srv:
            for r in range(args.rounds):
                srv.round(prompts(2 * r + 1))
    offline, served, counts, cpu = off.rates, srv.rates, srv.counts, srv.cpu_per_token()
    pause = srv.median_pause()
    offline_cpu = off.cpu_per_token()

    def median(xs: list[float]) -> float:
        return statistics.median(xs)

    def rounds(xs: list[float]) -> str:
        return ", ".join(f"{x:.1f}" for x in xs)

    ratio = median(served.tok_s) / median(offline.tok_s)
    decode_ratio = median(served.decode_tok_s) / median(offline.decode_tok_s)
    # interleaved, each served round ran right after its offline round (the same machine state)
    pairs = zip(served.decode_tok_s, offline.decode_tok_s, strict=True)
    by_round = median(s / o for s, o in pairs) if args.interleave else None
    for label, side in (("offline", offline), ("served", served)):
        print(f"{label:8s} {median(side.tok_s):8.1f} output tok/s  (rounds: {rounds(side.tok_s)})")
        print(f"{'':8s} {median(side.decode_tok_s):8.1f} decode tok/s  (rounds: {rounds(side.decode_tok_s)})")
    print(
        f"served / offline {ratio:.2f}x output, {decode_ratio:.2f}x decode ({args.client} client, {args.concurrency} streams)"
        + (
            f"; decode by round {by_round:.2f}x (the median of the rounds' ratios)"
            if by_round is not None
            else ""
        )
    )
    if pause is not None:
        print(f"served: a stream's second piece came a median {1000 * pause:.0f} ms after its first")
    print(
        "served: longest wait between two pieces after the second, per round: "
        + ", ".join(f"{1000 * gap:.0f}" for gap in srv.longest_gaps)
        + " ms"
    )
    print(
        "CPU ms per output token, served: "
        + ", ".join(f"{name} {1000 * s:.2f}" for name, s in cpu.items())
        + f"; offline engine {1000 * offline_cpu:.2f}"
    )
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "log_dir")}
    payload = {
        "settings": settings,
        "offline_tok_s": offline.tok_s,
        "served_tok_s": served.tok_s,
        "ratio": ratio,
        "offline_decode_tok_s": offline.decode_tok_s,
        "served_decode_tok_s": served.decode_tok_s,
        "decode_ratio": decode_ratio,
    }
    if by_round is not None:
        payload["decode_ratio_by_round"] = by_round
    payload["served_pieces"] = counts  # tokens (gRPC) or text chunks (openai) the client saw
    payload["served_first_pause_s"] = srv.pauses  # per round: first piece to second, the streams' median
    payload["served_longest_gap_s"] = srv.longest_gaps  # per round, over every stream
    payload["served_cpu_s_per_token"] = cpu
    payload["offline_cpu_s_per_token"] = offline_cpu
    path = save("served_vs_offline", payload, Path(args.output) if args.output else None)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
