"""Sampler semantics on small hand-made logits: exact where the answer is determined, and
statistical (many rows of one batch, fixed global seed) where it is a distribution."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

import engine.sampler as sampler_module
from engine.sampler import Sampler, SamplerOutput, argmax, prompt_logprobs
from engine.sampling_params import SamplingParams

EOS = 2


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [5, 6])
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def row(prompt: list[int] | None = None, output: list[int] | None = None, **kwargs) -> Row:
    params = SamplingParams(**kwargs)
    params.validate()
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return Row(params, [5, 6] if prompt is None else prompt, output or [], generator)


def sample(logits: torch.Tensor, rows: list[Row], vocab: int | None = None) -> SamplerOutput:
    # The sampler edits logits in place; the tests reuse theirs.
    sampler = Sampler(vocab_size=vocab or logits.shape[1], eos_token_ids=[EOS])
    return sampler(logits.clone(), rows)


def random_logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- greedy and the filters that reduce to it ---------------------------------------------------


@pytest.mark.parametrize("batch,vocab", [(1, 7), (5, 100), (33, 1000)], ids=lambda v: str(v))
def test_greedy_is_argmax(batch, vocab):
    logits = random_logits(batch, vocab)
    out = sample(logits, [row(temperature=0.0) for _ in range(batch)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * batch


def test_greedy_does_not_touch_logits_or_use_randomness():
    logits = random_logits(4, 50)
    before = logits.clone()
    state = torch.get_rng_state()
    Sampler(50, [EOS])(logits, [row(temperature=0.0) for _ in range(4)])
    assert torch.equal(logits, before)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("temperature", [1e-30, 1e-7, 1e-6], ids=lambda t: f"T{t:g}")
def test_temperature_below_eps_is_greedy(temperature):
    logits = random_logits(8, 64)
    out = sample(logits, [row(temperature=temperature) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-4, 1e-2], ids=lambda t: f"T{t:g}")
def test_small_temperature_concentrates_on_argmax(temperature):
    # Top logit 1 above the rest: at T=1e-2 the others have probability ~e^-100 each.
    logits = torch.zeros(64, 32)
    logits[torch.arange(64), torch.arange(64) % 32] = 1.0
    torch.manual_seed(0)
    out = sample(logits, [row(temperature=temperature) for _ in range(64)])
    assert out.token_ids == [i % 32 for i in range(64)]


@pytest.mark.parametrize(
    "filter_kwargs",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 1, "top_p": 0.5}],
    ids=["topk1", "topp-tiny", "minp1", "topk1-topp0.5"],
)
def test_filters_that_keep_one_token_equal_greedy(filter_kwargs):
    logits = random_logits(16, 300)
    torch.manual_seed(0)
    out = sample(logits, [row(temperature=1.0, **filter_kwargs) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


# --- filters: the support of many samples -------------------------------------------------------


@pytest.fixture(params=[256, 2], ids=["candidates256", "candidates2"])
def top_p_candidates(request, monkeypatch):
    """Run a test with the default top_p candidate width (all-sort on these small vocabularies)
    and with 2, which sends rows through the topk-candidates path and its sort fallback."""
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", request.param)
    return request.param


PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])


def support(kwargs: dict, n: int = 4000) -> set[int]:
    logits = PROBS.log().expand(n, -1).contiguous()
    torch.manual_seed(1)
    return set(sample(logits, [row(**kwargs) for _ in range(n)]).token_ids)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, {0, 1, 2, 3, 4, 5}),
        # Threshold min_p * 0.40: 0.5 -> 0.20, 0.3 -> 0.12, 0.11 -> 0.044, 0.09 -> 0.036.
        ({"min_p": 0.5}, {0, 1}),
        ({"min_p": 0.3}, {0, 1, 2}),
        ({"min_p": 0.11}, {0, 1, 2, 3, 4}),
        ({"min_p": 0.09}, {0, 1, 2, 3, 4, 5}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_k": 100}, {0, 1, 2, 3, 4, 5}),
        # Smallest set reaching the mass: 0.40 + 0.25 = 0.65 >= 0.6; 0.65 + 0.15 = 0.80 >= 0.7.
        ({"top_p": 0.6}, {0, 1}),
        ({"top_p": 0.7}, {0, 1, 2}),
        # top_p measured on what top_k kept: 0.40/0.65 = 0.62 < 0.7 so token 1 stays too.
        ({"top_k": 2, "top_p": 0.7}, {0, 1}),
        ({"top_k": 4, "min_p": 0.3}, {0, 1, 2}),
    ],
    ids=[
        "none",
        "minp0.5",
        "minp0.3",
        "minp0.11",
        "minp0.09",
        "topk3",
        "topk-past-vocab",
        "topp0.6",
        "topp0.7",
        "topk2-topp0.7",
        "topk4-minp0.3",
    ],
)
def test_filter_support(kwargs, expected, top_p_candidates):
    assert support(kwargs) == expected


def test_mixed_filters_in_one_batch_apply_per_row(top_p_candidates):
    n = 2000
    logits = PROBS.log().expand(3 * n, -1).contiguous()
    rows = [row(top_k=2) for _ in range(n)] + [row(min_p=0.3) for _ in range(n)] + [row() for _ in range(n)]
    torch.manual_seed(2)
    tokens = sample(logits, rows).token_ids
    assert set(tokens[:n]) == {0, 1}
    assert set(tokens[n : 2 * n]) == {0, 1, 2}
    assert set(tokens[2 * n :]) == {0, 1, 2, 3, 4, 5}


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, PROBS),
        ({"temperature": 0.5}, PROBS**2 / (PROBS**2).sum()),
        ({"top_k": 3}, PROBS[:3] / PROBS[:3].sum()),
    ],
    ids=["T1", "T0.5", "topk3"],
)
def test_sample_frequencies_match_distribution(kwargs, expected):
    n = 20000
    logits = PROBS.log().expand(n, -1).contiguous()
    torch.manual_seed(3)
    tokens = torch.tensor(sample(logits, [row(**kwargs) for _ in range(n)]).token_ids)
    freq = torch.bincount(tokens, minlength=len(PROBS)).double() / n
    expected = torch.nn.functional.pad(expected.double(), (0, len(PROBS) - len(expected)))
    # 5 standard deviations of a binomial proportion: a false alarm is ~1e-6 per token.
    tolerance = 5 * (expected * (1 - expected) / n).sqrt() + 1e-9
    assert ((freq - expected).abs() <= tolerance).all(), (freq, expected)


def reference_kept(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """Per-row, by the definitions: the k most likely, then the smallest prefix reaching p."""
    order = logits.argsort(descending=True).tolist()
    if k > 0:
        order = order[:k]
    probs = torch.softmax(logits[order].double(), 0).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs, strict=True):
        if mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("width", [1, 4, 16, 1000], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0], ids=["flat", "peaky", "very-peaky"])
def test_top_k_top_p_matches_reference(width, scale, monkeypatch):
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", width)
    vocab = 200
    settings = [
        (-1, 0.5),
        (-1, 0.9),
        (-1, 0.99),
        (3, 0.9),
        (10, 0.3),
        (50, 0.95),
        (150, 0.8),
        (7, 1.0),
        (-1, 1.0),
        (1, 0.5),
    ]
    logits = random_logits(len(settings), vocab, seed=int(scale * 10)) * scale
    filtered = logits.clone()
    top_k = [k if k > 0 else vocab for k, _ in settings]
    sampler_module._top_k_top_p(filtered, top_k, [p for _, p in settings])
    for r, (k, p) in enumerate(settings):
        kept = set(torch.isfinite(filtered[r]).nonzero().squeeze(1).tolist())
        assert kept == reference_kept(logits[r], k, p), (k, p)
        assert torch.equal(filtered[r][list(kept)], logits[r][list(kept)])


# --- penalties and min_tokens on hand-computed logits -------------------------------------------

BASE = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]


def greedy_after(kwargs: dict, prompt: list[int], output: list[int]) -> int:
    logits = torch.tensor([BASE])
    return sample(logits, [row(prompt=prompt, output=output, temperature=0.0, **kwargs)]).token_ids[0]


@pytest.mark.parametrize(
    "kwargs,prompt,output,expected_logits",
    [
        # Seen tokens 0 (prompt) and 1 (output): positive divided, negative multiplied.
        ({"repetition_penalty": 2.0}, [0], [1], [1.0, -2.0, 0.5, -0.5, 1.0, 0.0]),
        # Below 1 it rewards repeats: 2.0 / 0.5 = 4.0, -1.0 * 0.5 = -0.5.
        ({"repetition_penalty": 0.5}, [0], [1], [4.0, -0.5, 0.5, -0.5, 1.0, 0.0]),
        # Output-only; counts 0: x2, 4: x1. Prompt token 2 is not penalised.
        ({"frequency_penalty": 0.75}, [2], [0, 4, 0], [0.5, -1.0, 0.5, -0.5, 0.25, 0.0]),
        ({"presence_penalty": 1.5}, [2], [0, 4, 0], [0.5, -1.0, 0.5, -0.5, -0.5, 0.0]),
        (
            {"frequency_penalty": -0.5, "presence_penalty": 0.25},
            [],
            [3, 3, 3],
            [2.0, -1.0, 0.5, 0.75, 1.0, 0.0],
        ),
        # Repetition first, then frequency: 2.0 / 2 - 1.0 * 2 = -1.0.
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 1.0},
            [],
            [0, 0],
            [-1.0, -1.0, 0.5, -0.5, 1.0, 0.0],
        ),
    ],
    ids=["rep2", "rep0.5", "freq", "presence", "neg-freq-presence", "rep-then-freq"],
)
def test_penalties(kwargs, prompt, output, expected_logits):
    # A greedy row's logits are penalised in place and then argmaxed: read the whole vector back.
    logits = torch.tensor([BASE])
    sampler = Sampler(6, [EOS])
    r = row(prompt=prompt, output=output, temperature=0.0, **kwargs)
    penalised = logits.clone()
    sampler(penalised, [r])  # edits in place: what greedy took the argmax of
    torch.testing.assert_close(penalised, torch.tensor([expected_logits]), rtol=0, atol=1e-6)
    assert greedy_after(kwargs, prompt, output) == max(range(6), key=lambda t: expected_logits[t])


def test_penalties_only_touch_their_rows():
    logits = random_logits(3, 20)
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, output=[1, 1], repetition_penalty=1.3, frequency_penalty=0.4),
        row(temperature=0.0, output=[1]),
    ]
    edited = logits.clone()
    Sampler(20, [EOS])(edited, rows)
    assert torch.equal(edited[[0, 2]], logits[[0, 2]])
    assert not torch.equal(edited[1], logits[1])


def test_logits_past_vocab_size_are_never_sampled():
    logits = torch.zeros(4, 10)
    logits[:, 8:] = 100.0  # padding columns of a padded lm_head
    out = Sampler(8, [EOS])(logits, [row(temperature=0.0), row(), row(seed=1), row(logprobs=3)])
    assert all(t < 8 for t in out.token_ids)


@pytest.mark.parametrize(
    "kwargs,n_output,masked",
    [
        ({"min_tokens": 3}, 0, {EOS}),
        ({"min_tokens": 3}, 2, {EOS}),
        ({"min_tokens": 3}, 3, set()),
        ({"min_tokens": 3, "stop_token_ids": [4]}, 1, {EOS, 4}),
        ({"min_tokens": 3, "stop_token_ids": [4]}, 3, set()),
        # With ignore_eos EOS is just a token; stop_token_ids are still masked.
        ({"min_tokens": 3, "stop_token_ids": [4], "ignore_eos": True}, 0, {4}),
        ({"stop_token_ids": [4]}, 0, set()),
    ],
    ids=["eos-0of3", "eos-2of3", "reached", "stop-ids", "stop-ids-reached", "ignore-eos", "no-min"],
)
def test_min_tokens_masks_stop_tokens(kwargs, n_output, masked):
    # Each candidate stop token gets the top logit in turn: it is chosen iff not masked.
    for token in (EOS, 4):
        logits = torch.zeros(1, 6)
        logits[0, token] = 10.0
        r = row(output=[0] * n_output, temperature=0.0, max_tokens=8, **kwargs)
        chosen = sample(logits, [r]).token_ids[0]
        assert (chosen != token) == (token in masked), (token, chosen)


def test_min_tokens_mask_holds_for_random_sampling():
    logits = torch.zeros(500, 6)
    logits[:, EOS] = 5.0
    torch.manual_seed(4)
    out = sample(logits, [row(output=[1], min_tokens=2, max_tokens=8) for _ in range(500)])
    assert EOS not in out.token_ids


# --- seeds: reproducible whatever the batch ------------------------------------------------------


def mixed_batch(target: Row, position: int) -> list[Row]:
    kinds = [
        dict(seed=7),
        dict(),
        dict(temperature=0.0),
        dict(seed=123, top_p=0.9),
        dict(top_k=5),
        dict(min_p=0.1, seed=9),
        dict(temperature=0.7),
        dict(repetition_penalty=1.2, output=[3]),
        dict(logprobs=2),
        dict(seed=8, top_k=40, top_p=0.8),
        dict(temperature=0.0, logprobs=1),
        dict(presence_penalty=0.5, output=[1, 2]),
        dict(seed=1000),
        dict(temperature=1.5),
        dict(top_p=0.5),
    ]
    rows = [row(**k) for k in kinds]
    rows.insert(position, target)
    return rows


@pytest.mark.parametrize(
    "target_kwargs",
    [dict(seed=42), dict(seed=42, top_p=0.9, top_k=50), dict(seed=0, temperature=0.6, min_p=0.05)],
    ids=["plain", "topk-topp", "temp-minp"],
)
def test_seeded_row_same_alone_and_in_batch(target_kwargs):
    vocab, steps, position = 500, 6, 9
    alone, batched = row(**target_kwargs), row(**target_kwargs)
    tokens_alone, tokens_batched = [], []
    for step in range(steps):
        logits = random_logits(16, vocab, seed=step)
        tokens_alone.append(sample(logits[position : position + 1], [alone]).token_ids[0])
        torch.manual_seed(step)  # the other rows' draws differ in each run below
        batch = mixed_batch(batched, position)
        tokens_batched.append(sample(logits, batch).token_ids[position])
        alone.output_token_ids.append(tokens_alone[-1])
        batched.output_token_ids.append(tokens_batched[-1])
    assert tokens_alone == tokens_batched
    # And the seed is doing the work: a different seed gives a different sequence.
    other = row(**{**target_kwargs, "seed": target_kwargs["seed"] + 1})
    tokens_other = [
        sample(random_logits(16, vocab, seed=s)[position : position + 1], [other]).token_ids[0]
        for s in range(steps)
    ]
    assert tokens_other != tokens_alone


def test_seeded_rows_ignore_global_rng():
    logits = random_logits(2, 1000)
    torch.manual_seed(1)
    first = sample(logits, [row(seed=5), row(seed=6)]).token_ids
    torch.manual_seed(99)
    second = sample(logits, [row(seed=5), row(seed=6)]).token_ids
    assert first == second


# --- logprobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num", [0, 1, 3, 20], ids=lambda n: f"N{n}")
def test_logprobs_are_raw_and_include_sampled(num):
    vocab = 50
    logits = random_logits(4, vocab)
    raw = torch.log_softmax(logits, -1)
    rows = [
        row(temperature=0.0, logprobs=num),
        row(temperature=0.0, logprobs=num, repetition_penalty=1.7, prompt=list(range(vocab))),
        row(seed=3, temperature=0.3, top_k=5, logprobs=num),
        row(temperature=0.0),
    ]
    out = sample(logits, rows)
    assert out.logprobs[3] is None
    for i in range(3):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        top = raw[i].topk(num).indices.tolist() if num else []
        assert set(lp) == set(top) | {token}
        assert next(iter(lp)) == token  # sampled first
        for t, value in lp.items():
            # Raw: before penalties and temperature.
            assert math.isclose(value, raw[i, t].item(), abs_tol=1e-6)


def test_logprobs_include_sampled_token_outside_top_n():
    # Greedy picks token 0 once repetition penalty pushes the raw best (token 1) down.
    logits = torch.tensor([[3.0, 4.0, 1.0, 0.0]])
    out = sample(logits, [row(temperature=0.0, logprobs=1, prompt=[1], repetition_penalty=3.0)])
    raw = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx({0: raw[0].item(), 1: raw[1].item()}, abs=1e-6)


@pytest.mark.parametrize("T,V,num", [(1, 7, 0), (5, 31, 3), (17, 100, 20)], ids=lambda v: str(v))
def test_prompt_logprobs(T, V, num):
    logits = random_logits(T, V)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    out = prompt_logprobs(logits, targets, num)
    raw = torch.log_softmax(logits, -1)
    assert len(out) == T
    for t in range(T):
        expected_ids = set(raw[t].topk(num).indices.tolist()) | {targets[t].item()}
        assert set(out[t]) == expected_ids
        for token, value in out[t].items():
            assert math.isclose(value, raw[t, token].item(), abs_tol=1e-6)


def test_prompt_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="target_ids"):
        prompt_logprobs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="num"):
        prompt_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), 6)


def test_empty_batch():
    assert sample(torch.zeros(0, 5), []) == SamplerOutput(token_ids=[], logprobs=[])


# --- logit_bias -----------------------------------------------------------------------------------


def test_logit_bias_steers_greedy_and_sampled_rows_but_not_logprobs():
    logits = random_logits(3, 50, seed=4)
    top = logits.argmax(dim=-1).tolist()
    rows = [
        row(temperature=0.0, logit_bias={17: 100.0}, logprobs=1),  # forced
        row(temperature=0.0, logit_bias={top[1]: -100.0}),  # the argmax is pushed away
        row(temperature=0.7, seed=3, logit_bias={23: 100.0}),  # sampling follows the bias too
    ]
    out = sample(logits, rows)
    assert out.token_ids[0] == 17 and out.token_ids[2] == 23
    second = logits[1].clone()
    second[top[1]] -= 100.0
    assert out.token_ids[1] == int(second.argmax())
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0][17] == pytest.approx(float(raw[17]), abs=1e-5)  # raw model logprobs


def test_logit_bias_of_one_row_leaves_the_others_alone():
    logits = random_logits(4, 30, seed=5)
    plain = sample(logits, [row(temperature=0.0) for _ in range(4)]).token_ids
    mixed = sample(
        logits, [row(temperature=0.0, logit_bias={0: 100.0})] + [row(temperature=0.0) for _ in range(3)]
    )
    assert mixed.token_ids[0] == 0 and mixed.token_ids[1:] == plain[1:]


def test_argmax_is_torch_argmax_with_ties_and_nans():
    """engine.sampler.argmax (through torch.max) picks what torch.argmax picks: the first of equal
    maxima, and NaN as the largest value, over random rows with planted ties and NaNs."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 1000, generator=gen)
    logits[::3, 7] = logits[::3, 900] = 50.0  # a tie, the first at 7
    logits[1::5, 300] = logits[1::5, 40] = float("nan")  # the first NaN wins
    logits[2::7] = 1.0  # all equal: index 0
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        assert torch.equal(argmax(rows), rows.argmax(dim=-1))
    assert argmax(logits)[0] == 7 and argmax(logits)[1] == 40 and argmax(logits)[2] == 0


@pytest.mark.parametrize(
    "kwargs, plain",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "ignore_eos": True, "max_tokens": 9}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.0, "logprobs": 2}, False),
        ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0.0, "presence_penalty": 0.5}, False),
        ({"temperature": 0.0, "logit_bias": {3: 1.0}}, False),
        ({"temperature": 0.0, "min_tokens": 4}, False),  # EOS masked for now: not one argmax
    ],
    ids=str,
)
def test_only_argmax_says_when_the_step_is_one_argmax(kwargs, plain):
    """The model runner takes the argmax of the bf16 logits itself exactly when the sampler's
    answer would be the argmax of the logits and nothing else."""
    sampler = Sampler(vocab_size=50, eos_token_ids=[EOS])
    assert sampler.only_argmax([row(temperature=0.0), row(**kwargs)]) is plain
    if plain:  # and then the sampler's own answer is that argmax
        logits = random_logits(2, 50)
        assert (
            sampler(logits.clone(), [row(temperature=0.0), row(**kwargs)]).token_ids
            == argmax(logits).tolist()
        )
