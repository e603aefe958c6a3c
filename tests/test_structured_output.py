"""Structured output's parts, without a model: the constraint parameters and their checks, the
grammar compiler and its cache, the vocabulary llguidance builds from the byte-level BPE
tokenizer, and the token bitmask (filled by the library, applied to the logits in one pass).
The engine end to end is tests/test_structured_engine.py."""

from __future__ import annotations

import json
import threading

import llguidance
import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputsParams as S
from engine.structured.bitmask import TokenBitmask, fill_bitmask, unpack, words_per_row
from engine.structured.compiler import ConstraintChecker, GrammarCompiler, grammar_bytes
from engine.structured.params import MAX_CHOICES, MAX_STRUCTURED_OUTPUT_CHARS
from engine.tokenizer import Tokenizer

EOS = 1  # the tiny tokenizer's <｜end▁of▁sentence｜>
_ENUM_WRAPPER = '{"enum":[""]}'  # around the one string of an enum schema, in compact JSON


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.tokenizer, tokenizer.vocab_size, [EOS])


@pytest.fixture
def checker(tokenizer) -> ConstraintChecker:
    return ConstraintChecker(tokenizer.tokenizer, [EOS])


# ---- parameters and their checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field",
    [
        (S(), "structured_outputs must set exactly one"),
        (S(regex="a", choice=["a"]), "structured_outputs must set exactly one"),
        (S(regex=""), "structured_outputs.regex must be a non-empty string"),
        (S(grammar=3), "structured_outputs.grammar must be a non-empty string"),
        (S(choice=[]), "structured_outputs.choice must be a non-empty list"),
        (S(choice=["a", 1]), "structured_outputs.choice must be a non-empty list"),
        (S(choice=["x"] * (MAX_CHOICES + 1)), f"more than the limit of {MAX_CHOICES}"),
        (S(json="{not json"), "structured_outputs.json is not valid JSON"),
        (S(json=[1, 2]), "structured_outputs.json must be a JSON schema"),
        (S(json_object="yes"), "structured_outputs.json_object must be true or false"),
        (S(regex="a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)), f"limit of {MAX_STRUCTURED_OUTPUT_CHARS}"),
        (
            S(json={"enum": ["x" * MAX_STRUCTURED_OUTPUT_CHARS]}),
            f"structured_outputs.json has {len(_ENUM_WRAPPER) + MAX_STRUCTURED_OUTPUT_CHARS} characters",
        ),
    ],
    ids=lambda v: None if isinstance(v, S) else v[:30],
)
def test_malformed_constraints_are_value_errors_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        SamplingParams(structured_outputs=params).validate(4096)


def test_structured_outputs_must_be_typed():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"json": {}}).validate(4096)


@pytest.mark.parametrize(
    "params, message",
    [
        (S(regex="a(b"), "structured_outputs.regex is not a valid regular expression: .*unclosed group"),
        (S(json={"type": "objx"}), "structured_outputs.json is not a valid JSON schema: .*objx"),
        (S(json={"$ref": "#/$defs/missing"}), "structured_outputs.json is not a valid JSON schema"),
        (S(json=False), "structured_outputs.json is not a valid JSON schema: .*false"),
        (
            S(grammar="start: nothing_here"),
            "structured_outputs.grammar is not a valid grammar: .*nothing_here",
        ),
    ],
)
def test_the_library_refuses_invalid_constraints_naming_the_field(params, message, compiler, checker):
    with pytest.raises(ValueError, match=message):
        checker.check(params)
    with pytest.raises(ValueError, match=message.replace("structured_outputs", "response_format", 1)):
        checker.check(params, "response_format", f"response_format.{params.kind.value}")
    with pytest.raises(ValueError, match=message):  # the engine's compile says the same
        compiler.submit(params).result()


