"""The offline API end to end on the default model: what `LLM.generate` / `LLM.stream` return.

One output per prompt, in order; text that is the decoded tokens; finish and stop reasons for
max_tokens, EOS, stop token ids and stop strings; min_tokens; logprobs; seeds; the chat
template; aborting a request. The model runs in float32 so greedy choices are stable.

The default model is random and its EOS (id 1) has a logprob of about -8.5, below the uniform
-8.3, so greedy or seeded sampling practically never emits it. EOS is therefore forced: a copy of
the model folder whose generation_config.json also lists a token the model greedily emits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore
from modelkit.bpe_tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, USER_TOKEN
from services.common import convert
from tests.engine_testing import table

BOS_ID, EOS_ID, USER_ID, ASSISTANT_ID = 0, 1, 3, 4
MAX_TOKENS = 12
PROMPTS = ["def f(x):", "import os\n", "class Foo:"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
STOP_AT = 4
"""Output position whose token the stop-token and EOS tests stop on (or mask)."""


def _llm(model: str | Path) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return _llm(tiny_model)


@pytest.fixture(scope="module")
def greedy(llm):
    """Greedy completions of PROMPTS, generated together."""
    return llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def stop_token(greedy) -> int:
    """The token greedily emitted at output position STOP_AT of PROMPTS[0], seen there first."""
    ids = greedy[0].token_ids
    assert ids[STOP_AT] not in ids[:STOP_AT], "precondition: the stop token is new at STOP_AT"
    return ids[STOP_AT]


@pytest.fixture(scope="module")
def eos_llm(tiny_model, stop_token, tmp_path_factory) -> LLM:
    """The default model, but generation_config.json makes `stop_token` a second EOS id."""
    folder = tmp_path_factory.mktemp("eos-model")
    for f in Path(tiny_model).iterdir():
        if f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    gen_cfg = json.loads((Path(tiny_model) / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [EOS_ID, stop_token]
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    llm = _llm(folder)
    assert llm.engine.eos_token_ids == (EOS_ID, stop_token)
    return llm


def _params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(**kw)


# ---- outputs ---------------------------------------------------------------------------------


def test_one_output_per_prompt_in_order(llm, greedy):
    assert [o.prompt for o in greedy] == PROMPTS
    for prompt, out in zip(PROMPTS, greedy, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids[0] == BOS_ID
        assert out.prompt_token_ids.count(BOS_ID) == 1
    assert len({o.request_id for o in greedy}) == len(PROMPTS)
    # Outputs follow the prompts, not the order requests finish or are stored in.
    reversed_outs = llm.generate(PROMPTS[::-1], GREEDY)
    assert [o.token_ids for o in reversed_outs] == [o.token_ids for o in greedy[::-1]]
    assert len({tuple(o.token_ids) for o in greedy}) == len(PROMPTS), "distinct prompts, distinct outputs"


def test_max_tokens_gives_length_and_text_is_the_decoded_tokens(llm, greedy):
    for out in greedy:
        assert out.finished
        assert out.finish_reason == "length"
        assert out.stop_reason is None
        assert len(out.token_ids) == MAX_TOKENS
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.text  # the tiny model's tokens decode to something
        assert out.logprobs is None and out.prompt_logprobs is None


def test_metrics_are_set_and_ordered(greedy):
    for out in greedy:
        m = out.metrics
        assert None not in (m.first_scheduled_time, m.first_token_time, m.finished_time)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token > 0
        assert m.e2e_latency >= m.time_to_first_token
        assert m.num_preemptions == 0


def test_prompt_token_ids_input_gives_no_prompt_text(llm, greedy):
    ids = greedy[0].prompt_token_ids
    (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY)
    assert out.prompt is None
    assert out.prompt_token_ids == ids
    assert out.token_ids == greedy[0].token_ids
    *_, streamed = llm.stream(sampling_params=GREEDY, prompt_token_ids=ids)
    assert streamed.prompt is None
    assert (streamed.token_ids, streamed.text) == (greedy[0].token_ids, greedy[0].text)


# ---- stop tokens, EOS, min_tokens ------------------------------------------------------------


def test_stop_token_id_ends_generation_and_is_kept(llm, greedy, stop_token):
    (out,) = llm.generate(PROMPTS[0], _params(stop_token_ids=[stop_token]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token
    assert out.token_ids == greedy[0].token_ids[: STOP_AT + 1]
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_eos_ends_generation_with_no_stop_reason(eos_llm, greedy):
    (out,) = eos_llm.generate(PROMPTS[0], GREEDY)
    assert out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS is not a stop token the caller asked for
    assert out.token_ids == greedy[0].token_ids[: STOP_AT + 1]
    assert out.text == eos_llm.tokenizer.decode(out.token_ids)


def test_ignore_eos_generates_past_eos(eos_llm, greedy):
    (out,) = eos_llm.generate(PROMPTS[0], _params(ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == greedy[0].token_ids


MIN_TOKENS_CASES = [
    # (kind, output position where greedy emits the stop token, min_tokens)
    pytest.param("stop_token_id", 0, 4, id="stop_token_id-first-token-min4"),
    pytest.param("stop_token_id", STOP_AT, STOP_AT + 2, id=f"stop_token_id-at{STOP_AT}-min{STOP_AT + 2}"),
    pytest.param("eos", STOP_AT, STOP_AT + 1, id=f"eos-at{STOP_AT}-min{STOP_AT + 1}"),
    pytest.param("eos", STOP_AT, STOP_AT, id=f"eos-at{STOP_AT}-min{STOP_AT}-not-masked"),
]


@pytest.mark.parametrize("kind,position,min_tokens", MIN_TOKENS_CASES)
def test_min_tokens_masks_stop_tokens(request, greedy, kind, position, min_tokens):
    """The stop token is masked while fewer than min_tokens tokens exist, so greedy takes the
    runner-up there; from min_tokens on it stops as usual."""
    expected = greedy[0].token_ids
    stop = expected[position]
    if kind == "eos":
        llm, kw = request.getfixturevalue("eos_llm"), {}
        assert stop in llm.engine.eos_token_ids
    else:
        llm, kw = request.getfixturevalue("llm"), dict(stop_token_ids=[stop])
    (out,) = llm.generate(PROMPTS[0], _params(min_tokens=min_tokens, **kw))
    if min_tokens <= position:
        assert out.token_ids == expected[: position + 1]
        assert out.finish_reason == "stop"
        return
    assert len(out.token_ids) >= min_tokens
    assert stop not in out.token_ids[:min_tokens]
    assert out.token_ids[:position] == expected[:position]
    assert out.token_ids[position] != stop
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS


# ---- stop strings ----------------------------------------------------------------------------


def _token_ends(llm: LLM, ids: list[int]) -> list[int]:
    """Text length after each token of a completion."""
    return [len(llm.tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]


# (first token, char offset into it, stop string length): where the stop string starts.
STOP_CASES = [
    pytest.param(3, 1, 6, id="mid-token-spanning-tokens"),
    pytest.param(2, 0, 1, id="token-start-one-char"),
    # PROMPTS[0]'s token 8 is a lone byte (U+FFFD): the match comes after held-back bytes.
    pytest.param(9, 0, 40, id="after-lone-byte-to-end-of-text"),
]


def _stop_string(llm: LLM, out, token: int, offset: int, length: int) -> tuple[str, int]:
    """A stop string cut from a greedy completion -> (stop string, its position in the text)."""
    ends = _token_ends(llm, out.token_ids)
    start = ends[token - 1] + offset
    assert start < ends[token], "precondition: offset lies inside the token"
    stop = out.text[start : start + length]
    assert "\ufffd" not in stop, "precondition: the stop string is whole characters"
    assert out.text.find(stop) == start, "precondition: first occurrence"
    return stop, start


@pytest.mark.parametrize("token,offset,length", STOP_CASES)
def test_stop_string_truncates_text(llm, greedy, token, offset, length):
    stop, start = _stop_string(llm, greedy[0], token, offset, length)
    (out,) = llm.generate(PROMPTS[0], _params(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == greedy[0].text[:start]
    # Generation stops at the token that completes the match.
    last = next(i for i, end in enumerate(_token_ends(llm, greedy[0].token_ids)) if end >= start + len(stop))
    assert out.token_ids == greedy[0].token_ids[: last + 1]


def test_earliest_of_several_stop_strings_wins(llm, greedy):
    late, late_start = _stop_string(llm, greedy[0], 5, 0, 3)
    early, early_start = _stop_string(llm, greedy[0], 3, 1, 2)
    (out,) = llm.generate(PROMPTS[0], _params(stop=[late, early]))
    assert out.stop_reason == early
    assert out.text == greedy[0].text[:early_start]


@pytest.mark.parametrize(
    "token,offset,length", [*STOP_CASES, pytest.param(None, None, None, id="no-stop-string")]
)
def test_stream_pieces_add_up_and_never_show_the_stop_string(llm, greedy, token, offset, length):
    if token is None:
        stop, expected = [], greedy[0].text
    else:
        s, start = _stop_string(llm, greedy[0], token, offset, length)
        stop, expected = [s], greedy[0].text[:start]
    pieces, new_ids, outs = [], [], []
    for out in llm.stream(PROMPTS[0], _params(stop=stop)):
        pieces.append(out.new_text)
        new_ids.extend(out.new_token_ids)
        outs.append(out)
        streamed = "".join(pieces)
        assert out.text == streamed
        # Nothing past the match point is ever shown, so no part of the stop string at it.
        assert expected.startswith(streamed)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1]
    assert final.text == expected == "".join(pieces)
    assert new_ids == final.token_ids
    assert final.finish_reason == ("stop" if stop else "length")


# ---- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 20], ids=lambda n: f"top{n}")
def test_greedy_logprobs_hold_the_sampled_token_as_the_max(llm, greedy, n):
    (out,) = llm.generate(PROMPTS[0], _params(max_tokens=6, logprobs=n))
    assert out.token_ids == greedy[0].token_ids[:6], "asking for logprobs changes no token"
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        # Greedy picks the argmax, which is in any top-n: n entries, or 1 for n = 0.
        assert len(entry) == max(n, 1)
        assert tok in entry
        assert entry[tok] == max(entry.values())
        assert all(v <= 0 for v in entry.values())


def test_a_step_output_keeps_its_own_logprobs_after_later_steps(llm):
    """The worker converts an output on its event loop while the engine thread steps on: what a
    step's output says about its new tokens must not move when later steps append to the
    request (it once read the tail of the live list and reported a later token's logprob)."""
    core = llm.engine
    core.add_request("live", core.tokenizer.encode(PROMPTS[2]), _params(max_tokens=6, logprobs=2))
    outputs = []
    while core.has_request("live"):
        outputs.extend(core.step())
    final = outputs[-1]
    assert [t for o in outputs for t in o.new_token_ids] == final.token_ids
    assert [lp for o in outputs for lp in o.new_logprobs] == final.logprobs
    for out in outputs:  # converted only now, after every step ran
        msg = convert.output_to_proto(out, first=False)
        assert [entry.token_ids[0] for entry in msg.logprobs] == out.new_token_ids


def test_sampled_logprobs_are_the_top_n_plus_the_sampled_token(llm):
    n = 5
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=n)
    (out,) = llm.generate(PROMPTS[1], params)
    outside_top_n = 0
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in entry
        assert all(v <= 0 for v in entry.values())
        others = [v for t, v in entry.items() if t != tok]
        if len(entry) == n + 1:  # sampled token outside the top n: below all of them
            outside_top_n += 1
            assert all(entry[tok] <= v for v in others)
        else:
            assert len(entry) == n
    assert outside_top_n > 0, "precondition: temperature 1.5 samples outside the top 5"
    # Decode logprobs are the raw model distribution: the same as the prompt logprobs of the
    # same tokens fed back as a prompt.
    (again,) = llm.generate(
        prompt_token_ids=[out.prompt_token_ids + out.token_ids],
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=n),
    )
    n_prompt = len(out.prompt_token_ids)
    for i, entry in enumerate(out.logprobs):
        refed = again.prompt_logprobs[n_prompt + i]
        assert refed.keys() == entry.keys()
        for t, v in entry.items():
            assert refed[t] == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("n", [0, 3], ids=lambda n: f"top{n}")
