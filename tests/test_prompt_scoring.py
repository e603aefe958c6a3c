"""Echo and prompt scoring on a real stack, through the `openai` client, raw HTTP and gRPC.

lm-eval's `local-completions` loglikelihood requests (`echo: true, logprobs: 1, max_tokens: 1`,
prompts as token ids, and `max_tokens: 0` to score only) must give the prompt tokens' logprobs
that transformers computes for the same checkpoint, and that the offline engine gives; the
echoed text and its text_offset must line up. Also: the chat logprobs of a stream and of a
whole response agree, the end-of-sentence token included (as vLLM returns it).
"""

from __future__ import annotations

import json
import urllib.request
from operator import itemgetter

import grpc
import openai
import pytest
import torch

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2 as pb
from tests.hf_reference import load_hf_model
from tests.service_testing import inference

MODEL = "pdserve-tiny"
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
MODES = {"disaggregated": pb.SERVING_MODE_DISAGGREGATED, "colocated": pb.SERVING_MODE_COLOCATED}
ATOL = 1e-4


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model):
    """ids -> [T - 1, V] log-softmax of transformers' logits at positions 0..T-2 (float32)."""
    model = load_hf_model(tiny_model)

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)

    return logprobs


def _token_logprobs(rows: torch.Tensor, ids: list[int]) -> list[float]:
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def _offline_prompt_logprobs(offline: LLM, ids: list[int], n: int) -> list[dict[int, float] | None]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=n)
    return offline.generate(prompt_token_ids=[ids], sampling_params=params)[0].prompt_logprobs


def _check_offsets(text: str, tokens: list[str], offsets: list[int], special: set[str]) -> None:
    """Each token's text starts at its offset in the returned text; special tokens take no room."""
    assert offsets == sorted(offsets) and len(offsets) == len(tokens)
    for token, offset in zip(tokens, offsets, strict=True):
        if token not in special and "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (token, offset)


@pytest.mark.parametrize("mode", list(MODES))
def test_openai_client_scores_a_prompt_as_transformers_does(client, tok, offline, hf_logprobs, mode):
    """client.completions.create(echo=True, logprobs=1, max_tokens=0): the prompt back, its
    tokens' logprobs (the first null), top-1 alternatives, and nothing generated."""
    ids = tok.encode(TEXT)
    out = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, extra_body={"mode": mode}
    )
    [choice] = out.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = hf_logprobs(ids)
    assert lp.token_logprobs[1:] == pytest.approx(_token_logprobs(rows, ids), abs=ATOL)
    ref = _offline_prompt_logprobs(offline, ids, 1)
    assert lp.token_logprobs[1:] == pytest.approx(
        [e[t] for e, t in zip(ref[1:], ids[1:], strict=True)], abs=ATOL
    )
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert max(top.values()) == pytest.approx(rows[i].max().item(), abs=ATOL)
        assert lp.token_logprobs[i + 1] in top.values() and len(top) in (1, 2)
    _check_offsets(choice.text, lp.tokens, lp.text_offset, {tok.bos_token})
    assert lp.text_offset[:2] == [0, 0]  # the BOS the tokenizer added is not in the text


