"""Every serving path with a checkpoint as DeepSeek releases it (FP8 32 x 32 ue8m0 block scales,
MXFP4 routed experts, `pdserve quantize`): the disaggregated stack (KV shipped between workers,
structured output) gives the offline engine's tokens; DP + EP with redundant experts and live EPLB
(an expert's scales move with it) the one-process tokens; MTP speculative decoding its greedy
tokens without drafts; a prefix brought back from the host offload tier the same tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.structured import StructuredOutputsParams
from modelkit.quantize import QuantOptions, quantize_folder
from pdserve.v1 import inference_pb2 as pb
from tests.service_testing import generate, inference, start_stack

PROMPTS = [
    [5 + (i * 13 + j * 7) % 3000 for j in range(length)] for i, length in enumerate((9, 40, 17, 3, 28))
]
ENGINE = dict(dtype="float32", num_kv_blocks=128, block_size=4, num_threads=1)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
OPTIONS = QuantOptions(block=32, ue8m0=True, experts_fp4=True)


def _greedy(n: int = 12, logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=logprobs, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory) -> str:
    folder = quantize_folder(tiny_model, tmp_path_factory.mktemp("q") / "tiny-fp8-fp4", OPTIONS)
    assert json.loads((folder / "config.json").read_text())["expert_dtype"] == "fp4"
    return str(folder)


@pytest.fixture(scope="module")
def reference(quantized):
    return LLM(quantized, **ENGINE).generate(prompt_token_ids=PROMPTS, sampling_params=_greedy())


def _same(outs, refs) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref.token_ids
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert list(got) == list(want) and got == pytest.approx(want, abs=1e-4)


def test_the_disaggregated_stack_serves_it_as_the_offline_engine(quantized, tmp_path):
    stack = start_stack(quantized, tmp_path, router_args=["--colocate-max-tokens", "0"])
    try:
        stub = inference(stack)
        offline = LLM(quantized, dtype="float32", num_kv_blocks=256, block_size=16, num_threads=1)
        for prompt in PROMPTS[:2]:
            tokens, msgs = generate(
                stub, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                mode=pb.SERVING_MODE_DISAGGREGATED,
            )  # fmt: skip
            (ref,) = offline.generate(prompt_token_ids=[prompt], sampling_params=_greedy(logprobs=None))
            assert tokens == ref.token_ids and msgs[-1].disaggregated
        schema = pb.StructuredOutputs(json_schema=json.dumps(PERSON))
        tokens, msgs = generate(
            stub, text="Answer:", sampling=pb.SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=schema),
            mode=pb.SERVING_MODE_DISAGGREGATED,
        )  # fmt: skip
        (ref,) = offline.generate(
            ["Answer:"],
            [
                SamplingParams(
                    temperature=0.0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=PERSON)
                )
            ],
        )
        assert tokens == ref.token_ids and msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads("".join(m.text for m in msgs)), PERSON)
    finally:
        codes = stack.stop()
    assert codes == {name: 0 for name in codes}


def test_ep_with_redundant_experts_and_live_eplb_keeps_the_tokens(quantized, reference):
    llm = LLM(
        quantized, data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=4, eplb_interval=4,
        **ENGINE,
    )  # fmt: skip
    try:
        _same(llm.generate(prompt_token_ids=PROMPTS, sampling_params=_greedy()), reference)
    finally:
        llm.engine.shutdown()
    stats = llm.engine.final_stats
    assert stats[0]["eplb_rebalances"] >= 1 and stats[0]["phy2log"] == stats[1]["phy2log"]
    assert all(p.exitcode == 0 for p in llm.engine.procs)


def test_mtp_drafts_keep_the_greedy_tokens(tmp_path):
    """The trained tiny model (it has an MTP layer), quantized: its drafts are still taken, and
    the greedy tokens are those without drafts."""
    folder = str(quantize_folder("assets/pdserve-tiny", tmp_path / "q", OPTIONS))
    prompts = ["The module provides", "This function returns a", "def main():"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = LLM(folder, **ENGINE).generate(prompts, params)
    llm = LLM(folder, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.spec_stats.acceptance_rate > 0.3  # the quantized MTP layer drafts well


def test_a_prefix_from_the_host_tier_gives_the_same_tokens(quantized, reference):
    llm = LLM(quantized, kv_offload="host", kv_host_blocks=64, **{**ENGINE, "num_kv_blocks": 24})
    prompt = PROMPTS[1]  # 40 tokens: 10 blocks
    (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy())
    _same([first], [reference[1]])
    fillers = [[100 + j for j in range(60)], [2000 + j for j in range(60)]]
    llm.generate(prompt_token_ids=fillers, sampling_params=SamplingParams(max_tokens=2, temperature=0))
    before = llm.engine.connector.stats.loaded_blocks["host"]
    (again,) = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy())
    _same([again], [reference[1]])
    assert again.num_cached_tokens > 0 and llm.engine.connector.stats.loaded_blocks["host"] > before
