"""DeepSeek-V3.2 down every serving path (STYLE 9). The indexer's keys are a second cache group
(CacheKind.INDEXER_KEYS) on the latent cache's block table, so whatever moves, keeps, drops or
rebuilds a request's latents must do the same to its indexer keys. Every route's greedy tokens
equal each prompt's run alone, one-shot, on tiny-v32, whose index_topk (32) is below every prompt
here: prefill and decode alike attend to the indexer's choice, not to the whole context.

Routes: chunked prefill; prefix-cache hits (the whole prompt, a shared prefix); preemption with
and without prefix caching; a batch of mixed lengths; the disaggregated stack (worker processes,
KV over NIXL) and its colocated mode; the host and Redis offload tiers; DP2 and DP2 + EP2; the FP8
checkpoint chunked offline and disaggregated with KV over the gRPC chunk stream. All in float32,
where the routes stay within rounding of each other (the PyTorch sparse path); then in bf16 with
batch_invariant, where the native indexer_topk and sparse_mla_decode run and a route may change no
bit of the tokens or their logprobs. Two checks show that the equalities can fail: dense attention
gives other tokens than the indexer's choice, and a prefix hit over zeroed indexer keys gives
other tokens than the hit over the stored ones.
"""

from __future__ import annotations

import json
import math
import random
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from engine import LLM, SamplingParams
from engine.kv_cache.cache_group import CacheKind
from engine.models.deepseek_v32 import SparseMLAttention
from modelkit.make_model import make_model
from modelkit.quantize import QuantOptions
from pdserve.v1 import inference_pb2 as pb
from tests.engine_testing import run_finished
from tests.redis_server import RedisServer
from tests.service_testing import generate, inference, start_stack

_rng = random.Random(32)
PROMPTS = [[_rng.randrange(5, 4000) for _ in range(n)] for n in (40, 61, 88, 120)]
MAX_TOKENS = [40, 20, 32, 24]
# Context 24, within index_topk: dense MLA, alone or in a step where the others go sparse.
SHORT, SHORT_TOKENS = [_rng.randrange(5, 4000) for _ in range(12)], 12
# The longest prompt's first 64 tokens, then a tail of its own.
SHARED = PROMPTS[3][:64] + [_rng.randrange(5, 4000) for _ in range(30)]
BLOCK = 4
# torch on one thread: each route runs on as many threads as the run alone it is compared with, and
# two OpenMP threads beside other processes on two cores (the stacks' workers, the other test
# worker) wait on each other for most of a step.
ENGINE = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=512, num_threads=1)
STACK_BLOCK = 16  # tests/service_testing.py ENGINE_ARGS


