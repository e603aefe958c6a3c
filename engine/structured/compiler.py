"""Constraints to grammars, and grammars compiled against the model's vocabulary, off the engine thread.

The grammar library is llguidance (MIT, Microsoft/guidance-ai; the structured-output engine of
OpenAI's API, vLLM, SGLang and llama.cpp). Chosen over xgrammar because it is a self-contained
Rust wheel with no Python dependencies, so it installs next to the pinned CPU torch without
pulling transformers, triton or a CUDA build (xgrammar's wheel requires torch, transformers and
triton), and because it computes masks lazily from a token trie: a new schema compiles in about a
millisecond, with no per-schema precomputation over the vocabulary. It reads the HF `tokenizers`
JSON itself (byte-level BPE included: token strings are mapped back to their bytes) and gives a
matcher per request with the operations speculative decoding needs (masks after draft tokens,
rollback).

Threads: `GrammarCompiler.submit` is called by the engine thread and returns a future; the
compile (and, the first time, building the tokenizer's token trie) runs on the compiler's own
thread. llguidance releases the GIL while it builds, so the engine keeps stepping meanwhile.
Compiled grammars are cached by (kind, text) in an LRU bounded by bytes; a request gets a fresh copy
of the cached matcher (`LLMatcher.deep_copy`), which shares the compiled grammar.

The router checks a constraint before any worker sees it (`ConstraintChecker`): the same matcher
built against the same vocabulary under the same limits (`LIMITS`, `build_matcher`), so a request
the router accepts compiles and takes its first step on a worker. What fails later (a constraint
that grows past the per-step limits after some tokens) ends the request with an error the client
sees (engine/structured/manager.py).

JSON is generated without free whitespace (llguidance's `whitespace_flexible: false`: `,` and `:`
with nothing around them, as OpenAI's structured outputs): a model may otherwise fill its
max_tokens with blanks. A schema's own `x-guidance` options override that.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import tokenizers

from engine.structured.params import ConstraintKind, StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20
"""What the compiled grammars kept may take (least recently used dropped first), in the estimate
of `grammar_bytes`: bounded by memory, not by count (370 distinct costly schemas once took a
worker from 0.4 to 2 GB)."""
MAX_ERROR_CHARS = 500
"""Longest library error message passed on to the client."""
INITIAL_LEXER_FUEL = 200_000
"""llguidance's budget for building a grammar's lexer (its `initial_lexer_fuel`; the library's
default is 1,000,000): the cost of a constraint, measured as the library measures it rather than
by its length. A schema of 1,500 `format: uri` strings (55 K characters) needs ~750 K and took
0.85-1.2 s of a core to check; at 200 K it is refused in ~0.1 s. A 60-property object schema with
dates and enums needs ~6 K, 100 uri strings ~50 K."""
LIMITS = llguidance.LLParserLimits(verbose_errors=False, initial_lexer_fuel=INITIAL_LEXER_FUEL)
"""The limits every matcher is built and run under: the router's check and the workers' compile
take the same, so what the router accepts a worker compiles."""
_JSON_DEFAULTS = {"whitespace_flexible": False}

GrammarKey = tuple[ConstraintKind, str]


def grammar_text(key: GrammarKey) -> str:
    """llguidance's grammar for a constraint key (StructuredOutputsParams.key). ValueError for a
    schema that is not a JSON object."""
    kind, text = key
    if kind is ConstraintKind.JSON:
        if text in ("true", "false"):  # boolean schemas take no options: true is the empty schema
            return llguidance.LLMatcher.grammar_from_json_schema("{}" if text == "true" else text)
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=_JSON_DEFAULTS)
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind is ConstraintKind.CHOICE:
        # One Lark alternative per choice, each a JSON string literal (Lark reads the same escapes).
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
        )
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.grammar_from("grammar", text)  # Lark as is, GBNF converted to Lark
    raise AssertionError(kind)


def _field_error(field: str, kind: ConstraintKind, message: str) -> ValueError:
    what = {
        ConstraintKind.JSON: "JSON schema",
        ConstraintKind.JSON_OBJECT: "JSON object constraint",
        ConstraintKind.REGEX: "regular expression",
        ConstraintKind.CHOICE: "choice",
        ConstraintKind.GRAMMAR: "grammar",
    }[kind]
    message = re.sub(r"\s+", " ", message).strip()
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return ValueError(f"{field} is not a valid {what}: {message}")


def tokenizer_json(raw: str) -> str:
    """The HF tokenizer.json text llguidance builds its vocabulary from, without padding or
    truncation (they would change what a token string encodes to)."""
    config = json.loads(raw)
    config["padding"] = None
    config["truncation"] = None
    return json.dumps(config)


def vocabulary(
    hf_tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it (a fraction of a second for 32k tokens)."""
    return llguidance.LLTokenizer(
        tokenizer_json(hf_tokenizer.to_str()), n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )


