"""Structured output in the engine: every constrained output follows its constraint under every
sampling mode, with speculative decoding, preemption and a continuation after a KV transfer; the
unconstrained requests of the same batch are not changed by a constrained neighbour; a new
schema compiles off the engine thread while the others keep stepping.

The constraints are bounded (maxLength, maxItems, enums, bounded integers and repetitions), so
even a random-weight model completes them well within max_tokens: an output that does not parse
is a bug, never bad luck.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

import engine.spec_decode.drafter as drafter_module
from engine import LLM, SamplingParams
from engine.request import RequestStatus
from engine.structured import StructuredOutputsParams as S
from tests.engine_testing import run_finished

ENGINE = dict(dtype="float32", num_kv_blocks=256, block_size=4, num_threads=1)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 4,
}
REGEX = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,4})?"
CHOICES = ["yes", "no", "maybe so", 'a "quoted" one']
LARK = 'start: item (", " item)~0..2\nitem: "cat" | "dog" | NUMBER\nNUMBER: /[1-9][0-9]?/'
LARK_AS_REGEX = r"(cat|dog|[1-9][0-9]?)(, (cat|dog|[1-9][0-9]?)){0,2}"
BOUNDED = {
    "person": S(json=PERSON),
    "points": S(json=json.dumps(POINTS)),
    "regex": S(regex=REGEX),
    "choice": S(choice=CHOICES),
    "grammar": S(grammar=LARK),
}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, seed=11),
    "filtered": dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=5),
    "penalties": dict(
        temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "logprobs": dict(temperature=0.9, seed=2, logprobs=3),
}
PROMPT = "The record reads:"
MAX_TOKENS = 160


def assert_follows(constraint: S, text: str) -> None:
    kind = constraint.kind.value
    if kind in ("json", "json_object"):
        value = json.loads(text)
        schema = {"type": "object"} if kind == "json_object" else constraint.key()[1]
        jsonschema.validate(value, json.loads(schema) if isinstance(schema, str) else schema)
    elif kind == "regex":
        assert re.fullmatch(constraint.regex, text), text
    elif kind == "choice":
        assert text in constraint.choice
    else:
        assert re.fullmatch(LARK_AS_REGEX, text), text


def _params(constraint: S | None, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, **kw}, structured_outputs=constraint)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model, **ENGINE)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    from modelkit.make_model import make_model

    return str(make_model("tiny-mtp", tmp_path_factory.mktemp("models") / "tiny-mtp"))


@pytest.mark.parametrize("mode", SAMPLING)
def test_every_output_follows_its_constraint(llm, mode):
    cases = BOUNDED
    outs = llm.generate([PROMPT] * len(cases), [_params(c, **SAMPLING[mode]) for c in cases.values()])
    eos = llm.engine.eos_token_ids
    for (name, constraint), out in zip(cases.items(), outs, strict=True):
        assert out.finish_reason == "stop" and out.token_ids[-1] in eos, (name, out.text)
        assert_follows(constraint, out.text)
        if mode == "logprobs":  # the raw model's logprobs of what was sampled: finite
            assert len(out.logprobs) == len(out.token_ids)
            for token, entry in zip(out.token_ids, out.logprobs, strict=True):
                assert token in entry and all(lp > float("-inf") for lp in entry.values())


def test_any_json_object(llm):
    """json_object is unbounded (a random model may never close its first key), so a logit bias
    on "}" makes it close: the mask comes first, so the bias cannot add anything the constraint
    refuses (the "}" before the "{")."""
    close = llm.tokenizer.encode("}", add_special_tokens=False)
    outs = llm.generate(
        [PROMPT] * 2,
        [
            _params(S(json_object=True), temperature=0.0, logit_bias={close[0]: 100.0}),
            _params(S(json_object=True), temperature=1.0, seed=4, logit_bias={close[0]: 100.0}),
        ],
    )
    for out in outs:
        assert out.finish_reason == "stop" and out.text == "{}"


def test_many_samples_hold(llm):
    """50 seeded samples each of a regex and a choice constraint."""
    params = [_params(S(regex=REGEX), temperature=1.0, seed=s) for s in range(25)]
    params += [_params(S(choice=CHOICES), temperature=1.0, seed=s) for s in range(25)]
    params += [_params(S(regex=REGEX), temperature=1.2, top_k=100, seed=100 + s) for s in range(25)]
    params += [_params(S(choice=CHOICES), temperature=1.2, top_p=0.95, seed=100 + s) for s in range(25)]
    outs = llm.generate(["A"] * len(params), params)
    for p, out in zip(params, outs, strict=True):
        assert_follows(p.structured_outputs, out.text)
    assert len({o.text for o in outs if o.text in CHOICES}) > 1  # sampling, not one forced answer


def test_a_seeded_constrained_request_samples_the_same_alone_and_in_a_batch(llm):
    params = _params(S(json=PERSON), temperature=1.0, seed=42)
    (alone,) = llm.generate([PROMPT], [params])
    batch = llm.generate(["x", PROMPT, PROMPT], [_params(None, temperature=1.0, seed=1), params, params])
    assert batch[1].token_ids == batch[2].token_ids == alone.token_ids


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_unconstrained_neighbours_get_the_same_tokens(llm, mode):
    plain = [_params(None, **SAMPLING[mode], ignore_eos=True) for _ in range(3)]
    prompts = ["One", "Two three", "Four five six"]
    alone = llm.generate(prompts, plain)
    mixed = llm.generate(
        [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]],
        [plain[0], _params(S(json=PERSON), **SAMPLING[mode]), plain[1], _params(S(regex=REGEX)), plain[2]],
    )
    assert [o.token_ids for o in (mixed[0], mixed[2], mixed[4])] == [o.token_ids for o in alone]
    assert_follows(S(json=PERSON), mixed[1].text)


def test_a_complete_constraint_ends_the_request(llm):
    """Once nothing but EOS may follow, the request ends with finish_reason stop: by sampling EOS,
    or at once when EOS would not end it (ignore_eos, or short of min_tokens)."""
    outs = llm.generate(
        [PROMPT] * 3,
        [
            _params(S(choice=["done"]), temperature=0.0),
            _params(S(choice=["done"]), temperature=0.0, ignore_eos=True),
            _params(S(choice=["done"]), temperature=0.9, seed=1, min_tokens=20),
        ],
    )
    assert [o.text for o in outs] == ["done"] * 3 and [o.finish_reason for o in outs] == ["stop"] * 3
    assert outs[0].token_ids[-1] in llm.engine.eos_token_ids
    assert not set(outs[1].token_ids) & set(llm.engine.eos_token_ids)


def test_the_compile_cache_is_hit_the_second_time(llm):
    compiler = llm.engine.structured.compiler
    schema = {
        "type": "object",
        "properties": {"seen": {"enum": ["once", "twice"]}},
        "required": ["seen"],
        "additionalProperties": False,
    }
    hits, misses = compiler.hits, compiler.misses
    core = llm.engine
    core.add_request("cache-1", [5, 6, 7], _params(S(json=schema), temperature=0.0))
    assert (compiler.hits, compiler.misses) == (hits, misses + 1)
    run_finished(core)
    core.add_request("cache-2", [8, 9], _params(S(json=json.dumps(schema, indent=1)), temperature=0.0))
    assert (compiler.hits, compiler.misses) == (hits + 1, misses + 1)
    assert_follows(S(json=schema), run_finished(core)["cache-2"].text)


def test_a_slow_compile_does_not_stall_the_other_requests(llm):
    """The constrained request waits (held, outside the scheduler) while its grammar compiles; the
    engine steps the others to the end meanwhile, with the tokens they get alone."""
    core = llm.engine
    compiler = core.structured.compiler
    gate = threading.Event()
    real = compiler.compile_fn
    compiler.compile_fn = lambda key: (gate.wait(), real(key))[1]
    try:
        plain = _params(None, temperature=0.0, max_tokens=12, ignore_eos=True)
        (reference,) = llm.generate(prompt_token_ids=[[11, 12, 13]], sampling_params=plain)
        slow = core.add_request("slow", [4, 5, 6], _params(S(regex="[a-f]{1,6}-slow"), temperature=0.0))
        core.add_request("other", [11, 12, 13], plain)
        finished = run_finished(core, steps=plain.max_tokens + 5)
        assert set(finished) == {"other"} and finished["other"].token_ids == reference.token_ids
        assert core.structured.num_held == 1 and core.has_unfinished_requests()
        assert slow.status is RequestStatus.WAITING and slow.grammar is None and not slow.output_token_ids
        assert slow not in core.scheduler.waiting and slow not in core.scheduler.running
        gate.set()
        out = run_finished(core)["slow"]
    finally:
        compiler.compile_fn = real
        gate.set()
    assert out.finish_reason == "stop" and re.fullmatch("[a-f]{1,6}-slow", out.text)


def test_an_invalid_constraint_is_refused(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is not a valid regular expression"):
        llm.generate([PROMPT], [_params(S(regex="[unclosed"))])
    # Past validate (a caller that skips it): the request ends as aborted, the others go on.
    core = llm.engine
    core.add_request("bad", [4, 5], _params(S(grammar="start: missing_rule")))
    core.add_request("good", [4, 5], _params(S(choice=CHOICES), temperature=0.0))
    finished = run_finished(core)
    assert finished["bad"].finish_reason == "abort" and finished["bad"].token_ids == []
    assert finished["good"].text in CHOICES


def test_preemption_keeps_the_matcher_with_the_request(tiny_model, llm):
    params = [_params(c, temperature=0.0, max_tokens=90) for c in BOUNDED.values()]
    params += [_params(S(json=PERSON), temperature=1.0, seed=s, max_tokens=90) for s in range(6)]
    reference = llm.generate([PROMPT] * len(params), params)
    assert all(r.finish_reason == "stop" for r in reference)
    # A cache this small (one request's worth) preempts and recomputes requests mid-output.
    small = LLM(tiny_model, **{**ENGINE, "num_kv_blocks": 25})
    outs = small.generate([PROMPT] * len(params), params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_a_continued_request_rebuilds_its_matcher_from_the_tokens_it_brings(llm, mode):
    """A decode worker continues a request after tokens sampled elsewhere (begin_import): its
    matcher starts from those tokens. Here the KV is recomputed instead of transferred."""
    core = llm.engine
    params = _params(S(json=PERSON), **SAMPLING[mode])
    prompt = core.tokenizer.encode(PROMPT)
    (whole,) = llm.generate(prompt_token_ids=[prompt], sampling_params=[params])
    head = whole.token_ids[:3]
    req = core.begin_import("continued", prompt, head, params)
    core.handover.recompute_import("continued")
    out = run_finished(core)["continued"]
    assert out.token_ids[:3] == head and req.grammar is not None
    assert_follows(S(json=PERSON), out.text)
    if mode == "greedy":  # (seeded, the continuation's generator starts afresh: other draws)
        assert out.token_ids == whole.token_ids


def test_a_continued_request_whose_tokens_break_the_constraint_is_aborted(llm):
    core = llm.engine
    prompt = core.tokenizer.encode(PROMPT)
    bad_first = core.tokenizer.encode("x", add_special_tokens=False)  # JSON starts with "{"
    core.begin_import("broken", prompt, bad_first, _params(S(json=PERSON)))
    core.handover.recompute_import("broken")
    out = run_finished(core)["broken"]
    assert out.finish_reason == "abort" and out.token_ids == bad_first


# ---- speculative decoding --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_reference(mtp_model):
    params = [_params(c, temperature=0.0) for c in BOUNDED.values()]
    return params, LLM(mtp_model, **ENGINE).generate([PROMPT] * len(params), params)


def _draft_with(monkeypatch, choose) -> None:
    """Replace the MTP layer's drafts: choose(request, position of its first draft, k) -> drafts."""
    real = drafter_module.draft_with_mtp

    def fake(runner, items, batch, hidden, out):
        real(runner, items, batch, hidden, out)  # keeps the MTP cache filled as usual
        for it in items:
            req = it.request
            if req.request_id in out.drafts:
                done = req.num_output_tokens + len(out.sampled.get(req.request_id, []))
                out.drafts[req.request_id] = choose(req, done, len(out.drafts[req.request_id]))

    monkeypatch.setattr("engine.runner.draft_with_mtp", fake)


