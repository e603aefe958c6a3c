"""Turn one step's logits into one token per running request.

Order per row (vLLM's): structured-output bitmask -> min_tokens mask -> logit_bias -> repetition
penalty -> frequency/presence penalties -> temperature (0: greedy argmax of the penalised logits)
-> min_p -> top_k -> top_p -> sample.
Logprobs are those of the raw model distribution (log_softmax before any of the above), which
is vLLM's default ("raw_logprobs").

The sampler is called every decode step at batch sizes up to a few hundred, so every stage is
skipped when no row uses it and the filters run on the whole batch at once; only the draws of
seeded rows loop over rows, because each must come from its own generator.

Legend: B rows in the batch, V vocabulary size, R rows that sample randomly, S seeded rows,
W top_p candidates, T prompt positions, K (row, token) pairs seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams
from engine.structured.bitmask import TokenBitmask

# Logits a top_p row is first tried on before its row is fully sorted; see _top_k_top_p.
_TOP_P_CANDIDATES = 256
# Rows of prompt logits handled at once: bounds the [rows, V] float32 temporaries (1024 x 129k
# is ~0.5 GB) when a long prompt asks for prompt_logprobs.
_PROMPT_LOGPROBS_CHUNK = 1024


class SamplingRow(Protocol):
    """One row of the batch that samples a token this step (the engine's request)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    """Set when params.seed is not None: seeded with it, owned by the request, advanced only here."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """The sampled token of each row, in row order."""
    logprobs: list[dict[int, float] | None]
    """Per row: None unless params.logprobs is set; else the sampled token's raw logprob plus the
    top params.logprobs tokens (the sampled one first, so it is there even outside the top N)."""


class Sampler:
    """Stateless between calls: everything a row needs lives on the row (its params, tokens so
    far and generator), so a request sampled alone or in any batch gets the same tokens."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        """logits: [B, V'] with V' >= vocab_size (columns past vocab_size, the padding of a
        padded lm_head, are never sampled). Modified in place, as vLLM's sampler does: the model
        runner hands over a fresh buffer each step, and a copy of [256, V] per step is not free.
        bitmask: the allowed tokens of the constrained rows (structured output), numbered as
        these rows; the others are not touched."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        assert logits.shape[1] >= self.vocab_size, (tuple(logits.shape), self.vocab_size)
        logits = logits[:, : self.vocab_size]  # [B, V]
        params = [row.params for row in rows]
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])

        masks = self._min_tokens_masks(rows)
        uses_penalties = any(_has_penalties(p) for p in params)
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        # Taken before anything below edits the logits in place.
        raw_logprobs = (
            torch.log_softmax(logits[wants_logprobs].float(), dim=-1) if wants_logprobs else None
        )  # [len(wants_logprobs), V]
        if bitmask is not None:
            bitmask.apply(logits)
        if not masks and all(_plain_greedy(p) for p in params):
            # The common greedy-decode step: one argmax, nothing else built.
            return SamplerOutput(token_ids=argmax(logits).tolist(), logprobs=[None] * len(rows))

        if masks:
            mask_rows, mask_tokens = zip(*masks, strict=True)
            logits[list(mask_rows), list(mask_tokens)] = float("-inf")
        if biased:
            _apply_logit_bias(logits, [(i, params[i].logit_bias) for i in biased])
        if uses_penalties:
            _apply_penalties(logits, rows)

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [B]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            tokens[greedy] = argmax(logits[greedy])
        if random:
            random_logits = logits if not greedy else logits[random]  # [R, V]
            tokens[random] = _sample(random_logits, [rows[i] for i in random])

        token_ids = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            nums = [params[i].logprobs for i in wants_logprobs]
            chosen = tokens[wants_logprobs]
            for i, entry in zip(wants_logprobs, _top_logprobs(raw_logprobs, chosen, nums), strict=True):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def only_argmax(self, rows: Sequence[SamplingRow]) -> bool:
        """Whether sampling these rows (without a bitmask) is each row's argmax over the first
        vocab_size logits and nothing else: greedy, no logprobs, biases, penalties or min_tokens
        mask. The model runner then takes the argmax from the bf16 logits (DeepseekV2ForCausalLM
        greedy_tokens), the same tokens as this sampler's."""
        return all(_plain_greedy(row.params) for row in rows) and not self._min_tokens_masks(rows)

    def _min_tokens_masks(self, rows: Sequence[SamplingRow]) -> list[tuple[int, int]]:
        """(row, token) pairs to mask: the stop tokens of rows still short of min_tokens.

        EOS counts as a stop token unless ignore_eos, where it is an ordinary token."""
        masks = []
        for i, row in enumerate(rows):
            p = row.params
            if p.min_tokens == 0 or len(row.output_token_ids) >= p.min_tokens:
                continue  # checked in this order: output_token_ids may be a fresh copy
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops.update(self.eos_token_ids)
            masks.extend((i, t) for t in sorted(stops) if 0 <= t < self.vocab_size)
        return masks


