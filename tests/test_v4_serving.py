"""DeepSeek-V4 down the serving paths that move or keep its KV outside one engine's step loop.

A V4 request's KV is three block tables (the sliding window's K = V rows, the CSA entries with
their indexer keys, the HCA entries) and its compressors' states. Whatever moves or restores a
request must carry all of them: the disaggregated stack (prefill and decode workers, KV over NIXL:
only the window blocks the next token reads, every compressed block, then the states), the host
offload tier (evicted blocks of every table and the state snapshots at their ends) and data
and expert parallelism (EPLB included). Every route's greedy tokens equal each prompt's run alone on tiny-v4 (made by
`pdserve make-model tiny-v4`, in DeepSeek's V4 tensor names), whose prompts here are not multiples
of its 4- or 32-token entries, and whose 32-token window the prompts outgrow.
"""

from __future__ import annotations

import random
from concurrent import futures
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache.cache_group import CacheKind
from modelkit.make_model import PRESETS, make_model
from pdserve.v1 import inference_pb2 as pb
from tests.engine_testing import run_finished
from tests.redis_server import RedisServer
from tests.service_testing import generate, inference, start_stack

_rng = random.Random(4)
PROMPTS = [[_rng.randrange(5, 4000) for _ in range(n)] for n in (45, 70, 99)]
MAX_TOKENS = [24, 16, 20]
ENGINE = dict(dtype="float32", block_size=16, num_kv_blocks=64, num_threads=1)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[_greedy(n) for n in max_tokens])
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_model("tiny-v4", tmp_path_factory.mktemp("v4") / "tiny-v4"))


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    """Each prompt alone, one-shot, nothing cached."""
    p = PRESETS["tiny-v4"]
    assert all(len(q) % p.csa_rate and len(q) % p.hca_rate and len(q) > p.sliding_window for q in PROMPTS)
    llm = LLM(model, enable_prefix_caching=False, **ENGINE)
    return [_tokens(llm, [q], [n])[0] for q, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


def test_the_disaggregated_stack_then_colocated_match_offline(model, reference, tmp_path):
    nixl = ["--kv-transport", "nixl"]
    st = start_stack(
        model,
        tmp_path,
        router_args=["--colocate-max-tokens", "0"],
        worker_args={"prefill": nixl, "decode": nixl},
    )
    try:
        stub = inference(st)

        def one(i: int, mode) -> tuple[list[int], list]:
            sampling = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
            return generate(stub, token_ids=pb.TokenIds(ids=PROMPTS[i]), sampling=sampling, mode=mode)

        for mode, disaggregated in (
            (pb.SERVING_MODE_DISAGGREGATED, True),
            (pb.SERVING_MODE_COLOCATED, False),
        ):
            with futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                served = list(pool.map(lambda i, m=mode: one(i, m), range(len(PROMPTS))))
            for (tokens, msgs), want in zip(served, reference, strict=True):
                assert tokens == want and msgs[-1].disaggregated == disaggregated
                assert (msgs[-1].usage.kv_transfer_bytes > 0) == disaggregated
        assert "moves over NIXL" in st.workers("decode")[0].log_path.read_text()
    finally:
        codes = st.stop()
        assert codes == {name: 0 for name in codes}, f"unclean exits: {codes}"


def test_the_host_then_redis_tier_give_back_every_table_and_the_state(model, reference):
    """The 99-token prompt's blocks (engine blocks of 32 tokens: the HCA rate) pushed out of a
    6-block cache, then asked for again: its three full blocks come back in every table with the
    compressors' state after them, from the host tier, then (the host tier cleared) from Redis, and
    the tokens are the one-shot run's."""
    prompt, n = PROMPTS[2], MAX_TOKENS[2]
    fillers = [[100 + j for j in range(90)], [2000 + j for j in range(90)]]
    with RedisServer() as server:
        llm = LLM(
            model, kv_offload="host,redis", kv_redis_url=server.url, kv_host_blocks=64,
            **{**ENGINE, "num_kv_blocks": 6},
        )  # fmt: skip
        off = llm.engine.connector
        try:
            spec = llm.engine.kv_spec
            assert spec.block_size == 32 and spec.has(CacheKind.HEAVILY_COMPRESSED) and spec.states
            assert _tokens(llm, [prompt], [n]) == [reference[2]]
            for tier in ("host", "redis"):
                _tokens(llm, fillers, [2, 2])  # pushes the prompt's blocks out of the device cache
                if tier == "redis":
                    assert off.tiers[1].flush()
                    off.tiers[0].clear()  # only Redis has them now
                before = off.stats.loaded_blocks[tier]
                (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(n))
                assert list(out.token_ids) == reference[2], tier
                assert out.num_cached_tokens == 96 and off.stats.loaded_blocks[tier] - before >= 3, tier
            assert off.stats.checksum_failures == 0
        finally:
            off.close()


PARALLEL = {
    "dp2": {},
    "dp2-ep2": {"enable_expert_parallel": True},
    "dp2-ep2-eplb": {"enable_expert_parallel": True, "num_redundant_experts": 2, "eplb_interval": 4},
}


@pytest.mark.parametrize("layout", list(PARALLEL))
def test_data_and_expert_parallel_match_one_process(model, reference, layout):
    """Two ranks (each its own batch and KV); with EP each holds half the experts (the hash layers'
    too: their table names logical experts) and with EPLB the placement changes while they run."""
    llm = LLM(model, data_parallel_size=2, **PARALLEL[layout], **ENGINE)
    engine = llm.engine
    try:
        for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
            engine.add_request(str(i), p, _greedy(n))
        final = run_finished(engine)
        assert [final[str(i)].token_ids for i in range(len(PROMPTS))] == reference
    finally:
        engine.shutdown()
    assert all(p.exitcode == 0 for p in engine.procs)


def test_a_released_style_folder_is_what_make_model_writes(model):
    names = (Path(model) / "model.safetensors").read_bytes()[:200_000]
    assert b'"embed.weight"' in names and b"layers.1.attn.indexer.compressor.wkv.weight" in names


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(make_model("tiny-v4-mtp", tmp_path_factory.mktemp("v4mtp") / "tiny-v4-mtp"))


@pytest.fixture(scope="module")
def mtp_reference(mtp_model) -> list[list[int]]:
    llm = LLM(mtp_model, enable_prefix_caching=False, **ENGINE)
    return [_tokens(llm, [q], [n])[0] for q, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.mark.parametrize(("k", "oracle"), [(1, False), (3, False), (3, True)], ids=["k1", "k3", "k3-oracle"])
def test_mtp_speculation_matches_greedy_without_it(mtp_model, mtp_reference, k, oracle, monkeypatch):
    """The V4 MTP layer (model layer num_hidden_layers: sliding window, its input the target's
    streams and the next token) drafts, the target verifies 1 + k tokens a request: the tokens of
    greedy decoding without drafts. The random model's own drafts are never accepted; the
    oracle's (the reference continuation, wrong at its third draft) are, up to their error, so
    every verification rejects some drafts after its compressors took their rows: the rings'
    room (MAX_SPECULATIVE_TOKENS) keeps what the next tokens read, nothing is rolled back."""
    from tests.test_spec_decode import Oracle

    if oracle:
        Oracle(monkeypatch, {tuple(p): w for p, w in zip(PROMPTS, mtp_reference, strict=True)}, wrong_at=2)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **ENGINE)
    assert _tokens(llm, PROMPTS, MAX_TOKENS) == mtp_reference
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert (stats.acceptance_rate > 0.5) == oracle
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    runner = llm.engine.runner
    mtp_rows = runner.kv_caches.layer(CacheKind.SLIDING_WINDOW, runner.model_cfg.num_hidden_layers)
    assert mtp_rows.abs().sum() > 0  # the MTP layer's own window rows were written


def test_without_room_a_rejected_draft_corrupts_the_state(mtp_model, mtp_reference, monkeypatch):
    """The check above can fail: with rings only as long as a compressor reads (no room for
    drafts), the oracle's rejected drafts overwrite rows the next tokens need and the tokens
    change."""
    import engine.models.deepseek_v4 as v4
    from tests.test_spec_decode import Oracle

    monkeypatch.setattr(v4, "MAX_SPECULATIVE_TOKENS", 0)
    Oracle(monkeypatch, {tuple(p): w for p, w in zip(PROMPTS, mtp_reference, strict=True)}, wrong_at=1)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **ENGINE)
    assert _tokens(llm, PROMPTS, MAX_TOKENS) != mtp_reference
