"""Different routes through the engine must give the same tokens (STYLE 9).

Absorbed (decode) vs non-absorbed (prefill) MLA, paged vs contiguous cache, chunked vs one-shot
prefill, prefix-cache hit vs miss, preempted-and-recomputed vs uninterrupted, and a request
alone vs inside a batch of 16. The default model runs in float32 so that the routes, which add
in different orders, stay within ~1e-6 of each other and greedy choices do not flip.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig

TRAINED = "assets/pdserve-tiny"

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _llm(model: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 512)
    if kw["dtype"] == "float32":
        # torch's products on one thread: each route is compared with one on as many threads, and
        # torch's two OpenMP threads, beside the other test processes on two cores, wait on each
        # other for most of a step (this file took 3-4x as long). bf16 engines keep the default:
        # how a step splits between the native kernels' threads and torch's is theirs to hold.
        kw.setdefault("num_threads", 1)
    return LLM(model, **kw)


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def first_run(tiny_model):
    """A fresh engine and its first outputs for six prompts (none of them cached yet): the
    baseline every other route must match, and the prefix-cache misses that
    test_prefix_cache_hit_matches_miss holds the same engine's hits to (the one test that runs
    this engine again)."""
    llm = _llm(tiny_model)
    prompts = _prompts(6)
    return llm, prompts, llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)


@pytest.fixture(scope="module")
def baseline(first_run):
    _, prompts, outs = first_run
    return prompts, [o.token_ids for o in outs]


def test_absorbed_decode_matches_non_absorbed_prefill(tiny_model):
    """Logprobs of generated tokens (absorbed decode) equal the prompt logprobs of the same
    tokens re-fed as a prompt (non-absorbed prefill)."""
    llm = _llm(tiny_model)
    prompt = _prompts(1, seed=3, lo=20, hi=20)[0]
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
    )[0]
    again = llm.generate(
        prompt_token_ids=[prompt + out.token_ids],
        sampling_params=SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
    )[0]
    for i, tok in enumerate(out.token_ids):
        decode_lp = out.logprobs[i][tok]
        prefill_lp = again.prompt_logprobs[len(prompt) + i][tok]
        assert decode_lp == pytest.approx(prefill_lp, abs=1e-5), f"step {i}"


def test_paged_shuffled_blocks_match_contiguous(tiny_model, baseline):
    prompts, expected = baseline
    llm = _llm(tiny_model)
    free = llm.engine.kv.pools[0].free_queue
    order = list(free)
    random.Random(1).shuffle(order)
    free.clear()
    free.update((b, None) for b in order)
    assert _tokens(llm, prompts) == expected
    used = llm.engine.kv.pools[0]
    assert used.num_free_blocks == used.num_blocks


@pytest.mark.parametrize("budget", [5, 16], ids=lambda b: f"budget{b}")
def test_chunked_prefill_matches_one_shot(tiny_model, baseline, budget):
    prompts, expected = baseline
    llm = _llm(tiny_model, max_num_batched_tokens=budget)
    assert _tokens(llm, prompts) == expected


def test_prefix_cache_hit_matches_miss(tiny_model, first_run, baseline):
    # The misses are the baseline's own run, this engine's first (its tokens are `expected`).
    llm, prompts, first = first_run
    expected = baseline[1]
    second = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in second] == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 4 * 4 for p in prompts]
    no_cache = _llm(tiny_model, enable_prefix_caching=False)
    outs = no_cache.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_preempted_and_recomputed_matches_uninterrupted(tiny_model, baseline):
    prompts, expected = baseline
    # 6 requests of up to 64 tokens need up to 96 blocks of 4; 24 blocks force preemptions.
    llm = _llm(tiny_model, num_kv_blocks=24)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    pool = llm.engine.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks


def test_batch_invariance_greedy_and_seeded(tiny_model):
    llm = _llm(tiny_model)
    target = _prompts(1, seed=7, lo=11, hi=11)[0]
    others = _prompts(15, seed=8, lo=1, hi=60)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    mixed = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=10 + i, ignore_eos=True) if i % 2 else greedy
        for i in range(15)
    ]
    for params in (greedy, seeded):
        alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0].token_ids
        batch = llm.generate(
            prompt_token_ids=others[:7] + [target] + others[7:],
            sampling_params=mixed[:7] + [params] + mixed[7:],
        )
        assert batch[7].token_ids == alone
    # Unseeded sampling is really random: two runs differ.
    free = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a, b = (llm.generate(prompt_token_ids=[target], sampling_params=free)[0].token_ids for _ in range(2))
    assert a != b


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runners_own_argmax_gives_the_samplers_tokens(tiny_model, monkeypatch, dtype):
    """A step whose every row is plain greedy takes each row's argmax from the model
    (greedy_tokens: from the bf16 logits, natively, where it can) instead of the sampler's over
    float32 logits: the same tokens either way, prefills and decodes, alone and batched. Prefix
    caching is off: the second run would take prefix hits, whose prefill over the cached context
    rounds differently in bf16 (test_prefix_cache_hit_matches_miss holds that route, in float32)."""
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.sampler import Sampler

    llm = _llm(tiny_model, dtype=dtype, enable_prefix_caching=False)
    prompts = _prompts(9, seed=3)
    rows = []
    own = DeepseekV2ForCausalLM.greedy_tokens
    monkeypatch.setattr(
        DeepseekV2ForCausalLM, "greedy_tokens", lambda self, h, v: rows.append(h.shape[0]) or own(self, h, v)
    )
    fast = _tokens(llm, prompts)
    assert sum(rows) == 9 * GREEDY.max_tokens and max(rows) == 9  # every token, batched
    monkeypatch.setattr(Sampler, "only_argmax", lambda self, rows: False)
    assert _tokens(llm, prompts) == fast
    assert sum(rows) == 9 * GREEDY.max_tokens  # the sampler took them all this time


def _alone_and_among_others(llm: LLM, seed: int) -> tuple:
    """A 600-token prompt's greedy tokens and logprobs alone, then among 150 others: long prompts
    whose chunks share its steps (a 256-token budget) and short ones that decode beside it, more
    than 128 rows a step."""
    rng = random.Random(seed)
    target = [rng.randrange(5, 4000) for _ in range(600)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    alone = llm.generate(prompt_token_ids=[target], sampling_params=params)[0]
    others = [[rng.randrange(5, 4000) for _ in range(rng.randrange(100, 300))] for _ in range(10)]
    others += [[rng.randrange(5, 4000) for _ in range(rng.randrange(1, 8))] for _ in range(140)]
    rest = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 24), ignore_eos=True) for _ in others]
    outs = llm.generate(
        prompt_token_ids=[*others[:5], target, *others[5:]], sampling_params=[*rest[:5], params, *rest[5:]]
    )
    among = outs[5]
    return (alone.token_ids, alone.logprobs), (among.token_ids, among.logprobs)


def test_batch_invariant_keeps_a_requests_bits_whatever_its_batch():
    """batch_invariant=True (bf16, every product and MoE in the native kernels): a request's tokens
    and logprobs bit for bit the same alone and among others, its prompt chunked beside theirs and
    its decodes in steps of over 128 rows. The default differs from it only where a step leaves the
    native kernels (products past native.max_rows(), MoEs past native_pairs_per_expert()): where
    this scenario's steps do (AVX512-BF16 without AMX: torch's oneDNN products above FEW_ROWS
    rows), the default's bits move; where they do not (the AVX2 and AVX512F builds, which take
    every product natively; AMX up to 256 rows), the default is invariant too, and checked to be.
    Both engines share the process: each step sets its own."""
    from engine.platform import use_native_kernels
    from kernels import native
    from kernels.moe import native_pairs_per_expert

    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig(model=TRAINED, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant with enable_expert_parallel is not supported"):
        EngineConfig(model=TRAINED, batch_invariant=True, enable_expert_parallel=True)
    kw = dict(
        dtype="bfloat16", block_size=16, num_kv_blocks=1024, max_num_seqs=256, max_num_batched_tokens=256
    )
    if not use_native_kernels(torch.bfloat16, torch.device("cpu")):  # off, or not on this CPU
        with pytest.raises(ValueError, match="batch_invariant needs the native bf16 kernels"):
            LLM(TRAINED, batch_invariant=True, **kw)
        return
    default = LLM(TRAINED, **kw)
    invariant = LLM(TRAINED, batch_invariant=True, **kw)
    alone, among = _alone_and_among_others(default, seed=1)
    model = default.engine.model_cfg
    step = kw["max_num_batched_tokens"]  # the most tokens (product rows) a step of the scenario holds
    pairs = step * model.num_experts_per_tok
    assert not native.batch_invariant()  # the default engine's steps ran, and left it off
    if native.max_rows() >= step and native_pairs_per_expert() * model.n_routed_experts >= pairs:
        assert alone == among, "every step ran natively: the default should be invariant here"
    else:
        assert alone[1] != among[1], "the scenario should move the default's bits (else it tests nothing)"
    alone, among = _alone_and_among_others(invariant, seed=1)
    assert alone == among
    default.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
    assert not native.batch_invariant()  # the default engine's step turned it off again
    with pytest.raises(ValueError, match="batch_invariant needs the native bf16 kernels.*float32 on cpu"):
        LLM(TRAINED, dtype="float32", batch_invariant=True, num_kv_blocks=64)


@pytest.mark.parametrize("experts", ["fp8", "fp4"])
def test_batch_invariant_holds_with_weights_kept_quantized(tmp_path, experts):
    """The same with the tiny model as DeepSeek releases its checkpoints (FP8 128 x 128 block
    scales; MXFP4 routed experts): every product and MoE widens the stored weights in the native
    kernels, so a request's bits are the same alone and among others."""
    from engine.platform import use_native_kernels
    from modelkit.quantize import QuantOptions, quantize_folder

    folder = quantize_folder(TRAINED, tmp_path / "q", QuantOptions(experts_fp4=experts == "fp4"))
    kw = dict(
        dtype="bfloat16", block_size=16, num_kv_blocks=1024, max_num_seqs=256, max_num_batched_tokens=256
    )
    if not use_native_kernels(torch.bfloat16, torch.device("cpu")):  # off, or not on this CPU
        with pytest.raises(ValueError, match="batch_invariant needs the native bf16 kernels"):
            LLM(str(folder), batch_invariant=True, **kw)
        return
    llm = LLM(str(folder), batch_invariant=True, **kw)
    model = llm.engine.runner.model
    assert model.native_stack is not None  # decode steps in one native call, weights quantized
    alone, among = _alone_and_among_others(llm, seed=2)
    assert alone == among
