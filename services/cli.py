"""`pdserve` command line: build the project's models, generate offline, run the demo job."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import itertools
import logging
import shlex
import sys
import time
from pathlib import Path

from engine import env

# Flags map one-to-one onto EngineConfig / SamplingParams fields (--max-num-seqs -> max_num_seqs).
ENGINE_FLAGS: dict[str, dict] = {
    "dtype": dict(default="bfloat16", choices=["bfloat16", "float16", "float32"]),
    "block_size": dict(type=int, default=16),
    "max_num_seqs": dict(type=int, default=256),
    "max_num_batched_tokens": dict(
        type=int,
        default=4096,
        help="tokens a step computes (prompt chunks and decodes); a step that takes every prompt that "
        "arrived together keeps their streams in step (vLLM-CPU's for MLA)",
    ),
    "max_model_len": dict(type=int, default=None),
    "num_kv_blocks": dict(type=int, default=None),
    "kv_cache_memory_gib": dict(type=float, default=1.0, help="KV space when --num-kv-blocks is not given"),
    "num_threads": dict(type=int, default=None),
    "num_redundant_experts": dict(type=int, default=0),
    "expert_placement_file": dict(default=None),
    "eplb_interval": dict(type=int, default=0),
    "eplb_window": dict(type=int, default=0),
    "kv_offload": dict(default=None, help="KV offload tiers: host, redis or host,redis"),
    "kv_host_blocks": dict(type=int, default=4096),
    "kv_redis_url": dict(default=None, help="redis://host:port/db for the shared KV tier"),
    "kv_redis_ttl_s": dict(type=int, default=3600),
    "kv_prefault": dict(
        action="store_true", help="make the whole KV cache resident at start (a server's: steady latency)"
    ),
    "batch_invariant": dict(
        action="store_true",
        help="each request's tokens independent of the rest of its batch (every product in the native kernels)",
    ),
    "heap_free_limit_mib": dict(
        type=int,
        default=256,
        help="free host heap kept between steps before it goes back to the system (0: keep all)",
    ),
}
SAMPLING_FLAGS: dict[str, dict] = {
    "max_tokens": dict(type=int, default=64),
    "min_tokens": dict(type=int, default=0),
    "temperature": dict(type=float, default=0.0),
    "top_p": dict(type=float, default=1.0),
    "top_k": dict(type=int, default=-1),
    "min_p": dict(type=float, default=0.0),
    "seed": dict(type=int, default=None),
    "repetition_penalty": dict(type=float, default=1.0),
    "presence_penalty": dict(type=float, default=0.0),
    "frequency_penalty": dict(type=float, default=0.0),
    "stop": dict(action="append", default=[], help="stop string (repeatable)"),
    "ignore_eos": dict(action="store_true"),
}


def model_name(path: str) -> str:
    """The served model name: the model folder's name."""
    return Path(path).resolve().name


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative", default=None, choices=["mtp"], help="speculative decoding with the MTP layer"
    )
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="draft tokens per step (k)")
    p.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="steps running at least this many requests draft nothing",
    )
    p.add_argument(
        "--speculative-draft-vocab",
        default=None,
        help="draft from this file's tokens alone (pdserve draft-vocab writes it)",
    )


def _spec_config(args: argparse.Namespace) -> dict:
    if not args.speculative:
        return {}
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative_disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.speculative_disable_by_batch_size
    if args.speculative_draft_vocab is not None:
        spec["draft_vocab"] = args.speculative_draft_vocab
    return {"speculative_config": spec}


def _spec_args(args: argparse.Namespace) -> list[str]:
    """The speculative flags as `pdserve worker` takes them (`pdserve serve` passes them on)."""
    if not args.speculative:
        return []
    flags = ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.speculative_disable_by_batch_size is not None:
        flags += ["--speculative-disable-by-batch-size", str(args.speculative_disable_by_batch_size)]
    if args.speculative_draft_vocab is not None:  # the workers may start elsewhere: an absolute path
        flags += ["--speculative-draft-vocab", str(Path(args.speculative_draft_vocab).resolve())]
    return flags


