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
Compiled grammars are cached by (kind, text) in a bounded LRU; a request gets a fresh copy of the
cached matcher (`LLMatcher.deep_copy`), which shares the compiled grammar.

JSON is generated without free whitespace (llguidance's `whitespace_flexible: false`: `,` and `:`
with nothing around them, as OpenAI's structured outputs): a model may otherwise fill its
max_tokens with blanks. A schema's own `x-guidance` options override that.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import tokenizers

from engine.structured.params import ConstraintKind, StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""
MAX_ERROR_CHARS = 500
"""Longest library error message passed on to the client."""
_JSON_DEFAULTS = {"whitespace_flexible": False}
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

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


def check(
    params: StructuredOutputsParams, field: str = "structured_outputs", where: str | None = None
) -> None:
    """Raise ValueError naming the field when the constraint is malformed or the library refuses it
    (a bad schema, regex or grammar): `where` (default field.kind) for its value, as
    StructuredOutputsParams.validate. Builds the grammar without a vocabulary (about a millisecond
    for a typical schema): the router calls it off its event loop, before any worker sees the request."""
    params.validate(field, where)
    key = params.key()
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(key), None, limits=_LIMITS)
    except ValueError as e:
        error = str(e)
    if error:
        raise _field_error(where or f"{field}.{key[0].value}", key[0], error)


def tokenizer_json(raw: str) -> str:
    """The HF tokenizer.json text llguidance builds its vocabulary from, without padding or
    truncation (they would change what a token string encodes to)."""
    config = json.loads(raw)
    config["padding"] = None
    config["truncation"] = None
    return json.dumps(config)


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
        cache_size: int = CACHE_SIZE,
    ):
        """hf_tokenizer: the model's (engine.tokenizer.Tokenizer.tokenizer); vocab_size: the
        model's (the logits' width, at least the tokenizer's); eos_token_ids: the tokens that end
        a request, allowed once the constraint is complete."""
        if not eos_token_ids:
            raise ValueError("structured output needs at least one EOS token id")
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
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
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer_json(self._hf_tokenizer.to_str()),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids,
            )
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
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
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

    def _compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        field = f"structured_outputs.{key[0].value}"
        try:
            grammar = grammar_text(key)
        except ValueError as e:
            raise _field_error(field, key[0], str(e)) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise _field_error(field, key[0], matcher.get_error())
        logger.debug("compiled a %s constraint of %d characters", key[0].value, len(key[1]))
        return matcher


def _copy_into(template: Future, out: Future) -> None:
    """Resolve out with a deep copy of the template matcher (or its error)."""
    error = template.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(template.result().deep_copy())