def test_prompt_logprobs_cover_every_prompt_token_but_the_first(llm, n):
    prompt = "for i in range(10):\n    print(i)"
    (out,) = llm.generate(prompt, _params(max_tokens=2, prompt_logprobs=n))
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None
    for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in entry
        assert len(entry) in (max(n, 1), n + 1)
        assert all(v <= 0 for v in entry.values())
        if len(entry) == n + 1:
            assert all(entry[tok] <= v for t, v in entry.items() if t != tok)


# ---- seeds -----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    def seeded(seed):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)

    (alone,) = llm.generate(PROMPTS[0], seeded(7))
    # Again, now between an unseeded and a differently seeded request.
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[0]],
        [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), seeded(7), seeded(8)],
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[2].token_ids != alone.token_ids


# ---- chat template ---------------------------------------------------------------------------


def test_chat_template_renders_deepseek_markers_and_encodes(llm):
    tok = llm.tokenizer
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        f"{BOS_TOKEN}Be brief.{USER_TOKEN}hi{ASSISTANT_TOKEN}hello{EOS_TOKEN}{USER_TOKEN}bye{ASSISTANT_TOKEN}"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == rendered.removesuffix(
        ASSISTANT_TOKEN
    )
    # The rendered text carries its BOS, so it is encoded without adding special tokens.
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids.count(USER_ID) == 2 and ids.count(ASSISTANT_ID) == 2 and ids.count(EOS_ID) == 1
    assert ids[-1] == ASSISTANT_ID
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    (out,) = llm.generate(prompt_token_ids=[ids], sampling_params=_params(max_tokens=4))
    assert out.prompt_token_ids == ids
    assert len(out.token_ids) == 4


