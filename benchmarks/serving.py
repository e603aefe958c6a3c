"""Online serving benchmark: disaggregated (1 prefill + 1 decode worker) vs colocated (the decode
worker alone doing prefill and decode), under Poisson arrivals.

One stack (router + one prefill worker + one decode worker) is started, or an existing router is
given with --router. For each request rate the same request stream (seeded: the same arrival
times and prompt bodies) is sent twice through the router's gRPC `Inference.Generate`, once with
mode=SERVING_MODE_DISAGGREGATED and once with mode=SERVING_MODE_COLOCATED (which the router runs
on the decode worker). Prompts are random token ids (`token_ids`, so lengths are exact), different
per request; the first two tokens of every prompt are a salt drawn per run, so no run reads KV
that another run (or an earlier invocation) left in a prefix cache. Greedy, ignore_eos, exactly
--output-len tokens per request.

Measured at the client, per run: TTFT (send to the first message carrying a token), inter-token
latency (gap between token-carrying messages / tokens in the later message, one sample per token),
end-to-end latency (p50 / p99 of each), output token and request throughput over the run's wall
time, KV bytes moved (sum of the final usage.kv_transfer_bytes), prompt tokens served from a
prefix cache, failures. Results go to benchmarks/results/serving_<hardware>_<date>.json.

    python benchmarks/serving.py --model models/pdserve-bench --rates 1,2,4 --num-requests 32
    pdserve bench-serve --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save  # noqa: E402

MODES = ("disaggregated", "colocated")
SALT_TOKENS = 2
"""Leading prompt tokens drawn per run (not from the seed) so runs never share cached KV."""
FIRST_TOKEN_ID = 10
"""Random prompt tokens are drawn from [FIRST_TOKEN_ID, vocab) to stay clear of special tokens."""
SMOKE_REQUESTS = 3


@dataclass
class Request:
    arrival_s: float
    """Offset from the start of the run at which the request is sent."""
    token_ids: list[int]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    kv_transfer_bytes: int = 0
    cached_tokens: int = 0
    disaggregated: bool = False
    server_prefill_s: float = 0.0
    server_kv_transfer_s: float = 0.0


def workload(
    num_requests: int | None,
    duration_s: float | None,
    rate: float,
    input_len: int,
    shared_prefix_len: int,
    vocab: int,
    seed: int,
) -> list[Request]:
    """The seeded request stream of one rate: Poisson arrivals (the first at 0; rate inf: all at
    once) and prompts of input_len random tokens, the first shared_prefix_len shared by all."""
    arrivals_rng = random.Random(f"{seed}-arrivals-{rate}")
    prompts_rng = random.Random(f"{seed}-prompts")
    shared = [prompts_rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(shared_prefix_len)]
    if num_requests is None and not math.isfinite(rate):
        raise ValueError("rate inf needs --num-requests (--duration would never end)")
    requests: list[Request] = []
    t = 0.0
    while True:
        if num_requests is not None and len(requests) >= num_requests:
            break
        if duration_s is not None and t >= duration_s and requests:
            break
        body = [prompts_rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(input_len - shared_prefix_len)]
        requests.append(Request(t, shared + body))
        if math.isfinite(rate):
            t += arrivals_rng.expovariate(rate)
    return requests


def salted(token_ids: list[int], salt: list[int]) -> list[int]:
    return salt + token_ids[len(salt) :]


def new_salt(vocab: int) -> list[int]:
    rng = random.SystemRandom()
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(SALT_TOKENS)]


async def one_request(stub, pb, mode: int, token_ids: list[int], output_len: int, timeout_s: float) -> Result:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=token_ids),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        mode=mode,
    )
    res = Result()
    start = time.perf_counter()
    last = None
    final = None
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            now = time.perf_counter()
            if msg.token_ids:
                n = len(msg.token_ids)
                if last is None:
                    res.ttft_s = now - start
                else:
                    res.itl_s.extend([(now - last) / n] * n)
                last = now
                res.output_tokens += n
            if msg.HasField("usage"):
                final = msg
        res.e2e_s = time.perf_counter() - start
    except Exception as e:  # grpc.aio.AioRpcError, cancellation by the deadline, ...
        code = getattr(e, "code", None)
        res.error = f"{code().name}: {e.details()}" if callable(code) else f"{type(e).__name__}: {e}"
        return res
    if final is None:
        res.error = "stream ended without a final message"
        return res
    res.kv_transfer_bytes = final.usage.kv_transfer_bytes
    res.cached_tokens = final.usage.cached_tokens
    res.disaggregated = final.disaggregated
    res.server_prefill_s = final.timings.prefill_ns / 1e9
    res.server_kv_transfer_s = final.timings.kv_transfer_ns / 1e9
    if res.output_tokens != output_len:
        res.error = f"{res.output_tokens} tokens, expected {output_len}"
        return res
    res.ok = True
    return res


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values) * scale
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(results: list[Result], wall_s: float, want_disaggregated: bool) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(results),
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": errors,
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "req_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([r.ttft_s for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok]),
        "kv_transfer_bytes": sum(r.kv_transfer_bytes for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "mode_mismatches": sum(r.disaggregated != want_disaggregated for r in ok),
        "server_prefill_ms_mean": percentiles([r.server_prefill_s for r in ok])["mean"],
        "server_kv_transfer_ms_mean": percentiles([r.server_kv_transfer_s for r in ok])["mean"],
    }


async def run_stream(
    endpoint: str, mode_name: str, requests: list[Request], args, vocab: int
) -> tuple[dict, dict]:
    """Warm-up request, then the stream with one task per request -> (warm-up, summary)."""
    import grpc

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    mode = {
        "disaggregated": pb.SERVING_MODE_DISAGGREGATED,
        "colocated": pb.SERVING_MODE_COLOCATED,
    }[mode_name]
    want_disagg = mode_name == "disaggregated"
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = pb_grpc.InferenceStub(ch)
        warm_prompt = salted(requests[0].token_ids, new_salt(vocab))
        warm = await one_request(stub, pb, mode, warm_prompt, min(args.output_len, 8), args.timeout)
        if not warm.ok:
            raise RuntimeError(f"{mode_name} warm-up request failed: {warm.error}")
        salt = new_salt(vocab)

        async def send(r: Request, t0: float) -> Result:
            await asyncio.sleep(max(t0 + r.arrival_s - time.perf_counter(), 0.0))
            return await one_request(stub, pb, mode, salted(r.token_ids, salt), args.output_len, args.timeout)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(send(r, t0) for r in requests))
        wall = time.perf_counter() - t0
    return {"ttft_ms": warm.ttft_s * 1000, "e2e_ms": warm.e2e_s * 1000}, summarize(
        list(results), wall, want_disagg
    )


def server_info(endpoint: str) -> dict:
    import grpc

    from pdserve.v1 import inference_pb2 as pb
    from pdserve.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(endpoint) as ch:
        info = pb_grpc.InferenceStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    card = info.models[0]
    return {
        "version": info.version,
        "model": card.id,
        "vocab_size": card.vocab_size,
        "max_model_len": card.max_model_len,
        "workers": [{"endpoint": w.endpoint, "role": w.role, "healthy": w.healthy} for w in info.workers],
    }


def _ms(d: dict, key: str) -> str:
    v = d[key]
    return "-" if v is None else f"{v:.1f}"


def _ratio(a, b) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def table(rate: float, by_mode: dict[str, dict]) -> str:
    d, c = by_mode["disaggregated"], by_mode["colocated"]
    rows = [
        ("completed / failures", lambda s: f"{s['completed']} / {s['failures']}", None),
        ("TTFT p50 (ms)", lambda s: _ms(s["ttft_ms"], "p50"), lambda s: s["ttft_ms"]["p50"]),
        ("TTFT p99 (ms)", lambda s: _ms(s["ttft_ms"], "p99"), lambda s: s["ttft_ms"]["p99"]),
        ("ITL p50 (ms)", lambda s: _ms(s["itl_ms"], "p50"), lambda s: s["itl_ms"]["p50"]),
        ("ITL p99 (ms)", lambda s: _ms(s["itl_ms"], "p99"), lambda s: s["itl_ms"]["p99"]),
        ("E2E p50 (ms)", lambda s: _ms(s["e2e_ms"], "p50"), lambda s: s["e2e_ms"]["p50"]),
        ("E2E p99 (ms)", lambda s: _ms(s["e2e_ms"], "p99"), lambda s: s["e2e_ms"]["p99"]),
        ("output tok/s", lambda s: f"{s['output_tok_per_s']:.1f}", lambda s: s["output_tok_per_s"]),
        ("requests/s", lambda s: f"{s['req_per_s']:.2f}", lambda s: s["req_per_s"]),
        ("KV transferred (MiB)", lambda s: f"{s['kv_transfer_bytes'] / 2**20:.2f}", None),
        ("cached prompt tokens", lambda s: str(s["cached_tokens"]), None),
    ]
    width = 22
    lines = [
        f"rate {rate:g} req/s ({d['requests']} requests)",
        f"  {'':<{width}} {'disaggregated':>14} {'colocated':>14} {'disagg/coloc':>13}",
    ]
    for name, fmt, value in rows:
        ratio = _ratio(value(d), value(c)) if value else ""
        lines.append(f"  {name:<{width}} {fmt(d):>14} {fmt(c):>14} {ratio:>13}")
    return "\n".join(lines)


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates: positive numbers (or inf), comma-separated; got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serving.py", description=__doc__.split("\n\n")[0].replace("\n", " "))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="HF-format model folder (default: the tiny model)")
    src.add_argument("--router", default=None, help="HOST:PORT of a running router (no stack is started)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument(
        "--rates", type=parse_rates, default=[1.0, 2.0, 4.0], help="req/s, e.g. 1,2,4 (inf: all at once)"
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--num-requests", type=int, default=None, help="requests per rate and mode (default 32)"
    )
    size.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate and mode")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--shared-prefix-len", type=int, default=0, help="leading prompt tokens all requests share"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_REQUESTS} requests per mode at the first rate; not saved",
    )
    p.add_argument(
        "--output", default=None, help="write the results JSON here (default: benchmarks/results/...)"
    )
    p.add_argument("--log-dir", default=None, help="stack process logs (default: a temporary folder)")
    return p


def check_args(args, info: dict | None = None) -> None:
    """ValueError naming the flag; the model's limits are checked once info (the server's) is known."""
    if args.num_requests is None and not all(math.isfinite(r) for r in args.rates):
        raise ValueError("rate inf needs --num-requests (--duration would never end)")
    if args.input_len < max(SALT_TOKENS + 1, args.shared_prefix_len + 1):
        raise ValueError(
            f"--input-len must exceed --shared-prefix-len and be at least {SALT_TOKENS + 1}; got {args.input_len}"
        )
    if args.shared_prefix_len and args.shared_prefix_len < SALT_TOKENS:
        raise ValueError(f"--shared-prefix-len: 0 or at least {SALT_TOKENS}")
    if info is not None and args.input_len + args.output_len > info["max_model_len"]:
        raise ValueError(
            f"--input-len + --output-len = {args.input_len + args.output_len} exceeds the model's "
            f"max_model_len {info['max_model_len']}"
        )


async def bench(endpoint: str, args, info: dict) -> list[dict]:
    per_rate = []
    for rate in args.rates:
        requests = workload(
            args.num_requests,
            args.duration,
            rate,
            args.input_len,
            args.shared_prefix_len,
            info["vocab_size"],
            args.seed,
        )
        by_mode, warmups = {}, {}
        for mode in MODES:
            warmups[mode], by_mode[mode] = await run_stream(
                endpoint, mode, requests, args, info["vocab_size"]
            )
        print(table(rate, by_mode), flush=True)
        per_rate.append({"rate": rate, "num_requests": len(requests), "warmup": warmups, **by_mode})
    return per_rate


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.rates, args.num_requests, args.duration = args.rates[:1], SMOKE_REQUESTS, None
    elif args.num_requests is None and args.duration is None:
        args.num_requests = 32
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stack = None
    if args.router:
        endpoint, model = args.router, None
        comparison = "an existing router (--router): colocated requests go to its least loaded decode worker"
    else:
        from engine import env
        from modelkit.make_model import make_model
        from services.launcher import Stack, StackConfig

        model = args.model or str(make_model("tiny", Path(env.model_cache_dir()) / "pdserve-tiny"))
        log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-serve-")
        stack = Stack(
            StackConfig(
                model=model,
                num_prefill=1,
                num_decode=1,
                http_port=None,
                engine_args=["--dtype", args.dtype, "--num-kv-blocks", str(args.num_kv_blocks)],
                threads_per_worker=args.threads_per_worker,
                log_dir=log_dir,
            )
        )
        print(f"starting a stack of 1 prefill + 1 decode worker on {model} (logs: {log_dir})", flush=True)
        stack.start()
        endpoint = stack.grpc_endpoint
        comparison = (
            "disaggregated: 1 prefill + 1 decode worker; colocated: the same decode worker alone "
            "doing prefill and decode (the prefill worker idles)"
        )
    try:
        info = server_info(endpoint)
        try:
            check_args(args, info)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(comparison, flush=True)
        print(
            f"model {info['model']}, {args.input_len} input + {args.output_len} output tokens, "
            f"shared prefix {args.shared_prefix_len}, seed {args.seed}",
            flush=True,
        )
        per_rate = asyncio.run(bench(endpoint, args, info))
    finally:
        if stack is not None:
            stack.stop()

    settings = {
        k: getattr(args, k)
        for k in (
            "router",
            "dtype",
            "num_kv_blocks",
            "threads_per_worker",
            "rates",
            "num_requests",
            "duration",
            "input_len",
            "output_len",
            "shared_prefix_len",
            "seed",
            "timeout",
            "smoke",
        )
    }
    payload = {
        "model": model or info["model"],
        "comparison": comparison,
        "server": info,
        "settings": settings,
        "results": per_rate,
    }
    failures = sum(r[m]["failures"] for r in per_rate for m in MODES)
    if args.output:
        print(f"saved {save('serving', payload, Path(args.output))}")
    elif not args.smoke:
        print(f"saved {save('serving', payload)}")
    if failures:
        print(f"{failures} requests failed", file=sys.stderr)
    return 1 if failures and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
