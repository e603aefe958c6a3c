"""Speculative decoding settings, parsed from `speculative_config={"method": "mtp", ...}`."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 8
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    """Only "mtp": drafts come from the checkpoint's multi-token-prediction layer."""
    num_speculative_tokens: int = 1
    """Draft tokens per step (k); the MTP layer is reused for k > 1."""
    disable_by_batch_size: int | None = None
    """A step that runs at least this many requests drafts nothing (its MTP cache rows are still
    written, so drafting resumes when the batch shrinks): where verification is compute-bound,
    large batches decode faster one token at a time. None: always draft."""
    draft_vocab: str | None = None
    """A draft vocabulary file (engine/spec_decode/draft_vocab.py, `pdserve draft-vocab`): drafts
    are the argmax over its tokens' logits alone. None: over the whole vocabulary."""

    @staticmethod
    def parse(raw: dict | None) -> SpeculativeConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        unknown = set(raw) - {"method", "num_speculative_tokens", "disable_by_batch_size", "draft_vocab"}
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {sorted(unknown)}")
        method = raw.get("method", "mtp")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        k = raw.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        limit = raw.get("disable_by_batch_size")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 2):
            raise ValueError(f"disable_by_batch_size must be an integer >= 2 or None, got {limit!r}")
        vocab = raw.get("draft_vocab")
        if vocab is not None and (not isinstance(vocab, str) or not 0 < len(vocab) <= MAX_PATH_CHARS):
            raise ValueError(f"draft_vocab must be a file path of 1 to {MAX_PATH_CHARS} characters or None")
        return SpeculativeConfig(method, k, limit, vocab)
