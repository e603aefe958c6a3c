"""Logits parity: the engine against transformers on tiny random DeepSeek-V2/V3 checkpoints.

For every variant in `VARIANTS` and every KV block size, one batched `generate` over prompts of several
lengths must give, in float32:
- the reference's greedy tokens, exactly;
- per generated token, logprobs within ATOL of transformers' log_softmax at every returned id, and the
  reference's top-N ids (up to near-ties at the N-th place);
- the same for the prompt logprobs (position 0 has none).

Prompts are 1 token (decode straight after a one-token prefill), shorter than a block, an exact multiple
of both block sizes, and several blocks long; with 32 generated tokens every sequence crosses block
boundaries during decode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_reference import VARIANTS, Reference, build_hf_checkpoint, decisive_references

PROMPT_LENS = (1, 7, 16, 23)
STEPS = 32
TOP_N = 20
ATOL = 1e-4
"""Absolute tolerance on every logprob the engine returns."""
TOPN_TIE = 2 * ATOL
"""Reference ids this close to the N-th best logprob may swap in or out of the engine's top-N: an engine
within ATOL can legitimately order them either way (the references hold 20th/21st gaps of ~5e-6)."""
SEED = 0


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread inside, as the engines here run: these models' products are too small
    for a second, and two OpenMP threads beside other processes on two cores wait on each other
    for most of each op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory) -> tuple[Path, list[Reference]]:
    """The variant's checkpoint and its references, built once per variant for all block sizes."""
    with one_torch_thread():
        model_dir = build_hf_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"), seed=SEED)
        return model_dir, decisive_references(model_dir, PROMPT_LENS, steps=STEPS, seed=SEED)


def assert_logprobs_match(got: dict[int, float], ref: torch.Tensor, token: int, where: str) -> None:
    """Check one position's engine logprobs against the reference row.

    got: the engine's dict, token id -> logprob, holding `token` plus the engine's top-N.
    ref: [V] reference log_softmax at that position.
    token: the generated (or prompt) token at that position.
    """
    assert token in got, f"{where}: token {token} missing from the returned logprobs"
    assert len(got) in (TOP_N, TOP_N + 1), (
        f"{where}: {len(got)} logprobs returned, expected {TOP_N} or {TOP_N + 1}"
    )
    for tid, lp in got.items():
        assert 0 <= tid < ref.shape[0], f"{where}: token id {tid} outside the vocabulary [0, {ref.shape[0]})"
        assert abs(float(lp) - ref[tid].item()) <= ATOL, (
            f"{where}: logprob of token {tid} is {float(lp):.6f}, reference {ref[tid].item():.6f}"
        )

    kth = ref.topk(TOP_N).values[-1].item()
    must = set((ref > kth + TOPN_TIE).nonzero().flatten().tolist())  # clearly inside the reference top-N
    may = set((ref >= kth - TOPN_TIE).nonzero().flatten().tolist())  # inside, or tied at the N-th place
    ranked = sorted(got, key=lambda t: float(got[t]), reverse=True)
    engine_top, beyond = set(ranked[:TOP_N]), ranked[TOP_N:]
    want = f"reference top-{TOP_N} is {ref.topk(TOP_N).indices.tolist()}"
    assert must <= engine_top, f"{where}: top-{TOP_N} lacks {sorted(must - engine_top)}; {want}"
    assert engine_top <= may, f"{where}: top-{TOP_N} has extra {sorted(engine_top - may)}; {want}"
    # A 21st entry may only be the token itself (ranked below the top-N) or a tie at the boundary.
    assert all(t == token or t in may for t in beyond), f"{where}: unexpected extra entries {beyond}"


def _first_divergence(got: list[int], want: list[int]) -> int:
    """Index of the first differing token, or the shorter length when one is a prefix of the other."""
    pairs = zip(got, want, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want)))


@pytest.mark.parametrize("block_size", [4, 16], ids=lambda b: f"bs{b}")
def test_logits_parity(case: tuple[Path, list[Reference]], block_size: int) -> None:
    model_dir, refs = case
    assert_parity(model_dir, refs, block_size)


def assert_parity(model_dir: Path, refs: list[Reference], block_size: int, **engine_args) -> None:
    """The engine in float32 on model_dir (with engine_args) against the references: greedy tokens
    exactly, every logprob it returns (generated and prompt) within ATOL, the reference's top-N."""
    llm = LLM(model=str(model_dir), dtype="float32", block_size=block_size, num_threads=1, **engine_args)
    params = SamplingParams(
        temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP_N, prompt_logprobs=TOP_N
    )
    outputs = llm.generate(prompt_token_ids=[r.prompt_ids for r in refs], sampling_params=params)
    assert len(outputs) == len(refs)

    for ref, out in zip(refs, outputs, strict=True):
        t = len(ref.prompt_ids)
        tokens = list(out.token_ids)
        assert len(out.logprobs) == len(tokens), f"{t}-token prompt: {len(out.logprobs)} logprob dicts"

        # Up to and including the first divergence both sides saw the same prefix, so the logprobs
        # there say whether a wrong token came from wrong logits or from a near-tie.
        diverged = _first_divergence(tokens, ref.greedy_tokens)
        for step in range(min(diverged + 1, len(tokens), STEPS)):
            assert_logprobs_match(
                out.logprobs[step], ref.step_logprobs[step], tokens[step], f"{t}-token prompt, step {step}"
            )
        assert tokens == ref.greedy_tokens, f"{t}-token prompt: greedy tokens diverge at step {diverged}"

        prompt_logprobs = out.prompt_logprobs
        assert len(prompt_logprobs) == t, f"{t}-token prompt: {len(prompt_logprobs)} prompt logprob entries"
        assert prompt_logprobs[0] is None, "the first prompt position has no logprobs"
        for i in range(1, t):
            where = f"{t}-token prompt, position {i}"
            assert_logprobs_match(prompt_logprobs[i], ref.prompt_logprobs[i - 1], ref.prompt_ids[i], where)