def _add_flags(p: argparse.ArgumentParser, flags: dict[str, dict]) -> None:
    for name, options in flags.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, **options)


def _pick(args: argparse.Namespace, flags: dict[str, dict]) -> dict:
    return {name: getattr(args, name) for name in flags}


def cmd_make_model(args: argparse.Namespace) -> int:
    from modelkit.make_model import make_model
    from modelkit.quantize import QuantOptions

    start = time.perf_counter()
    path = make_model(args.name, args.out, force=args.force, quant=QuantOptions() if args.fp8 else None)
    print(f"{args.name}: {path} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from modelkit.quantize import QuantOptions, quantize_folder

    opts = QuantOptions(
        block=args.block,
        ue8m0=args.ue8m0,
        scale_dtype=args.scale_dtype or ("e8m0" if args.names == "deepseek" and args.ue8m0 else "f32"),
        experts_fp4=args.experts == "fp4",
        names=args.names,
    )
    start = time.perf_counter()
    path = quantize_folder(args.model, args.out, opts, shard_bytes=int(args.shard_gb * 1e9))
    print(f"{path} ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_train_tiny(args: argparse.Namespace) -> int:
    try:
        if args.arch == "v4":
            from modelkit.training.train_tiny_v4 import run
        else:
            from modelkit.training.train_tiny import run
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
        print(
            "pdserve train-tiny trains through HF transformers, which this install lacks: "
            "install the 'train' extra (pip install -e '.[train]', or pip install transformers==5.23.0)",
            file=sys.stderr,
        )
        return 2

    print(f"trained: {run(args, shlex.join(['pdserve', *args.argv]))}")
    return 0


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from engine.spec_decode.draft_vocab import corpus_texts, count_tokens, most_frequent, write_draft_vocab
    from engine.tokenizer import Tokenizer

    if not args.corpus and not args.stdlib_docs:
        print("pdserve draft-vocab: give --corpus files, --stdlib-docs, or both", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_pretrained(args.model)
    if not 1 <= args.size <= cfg.vocab_size:
        print(
            f"pdserve draft-vocab: --size must be in [1, {cfg.vocab_size}] (the vocabulary), got {args.size}",
            file=sys.stderr,
        )
        return 2
    tokenizer = Tokenizer(args.model)
    texts = corpus_texts(args.corpus)  # read file by file as they are counted
    if args.stdlib_docs:
        from modelkit.training.data import split_documents

        texts = itertools.chain(texts, (d.text for d in split_documents()[0]))
    counts = count_tokens(texts, lambda t: tokenizer.encode(t, add_special_tokens=False), cfg.vocab_size)
    ids = most_frequent(counts, args.size, always=cfg.eos_token_ids)
    total = int(counts.sum())
    coverage = int(counts[ids].sum()) / total if total else 0.0
    corpus = [*args.corpus, *(["stdlib-docs"] if args.stdlib_docs else [])]
    write_draft_vocab(
        args.out, ids, model=str(args.model), corpus=corpus, corpus_tokens=total, coverage=coverage
    )
    print(f"{args.out}: {len(ids)} of {cfg.vocab_size} tokens, {coverage:.1%} of the corpus's {total} tokens")
    return 0


def _stream(llm, prompt: str | None, params, prompt_token_ids: list[int] | None = None) -> None:
    """Print one completion as it is generated, then its throughput."""
    start = time.perf_counter()
    out = None
    for out in llm.stream(prompt, params, prompt_token_ids=prompt_token_ids):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    assert out is not None
    n = len(out.token_ids)
    ttft = out.metrics.time_to_first_token or 0.0
    decode_rate = (n - 1) / max(elapsed - ttft, 1e-9) if n > 1 else 0.0
    print(
        f"\n\n[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s overall, "
        f"TTFT {ttft * 1000:.0f} ms, decode {decode_rate:.1f} tok/s; finish_reason={out.finish_reason}]"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **_pick(args, ENGINE_FLAGS), **_spec_config(args))
    prompt, ids = args.prompt, None
    if args.chat:
        # The template writes the BOS itself: encode without special tokens, as HF's
        # apply_chat_template(tokenize=True) does, or the model sees two BOS tokens.
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt, ids = None, llm.tokenizer.encode(rendered, add_special_tokens=False)
    _stream(llm, prompt, SamplingParams(**_pick(args, SAMPLING_FLAGS)), prompt_token_ids=ids)
    return 0


SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "pdserve-tiny"
"""The trained default model checked into the repository (`pdserve train-tiny` made it)."""
SHIPPED_V4_MODEL = SHIPPED_MODEL.with_name("pdserve-tiny-v4")
"""The trained DeepSeek-V4 beside it (`pdserve train-tiny --arch v4`)."""


def default_model(model_dir: str, arch: str = "v3") -> Path:
    """The shipped trained model of the architecture; without it (an install without the
    repository), the deterministic random tiny model built into model_dir."""
    shipped, preset = (SHIPPED_V4_MODEL, "tiny-v4") if arch == "v4" else (SHIPPED_MODEL, "tiny")
    if (shipped / "model.safetensors").is_file():
        return shipped
    from modelkit.make_model import make_model

    return make_model(preset, Path(model_dir) / f"pdserve-{preset}")


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job of `make run`: build the default model if needed, start the stack (router,
    prefill worker, decode worker) on loopback, stream a completion through it with the openai
    client and through gRPC, then stop it."""
    import tempfile

    from services import demo
    from services.launcher import Stack, StackConfig

    model = default_model(args.model_dir, args.arch)
    logs = tempfile.mkdtemp(prefix="pdserve-demo-")
    print(
        f"model: {model}\nstarting router + prefill worker + decode worker (logs in {logs}) ...", flush=True
    )
    start = time.perf_counter()
    cfg = StackConfig(
        model=str(model),
        engine_args=["--dtype", "bfloat16", "--num-kv-blocks", "2048"],
        log_dir=logs,
        threads_per_worker=1,
    )
    stack = Stack(cfg).start(on_wait=lambda line: print(line, flush=True))
    try:
        print(
            f"stack ready in {time.perf_counter() - start:.1f} s: OpenAI HTTP {stack.http_url}/v1, gRPC {stack.grpc_endpoint}\n"
        )
        demo.openai_stream(stack.http_url, model_name(str(model)), args.max_tokens, stack.api_key)
        demo.grpc_stream(stack.grpc_endpoint, args.max_tokens, stack.api_key)
    finally:
        stack.stop()
    return 0


def _engine_config(args: argparse.Namespace, **extra):
    from engine.config import EngineConfig

    return EngineConfig(model=str(args.model), **_pick(args, ENGINE_FLAGS), **extra)


def _security(args: argparse.Namespace):
    """The internal token / TLS of a worker or router; ValueError (exit 2) when its --host is not
    loopback and neither protects the internal RPCs, unless --insecure-internal."""
    from services.common.security import Security, check_exposure

    security = Security.from_env(args.tls_cert, args.tls_key, args.tls_ca)
    check_exposure(args.host, security, args.insecure_internal)
    return security


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="PEM certificate for mutual TLS on internal RPCs")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA bundle peers must chain to")
    p.add_argument(
        "--insecure-internal",
        action="store_true",
        help="allow a non-loopback --host without PDSERVE_INTERNAL_TOKEN or mutual TLS (trusted networks only)",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    import asyncio

    from engine.parallel.groups import GroupConfig
    from services.worker.server import WorkerServerConfig, serve
    from services.worker.settings import WorkerSettings

    if args.dp < 1 or (args.ep is not None and args.ep < 1):
        raise ValueError("--dp and --ep must be >= 1")
    security = _security(args)
    if args.dp > 1 and args.group_rank is None:
        from services.worker.ranks import launch_ranks

        return launch_ranks(args.argv, args)
    group_size = args.ep or 1
    group = None
    rank = args.group_rank if args.group_rank is not None else args.dp_rank_offset
    if group_size > 1:
        if args.dist_master_port == 0:
            raise ValueError("a rank started on its own (--dp 1 --ep N) needs --dist-master-port")
        group = GroupConfig(
            rank, group_size, args.dist_master_addr, args.dist_master_port, args.dist_timeout_s
        )
    extra = {"enable_expert_parallel": True, "data_parallel_size": group_size} if group is not None else {}
    extra.update(_spec_config(args))
    engine = _engine_config(args, **extra)
    chunk = {} if args.kv_chunk_bytes is None else {"kv_chunk_bytes": args.kv_chunk_bytes}
    settings = WorkerSettings(
        role=args.role,
        model_name=args.served_model_name or model_name(args.model),
        dp_rank=rank if group is not None else args.dp_rank,
        dp_size=max(group_size, args.dp),
        ep_size=group_size,
        lease_s=args.lease_s,
        max_total_lease_s=args.max_total_lease_s,
        max_pinned_fraction=args.max_pinned_fraction,
        kv_producers=tuple(e.strip() for e in args.kv_producers.split(",") if e.strip())
        if args.kv_producers
        else None,
        kv_transport=args.kv_transport,
        kv_checksums=args.kv_checksum,
        **chunk,
    )
    cfg = WorkerServerConfig(
        group=group,
        engine=engine,
        settings=settings,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        registry=args.registry,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        grace_s=args.grace_s,
        security=security,
        stall_timeout_s=args.stall_timeout_s,
        fault=env.fault(),
        kv_read_gate=env.kv_read_gate(),
    )
    return asyncio.run(serve(cfg))


def cmd_router(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.security import ApiKeys
    from services.router.core import RouterSettings
    from services.router.policy import RoutingConfig
    from services.router.server import RouterServerConfig, serve

    if not args.registry and not args.workers:
        raise ValueError("give --registry redis://... or --workers host:port,...")
    security = _security(args)
    api_keys = ApiKeys.load(args.api_key, args.api_key_file)
    routing = RoutingConfig(
        colocate_max_tokens=args.colocate_max_tokens,
        colocate_cached_fraction=args.colocate_cached_fraction,
        colocate_prefill_backlog=args.colocate_prefill_backlog,
    )
    settings = RouterSettings(
        model_name=args.served_model_name or model_name(args.model),
        routing=routing,
        max_in_flight=args.max_in_flight,
        max_queued=args.max_queued,
        queue_timeout_s=args.queue_timeout_s,
        max_generations_per_request=args.max_generations_per_request,
        max_attempts=args.max_attempts,
        kv_redis_url=args.kv_redis_url,
        stream_interval=args.stream_interval,
    )
    cfg = RouterServerConfig(
        model=args.model,
        settings=settings,
        probe_interval_s=args.probe_interval_s,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=None if args.no_http else args.http_port,
        registry=args.registry,
        workers=[w for w in (args.workers or "").split(",") if w],
        security=security,
        public_tls_cert=args.public_tls_cert,
        public_tls_key=args.public_tls_key,
        http_header_timeout_s=args.http_header_timeout_s,
        http_body_timeout_s=args.http_body_timeout_s,
        http_max_connections=args.http_max_connections,
        api_keys=api_keys,
    )
    return asyncio.run(serve(cfg))


SERVE_ENGINE_FLAGS = {name: flag for name, flag in ENGINE_FLAGS.items() if name != "num_threads"}
"""The engine flags `pdserve serve` takes and gives every worker (threads: --threads-per-worker)."""


def _serve_engine_args(args: argparse.Namespace) -> list[str]:
    """The engine flags `pdserve serve` gives every worker it starts: the dtype, and every other one
    set to what is not its default (a prefill worker writes the MTP layer's KV too, so the
    speculative flags go to all)."""
    engine_args = []
    for name, flag in SERVE_ENGINE_FLAGS.items():
        value, switch = getattr(args, name), flag.get("action") == "store_true"
        if value == flag.get("default", False if switch else None) and name != "dtype":
            continue
        option = "--" + name.replace("_", "-")
        engine_args += [option] if switch else [option, str(value)]
    return engine_args + _spec_args(args)


def _serve_roles(args: argparse.Namespace) -> dict[str, int]:
    """How many workers of each role `pdserve serve` starts: --colocated N alone, else the prefill
    and decode workers (at least one of each: the router hands a prompt from one to the other)."""
    if args.colocated < 0 or args.num_prefill < 0 or args.num_decode < 0:
        raise SystemExit("--colocated, --num-prefill and --num-decode count workers: 0 or more")
    if args.colocated:
        return {"prefill": 0, "decode": 0, "colocated": args.colocated}
    if args.num_prefill < 1 or args.num_decode < 1:
        raise SystemExit("a disaggregated stack needs --num-prefill and --num-decode >= 1 (or --colocated N)")
    return {"prefill": args.num_prefill, "decode": args.num_decode, "colocated": 0}


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from services.launcher import Stack, StackConfig

    model = args.model or str(default_model(env.model_cache_dir()))
    roles = _serve_roles(args)
    stack = Stack(
        StackConfig(
            model=model,
            host=args.host,
            num_prefill=roles["prefill"],
            num_decode=roles["decode"],
            num_colocated=roles["colocated"],
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            engine_args=_serve_engine_args(args),
            registry=args.registry,
            threads_per_worker=args.threads_per_worker,
            api_key=args.api_key,
            router_args=_router_flags(args),
        )
    )

    # The router runs in this process (one process fewer: ~40 MiB), the workers as its children.
    # A signal before the router's loop takes them over stops the stack here; after, the router
    # drains and returns, and the workers are stopped after it.
    class Stopped(Exception):
        pass

    def stop_now(*_):
        raise Stopped

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_now)
    failed, done = threading.Event(), threading.Event()

    def end(message: str) -> None:  # a worker failed: stop the router (then the stack)
        if not done.is_set():
            print(message, file=sys.stderr, flush=True)
            failed.set()
            os.kill(os.getpid(), signal.SIGTERM)

    def supervise() -> None:
        try:
            deadline = time.monotonic() + stack.cfg.ready_timeout_s
            stack.wait_all_ready(deadline, lambda line: print(line, flush=True), stack.cfg.progress_every_s)
            stack.wait_routable(deadline)
        except Exception as e:  # noqa: BLE001 - said, and the stack stopped
            return end(f"error: {e}; stopping the stack")
        print(
            f"pdserve serving {model}\n  OpenAI HTTP: {stack.http_url}/v1\n  gRPC:        {stack.grpc_endpoint}",
            flush=True,
        )
        if stack.api_key:
            print("  API key:     required (Authorization: Bearer <key>)", flush=True)
        for proc in stack.procs:
            print(f"  {proc.name:<10} {proc.endpoint} (pid {proc.popen.pid})", flush=True)
        print(f"  {'router':<10} {stack.grpc_endpoint} (pid {os.getpid()})", flush=True)
        while not done.wait(0.5):
            if any(p.popen.poll() is not None for p in stack.procs):
                return end("a process exited; stopping the stack")

    workers = ", ".join(f"{n} {role}" for role, n in roles.items() if n)
    print(f"starting {workers} worker(s) for {model}, and a router in this process ...", flush=True)
    code = 1
    try:
        for role, n in roles.items():
            for i in range(n):
                stack.start_worker(role, i)
        os.environ.update(stack.stack_environ(stack.api_key))
        router = build_parser().parse_args(stack.router_command())
        threading.Thread(target=supervise, name="supervise", daemon=True).start()
        code = router.func(router)
    except Stopped:
        code = 0
    finally:
        done.set()
        for sig in (signal.SIGINT, signal.SIGTERM):  # the workers get their grace, then SIGKILL
            signal.signal(sig, signal.SIG_IGN)
        codes = stack.stop()
    return 0 if code == 0 and not failed.is_set() and not any(codes.values()) else 1


def cmd_kernels(args: argparse.Namespace) -> int:
    """Which native CPU kernels this install holds and which one this CPU loads. --check (the
    image build runs it): exit 1 unless the install holds every ISA level's library and the
    KV checksums' and this CPU loads its level's without compiling."""
    from engine.kv_cache import checksum
    from engine.platform import load_native
    from kernels import native
    from kernels.native import build

    libs = {name: build.kernels(v) for name, v in build.VARIANTS.items()} | {"crc32c": build.CRC32C}
    print(f"prebuilt in {build.PREBUILT}:")
    missing = []
    for name, lib in libs.items():
        there = (build.PREBUILT / lib.file_name()).exists()
        missing += [] if there else [name]
        summary = build.VARIANTS[name].summary if name in build.VARIANTS else "the KV checksums"
        print(f"  {name:<12} {'yes' if there else 'MISSING':<8} {lib.file_name()}: {summary}")
    variant = build.choose(native.cpu_flags())
    print(f"this CPU runs: {variant.name if variant else 'none of them (torch kernels)'}")
    if args.check and missing:
        print(f"error: the install lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    loaded = load_native()
    print(f"loaded: {native.library_path() if loaded else 'no (torch kernels)'}")
    checksum.load()
    if args.check and variant is not None and not (loaded and native.library_path().parent == build.PREBUILT):
        print("error: this CPU's kernels did not load from the install", file=sys.stderr)
        return 1
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run benchmarks/serving.py (not installed with pdserve: found next to services/ in a checkout)."""
    bench_dir = Path(__file__).resolve().parent.parent / "benchmarks"
    if not (bench_dir / "serving.py").is_file():
        raise ValueError(f"bench-serve needs a pdserve source checkout: {bench_dir / 'serving.py'} not found")
    sys.path.insert(0, str(bench_dir))
    from serving import main as serving_main

    return serving_main(args.bench_args)


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    """The router's that `pdserve serve` passes on to the router it starts."""
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens a stream's message gathers before it goes out (first and last at once); "
        "larger: less CPU per token in the router and the clients, later tokens",
    )
    p.add_argument(
        "--colocate-prefill-backlog",
        type=int,
        default=0,
        help="prompt tokens in flight on every prefill worker past which a prompt runs colocated "
        "on its decode worker, if fewer wait there (0: never)",
    )


def _router_flags(args: argparse.Namespace) -> list[str]:
    backlog = ["--colocate-prefill-backlog", str(args.colocate_prefill_backlog)]
    return ["--stream-interval", str(args.stream_interval), *backlog]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="build one of the project's models (HF format)")
    p.add_argument(
        "name",
        choices=[
            "tiny",
            "tiny-mtp",
            "bench",
            "tiny-v32",
            "tiny-v32-mtp",
            "bench-v32",
            "tiny-v4",
            "tiny-v4-mtp",
            "bench-v4",
        ],
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.add_argument(
        "--fp8", action="store_true", help="its weights as DeepSeek's FP8 checkpoints store them (128 x 128)"
    )
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser(
        "quantize",
        help="write a bf16/fp32 model folder in DeepSeek's quantized format (FP8 block scales, MXFP4 experts)",
    )
    p.add_argument("model", help="the HF-format folder to read")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument(
        "--block", type=int, choices=[128, 32], default=128, help="FP8 block edge (V3: 128, V4.1: 32)"
    )
    p.add_argument("--ue8m0", action="store_true", help="scales rounded up to powers of two (V3.1 and later)")
    p.add_argument(
        "--scale-dtype",
        choices=["f32", "e8m0"],
        help="how scales are stored (default: e8m0 bytes for --ue8m0 with DeepSeek's names, else float32)",
    )
    p.add_argument(
        "--experts", choices=["fp8", "fp4"], default="fp8", help="routed experts' format (fp4: MXFP4, V4's)"
    )
    p.add_argument(
        "--names",
        choices=["hf", "deepseek"],
        default="hf",
        help="tensor names: HF's or DeepSeek's own (V4's)",
    )
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest output shard, GB")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("train-tiny", help="train the small DeepSeek-V3 + MTP model on the stdlib docs (CPU)")
    from modelkit.training import add_arguments  # flags only: the trainer (torch) loads on use

    add_arguments(p)
    p.set_defaults(func=cmd_train_tiny)

    p = sub.add_parser(
        "draft-vocab", help="the most frequent tokens of a corpus, for MTP drafts (--speculative-draft-vocab)"
    )
    p.add_argument("--model", required=True, help="HF-format model folder (its tokenizer and vocabulary)")
    p.add_argument("--size", type=int, required=True, help="tokens kept (end-of-sentence always among them)")
    p.add_argument("--corpus", nargs="*", default=[], help="text files; .jsonl: each line's 'text'")
    p.add_argument(
        "--stdlib-docs",
        action="store_true",
        help="add the stdlib docs pdserve-tiny was trained on to the corpus",
    )
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.set_defaults(func=cmd_draft_vocab)

    p = sub.add_parser("generate", help="stream one completion to the terminal")
    p.add_argument("--model", required=True, help="HF-format model folder")
    _add_flags(p, ENGINE_FLAGS)
    _add_flags(p, SAMPLING_FLAGS)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_spec_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("worker", help="serve one engine (prefill, decode or colocated) over gRPC")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    p.add_argument("--model", required=True, help="HF-format model folder")
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: the folder name)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--registry", default=None, help="redis://host:port/db to register in")
    p.add_argument("--heartbeat-ttl-s", type=float, default=10.0)
    p.add_argument("--lease-s", type=float, default=30.0, help="how long exported KV stays pinned")
    p.add_argument(
        "--max-total-lease-s",
        type=float,
        default=120.0,
        help="longest exported KV stays pinned, renewals included",
    )
    p.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=0.75,
        help="most of the KV blocks one caller may keep pinned in transfers",
    )
    p.add_argument(
        "--kv-producers", default=None, help="prefill workers host:port,... a decode worker may pull KV from"
    )
    p.add_argument(
        "--kv-transport",
        choices=["auto", "nixl", "grpc"],
        default="auto",
        help="how KV moves between workers: NIXL READs of registered memory, the gRPC chunk stream, "
        "or NIXL when both sides have it (auto)",
    )
    p.add_argument(
        "--no-kv-checksum",
        dest="kv_checksum",
        action="store_false",
        help="skip the end-to-end checksum of KV moved over NIXL (trusted fabrics only)",
    )
    p.add_argument(
        "--kv-chunk-bytes",
        type=int,
        default=None,
        help="largest KV chunk pulled (default: 4 MiB less headroom)",
    )
    p.add_argument("--grace-s", type=float, default=30.0, help="drain time after SIGTERM")
    p.add_argument(
        "--dp", type=int, default=1, help="rank processes to launch on this machine (ports --port + i)"
    )
    p.add_argument(
        "--ep", type=int, default=None, help="expert-parallel group size (all ranks, all machines)"
    )
    p.add_argument("--dp-rank-offset", type=int, default=0, help="global rank of this machine's first rank")
    p.add_argument("--dist-master-addr", default="127.0.0.1", help="rank 0's address for torch.distributed")
    p.add_argument(
        "--dist-master-port", type=int, default=0, help="rank 0's port (0: a free one, one machine)"
    )
    p.add_argument("--dist-timeout-s", type=float, default=60.0, help="a collective waiting longer fails")
    p.add_argument("--group-rank", type=int, default=None, help=argparse.SUPPRESS)
    _add_spec_flags(p)
    p.add_argument(
        "--stall-timeout-s", type=float, default=60.0, help="liveness fails after this long without a step"
    )
    _add_flags(p, ENGINE_FLAGS)
    _add_tls_flags(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="the public gRPC and OpenAI HTTP front over the workers")
    p.add_argument("--model", required=True, help="HF-format model folder (for the tokenizer)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
    p.add_argument(
        "--http-header-timeout-s",
        type=float,
        default=10.0,
        help="close connections slower to send a request head",
    )
    p.add_argument(
        "--http-body-timeout-s", type=float, default=30.0, help="408 for request bodies slower than this"
    )
    p.add_argument(
        "--http-max-connections", type=int, default=1024, help="more open HTTP connections get 503"
    )
    p.add_argument("--public-tls-cert", default=None, help="PEM certificate: TLS on the public gRPC and HTTP")
    p.add_argument("--public-tls-key", default=None, help="PEM private key of --public-tls-cert")
    p.add_argument("--registry", default=None, help="redis://host:port/db to discover workers in")
    p.add_argument("--workers", default=None, help="static worker endpoints host:port,... (no Redis)")
    p.add_argument("--colocate-max-tokens", type=int, default=32, help="shorter prompts run colocated")
    p.add_argument("--colocate-cached-fraction", type=float, default=0.8)
    p.add_argument("--max-in-flight", type=int, default=256, help="generations (prompts x n) routed at once")
    p.add_argument(
        "--max-generations-per-request",
        type=int,
        default=64,
        help="most generations (prompts x n) one request may ask for",
    )
    p.add_argument("--max-queued", type=int, default=1024, help="requests waiting beyond those (then 429)")
    p.add_argument("--queue-timeout-s", type=float, default=60.0)
    p.add_argument("--max-attempts", type=int, default=3, help="tries on UNAVAILABLE before the first token")
    _add_router_flags(p)
    p.add_argument(
        "--kv-redis-url", default=None, help="the workers' shared KV tier, for prefix-aware routing"
    )
    p.add_argument(
        "--probe-interval-s", type=float, default=0.5, help="how often workers' load and health are read"
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key the public API (/v1/*, gRPC Inference) accepts as 'Authorization: Bearer KEY' "
        "(repeatable; also PDSERVE_API_KEY, which stays out of process listings); none: open API",
    )
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line (# comments)")
    _add_tls_flags(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser(
        "serve",
        help="start a router and its workers on this machine (a prefill and a decode worker, or --colocated)",
    )
    p.add_argument("--model", default=None, help="HF-format model folder (default: the tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="N",
        help="N workers that each prefill and decode their own requests, instead of prefill and decode "
        "workers (one machine's cores in one engine: no KV handover, no second process)",
    )
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--registry", default=None, help="redis://host:port/db (default: static, no Redis)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the public API (or set PDSERVE_API_KEY); none: open",
    )
    _add_flags(p, SERVE_ENGINE_FLAGS)  # each worker's engine
    _add_router_flags(p)
    _add_spec_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "bench-serve",
        help="serving benchmark, disaggregated vs colocated (benchmarks/serving.py; its flags: bench-serve --help)",
        prefix_chars="+",  # every flag after bench-serve goes to the benchmark's own parser
        add_help=False,
    )
    p.add_argument("bench_args", nargs="*")
    p.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("kernels", help="the native CPU kernels this install holds and the one this CPU loads")
    p.add_argument(
        "--check", action="store_true", help="exit 1 unless every level is prebuilt and this CPU's loads"
    )
    p.set_defaults(func=cmd_kernels)

    p = sub.add_parser("demo", help="build the default model if needed and stream a completion")
    p.add_argument("--model-dir", default=env.model_cache_dir())
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--arch",
        choices=["v3", "v4"],
        default="v3",
        help="the shipped DeepSeek-V3 model (default) or the V4 one",
    )
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    with contextlib.suppress(io.UnsupportedOperation):  # stderr is no file (a test capturing it)
        faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints every thread's stack
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
