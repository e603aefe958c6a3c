"""Bad input gets a ValueError naming the field and the limit, and the engine keeps serving."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.engine_core import EngineCore

MAX_MODEL_LEN = 64

BAD_PARAMS = [
    pytest.param(dict(temperature=-0.5), "temperature", id="temperature-negative"),
    pytest.param(dict(temperature=math.nan), "temperature", id="temperature-nan"),
    pytest.param(dict(top_p=0.0), "top_p", id="top_p-zero"),
    pytest.param(dict(top_p=1.5), "top_p", id="top_p-above-1"),
    pytest.param(dict(top_k=0), "top_k", id="top_k-zero"),
    pytest.param(dict(top_k=-2), "top_k", id="top_k-below-minus-1"),
    pytest.param(dict(min_p=-0.1), "min_p", id="min_p-negative"),
    pytest.param(dict(min_p=1.1), "min_p", id="min_p-above-1"),
    pytest.param(dict(logprobs=21), "logprobs", id="logprobs-above-20"),
    pytest.param(dict(prompt_logprobs=21), "prompt_logprobs", id="prompt_logprobs-above-20"),
    pytest.param(dict(max_tokens=0), "max_tokens", id="max_tokens-zero"),
    pytest.param(dict(min_tokens=5, max_tokens=4), "min_tokens", id="min_tokens-above-max_tokens"),
    pytest.param(dict(repetition_penalty=0.0), "repetition_penalty", id="repetition_penalty-zero"),
    pytest.param(dict(presence_penalty=3.0), "presence_penalty", id="presence_penalty-above-2"),
    pytest.param(dict(frequency_penalty=-2.5), "frequency_penalty", id="frequency_penalty-below-minus-2"),
    pytest.param(dict(stop_token_ids=[10**6]), "stop_token_ids", id="stop_token_id-outside-vocab"),
    pytest.param(dict(logit_bias={10**6: 1.0}), "logit_bias", id="logit_bias-key-outside-vocab"),
    pytest.param(dict(logit_bias={-1: 1.0}), "logit_bias", id="logit_bias-key-negative"),
    pytest.param(dict(logit_bias={"7": 1.0}), "logit_bias", id="logit_bias-key-not-an-int"),
    pytest.param(dict(logit_bias={7: 101.0}), "logit_bias", id="logit_bias-value-above-100"),
    pytest.param(dict(logit_bias={7: math.nan}), "logit_bias", id="logit_bias-value-nan"),
]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=4)


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(**kwargs))


BAD_PROMPTS = [
    pytest.param([], {}, "prompt must not be empty", id="empty-prompt"),
    pytest.param(
        [5, 4096],
        {},
        r"prompt_token_ids\[1\] = 4096 is outside the vocabulary \[0, 4096\)",
        id="token-above-vocab",
    ),
    pytest.param([-1], {}, "outside the vocabulary", id="token-negative"),
    pytest.param(
        [5] * (MAX_MODEL_LEN + 1),
        {},
        f"more than max_model_len \\({MAX_MODEL_LEN}\\)",
        id="prompt-beyond-max_model_len",
    ),
    pytest.param(
        [5] * 60,
        dict(max_tokens=5),
        "exceeds max_model_len",
        id="prompt-plus-max_tokens-beyond-max_model_len",
    ),
]


@pytest.mark.parametrize("prompt,kwargs,message", BAD_PROMPTS)
def test_bad_prompts(llm, prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**kwargs))


def test_empty_text_prompt_is_rejected(tiny_model, tmp_path):
    # The tiny tokenizer adds BOS, so "" is one token; the engine's own emptiness check is on ids.
    llm = LLM(tiny_model, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="exactly one of prompts and prompt_token_ids"):
        llm.generate()


def test_bad_request_does_not_disturb_running_ones(llm):
    engine: EngineCore = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(prompt_token_ids=[[5, 6, 7], [9, 10]], sampling_params=params)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [9, 10], params)
    done = {}
    for step in range(40):
        if step == 3:
            for bad in ([], [99999], [5] * 100):
                with pytest.raises(ValueError):
                    engine.add_request(f"bad{step}-{len(bad)}", bad, params)
            with pytest.raises(ValueError, match="top_p"):
                engine.add_request("bad-top-p", [5], SamplingParams(top_p=2.0))
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("a", [5], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if not engine.has_unfinished_requests():
            break
    assert done == {"a": expected[0].token_ids, "b": expected[1].token_ids}
    assert set(engine.requests) == set()
    pool = engine.kv.pools[0]
    assert pool.num_free_blocks == pool.num_blocks


def test_one_bad_prompt_in_a_list_starts_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1: prompt must not be empty"):
        llm.generate(prompt_token_ids=[[5, 6], []], sampling_params=SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_engine_argument(tiny_model):
    with pytest.raises(ValueError, match="unknown engine argument.*max_batch"):
        LLM(tiny_model, max_batch=3)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        pytest.param(dict(dtype="int8"), "dtype", id="dtype"),
        pytest.param(dict(block_size=0), "block_size", id="block_size"),
        pytest.param(dict(max_model_len=10**6), "max_model_len", id="max_model_len-beyond-model"),
    ],
)
def test_bad_engine_config(tiny_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model, **kwargs)


# ---- model folders ---------------------------------------------------------------------------


def _copy(tiny_model: str, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_model_folder_missing_file(tiny_model, tmp_path, missing):
    folder = _copy(tiny_model, tmp_path)
    (folder / missing).unlink()
    with pytest.raises(ValueError, match=f"missing {missing}"):
        LLM(str(folder))


def test_model_folder_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    "patch,message",
    [
        pytest.param({"model_type": "llama"}, "model_type 'llama' is not supported", id="model_type"),
        pytest.param(
            {"architectures": ["DeepseekV9ForCausalLM"]},
            "architecture 'DeepseekV9ForCausalLM'",
            id="architecture",
        ),
        pytest.param({"rope_scaling": {"type": "longrope"}}, "rope type 'longrope'", id="rope-type"),
    ],
)
def test_unsupported_config(tiny_model, tmp_path, patch, message):
    folder = _copy(tiny_model, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(patch)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


@pytest.mark.parametrize("change", ["missing", "unexpected", "misshaped"])
def test_checkpoint_tensor_errors_name_the_tensor(tiny_model, tmp_path, change):
    folder = _copy(tiny_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    if change == "missing":
        del tensors[name]
        message = f"missing 1 tensor.*{name}"
    elif change == "unexpected":
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        message = "unexpected tensor.*model.layers.0.self_attn.extra.weight"
    else:
        tensors[name] = tensors[name][:, :-1].contiguous()
        message = f"{name}.*has shape"
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32")