def _set_bits(mask: bytes) -> Iterator[int]:
    """The token ids a bitmask allows (bit i of byte j: token 8j + i), in order."""
    for j, byte in enumerate(mask):
        while byte:
            low = byte & -byte
            yield 8 * j + low.bit_length() - 1
            byte ^= low


def build_matcher(tokenizer: llguidance.LLTokenizer, key: GrammarKey, where: str) -> llguidance.LLMatcher:
    """The constraint's matcher under LIMITS, or a ValueError naming `where` (the field holding the
    constraint's value): the grammar refused, past the limits when built (its lexer's cost), failing
    at its first tokens (a copy computes the first mask, takes an allowed token and computes the
    next mask: past the per-step limits there, a request would fail at once), or allowing nothing
    but the end (it accepts only the empty string: a request would stop with no output). What the
    router checks before it accepts a request and what a worker compiles are this, with the same
    limits; what fails later ends the request with an error its client sees."""
    kind = key[0]
    try:
        grammar = grammar_text(key)
    except ValueError as e:
        raise _field_error(where, kind, str(e)) from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise _field_error(where, kind, matcher.get_error())
    mask = matcher.compute_bitmask()  # the first token's; the template matcher stays at the start
    if matcher.is_error():
        raise _field_error(where, kind, f"fails at its first token: {matcher.get_error()}")
    eos = set(tokenizer.eos_tokens)
    first = next((t for t in _set_bits(mask) if t not in eos), None)
    if first is None:
        raise _field_error(where, kind, "it accepts only the empty string")
    # One step on a throw-away copy: the per-step limits bite as the first token is taken
    # (a $ref needed at every level, a row of 1,000+ optional properties).
    probe = matcher.deep_copy()
    if not probe.consume_token(first) or probe.is_error():
        raise _field_error(where, kind, f"fails at its first token: {probe.get_error()}")
    probe.compute_bitmask()
    if probe.is_error():
        raise _field_error(where, kind, f"fails at its second token: {probe.get_error()}")
    return matcher


def grammar_bytes(key: GrammarKey) -> int:
    """Estimated memory of a compiled matcher for a constraint, for the cache's bound: 256 KiB plus
    64 bytes per character of its grammar (measured on the tiny model's 4k vocabulary: ~0.4 MB for
    a 60-property schema of 2.4 K grammar characters, ~2.8 MB for 1,500 uri strings, 50 K; a larger
    vocabulary costs more per lexer state, and the estimate errs high)."""
    return (256 << 10) + 64 * (len(key[1]) + 16)