def _apply_logit_bias(logits: torch.Tensor, biases: list[tuple[int, dict[int, float]]]) -> None:
    """In place on logits [B, V]: add each row's bias to its listed tokens (one scatter for all)."""
    rows = [i for i, bias in biases for _ in bias]
    cols = [tok for _, bias in biases for tok in bias]
    values = torch.tensor(
        [v for _, bias in biases for v in bias.values()], dtype=logits.dtype, device=logits.device
    )
    logits[rows, cols] += values


def _plain_greedy(p: SamplingParams) -> bool:
    return p.greedy and p.logprobs is None and not p.logit_bias and not _has_penalties(p)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on logits [B, V]. Sparse: only the (row, token) pairs that occur are touched, so
    the cost follows the number of tokens seen, not B x V. A pair is keyed row * V + token, which
    relies on token ids < V (prompts are checked at admission, outputs come from here)."""
    vocab = logits.shape[1]
    device = logits.device
    rep_keys, out_keys, freq, pres = [], [], [], []
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, dtype=torch.long)
            rep_keys.append(i * vocab + seen)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
            out_keys.append(i * vocab + torch.tensor(row.output_token_ids, dtype=torch.long))
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)

    if rep_keys:
        keys = torch.unique(torch.cat(rep_keys)).to(device)  # [K] distinct (row, token) pairs
        row_of, token = keys // vocab, keys % vocab
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[row_of]
        values = logits[row_of, token]
        logits[row_of, token] = torch.where(values > 0, values / penalty, values * penalty).to(logits.dtype)
    if out_keys:
        keys, counts = torch.unique(torch.cat(out_keys), return_counts=True)  # [K], [K]
        keys, counts = keys.to(device), counts.to(device)
        row_of, token = keys // vocab, keys % vocab
        freq_t = torch.tensor(freq, device=device)[row_of]
        pres_t = torch.tensor(pres, device=device)[row_of]
        logits[row_of, token] -= (freq_t * counts + pres_t).to(logits.dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> each row's index of its largest value [B]: the first of equal ones, NaN counting
    as largest, as torch.argmax. Through torch.max, which on CPU ran 2.5-2.7x faster over a
    32k-token vocabulary (1 row 15 against 40 µs, 256 rows 2.0 against 5.2 ms; 2-core Xeon)."""
    return logits.max(dim=-1).indices


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min_p / top_k / top_p, then one draw per row. logits [R, V] (edited in
    place); returns token ids [R].

    Every filter's decision for a row depends on that row alone (never on which path or width
    the rest of the batch asked for), so a seeded request samples the same in any batch."""
    probs = target_probs(logits, [row.params for row in rows])  # [R, V]
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i (the
    # trick torch.multinomial uses for one sample), and takes exactly V draws per row whatever
    # the distribution, so a seeded row's stream of draws never depends on the batch.
    return argmax(probs / _exponential_noise(probs, rows))


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then min_p / top_k / top_p.
    logits [R, V] (may be edited in place) -> probs [R, V] float32. Speculative verification
    accepts drafts against exactly these."""
    device = logits.device
    logits = logits.float()
    logits.div_(torch.tensor([p.temperature for p in params], device=device).unsqueeze(1))

    if any(p.min_p > 0.0 for p in params):
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p): no softmax needed; min_p = 0
        # gives -inf and drops nothing.
        log_min_p = torch.tensor([p.min_p for p in params], device=device).log().unsqueeze(1)  # [R, 1]
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, float("-inf"))

    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        _top_k_top_p(logits, top_k, top_p)
    elif any(k < vocab for k in top_k):
        _top_k_only(logits, top_k)

    return logits.softmax(dim=-1)  # [R, V]


