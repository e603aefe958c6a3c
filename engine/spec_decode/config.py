"""Speculative decoding settings, parsed from `speculative_config={"method": "mtp", ...}`."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    """Only "mtp": drafts come from the checkpoint's multi-token-prediction layer."""
    num_speculative_tokens: int = 1
    """Draft tokens per step (k); the MTP layer is reused for k > 1."""

    @staticmethod
    def parse(raw: dict | None) -> SpeculativeConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        unknown = set(raw) - {"method", "num_speculative_tokens"}
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
        return SpeculativeConfig(method, k)