def _post(stack, body: dict) -> dict:
    req = urllib.request.Request(
        stack.http_url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_lm_eval_loglikelihood_requests(stack, tok, offline, hf_logprobs):
    """The body lm-eval's local-completions sends for loglikelihood (one batch of context +
    continuation token ids, max_tokens 1), read as its parse_logprobs reads it: the sum over the
    continuation and whether each continuation token was the greedy one."""
    pairs = [("The quick brown fox", " jumps over"), ("import os\nimport", " sys"), ("x = [1, 2,", " 3]")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        ctx = tok.encode(context)
        prompts.append(ctx + tok.encode(continuation, add_special_tokens=False))
        ctxlens.append(len(ctx))
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    out = _post(stack, {**body, "echo": True})
    choices = sorted(out["choices"], key=itemgetter("index"))
    assert len(choices) == len(prompts)
    for choice, ids, ctxlen in zip(choices, prompts, ctxlens, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        top_logprobs = choice["logprobs"]["top_logprobs"]
        assert len(token_logprobs) == len(ids) + 1  # the prompt, then the generated token
        got = sum(token_logprobs[ctxlen:-1])
        greedy = all(
            t == max(top.values())
            for t, top in zip(token_logprobs[ctxlen:-1], top_logprobs[ctxlen:-1], strict=True)
        )
        rows = hf_logprobs(ids)
        want = sum(_token_logprobs(rows, ids)[ctxlen - 1 :])
        assert got == pytest.approx(want, abs=ATOL * len(ids))
        ref = _offline_prompt_logprobs(offline, ids, 0)
        assert got == pytest.approx(sum(ref[i][ids[i]] for i in range(ctxlen, len(ids))), abs=ATOL * len(ids))
        assert greedy == all(int(rows[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
        generated = offline.generate(
            prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=1)
        )
        assert choice["text"].endswith(generated[0].text) and choice["finish_reason"] == "length"
    # max_tokens 0 (pure scoring): the same prompt logprobs, no generated token.
    scored = sorted(_post(stack, {**body, "echo": True, "max_tokens": 0})["choices"], key=itemgetter("index"))
    for score, choice in zip(scored, choices, strict=True):
        assert score["logprobs"]["token_logprobs"] == pytest.approx(
            choice["logprobs"]["token_logprobs"][:-1], abs=ATOL
        )


def test_echo_streams_the_prompt_first_and_offsets_run_on(client, tok, offline):
    ids = tok.encode(TEXT)
    ref = offline.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    )[0]
    stream = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=6, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].text.startswith(TEXT) and len(chunks[0].logprobs.tokens) > len(ids)
    text = "".join(c.text for c in chunks)
    assert text == TEXT + ref.text
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert len(tokens) == len(ids) + len(ref.token_ids)
    _check_offsets(text, tokens, offsets, {tok.bos_token, tok.eos_token})
    completion_lps = [lp for c in chunks for lp in c.logprobs.token_logprobs][len(ids) :]
    assert completion_lps == pytest.approx(
        [e[t] for e, t in zip(ref.logprobs, ref.token_ids, strict=True)], abs=ATOL
    )
    whole = client.completions.create(
        model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=6, temperature=0
    )
    assert whole.choices[0].text == text and whole.choices[0].logprobs.text_offset == offsets


@pytest.mark.parametrize("mode", list(MODES))
def test_grpc_echo_scores_and_generates(stack, tok, offline, mode):
    ids = tok.encode(TEXT)
    ref = _offline_prompt_logprobs(offline, ids, 2)
    stub = inference(stack)
    score = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(max_tokens=0, logprobs=2),
        mode=MODES[mode],
        echo=True,
    )
    [msg] = list(stub.Generate(score, timeout=60))
    assert list(msg.echo_token_ids) == ids and msg.echo_text == tok.decode(ids)
    assert not msg.token_ids and not msg.text and msg.finish_reason == pb.FINISH_REASON_LENGTH
    assert msg.usage.completion_tokens == 0 and msg.usage.prompt_tokens == len(ids)
    got = [dict(zip(e.token_ids, e.logprobs, strict=True)) for e in msg.prompt_logprobs]
    assert [list(g) for g in got] == [list(r) for r in ref[1:]]  # the prompt token, then the top 2
    for g, r in zip(got, ref[1:], strict=True):
        assert g == pytest.approx(r, abs=ATOL)

    want = offline.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=4)
    )[0]
    text = pb.GenerateRequest(
        text=TEXT, sampling=pb.SamplingParams(temperature=0, max_tokens=4), mode=MODES[mode], echo=True
    )
    msgs = list(stub.Generate(text, timeout=60))
    assert msgs[0].echo_text == TEXT and list(msgs[0].echo_token_ids) == ids
    assert not any(m.echo_text or m.echo_token_ids for m in msgs[1:])
    assert [t for m in msgs for t in m.token_ids] == want.token_ids and not msgs[0].prompt_logprobs

    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Generate(pb.GenerateRequest(text=TEXT, sampling=pb.SamplingParams(max_tokens=0)), timeout=30)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()


def test_logprobs_0_gives_each_token_and_itself_as_the_top(client):
    out = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert all(isinstance(v, float) for v in lp.token_logprobs)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_chat_logprobs_agree_streamed_and_whole_with_the_eos_last(client, tok):
    """Forced to end with EOS at its third token: both answers hold the same three logprobs, the
    EOS last (its logprob is returned, as vLLM does, though its text is not in the content)."""
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    kw = dict(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"min_tokens": 2, "logit_bias": {str(tok.eos_token_id): 100}},
    )
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert whole.finish_reason == chunks[-1].finish_reason == "stop"
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.logprobs.content]
    assert len(streamed) == 3 and streamed[-1].token == tok.eos_token
    assert tok.eos_token not in whole.message.content
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