def _exponential_noise(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Exp(1) noise [R, V]: one batched draw for unseeded rows, the row's own generator for the
    seeded ones. Made as -log(U), U ~ U[0, 1): on CPU that is ~4x cheaper than exponential_(),
    and U < 1 keeps E > 0, so p / E never divides by zero (U = 0 gives E = inf: p / E = 0)."""
    uniform = torch.empty_like(probs)
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if len(seeded) < len(rows):
        uniform.uniform_()
    if seeded:
        vocab = probs.shape[1]
        own = []
        for i in seeded:
            generator = rows[i].generator
            assert generator is not None
            # Drawn where the generator lives (CPU for requests) and copied over, so a seed
            # means the same noise on any device.
            own.append(torch.rand(vocab, dtype=probs.dtype, device=generator.device, generator=generator))
        uniform[seeded] = torch.stack(own).to(probs.device)  # [S, V]
    return uniform.log_().neg_()


def _top_k_only(logits: torch.Tensor, top_k: list[int]) -> None:
    """In place on logits [R, V]; top_k[r] = V when disabled. topk on the largest k asked is
    much cheaper than a full sort when k is small. The k-th value is exact whatever k.max() is,
    and ties with it are all kept (as in vLLM)."""
    vocab = logits.shape[1]
    k = torch.tensor(top_k, device=logits.device)  # [R]
    disabled = k >= vocab
    k = k.masked_fill(disabled, 1)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    kth.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """In place on logits [R, V]; top_k[r] = V when disabled, top_p[r] = 1 when disabled.
    top_p is measured on what top_k kept (vLLM's order).

    Sorting [256, 32000] on CPU takes ~1 s, so each row is first tried on its top
    _TOP_P_CANDIDATES logits (a topk, ~20x cheaper): a row whose kept set provably lies inside
    them (k <= width, or the candidates already hold top_p of the mass) is decided there. The
    rest fall back to a full sort of their rows only. Either way the result is a cutoff logit
    per row; ties with the cutoff are kept."""
    vocab = logits.shape[1]
    device = logits.device
    k = torch.tensor(top_k, device=device)  # [R]
    p = torch.tensor(top_p, device=device)  # [R]
    cutoff = torch.full((logits.shape[0],), float("-inf"), device=device)  # [R]
    width = _TOP_P_CANDIDATES
    # A row with width < k < V would need more candidates: it is always sorted, so that the
    # path a row takes depends on the row alone, not on the widest k in the batch.
    fits = (k <= width) | (k >= vocab)
    unresolved = torch.ones_like(fits)
    if width < vocab and bool(fits.any()):
        rows = fits.nonzero().squeeze(1)
        resolved, row_cutoff = _cutoff_from_candidates(logits[rows], k[rows], p[rows], width)
        cutoff[rows] = row_cutoff
        unresolved[rows] = ~resolved
    if bool(unresolved.any()):
        rows = unresolved.nonzero().squeeze(1)
        cutoff[rows] = _cutoff_from_sort(logits[rows], k[rows], p[rows])
    logits.masked_fill_(logits < cutoff.unsqueeze(1), float("-inf"))


def _cutoff_from_candidates(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V], k [R] (<= width or V), p [R] -> (resolved [R] bool, cutoff [R])."""
    vocab = logits.shape[1]
    values = logits.topk(width, dim=-1).values  # [R, W] descending
    rank = torch.arange(width, device=logits.device)  # [W]
    k_limited = k <= width  # [R]
    values = values.masked_fill(rank >= k.unsqueeze(1), float("-inf"))
    # The top_p mass is relative to what top_k kept: the candidates themselves when k <= width,
    # else the whole row.
    log_norm = values.logsumexp(dim=-1)  # [R]
    if not bool(k_limited.all()):
        log_norm = torch.where(k_limited, log_norm, logits.logsumexp(dim=-1))
    mass = (values - log_norm.unsqueeze(1)).exp().cumsum(dim=-1)  # [R, W] inclusive
    # Keep a token while the mass strictly above it is < top_p: the smallest set reaching top_p.
    keep = (mass - (values - log_norm.unsqueeze(1)).exp() < p.unsqueeze(1)) | (p >= 1.0).unsqueeze(1)
    keep &= rank < k.unsqueeze(1)
    keep[:, 0] = True
    kept = keep.sum(dim=-1)  # [R]; keep is a prefix, both conditions being monotone in rank
    # Decided here when top_k alone bounds the set, when the candidates already hold top_p of
    # the mass (so the next token is dropped), or when nothing is filtered at all.
    resolved = k_limited | ((mass[:, -1] >= p) & (p < 1.0)) | ((k >= vocab) & (p >= 1.0))
    cutoff = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
    return resolved, cutoff.masked_fill((k >= vocab) & (p >= 1.0), float("-inf"))


def _cutoff_from_sort(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits [R, V], k [R], p [R] -> cutoff [R], by a full ascending sort (vLLM's method)."""
    vocab = logits.shape[1]
    sorted_logits = logits.sort(dim=-1).values  # [R, V] ascending
    kth = sorted_logits.gather(1, (vocab - k).clamp(0, vocab - 1).unsqueeze(1))  # [R, 1]
    drop = sorted_logits < kth
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    cumulative = masked.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    # Drop the low tail whose mass stays within 1 - top_p; rows with top_p = 1 drop nothing,
    # and the most likely token is always kept.
    drop |= (cumulative <= 1.0 - p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, -1] = False
    dropped = drop.sum(dim=-1)  # [R]; drop is a prefix of the ascending order
    return sorted_logits.gather(1, dropped.unsqueeze(1)).squeeze(1)


def _top_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, nums: list[int | None]
) -> list[dict[int, float]]:
    """logprobs [M, V], chosen [M]: per row {chosen: lp} then the top nums[i] tokens."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()  # [M]
    widest = max(n or 0 for n in nums)
    top_vals, top_ids = logprobs.topk(widest, dim=-1) if widest else (None, None)  # [M, widest]
    top_vals = top_vals.tolist() if top_vals is not None else None
    top_ids = top_ids.tolist() if top_ids is not None else None
    out = []
    for m, (token, lp) in enumerate(zip(chosen.tolist(), chosen_lp, strict=True)):
        entry = {token: lp}
        n = nums[m] or 0
        if n:
            entry.update(zip(top_ids[m][:n], top_vals[m][:n], strict=True))
        out.append(entry)
    return out


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num: int) -> list[dict[int, float]]:
    """logits [T, V]: position t's logits, which predict target_ids[t] (target_ids [T], i.e. the
    prompt shifted by one). Returns T dicts, each the target's logprob plus the top-num tokens.
    Raw distribution, like the sampled logprobs. Done in chunks of rows to bound memory."""
    if logits.dim() != 2 or target_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [T, V] and target_ids [T], got {tuple(logits.shape)} and "
            f"{tuple(target_ids.shape)}"
        )
    if not 0 <= num <= logits.shape[1]:
        raise ValueError(f"num must be in [0, {logits.shape[1]}] (the vocabulary), got {num}")
    out: list[dict[int, float]] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        chunk = torch.log_softmax(logits[start : start + _PROMPT_LOGPROBS_CHUNK].float(), dim=-1)
        targets = target_ids[start : start + _PROMPT_LOGPROBS_CHUNK].to(chunk.device, torch.long)
        out.extend(_top_logprobs(chunk, targets, [num] * chunk.shape[0]))
    return out
