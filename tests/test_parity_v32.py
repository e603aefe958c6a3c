"""Logits parity for DeepSeek-V3.2 (DeepSeek Sparse Attention): the engine against transformers'
`DeepseekV32ForCausalLM` on tiny random checkpoints whose `index_topk` is smaller than the prompts and
the 32 greedy steps after them, so most queries attend to a strict subset of their context, chosen by
the indexer. The same checks as tests/test_parity_hf.py: greedy tokens exactly, every returned logprob
within 1e-4, prompt logprobs included, at two KV block sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf_reference import V32_VARIANTS, Reference, build_hf_checkpoint, decisive_references
from tests.test_parity_hf import PROMPT_LENS, SEED, STEPS, assert_parity, one_torch_thread


@pytest.fixture(scope="module", params=V32_VARIANTS)
def case(request, tmp_path_factory) -> tuple[Path, list[Reference]]:
    with one_torch_thread():
        model_dir = build_hf_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"), seed=SEED)
        return model_dir, decisive_references(model_dir, PROMPT_LENS, steps=STEPS, seed=SEED)


@pytest.mark.parametrize("block_size", [4, 16], ids=lambda b: f"bs{b}")
def test_sparse_attention_logits_match_transformers(
    case: tuple[Path, list[Reference]], block_size: int
) -> None:
    model_dir, refs = case
    index_topk = json.loads((model_dir / "config.json").read_text())["index_topk"]
    assert max(len(r.prompt_ids) for r in refs) + STEPS > index_topk  # sparse selection is exercised
    assert_parity(model_dir, refs, block_size)
