"""KV offloading: blocks evicted from a small device cache come back from the host tier or from a
real Redis shared by processes, exactly; incompatible engines never read them; a corrupt block or
a dead Redis only costs a recompute."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import redis

from engine import LLM, SamplingParams
from tests.bench_testing import run_benchmark
from tests.redis_server import RedisServer

PREFIX = [5 + (j * 7) % 3000 for j in range(48)]  # 12 blocks of 4
PROMPT = PREFIX + [9]
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
SMALL = dict(dtype="float32", num_kv_blocks=24, block_size=4, num_threads=1)
FILLERS = [[100 + j for j in range(60)], [2000 + j for j in range(60)]]


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def reference(tiny_model):
    return LLM(tiny_model, dtype="float32", num_kv_blocks=64, block_size=4, num_threads=1).generate(
        prompt_token_ids=[PROMPT], sampling_params=PARAMS
    )[0]


def _evict(llm: LLM) -> None:
    """Other long prompts push the prefix out of the 24-block device cache."""
    llm.generate(prompt_token_ids=FILLERS, sampling_params=SamplingParams(max_tokens=2, temperature=0))


def _same(out, ref) -> None:
    assert out.token_ids == ref.token_ids
    for got, want in zip(out.logprobs, ref.logprobs, strict=True):
        assert list(got) == list(want) and got == pytest.approx(want, abs=1e-4)


def _loaded(llm, tier: str) -> int:
    return llm.engine.connector.stats.loaded_blocks[tier]


def test_host_then_redis_tier_give_the_prefix_back_exactly(tiny_model, reference, redis_server):
    llm = LLM(tiny_model, kv_offload="host,redis", kv_redis_url=redis_server.url, kv_host_blocks=64, **SMALL)
    off = llm.engine.connector
    _same(llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0], reference)
    _evict(llm)
    before = _loaded(llm, "host")
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    _same(out, reference)
    assert out.num_cached_tokens == 48 and _loaded(llm, "host") - before == 12

    _evict(llm)
    assert off.tiers[1].flush()
    off.tiers[0].clear()  # the host tier forgets: only Redis has them now
    before = _loaded(llm, "redis")
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    _same(out, reference)
    assert out.num_cached_tokens == 48 and _loaded(llm, "redis") - before == 12
    assert off.stats.checksum_failures == 0
    # What a worker's /metrics shows of it (the connector's gauges) agrees.
    gauges = {g.name: g.read() for g in off.gauges()}
    assert gauges["pdserve_kv_offload_hits_host"] == _loaded(llm, "host") > 0
    assert gauges["pdserve_kv_offload_hits_redis"] == _loaded(llm, "redis") > 0
    assert gauges["pdserve_kv_offload_stored_bytes"] == off.stats.stored_bytes > 0
    assert gauges["pdserve_kv_offload_checksum_failures"] == 0
    # No leaks: bounded host pool, no pending writes, every Redis key expires.
    assert off.tiers[1].flush() and off.tiers[1].pending == 0 and len(off.tiers[0]) <= 64
    client = redis.Redis.from_url(redis_server.url)
    keys = client.keys("pdkv:*")
    assert keys and all(0 < client.ttl(k) <= 3600 for k in keys)
    off.close()


def test_another_process_sharing_redis_reuses_the_blocks(tiny_model, redis_server, reference):
    writer = LLM(tiny_model, kv_offload="redis", kv_redis_url=redis_server.url, **SMALL)
    redis.Redis.from_url(redis_server.url).flushall()
    writer.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)
    _evict(writer)  # evictions are what get written
    assert writer.engine.connector.tiers[0].flush()
    script = textwrap.dedent(f"""
        from engine import LLM, SamplingParams
        llm = LLM({tiny_model!r}, kv_offload="redis", kv_redis_url={redis_server.url!r}, dtype="float32",
                  num_kv_blocks=24, block_size=4, num_threads=1)
        out = llm.generate(prompt_token_ids=[{PROMPT!r}], sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        print(out.num_cached_tokens, out.token_ids)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cached, tokens = proc.stdout.strip().split(" ", 1)
    assert int(cached) == 48 and tokens == str(reference.token_ids)
    writer.engine.connector.close()


def test_an_incompatible_model_never_reads_the_blocks(tiny_model, redis_server, tmp_path):
    """Same tokenizer, block size and prompt (so the same block hashes), but another model config:
    the compatibility hash differs and nothing is read."""
    from modelkit.make_model import make_model

    other = str(make_model("tiny-mtp", tmp_path / "other"))
    redis.Redis.from_url(redis_server.url).flushall()
    a = LLM(tiny_model, kv_offload="redis", kv_redis_url=redis_server.url, **SMALL)
    a.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)
    _evict(a)
    assert a.engine.connector.tiers[0].flush()
    b = LLM(other, kv_offload="redis", kv_redis_url=redis_server.url, **SMALL)
    assert b.engine.connector.compat != a.engine.connector.compat
    out = b.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    assert out.num_cached_tokens == 0 and b.engine.connector.stats.loaded_bytes == 0
    assert redis.Redis.from_url(redis_server.url).keys(
        f"pdkv:{a.engine.connector.compat}:*"
    )  # they were there
    for llm in (a, b):
        llm.engine.connector.close()