# ---- abort -----------------------------------------------------------------------------------


@pytest.mark.parametrize("steps_before_abort", [0, 3], ids=["waiting", "running"])
def test_abort_frees_blocks_and_leaves_others_alone(llm, greedy, steps_before_abort):
    engine: EngineCore = llm.engine
    pool = engine.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    engine.add_request("keep", prompt_ids[0], GREEDY)
    engine.add_request("drop", prompt_ids[1], GREEDY)
    kept = []
    for _ in range(steps_before_abort):
        for out in engine.step():
            assert out.request_id in ("keep", "drop") and not out.finished
            if out.request_id == "keep":
                kept.extend(out.new_token_ids)

    aborted = engine.abort_request("drop")
    assert aborted.finished
    assert aborted.finish_reason == "abort"
    assert aborted.request_id == "drop"
    assert aborted.token_ids == greedy[1].token_ids[:steps_before_abort]
    assert aborted.metrics.finished_time is not None
    assert "drop" not in engine.requests
    assert engine.abort_request("drop") is None
    held = table(engine.requests["keep"])
    assert pool.num_free_blocks == pool.num_blocks - len(held)

    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            kept.extend(out.new_token_ids)
    assert out.finish_reason == "length"
    assert kept == out.token_ids == greedy[0].token_ids
    assert engine.requests == {}
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


def test_closing_a_stream_early_aborts_its_request(llm):
    stream = llm.stream(
        prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(temperature=0.0, max_tokens=30)
    )
    first = next(stream)
    assert not first.finished and llm.engine.has_request(first.request_id)
    stream.close()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.has_request(first.request_id)
    pool = llm.engine.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks
