"""Who speculates, and how well it goes: draft / accepted counts per draft position."""

from __future__ import annotations

from engine.sampling_params import SamplingParams


def speculation_allowed(params: SamplingParams) -> bool:
    """Drafts are verified against the plain sampling distribution; requests whose next-token
    distribution depends on per-token state (penalties, min_tokens, logit_bias) or that want
    logprobs decode one token at a time instead."""
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.min_tokens == 0
        and not params.logit_bias
        and params.logprobs is None
        and params.prompt_logprobs is None
    )


class SpecStats:
    def __init__(self, k: int):
        self.num_drafts = 0
        """Verification steps (one per request per step that had drafts)."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_at = [0] * k
        """accepted_at[i]: steps whose draft i was accepted."""

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_at]