class ConstraintChecker:
    """The router's check of a constraint before it accepts a request (`check`): the matcher a
    worker would build (build_matcher, the same limits), against the model's vocabulary. Verdicts
    are cached by the constraint's key, bounded by bytes (a digest and the error, not the schema
    or the grammar); a check that takes longer than `budget_s` of its thread is refused as too
    costly. Thread-safe: the router runs checks on its grammar threads."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int],
        budget_s: float = 2.0,
        cache_bytes: int = 4 << 20,
    ):
        self._hf_tokenizer = hf_tokenizer
        self.eos_token_ids = [t for t in eos_token_ids if t is not None]
        self.budget_s = budget_s
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._verdicts: OrderedDict[bytes, tuple[str | None, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                hf = self._hf_tokenizer
                self._tokenizer = vocabulary(
                    hf, hf.get_vocab_size(with_added_tokens=True), self.eos_token_ids
                )
            return self._tokenizer

    def check(
        self, params: StructuredOutputsParams, field: str = "structured_outputs", where: str | None = None
    ) -> None:
        """Raise ValueError naming the field when the constraint is malformed (`where`, default
        field.kind, for its value, as StructuredOutputsParams.validate) or build_matcher refuses
        it, or when building it took longer than the budget."""
        params.validate(field, where)
        key = params.key()
        where = where or f"{field}.{key[0].value}"
        digest = hashlib.sha256(f"{key[0].value}:{key[1]}".encode()).digest()
        with self._lock:
            verdict = self._verdicts.get(digest)
            if verdict is not None:
                self._verdicts.move_to_end(digest)
                self.hits += 1
        if verdict is None:
            self.misses += 1
            error = self._judge(key)
            with self._lock:
                if digest not in self._verdicts:
                    size = 128 + len(error or "")
                    self._verdicts[digest] = (error, size)
                    self._bytes += size
                    while self._bytes > self.cache_bytes:
                        self._bytes -= self._verdicts.popitem(last=False)[1][1]
        else:
            error = verdict[0]
        if error is not None:
            raise ValueError(error.replace("{where}", where, 1))

    def _judge(self, key: GrammarKey) -> str | None:
        """The verdict on a constraint: None (accepted) or its error, "{where}" standing for the
        field it came in."""
        tokenizer = self.tokenizer
        start = time.thread_time()
        try:
            build_matcher(tokenizer, key, "{where}")
        except ValueError as e:
            return str(e)
        took = time.thread_time() - start
        if took > self.budget_s:
            return str(
                _field_error(
                    "{where}",
                    key[0],
                    f"it took {took:.1f} s of CPU to build, more than the budget of {self.budget_s:.1f} s",
                )
            )
        return None


class GrammarCompiler:
    """Compiles constraints into llguidance matchers on one background thread, cached by key.

    Contract: `submit`, `stats` and the matchers handed out belong to the engine thread; the
    compile thread only builds the tokenizer and the cached template matchers, which nobody
    advances (a request advances its own deep copy)."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_bytes: int = CACHE_BYTES,
    ):
        """hf_tokenizer: the model's (engine.tokenizer.Tokenizer.tokenizer); vocab_size: the
        model's (the logits' width, at least the tokenizer's); eos_token_ids: the tokens that end
        a request, allowed once the constraint is complete."""
        if not eos_token_ids:
            raise ValueError("structured output needs at least one EOS token id")
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self.cached_bytes = 0
        """grammar_bytes of the grammars kept (compiled or compiling)."""
        self._lock = threading.Lock()  # the cache: futures complete on the compile thread
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        """Submits answered from the cache (compiled, or compiling for an earlier request)."""
        self.misses = 0
        """Submits that started a compile."""
        self.compile_fn: Callable[[GrammarKey], llguidance.LLMatcher] = self._compile
        """What runs on the compile thread (tests slow it down to watch the engine go on)."""

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it: built once (a fraction of a second for 32k tokens)."""
        if self._tokenizer is None:
            self._tokenizer = vocabulary(self._hf_tokenizer, self.vocab_size, self.eos_token_ids)
        return self._tokenizer

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of a fresh matcher for the constraint (its result: an `LLMatcher` the caller
        owns; its exception: a ValueError naming structured_outputs)."""
        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                template = self._pool.submit(self.compile_fn, key)
                template.add_done_callback(lambda f, key=key: self._forget_failed(key, f))
                self._cache[key] = template
                self.cached_bytes += grammar_bytes(key)
                while self.cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    dropped, _ = self._cache.popitem(last=False)
                    self.cached_bytes -= grammar_bytes(dropped)
        out: Future = Future()
        if template.done():
            _copy_into(template, out)
        else:
            template.add_done_callback(lambda f: _copy_into(f, out))
        return out

    def _forget_failed(self, key: GrammarKey, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]
                    self.cached_bytes -= grammar_bytes(key)

    def _compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        matcher = build_matcher(self.tokenizer, key, f"structured_outputs.{key[0].value}")
        logger.debug("compiled a %s constraint of %d characters", key[0].value, len(key[1]))
        return matcher


def _copy_into(template: Future, out: Future) -> None:
    """Resolve out with a deep copy of the template matcher (or its error)."""
    error = template.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(template.result().deep_copy())