def test_a_corrupt_block_is_recomputed_and_a_dead_redis_costs_nothing(tiny_model, redis_server, reference):
    from engine.kv_cache.hashing import hash_blocks

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    llm = LLM(tiny_model, kv_offload="redis", kv_redis_url=redis_server.url, **SMALL)
    off = llm.engine.connector
    llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)
    _evict(llm)
    assert off.tiers[0].flush() and len(client.keys(f"pdkv:{off.compat}:*")) >= 12
    # Corrupt the prefix's 5th block: the loaded run ends there and the rest is recomputed.
    fifth = f"pdkv:{off.key(hash_blocks(PREFIX, 4)[4])}"
    blob = bytearray(client.get(fifth))
    blob[-3] ^= 0x55
    client.set(fifth, bytes(blob))
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    _same(out, reference)
    assert out.num_cached_tokens == 16 and off.stats.checksum_failures == 1

    redis_server.stop()  # Redis gone mid-run: requests still succeed by recomputing
    try:
        _evict(llm)
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
        _same(out, reference)
        assert off.tiers[0].errors > 0
    finally:
        redis_server.start()
    assert off.tiers[0].flush()
    errors = off.tiers[0].errors
    _evict(llm)  # Redis back, empty: writes and reads work again without errors
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0]
    _same(out, reference)
    assert off.tiers[0].flush() and off.tiers[0].errors == errors
    off.close()


def test_offload_options_are_validated(tiny_model):
    with pytest.raises(ValueError, match="kv_redis_url"):
        LLM(tiny_model, kv_offload="redis", **SMALL)
    with pytest.raises(ValueError, match="host.*redis"):
        LLM(tiny_model, kv_offload="disk", **SMALL)


def test_a_request_waits_for_its_remote_blocks_while_others_run(
    tiny_model, redis_server, reference, monkeypatch
):
    import threading

    from engine.kv_cache import offload

    redis.Redis.from_url(redis_server.url).flushall()
    llm = LLM(tiny_model, kv_offload="redis", kv_redis_url=redis_server.url, **SMALL)
    off = llm.engine.connector
    llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)
    _evict(llm)
    assert off.tiers[0].flush()
    gate = threading.Event()
    real_fetch = offload.KVOffloader._fetch
    monkeypatch.setattr(
        offload.KVOffloader,
        "_fetch",
        staticmethod(lambda tiers, keys: gate.wait(10) and real_fetch(tiers, keys)),
    )
    engine = llm.engine
    engine.add_request("slow", PROMPT, PARAMS)
    engine.add_request("other", [7, 8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(20):  # "other" finishes while "slow" waits for its blocks
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "other" in finished:
            break
    assert "other" in finished and "slow" not in finished
    assert [r.request_id for r in engine.scheduler.waiting_for_kv] == ["slow"]
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    _same(finished["slow"], reference)
    assert finished["slow"].num_cached_tokens == 48 and off.num_fetching == 0
    off.close()


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_a_decode_worker_loads_shared_blocks_from_redis_instead_of_pulling_them(
    tiny_model, redis_server, tmp_path, reference, transport
):
    import time

    from pdserve.v1 import inference_pb2 as pb
    from tests.service_testing import generate, inference, start_stack

    redis.Redis.from_url(redis_server.url).flushall()
    args = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "24"]
    args += ["--kv-offload", "redis", "--kv-redis-url", redis_server.url]
    kv = ["--kv-transport", transport]  # nixl: required of both workers, never a silent fallback
    stack = start_stack(tiny_model, tmp_path, engine_args=args, worker_args={"prefill": kv, "decode": kv})
    try:
        stub = inference(stack)
        disagg = pb.SERVING_MODE_DISAGGREGATED
        sampling = pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tokens, msgs = generate(stub, token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling, mode=disagg)
        first_bytes = msgs[-1].usage.kv_transfer_bytes
        assert tokens == reference.token_ids and first_bytes > 0
        for filler in FILLERS:  # evicts the prompt's blocks on both workers, into Redis
            generate(
                stub, token_ids=pb.TokenIds(ids=filler), sampling=pb.SamplingParams(max_tokens=2), mode=disagg
            )
        time.sleep(0.5)  # write-behind
        tokens, msgs = generate(stub, token_ids=pb.TokenIds(ids=PROMPT), sampling=sampling, mode=disagg)
        assert tokens == reference.token_ids
        # The 12 full blocks came from Redis on both sides; only the partial last block moved.
        assert msgs[-1].usage.cached_tokens == 48
        assert msgs[-1].usage.kv_transfer_bytes == first_bytes // 13
    finally:
        stack.stop()


def test_prefix_offload_benchmark_smoke(tiny_model):
    out = run_benchmark("prefix_offload.py", "--model", tiny_model, "--smoke", "--threads", "1", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split()[0]: line.split()
        for line in out.stdout.splitlines()
        if line.split() and line.split()[0] in ("none", "host", "host+redis")
    }
    assert set(rows) == {"none", "host", "host+redis"} and all(float(r[1]) > 0 for r in rows.values())


def test_the_router_counts_blocks_in_the_shared_tier(redis_server):
    import asyncio

    from engine.kv_cache.hashing import hash_blocks
    from pdserve.v1 import worker_pb2 as wpb
    from services.common.metrics import Metrics
    from services.registry import StaticRegistry
    from services.router.core import RouterCore, RouterSettings
    from services.router.pool import WorkerHandle, WorkerPool

    hashes = hash_blocks(PREFIX, 4)
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    for h in hashes[:3] + hashes[4:6]:  # a gap after the third block: the run is 3
        client.set(f"pdkv:abc123:{h.hex()}", b"x")

    async def main():
        pool = WorkerPool(StaticRegistry([]))
        pool.workers["w"] = WorkerHandle("w", None, None, None, info=wpb.EngineInfo(compat_hash="abc123"))
        core = RouterCore(RouterSettings("m", kv_redis_url=redis_server.url), None, pool, Metrics("router"))
        got = await core._shared_blocks(hashes)
        pool.workers["w"].info.compat_hash = "other"  # another model's blocks never count
        other = await core._shared_blocks(hashes)
        await core.kv_redis.aclose()
        return got, other

    assert asyncio.run(main()) == (3, 0)
