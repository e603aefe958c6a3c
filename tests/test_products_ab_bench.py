"""`benchmarks/products_ab.py` as a user runs it, on the tiny model's shapes: both sides' native
kernels built in their own checkouts, every row count timed on each, and the ratio follows."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks.products_ab import step_products
from kernels import native
from tests.bench_testing import REPO, head_revision, run_benchmark, saved_result


# The two flags are independent: one run takes both (a checkout, two builds and torch's import
# fewer than a run each), the other neither.
@pytest.mark.parametrize(
    "flags",
    [[], ["--warm", "--avx2"]],
    ids=["weights-from-memory-this-cpu", "weights-in-cache-avx2-build"],
)
def test_products_ab_smoke(tiny_model, tmp_path, flags):
    out = tmp_path / "products.json"
    args = ["--baseline", head_revision(), "--model", tiny_model, "--rows", "1,3", "--rounds", "2", *flags]
    proc = run_benchmark("products_ab.py", *args, "--threads", "1", "--output", str(out), timeout=600)
    if not native.supported():
        assert proc.returncode == 1 and "do not run on this CPU" in proc.stdout
        return
    result = saved_result(proc, out)
    assert [row["rows"] for row in result["results"]] == [1, 3]
    assert result["weights_in_cache"] is ("--warm" in flags)
    assert (result["build"] == "AVX2") is ("--avx2" in flags)
    for row in result["results"]:
        assert row["baseline_ms"] > 0 and row["candidate_ms"] > 0
        assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["candidate_ms"])
    worktrees = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "pdserve-products-ab-" not in worktrees  # the baseline checkout is gone again


def test_step_products_follow_the_config():
    config = {
        "hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "q_lora_rank": 48, "intermediate_size": 96,
        "moe_intermediate_size": 24, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "vocab_size": 100,
    }  # fmt: skip
    attention = [(1, 48, 64), (1, 4 * 24, 48), (1, 32 + 8, 64), (4, 32, 16), (4, 16, 32), (1, 64, 4 * 16)]
    dense = [(1, 2 * 96, 64), (1, 64, 96)]
    experts = [(1, 2 * 24, 64), (1, 64, 24)] * 3  # two routed, one shared
    assert step_products(config) == attention + dense + attention + experts + [(1, 100, 64)]
    no_q_lora = {**config, "q_lora_rank": None, "num_hidden_layers": 1}
    assert step_products(no_q_lora)[:1] == [(1, 4 * 24, 64)]