def test_valid_constraints_pass_the_check(checker):
    for params in (
        S(
            json={
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "title": "T",
                "description": "d",
            }
        ),
        S(json='{"type": "string", "maxLength": 3}'),
        S(json=True),
        S(json_object=True),
        S(regex=r"[0-9]{3}"),
        S(choice=['say "hi"', "a\\b", "日本"]),
        S(grammar='start: "a" | "b"'),
        S(grammar='root ::= "a" [0-9]'),  # GBNF
    ):
        checker.check(params)


def test_the_cache_key_is_the_schema_not_its_spelling():
    compact = S(json={"type": "object", "properties": {"b": {}, "a": {}}})
    spaced = S(json='{ "type" : "object",\n "properties": {"b": {}, "a": {}} }')
    reordered = S(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert compact.key() == spaced.key()
    assert compact.key() != reordered.key()  # property order is generation order


# ---- the compiler ----------------------------------------------------------------------------------


def test_compiles_are_cached_by_constraint(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    first = compiler.submit(S(json=schema)).result()
    assert (compiler.hits, compiler.misses) == (0, 1)
    second = compiler.submit(S(json=json.dumps(schema, indent=2))).result()
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.submit(S(regex="[0-9]+")).result()
    assert (compiler.hits, compiler.misses) == (1, 2)
    # Each request owns its matcher: advancing one leaves the other where it was.
    assert first is not second
    assert first.consume_tokens(compiler.tokenizer.tokenize_str('{"n":'))
    assert second.validate_tokens(compiler.tokenizer.tokenize_str("{")) == 1
    assert second.validate_tokens(compiler.tokenizer.tokenize_str("1")) == 0


def test_failed_compiles_are_not_cached(compiler):
    for _ in range(2):
        with pytest.raises(ValueError):
            compiler.submit(S(regex="(")).result()
    assert compiler.misses == 2


def test_the_cache_is_bounded_by_bytes(tokenizer):
    two = 2 * grammar_bytes((S(regex="a").kind, "a"))
    compiler = GrammarCompiler(tokenizer.tokenizer, tokenizer.vocab_size, [EOS], cache_bytes=two)
    for pattern in ("a", "b", "c", "a"):
        compiler.submit(S(regex=pattern)).result()
    assert (compiler.hits, compiler.misses) == (0, 4)  # "a" was dropped when "c" came in
    assert compiler.cached_bytes == two


def test_a_compile_in_flight_serves_every_request_for_it(compiler):
    gate = threading.Event()
    real = compiler.compile_fn
    compiler.compile_fn = lambda key: (gate.wait(), real(key))[1]
    futures = [compiler.submit(S(regex="x+")) for _ in range(3)]
    assert not any(f.done() for f in futures)
    gate.set()
    matchers = [f.result() for f in futures]
    assert (compiler.hits, compiler.misses) == (2, 1) and len({id(m) for m in matchers}) == 3


# ---- the vocabulary as llguidance sees it ----------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte has a printable stand-in character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def test_the_vocabulary_is_the_byte_level_bpe_tokens_bytes(tokenizer, compiler):
    decoder = _byte_decoder()
    lltok = compiler.tokenizer
    assert lltok.vocab_size == tokenizer.vocab_size and lltok.eos_tokens == [EOS]
    added = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()}
    for text, token_id in tokenizer.tokenizer.get_vocab(with_added_tokens=True).items():
        token_bytes = None if text in added else bytes(decoder[c] for c in text)
        if token_bytes is None or token_bytes.startswith(b"\xff"):
            # Added tokens are special; so is a token starting with byte 0xFF, llguidance's
            # special-token marker, which no UTF-8 text contains.
            assert lltok.is_special_token(token_id), text
        else:
            assert lltok.decode_bytes([token_id]) == token_bytes, (token_id, text)
    # Multi-byte characters split across tokens come back whole.
    text = 'naïve {"ключ": "値"} 🙂'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert lltok.decode_bytes(ids).decode("utf-8") == text == tokenizer.decode(ids)


def test_a_model_vocabulary_wider_than_the_tokenizer_never_allows_the_extra_ids(tokenizer):
    wide = tokenizer.vocab_size + 40  # a padded embedding, as real checkpoints have
    compiler = GrammarCompiler(tokenizer.tokenizer, wide, [EOS])
    matcher = compiler.submit(S(regex=".{1,3}")).result()
    mask = fill_bitmask(llguidance.LLExecutor(1), [(matcher, 0, [])], wide, [EOS])
    allowed = unpack(mask.bits, wide)[0]
    assert allowed[: tokenizer.vocab_size].any() and not allowed[tokenizer.vocab_size :].any()


# ---- the bitmask ---------------------------------------------------------------------------------


def _loop_apply(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    """The reference: one token at a time."""
    out = logits.clone()
    for r, row in enumerate(rows):
        for t in range(out.shape[1]):
            word = t // 32
            allowed = word < bits.shape[1] and (int(bits[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("every_row", [False, True], ids=["some-rows", "every-row"])
@pytest.mark.parametrize(
    "vocab, width", [(1, 1), (31, 31), (32, 32), (33, 33), (100, 100), (64, 70)], ids=lambda v: str(v)
)
def test_apply_equals_the_token_by_token_reference(vocab, width, every_row):
    gen = torch.Generator().manual_seed(vocab)
    words = words_per_row(vocab)
    bits = torch.randint(-(2**31), 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[1] = -1  # everything allowed
    bits[2, 0] = -(2**31)  # only bit 31 (the sign bit) of the first word
    logits = torch.randn(3 if every_row else 5, width, generator=gen)  # width > 32 W: a padded lm_head
    logits[0, 0] = float("-inf")  # a token already refused stays refused
    rows = [0, 1, 2] if every_row else [4, 0, 2]
    want = _loop_apply(logits, rows, bits)
    got = logits.clone()
    TokenBitmask(rows, bits).apply(got)
    assert torch.equal(got, want)
    if not every_row:
        assert torch.equal(got[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched


def test_select_and_without_renumber_rows():
    bits = torch.arange(3, dtype=torch.int32).unsqueeze(1)  # [3, 1]
    mask = TokenBitmask([7, 2, 5], bits)
    part = mask.select([5, 9, 7])  # a sampler call over logits rows 5, 9, 7 in that order
    assert part.rows == [2, 0] and part.bits.flatten().tolist() == [0, 2]
    assert mask.select([1, 3]) is None
    rest = mask.without([5, 9, 7])
    assert rest.rows == [2] and rest.bits.flatten().tolist() == [1]


def test_fill_masks_drafts_rows_and_leaves_the_matcher_where_it_was(tokenizer, compiler):
    """Draft rows are the masks after each accepted draft; a refused draft stops the filling;
    the matcher is rolled back; a completed constraint allows only EOS."""
    ids = {c: tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcdx"}
    matcher = compiler.submit(S(regex="ab(c|d)")).result()
    executor = llguidance.LLExecutor(1)
    vocab = tokenizer.vocab_size
    mask = fill_bitmask(executor, [(matcher, 3, [ids["a"], ids["x"], ids["c"]])], vocab, [EOS])
    allowed = unpack(mask.bits, vocab)
    assert mask.rows == [3, 4, 5, 6]
    assert allowed[0, ids["a"]] and not allowed[0, ids["b"]]
    assert allowed[1, ids["b"]] and not allowed[1, ids["x"]] and not allowed[1, EOS]
    assert allowed[2].all() and allowed[3].all()  # after the refused "x": never read, left open
    assert matcher.validate_tokens([ids["a"], ids["b"], ids["d"]]) == 3  # nothing was consumed
    assert matcher.consume_tokens([ids["a"], ids["b"], ids["d"]]) and matcher.is_stopped()
    only_eos = unpack(fill_bitmask(executor, [(matcher, 0, [])], vocab, [EOS]).bits, vocab)[0]
    assert only_eos.nonzero().flatten().tolist() == [EOS]
    assert matcher.consume_token(EOS)  # past EOS the library allows nothing: EOS stays allowed
    past = unpack(fill_bitmask(executor, [(matcher, 0, [])], vocab, [EOS]).bits, vocab)[0]
    assert past.nonzero().flatten().tolist() == [EOS]


# ---- what the check refuses before a worker sees it -------------------------------------------------

_REF_EVERY_LEVEL = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}
_REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
_COSTLY = {"type": "array", "prefixItems": [{"type": "string", "format": "uri"}] * 1500, "items": False}


@pytest.mark.parametrize(
    "params, message",
    [
        (
            S(json=_COSTLY),
            r"initial lexer configuration \(grammar\) too big \(limit for this grammar: 200000\)",
        ),
        (S(json=_REF_CYCLE), "fails at its first token"),
        (S(regex="(?:)"), "it accepts only the empty string"),
        (S(json=_REF_EVERY_LEVEL), "fails at its first token: .*Too many items"),
        (S(grammar='start: a\na: "x" a'), "fails at its first token"),
        (
            S(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}),
            "fails at its first token: .*max is 2000",
        ),
    ],
    ids=["costly", "ref-cycle", "empty-only", "ref-every-level", "lark-no-end", "1500-optional"],
)
def test_the_check_refuses_what_would_fail_on_a_worker(params, message, checker, compiler):
    """Each of these compiled under the library's default limits, then ended its request at once
    with finish_reason abort (or, for the $ref cycle, an empty 'stop') and no word to the client."""
    with pytest.raises(ValueError, match=message):
        checker.check(params, "response_format", "response_format.json_schema.schema")
    with pytest.raises(ValueError, match=message):  # a worker's compile says the same
        compiler.submit(params).result()


def test_verdicts_are_cached_by_bytes_and_a_refusal_names_each_field(tokenizer):
    checker = ConstraintChecker(tokenizer.tokenizer, [EOS])
    bad = S(regex="(?:)")
    for field in ("guided_regex", "structured_outputs"):
        with pytest.raises(ValueError, match=f"^{field} is not a valid regular expression"):
            checker.check(bad, field, field)
    assert (checker.hits, checker.misses) == (1, 1)  # judged once, named as each request names it
    accepted = 128  # what an accepted verdict takes: a digest and its bookkeeping
    checker = ConstraintChecker(tokenizer.tokenizer, [EOS], cache_bytes=3 * accepted)
    good = S(regex="[0-9]+")
    checker.check(good)
    checker.check(good)
    assert (checker.hits, checker.misses) == (1, 1)
    for pattern in ("a", "b"):
        checker.check(S(regex=pattern))
    checker.check(good)
    assert checker.misses == 3  # three fit
    checker.check(S(regex="c"))  # drops the least recently used: "a"
    checker.check(good)
    checker.check(S(regex="a"))
    assert checker.misses == 5


def test_a_check_over_its_time_budget_is_refused(tokenizer):
    checker = ConstraintChecker(tokenizer.tokenizer, [EOS], budget_s=0.0)
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters .*more than the budget of 0.0 s"):
        checker.check(S(json={"type": "object"}), "tools", "tools[0].function.parameters")


def test_the_compiled_grammar_cache_stays_within_its_byte_bound(tokenizer):
    """400 distinct 60-property schemas (each compiled matcher ~0.4 MB on this vocabulary; 370
    distinct costly schemas once took a worker from 0.4 to 2 GB): the cache keeps what its byte
    bound allows, by its estimate, and the process's memory grows by about that, not by 400 of them."""

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    bound = 8 << 20
    compiler = GrammarCompiler(tokenizer.tokenizer, tokenizer.vocab_size, [EOS], cache_bytes=bound)
    compiler.submit(S(regex="warm")).result()  # the vocabulary, built once
    before = rss()
    for i in range(400):
        props = {
            f"f{i}_{j}": {"type": "string", "format": "date-time"} if j % 2 else {"type": "integer"}
            for j in range(60)
        }
        compiler.submit(S(json={"type": "object", "properties": props})).result()
        assert compiler.cached_bytes <= bound
    assert len(compiler._cache) < 400 / 4
    assert rss() - before < bound + (48 << 20), (rss() - before) >> 20