@pytest.mark.parametrize(
    "k, drafts", [(1, "mtp"), (3, "mtp"), (1, "oracle"), (3, "oracle"), (3, "wrong-at-1")]
)
def test_greedy_with_mtp_equals_constrained_greedy_without(mtp_model, spec_reference, monkeypatch, k, drafts):
    """Drafts from the MTP layer (random weights: rarely right), from the reference continuation
    (all accepted: the matcher is advanced over drafts for their masks), or wrong at position 1."""
    params, reference = spec_reference
    truth = {i: r.token_ids for i, r in enumerate(reference)}
    if drafts != "mtp":

        def choose(req, done, n):
            out = list(truth[int(req.request_id)][done : done + n])
            if drafts == "wrong-at-1" and len(out) > 1:
                out[1] = (out[1] + 1) % 4096
            return out

        _draft_with(monkeypatch, choose)
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **ENGINE)
    outs = llm.generate([PROMPT] * len(params), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for p, out in zip(params, outs, strict=True):
        assert_follows(p.structured_outputs, out.text)
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if drafts == "oracle":
        assert stats.acceptance_rate == 1.0
    if drafts == "wrong-at-1":
        assert stats.num_accepted_tokens > 0 and stats.per_position()[1] == 0.0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_drafts_the_constraint_refuses_are_never_accepted(mtp_model, spec_reference, monkeypatch):
    """Every draft is a token no constraint here allows (a bell): none is accepted, and
    the tokens are those without speculation."""
    params, reference = spec_reference
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    refused = llm.tokenizer.encode("\x07", add_special_tokens=False)[0]  # a bell: in no output here
    _draft_with(monkeypatch, lambda req, done, n: [refused] * n)
    outs = llm.generate([PROMPT] * len(params), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0


def test_sampled_constrained_requests_speculate_and_hold(mtp_model):
    llm = LLM(mtp_model, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    cases = list(BOUNDED.values())
    outs = llm.generate(
        [PROMPT] * len(cases), [_params(c, temperature=0.9, top_p=0.95, seed=i) for i, c in enumerate(cases)]
    )
    for constraint, out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop"
        assert_follows(constraint, out.text)
    assert llm.engine.spec_stats.num_drafts > 0