def _greedy(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def _run(llm: LLM, prompts, max_tokens, logprobs: int | None = None) -> list:
    params = [_greedy(n, logprobs) for n in max_tokens]
    return llm.generate(prompt_token_ids=prompts, sampling_params=params)


def _tokens(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return [o.token_ids for o in _run(llm, prompts, max_tokens)]


def _alone(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    return [_tokens(llm, [p], [n])[0] for p, n in zip(prompts, max_tokens, strict=True)]


def _block_bytes(config: dict, block_size: int) -> int:
    """One engine block of every layer's float32 latent row and indexer key."""
    row = config["kv_lora_rank"] + config["qk_rope_head_dim"] + config["index_head_dim"]
    return config["num_hidden_layers"] * row * 4 * block_size


@contextmanager
def _watched():
    """What the sparse layers run: every prefill as (new tokens, context), and how many times
    they attended sparsely (a step whose every context is within index_topk runs dense MLA)."""
    seen = {"prefills": [], "sparse": 0}
    forward, attend_sparse = SparseMLAttention.forward, SparseMLAttention.attend_sparse

    def watch_forward(self, x, cos, sin, batch, kv_cache):
        seen["prefills"] += [(p.q_len, p.ctx_len) for p in batch.prefills]
        return forward(self, x, cos, sin, batch, kv_cache)

    def watch_sparse(self, *args):
        seen["sparse"] += 1
        return attend_sparse(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SparseMLAttention, "forward", watch_forward)
        mp.setattr(SparseMLAttention, "attend_sparse", watch_sparse)
        yield seen


def _served(stack, prompts=PROMPTS, max_tokens=MAX_TOKENS, mode=pb.SERVING_MODE_DISAGGREGATED) -> list:
    """All prompts at once through the router -> [(tokens, messages)] in prompt order."""
    stub = inference(stack)

    def one(i):
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
        return generate(stub, token_ids=pb.TokenIds(ids=prompts[i]), sampling=sampling, mode=mode)

    with futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _decode_log(st) -> str:
    return st.workers("decode")[0].log_path.read_text()


def _stopped(st) -> None:
    codes = st.stop()
    assert codes == {name: 0 for name in codes}, f"unclean exits: {codes}"


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_model("tiny-v32", tmp_path_factory.mktemp("v32") / "tiny-v32"))


@pytest.fixture(scope="module")
def config(model) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


@pytest.fixture(scope="module")
def reference(model, config) -> list[list[int]]:
    """Each prompt alone, one-shot, nothing cached: the tokens every route must give."""
    topk = config["index_topk"]
    assert all(len(p) > topk for p in PROMPTS)  # every prefill already attends sparsely
    assert all(len(p) + n > topk for p, n in zip(PROMPTS, MAX_TOKENS, strict=True))
    llm = LLM(model, enable_prefix_caching=False, **ENGINE)
    with _watched() as seen:
        tokens = _alone(llm)
    assert seen["sparse"] > 0
    assert all(q == ctx for q, ctx in seen["prefills"])  # one-shot: no prefill had earlier context
    assert [len(t) for t in tokens] == MAX_TOKENS
    return tokens


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    """Router, a prefill and a decode worker as processes, KV over NIXL; disaggregation is never
    skipped for short prompts."""
    nixl = ["--kv-transport", "nixl"]
    st = start_stack(
        model, tmp_path_factory.mktemp("stack"), router_args=["--colocate-max-tokens", "0"],
        worker_args={"prefill": nixl, "decode": nixl},
    )  # fmt: skip
    yield st
    _stopped(st)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    """tiny-v32 as DeepSeek releases V3.2: FP8 128 x 128 blocks, the indexer's wq_b and wk too."""
    return str(make_model("tiny-v32", tmp_path_factory.mktemp("fp8") / "tiny-v32-fp8", quant=QuantOptions()))


@pytest.fixture(scope="module")
def fp8_reference(fp8_model) -> list[list[int]]:
    return _alone(LLM(fp8_model, enable_prefix_caching=False, **ENGINE))


# ---- the equalities below can fail -------------------------------------------------------------


def test_sparse_selection_changes_the_tokens(model, config, reference, tmp_path):
    """The same weights with an index_topk above every context (dense MLA) give other tokens, so a
    route whose queries attended to other tokens than the indexer's choice would show."""
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in Path(model).iterdir():
        if f.name != "config.json":
            (dense / f.name).symlink_to(f)
    (dense / "config.json").write_text(json.dumps({**config, "index_topk": 4096}))
    # The first tokens suffice (greedy: a shorter run is the longer one's start); here they part
    # within the first four.
    n = 8
    got = _alone(LLM(str(dense), enable_prefix_caching=False, **ENGINE), max_tokens=[n] * len(PROMPTS))
    assert sum(g != r[:n] for g, r in zip(got, reference, strict=True)) >= 2


def test_a_prefix_hit_reads_the_stored_indexer_keys(model, reference):
    """Zeroing the indexer-key caches between a prompt and its repeat changes the repeat's tokens:
    a hit reads the stored keys, so a route that lost or misplaced them would show."""
    llm = LLM(model, **ENGINE)
    assert _tokens(llm, PROMPTS[3:], MAX_TOKENS[3:]) == reference[3:]
    for cache in llm.engine.runner.kv_caches.group(CacheKind.INDEXER_KEYS):
        cache.zero_()
    (again,) = _run(llm, PROMPTS[3:], MAX_TOKENS[3:])
    assert again.num_cached_tokens == (len(PROMPTS[3]) - 1) // BLOCK * BLOCK
    assert again.token_ids != reference[3]


# ---- one engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [7, 16], ids=lambda b: f"budget{b}")
def test_chunked_prefill_matches_one_shot(model, config, reference, budget):
    llm = LLM(model, max_num_batched_tokens=budget, **ENGINE)
    with _watched() as seen:
        assert _tokens(llm) == reference
    assert max(q for q, _ in seen["prefills"]) <= budget
    # Later chunks choose among keys that earlier chunks stored, more of them than index_topk.
    assert any(q < ctx and ctx > config["index_topk"] for q, ctx in seen["prefills"])


def test_prefix_cache_hit_matches_miss(model, reference):
    llm = LLM(model, **ENGINE)
    first = _run(llm, PROMPTS, MAX_TOKENS)
    second = _run(llm, PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in second] == reference
    assert [o.num_cached_tokens for o in first] == [0] * len(PROMPTS)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]

    (want,) = _alone(LLM(model, enable_prefix_caching=False, **ENGINE), [SHARED], [30])
    (got,) = _run(llm, [SHARED], [30])
    assert got.num_cached_tokens == 64 and got.token_ids == want


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_preempted_and_resumed_matches_uninterrupted(model, reference, caching):
    # The four hold 107 blocks of 4 at their longest, the longest alone 36: 48 force preemptions.
    llm = LLM(model, **{**ENGINE, "num_kv_blocks": 48}, enable_prefix_caching=caching)
    outs = _run(llm, PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    pool = llm.engine.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks


def test_a_batch_of_mixed_lengths_matches_each_alone(model, reference):
    llm = LLM(model, enable_prefix_caching=False, **ENGINE)
    with _watched() as seen:
        (short,) = _alone(llm, [SHORT], [SHORT_TOKENS])
    assert seen["sparse"] == 0  # alone, the short prompt runs dense MLA throughout
    prompts = [PROMPTS[2], SHORT, *PROMPTS[:2], PROMPTS[3]]
    max_tokens = [MAX_TOKENS[2], SHORT_TOKENS, *MAX_TOKENS[:2], MAX_TOKENS[3]]
    assert _tokens(llm, prompts, max_tokens) == [reference[2], short, *reference[:2], reference[3]]


# ---- bf16: the native sparse kernels --------------------------------------------------------

BF16 = dict(ENGINE, dtype="bfloat16", batch_invariant=True, num_threads=None)
"""Every product and MoE in the native kernels, whose rows never depend on each other, and the
native indexer_topk and sparse_mla_decode over the paged caches: a route may change no bit. On the
default threads: how the native kernels split a step among them is part of what the bits hold."""


def _bits(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs) for o in outs]


def _no_bits_without_native(model, bf16_reference) -> bool:
    """True where the native kernels are off, after checking that batch_invariant is refused by name."""
    if bf16_reference is not None:
        return False
    with pytest.raises(ValueError, match="batch_invariant needs the native bf16 kernels"):
        LLM(model, **BF16)
    return True


@pytest.fixture(scope="module")
def bf16_reference(model) -> list[tuple] | None:
    """None where the native kernels are off (PDSERVE_NATIVE_KERNELS=0, or not for this CPU):
    there an engine computes bf16 in float32 and refuses batch_invariant (`_no_bits_without_native`)."""
    import torch

    from engine.platform import use_native_kernels

    if not use_native_kernels(torch.bfloat16, torch.device("cpu")):
        return None
    llm = LLM(model, enable_prefix_caching=False, **BF16)
    return [_bits(_run(llm, [p], [n], logprobs=1))[0] for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize("route", ["chunked", "prefix-hit", "preempted", "batch"])
def test_bf16_routes_keep_every_bit(model, bf16_reference, route, monkeypatch):
    """Bit for bit the tokens and logprobs of each prompt alone, one-shot. Chunks of 33 tokens, so
    that every step attends sparsely from the first one (chunks within index_topk: the test below)."""
    from kernels import native

    if _no_bits_without_native(model, bf16_reference):
        return
    calls = []
    topk = native.indexer_topk
    monkeypatch.setattr(native, "indexer_topk", lambda *a: calls.append(1) or topk(*a))
    kw = {**BF16, "num_kv_blocks": 48} if route == "preempted" else BF16
    llm = LLM(model, max_num_batched_tokens=33 if route == "chunked" else 2048, **kw)
    if route == "prefix-hit":
        _run(llm, PROMPTS, MAX_TOKENS)
    outs = _run(llm, PROMPTS, MAX_TOKENS, logprobs=1)
    assert _bits(outs) == bf16_reference
    assert calls  # the native indexer chose the tokens
    if route == "prefix-hit":
        assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    if route == "preempted":
        assert sum(o.metrics.num_preemptions for o in outs) > 0


@pytest.mark.parametrize("route", ["beside-a-long-prompt", "chunks-within-index_topk"])
def test_bf16_a_token_within_index_topk_keeps_its_bits(model, bf16_reference, route):
    """batch_invariant promises a request's bits whatever else its steps hold, prefill chunks
    included: a token whose context fits in index_topk runs dense MLA whether or not a token
    beside it goes sparse."""
    if _no_bits_without_native(model, bf16_reference):
        return
    llm = LLM(model, enable_prefix_caching=False, **BF16)
    if route == "beside-a-long-prompt":
        (alone,) = _run(llm, [SHORT], [SHORT_TOKENS], logprobs=1)
        among = _run(llm, [SHORT, PROMPTS[3]], [SHORT_TOKENS, MAX_TOKENS[3]], logprobs=1)[0]
        assert _bits([among]) == _bits([alone])
    else:  # the first chunks of 7 see at most 32 tokens: dense, where one-shot ran them sparse
        chunked = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=7, **BF16)
        assert _bits(_run(chunked, PROMPTS[:1], MAX_TOKENS[:1], logprobs=1)) == bf16_reference[:1]


# ---- the offload tiers -------------------------------------------------------------------------


def test_host_then_redis_tier_give_the_prefix_back(model, config, reference, redis_server):
    prompt, n = PROMPTS[1], MAX_TOKENS[1]  # 61 tokens: 15 full blocks of 4
    full = (len(prompt) - 1) // BLOCK
    llm = LLM(
        model, kv_offload="host,redis", kv_redis_url=redis_server.url, kv_host_blocks=64,
        **{**ENGINE, "num_kv_blocks": 32},
    )  # fmt: skip
    off = llm.engine.connector
    fillers = [[100 + j for j in range(60)], [2000 + j for j in range(60)]]
    try:
        assert _tokens(llm, [prompt], [n]) == [reference[1]]
        _run(llm, fillers, [2, 2])  # pushes the prompt's blocks out of the 32-block device cache
        before = off.stats.loaded_blocks["host"]
        (out,) = _run(llm, [prompt], [n])
        assert out.token_ids == reference[1]
        assert out.num_cached_tokens == full * BLOCK and off.stats.loaded_blocks["host"] - before == full

        _run(llm, fillers, [2, 2])
        assert off.tiers[1].flush()
        off.tiers[0].clear()  # only Redis has them now
        before = off.stats.loaded_blocks["redis"]
        (out,) = _run(llm, [prompt], [n])
        assert out.token_ids == reference[1]
        assert out.num_cached_tokens == full * BLOCK and off.stats.loaded_blocks["redis"] - before == full
        assert off.stats.checksum_failures == 0
        # A stored block: a header, then every layer's latent rows and indexer keys.
        payload = _block_bytes(config, BLOCK)
        assert payload < off.stats.stored_bytes // off.stats.stored_blocks < payload + 256
        assert redis.Redis.from_url(redis_server.url).keys(f"pdkv:{off.compat}:*")
    finally:
        off.close()


# ---- data and expert parallel ------------------------------------------------------------------


@pytest.mark.parametrize("ep", [False, True], ids=["dp2", "dp2-ep2"])
def test_data_and_expert_parallel_match_one_process(model, reference, ep):
    llm = LLM(model, data_parallel_size=2, enable_expert_parallel=ep, **ENGINE)  # a thread a rank
    engine = llm.engine
    try:
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
            engine.add_request(str(i), p, _greedy(n))
        assert sorted(engine.requests.values()) == [0, 0, 1, 1]  # both ranks serve
        final = run_finished(engine)
        assert [final[str(i)].token_ids for i in range(len(PROMPTS))] == reference
    finally:
        engine.shutdown()
    assert all(p.exitcode == 0 for p in engine.procs)


# ---- the disaggregated stack -------------------------------------------------------------------


def test_disaggregated_then_colocated_match_offline(stack, config, reference):
    """Fresh prompts disaggregated: all of their KV moves, latents and indexer keys, block for
    block; then colocated, on what was shipped or computed there."""
    block_bytes = _block_bytes(config, STACK_BLOCK)
    for (tokens, msgs), prompt, want in zip(_served(stack), PROMPTS, reference, strict=True):
        assert tokens == want and msgs[-1].disaggregated
        assert msgs[-1].usage.kv_transfer_bytes == math.ceil(len(prompt) / STACK_BLOCK) * block_bytes
    for (tokens, msgs), want in zip(_served(stack, mode=pb.SERVING_MODE_COLOCATED), reference, strict=True):
        assert tokens == want and not msgs[-1].disaggregated
    assert "moves over NIXL" in _decode_log(stack)


# ---- FP8 ---------------------------------------------------------------------------------------


def test_fp8_checkpoint_chunked_matches_one_shot(fp8_model, fp8_reference, reference):
    from safetensors import safe_open

    config = json.loads((Path(fp8_model) / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["index_topk"] == 32
    with safe_open(Path(fp8_model) / "model.safetensors", "pt") as f:
        indexer = "model.layers.0.self_attn.indexer"
        assert f.get_slice(f"{indexer}.wq_b.weight").get_dtype() == "F8_E4M3"
        assert f"{indexer}.wk.weight_scale_inv" in f.keys()
    assert fp8_reference != reference  # the FP8 weights are what ran
    assert _tokens(LLM(fp8_model, max_num_batched_tokens=7, **ENGINE)) == fp8_reference


def test_fp8_checkpoint_served_disaggregated_matches_offline(fp8_model, config, fp8_reference, tmp_path):
    grpc_only = ["--kv-transport", "grpc"]
    st = start_stack(
        fp8_model, tmp_path, router_args=["--colocate-max-tokens", "0"],
        worker_args={"prefill": grpc_only, "decode": grpc_only},
    )  # fmt: skip
    try:
        served = _served(st)
        log = _decode_log(st)
    finally:
        _stopped(st)
    assert [tokens for tokens, _ in served] == fp8_reference
    block_bytes = _block_bytes(config, STACK_BLOCK)  # the FP8 model's cache is float32 all the same
    for (_, msgs), prompt in zip(served, PROMPTS, strict=True):
        assert msgs[-1].disaggregated
        assert msgs[-1].usage.kv_transfer_bytes == math.ceil(len(prompt) / STACK_BLOCK) * block_bytes
    assert "gRPC only" in log and "moves over NIXL" not in log


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(make_model("tiny-v32-mtp", tmp_path_factory.mktemp("v32mtp") / "tiny-v32-mtp"))


@pytest.fixture(scope="module")
def mtp_reference(mtp_model) -> list[list[int]]:
    """The MTP model's greedy tokens without drafts, for every k to match."""
    return _tokens(LLM(mtp_model, **ENGINE))


@pytest.mark.parametrize(("k", "oracle"), [(1, False), (3, False), (3, True)], ids=["k1", "k3", "k3-oracle"])
def test_mtp_speculation_matches_greedy_without_it(mtp_model, mtp_reference, k, oracle, monkeypatch):
    """The MTP layer (a V3.2 layer: its own latent and indexer-key caches, model layer
    num_hidden_layers) drafts and the target verifies s = 1 + k tokens a request, each attending
    sparsely over its own context: the tokens of greedy decoding without drafts, every block
    freed after; the MTP layer's indexer keys are written. The random model's own drafts are
    never accepted; the oracle's (the reference continuation, wrong at its third draft) are, up
    to their error, so accepted drafts' cache rows are used by the steps after them."""
    from tests.test_spec_decode import Oracle

    want = mtp_reference
    if oracle:
        Oracle(monkeypatch, {tuple(p): w for p, w in zip(PROMPTS, want, strict=True)}, wrong_at=2)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **ENGINE)
    with _watched() as seen:
        assert _tokens(llm) == want
    assert seen["sparse"] > 0
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert (stats.acceptance_rate > 0.5) == oracle
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    runner = llm.engine.runner
    mtp_keys = runner.kv_caches.layer(CacheKind.INDEXER_KEYS, runner.model_cfg.num_hidden_layers)
    assert mtp_keys.abs().sum() > 0


@pytest.mark.parametrize("k, prompts", [(1, 1), (3, 3)], ids=["k1", "k3-batch3"])
def test_one_call_spec_step_keeps_tokens_drafts_and_caches(mtp_model, k, prompts, monkeypatch):
    """In bf16 with the native kernels, a step of greedy decodes that all speculate runs as one
    native call (the target's verification with each layer's indexer inside, the MTP layer's
    latent and indexer-key rows, its drafts): every step's tokens and drafts, and every cache (the
    layers' latents and keys, the MTP layer's), bit for bit what the forward, verify_greedy and
    draft_with_mtp give one by one, with contexts past index_topk. Without the kernels (float32)
    every step declines."""
    import torch

    from engine.platform import use_native_kernels
    from tests.test_spec_decode import watch_steps

    native = use_native_kernels(torch.bfloat16, torch.device("cpu"))
    engine = dict(ENGINE, dtype="bfloat16" if native else "float32")
    spec = {"method": "mtp", "num_speculative_tokens": k}
    runs = {}
    for one_call in (False, True):
        steps, taken = watch_steps(monkeypatch, one_call)
        llm = LLM(mtp_model, speculative_config=spec, **engine)
        tokens = _tokens(llm, PROMPTS[-prompts:], MAX_TOKENS[-prompts:])
        runs[one_call] = (tokens, steps, [c.clone() for c in llm.engine.runner.kv_caches])
        assert any(taken) == (one_call and native)
    (tokens, steps, caches), (tokens_1, steps_1, caches_1) = runs[False], runs[True]
    assert tokens_1 == tokens and steps_1 == steps
    assert any(drafts for _, drafts in steps)
    assert all(torch.equal(a, b) for a, b in zip(caches, caches_1, strict=True))


def test_fp8_checkpoint_in_deepseeks_own_names_loads_the_same(model, fp8_model, fp8_reference, tmp_path):
    """The same FP8 checkpoint with DeepSeek's tensor names (`layers.N.attn.indexer.wq_b.scale`,
    `layers.N.attn.wq_b.weight` for MLA's q_b_proj): the same tokens, so the indexer's wq_b is not
    taken for MLA's."""
    from safetensors import safe_open

    from modelkit.quantize import quantize_folder

    # `model` is make_model("tiny-v32"), the weights fp8_model holds quantized.
    native_names = quantize_folder(model, tmp_path / "deepseek-names", QuantOptions(names="deepseek"))
    with safe_open(next(Path(native_names).glob("*.safetensors")), "pt") as f:
        names = set(f.keys())
    assert {"layers.0.attn.indexer.wq_b.weight", "layers.0.attn.indexer.wq_b.scale"} <= names
    assert "layers.0.attn.wq_b.weight" in names  # MLA's q_b_proj, in DeepSeek's spelling
    assert _tokens(LLM(str(native_names), **ENGINE)) == fp8_reference
