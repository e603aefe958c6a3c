"""MTP speculative decoding: exact under greedy, distribution-preserving under sampling, and
exact block accounting with rejections and preemption."""

from __future__ import annotations

import pytest
import torch

import engine.spec_decode.drafter as drafter_module
from engine import LLM, SamplingParams
from engine.forward_batch import DecodeGroup, ForwardBatch, PrefillSeq
from engine.runner import ModelRunner
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.verify import accept_from_probs, verify_greedy
from services.cli import _spec_config, build_parser
from tests.bench_testing import run_benchmark

PROMPTS = [
    [5 + (i * 13 + j * 7) % 3000 for j in range(length)] for i, length in enumerate((9, 40, 17, 3, 28, 61))
]
MAX_TOKENS = (20, 3, 12, 30, 6, 9)
ENGINE = dict(dtype="float32", num_kv_blocks=256, block_size=4, num_threads=1)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    from modelkit.make_model import make_model

    return str(make_model("tiny-mtp", tmp_path_factory.mktemp("models") / "tiny-mtp"))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(mtp_model):
    return LLM(mtp_model, **ENGINE).generate(
        prompt_token_ids=PROMPTS, sampling_params=[_greedy(n) for n in MAX_TOKENS]
    )


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_equals_greedy_without(mtp_model, reference, k):
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **ENGINE)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[_greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


class Oracle:
    """Replaces the MTP layer's drafts with the reference continuation, wrong at one position, so
    acceptance is known exactly."""

    def __init__(self, monkeypatch, truth: dict[tuple[int, ...], list[int]], wrong_at: int | None):
        self.truth, self.wrong_at = truth, wrong_at
        real = drafter_module.draft_with_mtp

        def fake(runner, items, batch, hidden, out):
            real(runner, items, batch, hidden, out)  # keeps the MTP cache filled as usual
            for it in items:
                req = it.request
                if req.request_id not in out.drafts:
                    continue
                full = self.truth[tuple(req.prompt_token_ids)]
                done = req.num_output_tokens + len(out.sampled.get(req.request_id, []))
                drafts = list(full[done : done + len(out.drafts[req.request_id])])
                if self.wrong_at is not None and len(drafts) > self.wrong_at:
                    drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 4096
                out.drafts[req.request_id] = drafts

        monkeypatch.setattr("engine.runner.draft_with_mtp", fake)


@pytest.mark.parametrize("query_len", [1, 2, 3])
def test_decode_group_per_token_tables(query_len):
    """DecodeGroup.of's per-token tables (one row per query token, built from its lists) are
    kernels.mla.per_token_tables' over its tensors."""
    from kernels.mla import per_token_tables

    group = DecodeGroup.of(0, query_len, [[3, 1], [7], [2, 5, 9]], [8, 3, 12], "cpu")
    tables, lens = group.per_token
    want_tables, want_lens = per_token_tables(group.block_table, group.seq_lens, query_len)
    assert torch.equal(tables, want_tables) and torch.equal(lens, want_lens)
    assert tables.dtype == lens.dtype == torch.int32 and lens.shape == (3 * query_len,)
    assert group.block_table.tolist() == [[3, 1, 0], [7, 0, 0], [2, 5, 9]]  # zero-padded
    assert group.seq_lens.tolist() == [8, 3, 12]
    assert all(t.is_contiguous() for t in (tables, lens, group.block_table, group.seq_lens))  # read in place


def _without_one_call_spec_step(monkeypatch) -> None:
    """Greedy speculative steps through the forward, verify_greedy and draft_with_mtp one by one
    (ModelRunner._greedy_spec_step declines every step), where the native kernels would run them
    as one call."""
    monkeypatch.setattr(ModelRunner, "_greedy_spec_step", lambda self, *args: None)


@pytest.mark.parametrize("k, dtype", [(1, "float32"), (3, "float32"), (2, "bfloat16")])
def test_folding_known_rows_into_the_first_draft_keeps_the_drafts(monkeypatch, k, dtype):
    """A decode's accepted rows go through the MTP layer with its first draft, writing their MTP
    cache rows in that forward: every draft of every step is the one drafted with those rows
    stored apart first (mtp_store_kv), and the cache rows are the same: bit for bit through the
    native kernels (bf16 on a CPU with AVX512F or AVX2: the one-call paths and the tile attention's
    16-row blocks), up to float32 rounding through torch's (float32, or bf16 where the CPU computes
    it natively).
    The trained model, whose drafts are mostly accepted, so that there are rows to fold."""
    real = drafter_module.draft_with_mtp
    drafted: dict[bool, list[dict[str, list[int]]]] = {True: [], False: []}
    caches, folded = {}, []
    for fold in (False, True):

        def recording(runner, items, batch, hidden, out, fold=fold):
            real(runner, items, batch, hidden, out, fold=fold)
            drafted[fold].append(dict(out.drafts))
            if fold:  # decodes that verified more than their last token: rows folded this step
                folded.extend(it for it in items if it.is_decode and it.draft_token_ids)

        monkeypatch.setattr("engine.runner.draft_with_mtp", recording)
        _without_one_call_spec_step(monkeypatch)  # the drafter's own path, step by step
        spec = {"method": "mtp", "num_speculative_tokens": k}
        engine = {**ENGINE, "dtype": dtype, "block_size": 16 if dtype == "bfloat16" else 4}
        llm = LLM(TRAINED, speculative_config=spec, **engine)
        prompts = ["The module provides", "This function returns a", "def main():"]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        caches[fold] = llm.engine.runner.model.mtp_cache(llm.engine.runner.kv_caches)
        assert llm.engine.spec_stats.acceptance_rate > 0.3
    assert folded and sum(map(len, drafted[True])) > 0
    assert drafted[True] == drafted[False]
    if llm.engine.runner.native_kernels:  # each row's products are the same whatever the rows beside it
        assert torch.equal(caches[True], caches[False])
    else:  # torch's float32 products round by the number of rows, as with the batch's makeup
        torch.testing.assert_close(caches[True], caches[False], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k, prompts", [(1, 1), (2, 3)], ids=["k1-batch1", "k2-batch3"])
def test_the_first_draft_on_the_target_batch_keeps_the_drafts(monkeypatch, k, prompts):
    """Where every row of a step drafts (decodes whose drafts were all accepted), the first reuse
    runs on the target's own batch with the ids one on: the same drafts every step and the same
    MTP cache, bit for bit, as with its batch built again (bf16: the native one-call paths)."""
    taken = []
    real, real_draft = drafter_module._every_row_drafts, drafter_module.draft_with_mtp
    drafted: dict[bool, list[dict[str, list[int]]]] = {True: [], False: []}
    caches = {}
    for reuse in (False, True):

        def every_row_drafts(batch, rows, reuse=reuse):
            if not (reuse and real(batch, rows)):
                return False
            taken.append(1)
            return True

        monkeypatch.setattr(drafter_module, "_every_row_drafts", every_row_drafts)

        def recording(runner, items, batch, hidden, out, reuse=reuse):
            real_draft(runner, items, batch, hidden, out)
            drafted[reuse].append(dict(out.drafts))

        monkeypatch.setattr("engine.runner.draft_with_mtp", recording)
        _without_one_call_spec_step(monkeypatch)
        engine = {**ENGINE, "dtype": "bfloat16", "block_size": 16}
        llm = LLM(TRAINED, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
        texts = ["The module provides", "This function returns a", "def main():"][:prompts]
        llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        caches[reuse] = llm.engine.runner.model.mtp_cache(llm.engine.runner.kv_caches)
    assert taken and sum(map(len, drafted[True])) > 0
    assert drafted[True] == drafted[False]
    assert torch.equal(caches[True], caches[False])


@pytest.mark.parametrize("wrong_at", [None, 1])
def test_accepted_and_rejected_drafts_keep_tokens_and_blocks_exact(
    mtp_model, reference, monkeypatch, wrong_at
):
    Oracle(monkeypatch, {tuple(r.prompt_token_ids): r.token_ids for r in reference}, wrong_at)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **ENGINE)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[_greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.spec_stats
    if wrong_at is None:
        assert stats.acceptance_rate == 1.0 and stats.mean_accept_length > 3.0
    else:  # exactly the draft before the wrong one is accepted, whenever there was room for it
        assert 0 < stats.acceptance_rate < 0.5 and stats.per_position()[1] == 0.0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_preemption_during_speculation_stays_exact(mtp_model, reference, monkeypatch):
    Oracle(monkeypatch, {tuple(r.prompt_token_ids): r.token_ids for r in reference}, 2)
    # A cache this small forces preemptions while requests hold lookahead blocks.
    llm = LLM(
        mtp_model,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        **{**ENGINE, "num_kv_blocks": 24},
    )
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[_greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.kv.num_free_blocks == 24


def test_speculating_and_plain_requests_share_steps_exactly(mtp_model, reference):
    """Requests that want logprobs decode one token at a time next to speculating ones, and small
    chunks keep prefills in the same steps: decode groups of different query lengths, prefill
    chunks and an MTP pass over only the speculating requests, in one forward."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1 if i % 2 else None)
        for i, n in enumerate(MAX_TOKENS)
    ]
    small = {**ENGINE, "max_num_batched_tokens": 16}
    plain = LLM(mtp_model, **small).generate(prompt_token_ids=PROMPTS, sampling_params=params)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **small)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for got, want in zip(outs, plain, strict=True):
        assert got.token_ids == want.token_ids
        if want.logprobs is not None:
            assert got.logprobs is not None
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                assert g.keys() == w.keys()
                assert all(abs(g[t] - w[t]) < 1e-4 for t in w)
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_speculation_pauses_in_large_steps_and_resumes(mtp_model, reference, monkeypatch):
    """disable_by_batch_size=4: steps running 4 or more requests draft nothing, steps with fewer
    draft again once requests finish, and the tokens are the reference's throughout."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 4}
    llm = LLM(mtp_model, speculative_config=spec, **ENGINE)
    runner = llm.engine.runner
    steps = []  # (requests in the step, whether it drafted)
    real_execute = runner.execute

    def execute(sched):
        out = real_execute(sched)
        steps.append((len(sched.scheduled), bool(out.drafts)))
        return out

    monkeypatch.setattr(runner, "execute", execute)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[_greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert any(n >= 4 for n, _ in steps) and not any(drafted for n, drafted in steps if n >= 4)
    assert any(drafted for n, drafted in steps if n < 4)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_sampled_requests_speculate_and_finish(mtp_model):
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params)
    assert all(len(o.token_ids) == 12 for o in outs) and llm.engine.spec_stats.num_drafts > 0


# ---- the rejection sampler keeps the target distribution -------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; p-value from the chi-square survival function
    (the regularised upper incomplete gamma function)."""
    expected = (probs * counts.sum()).double()
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return 0.0  # a token the target never produces
    stat = (((counts[keep].double() - expected[keep]) ** 2) / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _empirical(sampler, probs: torch.Tensor, draft: int, n: int = 20000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(probs.shape[1])
    for _ in range(n):
        counts[sampler(probs, [draft], gen)[0]] += 1
    return counts


def test_rejection_sampling_preserves_the_target_distribution():
    p = torch.tensor(
        [[0.05, 0.4, 0.25, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]
    )  # target at the draft, then bonus
    for draft in (1, 3, 0):  # a likely, a middling and an unlikely draft
        counts = _empirical(accept_from_probs, p, draft)
        assert _chi2_pvalue(counts, p[0]) > 0.001


def test_the_chi_square_test_rejects_a_wrong_sampler():
    def always_accept(probs, drafts, gen):  # the classic bug: accepting with probability 1
        return accept_from_probs(
            torch.stack(
                [torch.nn.functional.one_hot(torch.tensor(drafts[0]), probs.shape[1]).float(), probs[1]]
            ),
            drafts,
            gen,
        )

    def forget_the_residual(probs, drafts, gen):  # resampling from p instead of p without the draft
        u = torch.rand(1, generator=gen).item()
        if u < probs[0, drafts[0]]:
            return [drafts[0]]
        return [int(torch.multinomial(probs[0], 1, generator=gen))]

    p = torch.tensor([[0.05, 0.4, 0.25, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    for wrong in (always_accept, forget_the_residual):
        assert _chi2_pvalue(_empirical(wrong, p, 1), p[0]) < 0.001


def test_greedy_verification_rule():
    best = [3, 7, 2, 9]  # the target's argmax at the last known token and after each draft
    assert verify_greedy(best, [3, 7, 2]) == [3, 7, 2, 9]  # all accepted + bonus
    assert verify_greedy(best, [3, 1, 2]) == [3, 7]  # stops at the first mismatch, emits the target's
    assert verify_greedy(best, [0, 7, 2]) == [3]


def test_speculative_config_validation(tiny_model):
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    for bad, msg in (
        ({"method": "ngram"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"k": 1}, "unknown"),
        ({"disable_by_batch_size": 1}, "disable_by_batch_size"),
        ({"disable_by_batch_size": "8"}, "disable_by_batch_size"),
    ):
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse({"disable_by_batch_size": 8}).disable_by_batch_size == 8
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "p", "--speculative", "mtp"]
        + ["--num-speculative-tokens", "3", "--speculative-disable-by-batch-size", "16"]
    )
    assert _spec_config(args) == {
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 16}
    }
    with pytest.raises(ValueError, match="MTP layers"):  # the plain tiny model has none
        LLM(tiny_model, speculative_config={"method": "mtp"}, **ENGINE)


def test_disaggregated_and_colocated_serving_with_mtp_keep_greedy_tokens(mtp_model, reference, tmp_path):
    """Both workers speculate; the MTP layer's KV moves with the prompt's, so the decode worker
    drafts from the first token on."""
    import urllib.request

    from pdserve.v1 import inference_pb2 as pb
    from tests.service_testing import ENGINE_ARGS, generate, inference, metric, start_stack

    stack = start_stack(
        mtp_model,
        tmp_path,
        engine_args=[*ENGINE_ARGS, "--speculative", "mtp", "--num-speculative-tokens", "2"],
        worker_metrics=True,
    )
    try:
        for mode in (pb.SERVING_MODE_DISAGGREGATED, pb.SERVING_MODE_COLOCATED):
            for prompt, n, ref in zip(PROMPTS, MAX_TOKENS, reference, strict=True):
                sampling = pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                tokens, msgs = generate(
                    inference(stack), token_ids=pb.TokenIds(ids=prompt), sampling=sampling, mode=mode
                )
                assert tokens == ref.token_ids
        decode = stack.workers("decode")[0]
        text = urllib.request.urlopen(decode.metrics_url).read().decode()
        assert metric(text, "pdserve_spec_draft_tokens") > 0
    finally:
        codes = stack.stop()
    assert all(c == 0 for c in codes.values()), codes


def test_spec_decode_benchmark_smoke(mtp_model):
    out = run_benchmark("spec_decode.py", "--model", mtp_model, "--smoke", "--threads", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [(row[0], row[1]) for row in lines] == [("1", "0"), ("1", "1")]
    assert all(float(row[2]) > 0 for row in lines)


# ---- the trained default model ---------------------------------------------------------------------

TRAINED = "assets/pdserve-tiny"


def _layout(ids: list[int], start: int, blocks: list[int], *, absorbed: bool) -> ForwardBatch:
    """ids at positions start.. of one sequence (cache blocks `blocks`, block size 16), as a
    prefill chunk or as one absorbed decode group of query length len(ids)."""
    n, ctx = len(ids), start + len(ids)
    pos = list(range(start, ctx))
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor([blocks[p // 16] * 16 + p % 16 for p in pos]),
        decodes=[DecodeGroup.of(0, n, [blocks], [ctx], "cpu")] if absorbed else [],
        prefills=[] if absorbed else [PrefillSeq(0, n, ctx, torch.tensor(blocks[: -(-ctx // 16)]))],
        logits_indices=torch.zeros(0, dtype=torch.long),
    )


def test_mtp_draft_logits_match_a_plain_reference_of_the_checkpoint():
    """The engine's MTP layer (paged MLA, fused MoE kernels) against `mtp_reference_logits`, a plain
    PyTorch implementation of the MTP step built from the checkpoint tensors: a prefill-style pass
    over the start of the prompt, cache rows only (`mtp_store_kv`, as the drafter writes the
    positions it reads no draft from) for the next three, then the last three positions as one
    causal absorbed decode group, which attend to all of them."""
    import json

    from safetensors.torch import load_file

    from modelkit.training.mtp import mtp_reference_logits

    llm = LLM(
        TRAINED,
        dtype="float32",
        num_kv_blocks=16,
        block_size=16,
        num_threads=1,
        speculative_config={"method": "mtp"},
    )
    runner, model = llm.engine.runner, llm.engine.runner.model
    ids = llm.tokenizer.encode("The module provides functions to read and write files in many formats")
    n = len(ids)
    blocks = list(range(-(-n // 16)))
    mtp_cache = model.mtp_cache(runner.kv_caches)
    with torch.inference_mode():
        hidden = model(_layout(ids, 0, blocks, absorbed=False), runner.kv_caches)  # [T, H] final norm
        # MTP position i reads (h_i, t_{i+1}): positions 0..n-8 as a chunk, n-7..n-5 cache rows
        # only, n-4..n-2 absorbed.
        first, kv_only, last = (0, n - 7), (n - 7, n - 4), (n - 4, n - 1)
        got = []
        for (lo, hi), absorbed in ((first, False), (kv_only, None), (last, True)):
            b = _layout(ids[lo + 1 : hi + 1], lo, blocks, absorbed=bool(absorbed))
            if absorbed is None:
                model.mtp_store_kv(b.input_ids, hidden[lo:hi], b.positions, b.slot_mapping, mtp_cache)
            else:
                got.append(model.compute_logits(model.mtp_forward(b.input_ids, hidden[lo:hi], b, mtp_cache)))
        got = torch.cat(got)
    config = json.loads(open(f"{TRAINED}/config.json").read())
    want = mtp_reference_logits(
        load_file(f"{TRAINED}/model.safetensors"), config, torch.tensor(ids), hidden.float()
    )
    want = torch.cat((want[slice(*first)], want[slice(*last)]))
    assert n >= 10 and got.shape == want.shape == (n - 4, config["vocab_size"])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() == 1.0


def test_trained_model_accepts_drafts_and_stays_exact():
    prompts = [
        "The module provides",
        "If the argument is",
        "This function returns a",
        "The following example",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(TRAINED, dtype="float32", num_threads=1).generate(prompts, params)
    llm = LLM(
        TRAINED,
        dtype="float32",
        num_threads=1,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    stats = llm.engine.spec_stats
    assert stats.acceptance_rate > 0.3 and stats.per_position()[0] > 0.4, (
        stats.per_position(),
        stats.acceptance_rate,
    )


@pytest.mark.parametrize("k", [1, 2])
def test_batch1_bf16_drafts_keep_the_tokens_bitwise(k):
    """bf16 greedy decoding with k <= 2 drafts at batch 1 gives the tokens of decoding without
    (the verification's <= 3 rows take the same per-row kernels as a one-token decode,
    tests/test_native_kernels.py holds them to that). Without the kernels, in float32."""
    from engine.platform import use_native_kernels

    dtype = "bfloat16" if use_native_kernels(torch.bfloat16, torch.device("cpu")) else "float32"
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    base = LLM(TRAINED, dtype=dtype, num_threads=1)
    llm = LLM(TRAINED, dtype=dtype, num_threads=1, speculative_config=spec)
    for prompt in ("The module provides", "This function returns a"):  # one request at a time
        assert llm.generate([prompt], params)[0].token_ids == base.generate([prompt], params)[0].token_ids
    assert llm.engine.spec_stats.num_drafts > 0


REAL_EXECUTE, REAL_GREEDY_SPEC_STEP = ModelRunner.execute, ModelRunner._greedy_spec_step


def watch_steps(monkeypatch, one_call: bool) -> tuple[list[tuple[dict, dict]], list[bool]]:
    """The runner's steps from here on, watched: -> (each step's (sampled, drafts), whether each
    greedy speculative step ran as one native call), the one-call step taken where it can be
    (one_call) or declined every time."""
    steps, taken = [], []

    def execute(self, sched):
        out = REAL_EXECUTE(self, sched)
        steps.append((dict(out.sampled), dict(out.drafts)))
        return out

    def one_call_step(self, *args):
        out = REAL_GREEDY_SPEC_STEP(self, *args) if one_call else None
        taken.append(out is not None)
        return out

    monkeypatch.setattr(ModelRunner, "execute", execute)
    monkeypatch.setattr(ModelRunner, "_greedy_spec_step", one_call_step)
    return steps, taken


@pytest.mark.parametrize(
    "k, prompts, limit",
    [(1, 1, None), (2, 1, None), (3, 3, None), (2, 3, 3)],
    ids=["k1", "k2", "k3-batch3", "k2-off"],
)
def test_one_call_spec_step_keeps_tokens_drafts_and_caches(monkeypatch, k, prompts, limit):
    """A step of greedy decodes that all speculate runs as one native call (verify, accept, the
    MTP layer's cache rows and drafts: native.greedy_spec_step): every step's tokens and drafts,
    and every cache (the layers' and the MTP layer's), bit for bit what the forward, verify_greedy
    and draft_with_mtp give one by one. Requests of different lengths run into their max_tokens
    (drafting fewer near the end); while disable_by_batch_size is reached nobody drafts, but the
    MTP cache rows are still written."""
    from engine.platform import use_native_kernels

    native = use_native_kernels(torch.bfloat16, torch.device("cpu"))  # what the engines will run
    dtype = "bfloat16" if native else "float32"  # without the kernels every step declines
    texts = ["The module provides", "This function returns a", "def main():"][:prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (21, 13, 17)[:prompts]]
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": limit}
    runs = {}
    for one_call in (False, True):
        steps, taken = watch_steps(monkeypatch, one_call)
        llm = LLM(
            TRAINED, dtype=dtype, num_kv_blocks=64, block_size=16, num_threads=1, speculative_config=spec
        )
        outs = llm.generate(texts, params)
        runs[one_call] = (
            [o.token_ids for o in outs],
            steps,
            [c.clone() for c in llm.engine.runner.kv_caches],
        )
        assert llm.engine.runner.native_kernels == native
        if one_call and native:
            assert sum(taken) >= len(taken) // 2, taken  # most steps: every decode step of one query length
        else:
            assert not any(taken)
    (tokens, steps, caches), (tokens_1, steps_1, caches_1) = runs[False], runs[True]
    assert tokens_1 == tokens and [len(t) for t in tokens] == [p.max_tokens for p in params]
    assert steps_1 == steps
    assert any(drafts for _, drafts in steps)
    if limit is not None:  # no drafts while `limit` requests run, drafts again when fewer do
        full = [drafts for sampled, drafts in steps if len(sampled) >= limit]
        assert full and not any(full)
    for cache, cache_1 in zip(caches, caches_1, strict=True):
        assert torch.equal(cache, cache_1)
