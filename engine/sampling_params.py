"""Per-request sampling parameters, with the validation that guards the engine.

The field names and defaults follow the ones vLLM users know. `validate` raises a `ValueError`
that names the field and the limit; it is called before a request enters the engine, so a bad
request never disturbs the ones already running.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy: dividing logits by ~1e-30 overflows to inf and nan (vLLM's eps)."""
MAX_STOP_STRING_CHARS = 1024
"""Longest stop string: the stream holds back up to this much text while a stop string may start."""
MAX_STOP_TOTAL_CHARS = 16 * MAX_STOP_STRING_CHARS
"""Most characters over all stop strings of a request (each costs O(its length) per request)."""
SEED_RANGE = (-(2**63), 2**64)
"""Seeds torch.Generator.manual_seed accepts (half-open); outside it raises at request start."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep the top_k most likely tokens; -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same samples whatever else is in the batch."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens seen in the prompt or output; 1 disables."""
    presence_penalty: float = 0.0
    """Subtract from the logits of tokens that appear in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token in the output, in [-2, 2]."""
    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Stop tokens (EOS and stop_token_ids) are masked until this many tokens were generated."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the matched string is not included in the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to EOS unless ignore_eos); the token is kept."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (benchmarks)."""
    logprobs: int | None = None
    """Return, per generated token, the sampled token's logprob and the top-N (N <= 20) alternatives."""
    prompt_logprobs: int | None = None
    """Return, per prompt position after the first, the prompt token's logprob and the top-N alternatives."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value in [-100, 100] added to its logit before sampling (OpenAI's logit_bias)."""
    structured_outputs: StructuredOutputsParams | None = None
    """A constraint the output follows (JSON schema, JSON object, regex, choice or grammar): tokens
    it does not allow are masked before sampling, and once it is complete only EOS is."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a mapping of token id to bias, got {type(self.logit_bias).__name__}"
            )
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field that is out of range."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if math.isnan(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        for i, s in enumerate(self.stop):
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop[{i}] has {len(s)} characters, more than the limit of {MAX_STOP_STRING_CHARS}"
                )
        total = sum(map(len, self.stop))
        if total > MAX_STOP_TOTAL_CHARS:
            raise ValueError(
                f"stop strings have {total} characters in all, more than the limit of {MAX_STOP_TOTAL_CHARS}"
            )
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"stop_token_ids entries must be integers >= 0, got {tok!r}")
        for tok, bias in (self.logit_bias or {}).items():
            if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"logit_bias key {tok!r} must be a token id in {limit}")
            if not _is_number(bias) or math.isnan(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{tok}] must be a number in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, "
                    f"got {type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate("structured_outputs")
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if tok >= vocab_size:
                    raise ValueError(
                        f"stop_token_ids entry {tok!r} is outside the vocabulary [0, {vocab_size})"
                    )


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_size: int | None = None,
    num_kv_blocks: int | None = None,
) -> None:
    """Everything about a request that must hold before it enters an engine (the engine and the
    router both call this): raise ValueError naming the field and the limit."""
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    n = len(prompt_token_ids)
    if n > max_model_len:  # first: what follows costs time linear in the prompt
        raise ValueError(f"prompt has {n} tokens, more than max_model_len ({max_model_len})")
    for i, tok in enumerate(prompt_token_ids):
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}] = {tok!r} is outside the vocabulary [0, {vocab_size})")
    params.validate(vocab_size)
    if n + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
            f"exceeds max_model_len ({max_model_len})"
        )
    if block_size is not None and num_kv_blocks is not None:
        blocks = -(-(n + params.max_tokens) // block_size)
        if blocks > num_kv_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {blocks} KV blocks, more than num_kv_blocks ({num_kv_blocks})"
            )
