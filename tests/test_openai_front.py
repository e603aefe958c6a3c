"""The OpenAI HTTP front over a fake Frontend, driven by the real `openai` client and raw HTTP.

The fake answers each prompt with its token ids reversed (two tokens per delta, text from the
tiny model's tokenizer), so every expected text, logprob and usage is computed here exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import prometheus_client
import pytest
from aiohttp import web

from engine.tokenizer import Tokenizer
from services.common.errors import ResourceExhausted, ServiceError, Unavailable
from services.openai.protocol import MAX_N, MAX_STOP
from services.openai.responses import LOGPROB_FLOOR, TokenStrings
from services.openai.server import build_app, start_http
from services.router.admission import Admission
from services.router.api import (
    Delta,
    Frontend,
    GenerateInput,
    KvFailurePolicy,
    ServingMode,
    Usage,
    score_only_delta,
)

MODEL = "pdserve-tiny"
MAX_MODEL_LEN = 64
CACHED_TOKENS = 2
KV_BYTES = 1234


class FakeFrontend(Frontend):
    """Answers a prompt with its token ids reversed, cut at max_tokens, two tokens per delta;
    prompt logprobs as `fake_prompt_logprobs`; a score-only input's deltas pass through
    score_only_delta, as the router's do. Records every GenerateInput and how each generate ended
    ("finished", "cancelled", "closed")."""

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN
    max_generations_per_request = 64

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.admission = Admission(max_in_flight=256, max_queued=0, queue_timeout_s=1.0)
        self.reset()

    def admit(self, weight: int, timeout: float | None):
        return self.admission.slot(weight, timeout)

    def reset(self) -> None:
        self.inputs: list[GenerateInput] = []
        self.ended: dict[str, str] = {}
        self.hang = False  # after the first delta, wait until cancelled
        self.error: Exception | None = None  # raised after error_after deltas
        self.error_after = 0

    def validate(self, prompt_token_ids: list[int], params) -> None:  # as EngineCore.validate
        params.validate(self.vocab_size)
        n = len(prompt_token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )

    async def generate(self, inp: GenerateInput):
        self.inputs.append(inp)
        params, prompt = inp.params, inp.prompt_token_ids
        tokens = reversed_tokens(prompt, params.max_tokens)
        try:
            for start in range(0, len(tokens), 2):
                if self.error is not None and start // 2 >= self.error_after:
                    raise self.error
                piece = tokens[start : start + 2]
                last = start + 2 >= len(tokens)
                delta = Delta(
                    token_ids=piece,
                    text=self.tokenizer.decode(piece),
                    logprobs=None
                    if params.logprobs is None
                    else [fake_logprobs(t, params.logprobs) for t in piece],
                    prompt_logprobs=(
                        fake_prompt_logprobs(prompt, params.prompt_logprobs)
                        if start == 0 and params.prompt_logprobs is not None
                        else None
                    ),
                    finish_reason=("length" if len(prompt) > params.max_tokens else "stop") if last else None,
                    usage=Usage(len(prompt), len(tokens), CACHED_TOKENS, KV_BYTES) if last else None,
                )
                yield score_only_delta(delta) if inp.score_only else delta
                await asyncio.sleep(0)
                if self.hang:
                    await asyncio.Event().wait()
            self.ended[inp.request_id] = "finished"
        except asyncio.CancelledError:
            self.ended[inp.request_id] = "cancelled"
            raise
        except GeneratorExit:
            self.ended[inp.request_id] = "closed"
            raise


def reversed_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return list(reversed(prompt))[:max_tokens]


def fake_logprobs(token: int, top: int) -> dict[int, float]:
    """The chosen token first (-0.5), then alternatives -1, -2, ..."""
    return {token: -0.5} | {token + 1 + k: -1.0 - k for k in range(top)}


def fake_prompt_logprobs(prompt: list[int], top: int) -> list[dict[int, float] | None]:
    """None for the first token; then the prompt token first (-inf at position 1, -0.25 after),
    and alternatives -1, -2, ..."""
    return [None] + [
        {t: -0.25 if i else float("-inf")} | {t + 1 + k: -1.0 - k for k in range(top)}
        for i, t in enumerate(prompt[1:])
    ]


def expected_text(tok: Tokenizer, prompt: list[int], max_tokens: int) -> str:
    tokens = reversed_tokens(prompt, max_tokens)
    return "".join(tok.decode(tokens[i : i + 2]) for i in range(0, len(tokens), 2))


class Server:
    """The app on a free loopback port, on its own event loop in a background thread."""

    def __init__(self, app: web.Application, handler_cancellation: bool = True):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = self._call(self._start(app, handler_cancellation))
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    @staticmethod
    async def _start(app: web.Application, handler_cancellation: bool) -> web.AppRunner:
        if handler_cancellation:
            return await start_http(app, "127.0.0.1", 0)
        runner = web.AppRunner(app)  # no handler cancellation: the front must poll the connection
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    def stop(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


@pytest.fixture(scope="module")
def registry() -> prometheus_client.CollectorRegistry:
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("pdserve_test_requests", "A test counter", registry=registry)
    counter.inc(3)
    return registry


@pytest.fixture(scope="module")
def fake(tok) -> FakeFrontend:
    return FakeFrontend(tok)


@pytest.fixture(scope="module")
def server(fake, registry):
    srv = Server(build_app(fake, registry, max_body_bytes=64 * 1024))
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.reset()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def post(server: Server, path: str, body: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(server: Server, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


# ---- /v1/completions ---------------------------------------------------------------------------


def test_completion(client, fake, tok):
    prompt = "hello world, this is a test"
    ids = tok.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.index == 0 and choice.text == expected_text(tok, ids, 3)
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3
    assert out.usage.total_tokens == len(ids) + 3
    assert out.usage.prompt_tokens_details.cached_tokens == CACHED_TOKENS
    assert out.usage.model_extra["kv_transfer_bytes"] == KV_BYTES
    [inp] = fake.inputs
    assert inp.prompt_token_ids == ids and inp.params.max_tokens == 3
    assert inp.request_id == f"{out.id}-0"
    assert inp.mode == ServingMode.AUTO and inp.kv_failure_policy == KvFailurePolicy.FAIL
    assert fake.ended == {inp.request_id: "finished"}


def test_completion_defaults_and_stop_finish(client, fake, tok):
    out = client.completions.create(model=MODEL, prompt="hi")
    [inp] = fake.inputs
    assert inp.params.max_tokens == 16 and inp.params.temperature == 1.0 and inp.params.stop == []
    assert out.choices[0].finish_reason == "stop"  # the whole reversed prompt fits
    assert out.choices[0].text == expected_text(tok, tok.encode("hi"), 16)


def test_completion_batch_token_ids_n2_seed(client, fake, tok):
    prompts = [[10, 11, 12, 13, 14], [20, 21, 22]]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        prompt = prompts[c.index // 2]
        assert c.text == expected_text(tok, prompt, 4)
    by_id = {inp.request_id: inp for inp in fake.inputs}
    assert sorted(by_id) == sorted(f"{out.id}-{i}" for i in range(4))
    assert [by_id[f"{out.id}-{i}"].params.seed for i in range(4)] == [7, 8, 7, 8]
    assert by_id[f"{out.id}-2"].prompt_token_ids == prompts[1]
    assert out.usage.prompt_tokens == 8  # each prompt counted once
    assert out.usage.completion_tokens == 4 + 4 + 3 + 3
    assert out.usage.model_extra["kv_transfer_bytes"] == 4 * KV_BYTES


def test_completion_stream_with_usage(client, fake, tok):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    *text_chunks, usage_chunk = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert len(text_chunks) == 3  # 2 + 2 + 1 tokens
    assert "".join(c.choices[0].text for c in text_chunks) == expected_text(tok, prompt, 5)
    assert [c.choices[0].finish_reason for c in text_chunks] == [None, None, "length"]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 5
    assert usage_chunk.usage.prompt_tokens == len(prompt)


def test_completion_stream_raw_sse(server):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = resp.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])


def test_completion_logprobs(client, tok):
    prompt = [40, 41, 42]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    tokens = reversed_tokens(prompt, 3)
    texts = [tok.decode([t]) for t in tokens]
    assert lp.tokens == texts and lp.token_logprobs == [-0.5] * 3
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(3)]
    for t, top in zip(tokens, lp.top_logprobs, strict=True):
        assert top == {tok.decode([t]): -0.5, tok.decode([t + 1]): -1.0}  # -inf is third, beyond the top 2


def test_completion_extra_fields_reach_sampling_params(client, fake):
    client.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=8,
        temperature=0.3,
        top_p=0.9,
        stop=["x", "yz"],
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        user="someone",
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [1, 7],
            "skip_special_tokens": False,
            "mode": "disaggregated",
            "kv_failure_policy": "recompute",
            "some_unknown_field": {"ignored": True},
        },
    )
    [inp] = fake.inputs
    p = inp.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.3, 0.9, 5, 0.1, 1.2)
    assert (p.presence_penalty, p.frequency_penalty, p.seed) == (0.5, -0.5, 3)
    assert p.ignore_eos and p.min_tokens == 2 and p.stop_token_ids == [1, 7] and not p.skip_special_tokens
    assert p.stop == ["x", "yz"] and p.max_tokens == 8 and p.logprobs is None
    assert inp.mode == ServingMode.DISAGGREGATED and inp.kv_failure_policy == KvFailurePolicy.RECOMPUTE


def test_completion_logprobs_0_gives_the_sampled_token_alone(client, tok):
    """logprobs 0: each position's logprob, and top_logprobs holding just the sampled token (as
    vLLM; OpenAI allows up to logprobs + 1 entries)."""
    prompt = [40, 41, 42]
    lp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=0).choices[0].logprobs
    tokens = reversed_tokens(prompt, 3)
    assert lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{tok.decode([t]): -0.5} for t in tokens]


def _strings(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def _offsets(tok: Tokenizer, ids: list[int], start: int = 0) -> list[int]:
    """text_offset of ids from start: special tokens take no room in the text."""
    special = {tok.bos_token_id, tok.eos_token_id}
    out = []
    for t in ids:
        out.append(start)
        start += 0 if t in special else len(tok.decode([t]))
    return out


def test_echo_returns_the_prompt_before_the_completion(client, fake, tok):
    prompt = "hello world, this is a test"
    ids = tok.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=[prompt, [50, 51, 52]], max_tokens=3, echo=True, n=2)
    texts = [c.text for c in out.choices]
    assert texts[:2] == [prompt + expected_text(tok, ids, 3)] * 2  # the text as sent, before each sample
    assert texts[2:] == [tok.decode([50, 51, 52]) + expected_text(tok, [50, 51, 52], 3)] * 2
    assert all(c.logprobs is None for c in out.choices)
    assert all(inp.params.prompt_logprobs is None and not inp.score_only for inp in fake.inputs)
    assert out.usage.completion_tokens == 12


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client, fake, tok):
    prompt = [50, 51, 52, 53]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    [inp] = fake.inputs
    assert inp.params.prompt_logprobs == 2 and inp.params.max_tokens == 3
    choice = out.choices[0]
    completion = reversed_tokens(prompt, 3)
    echoed = tok.decode(prompt)
    assert choice.text == echoed + expected_text(tok, prompt, 3)
    lp = choice.logprobs
    assert lp.tokens == _strings(tok, prompt + completion)
    assert lp.token_logprobs == [None, LOGPROB_FLOOR, -0.25, -0.25] + [-0.5] * 3
    assert lp.top_logprobs[0] is None

    def s(t: int) -> str:
        return tok.decode([t])

    # The top 2, and the prompt token after them when it is not among them (-inf at position 1).
    assert lp.top_logprobs[1] == {s(52): -1.0, s(53): -2.0, s(51): LOGPROB_FLOOR}
    assert lp.top_logprobs[2] == {s(52): -0.25, s(53): -1.0}
    assert lp.top_logprobs[4:] == [{s(t): -0.5, s(t + 1): -1.0} for t in completion]
    assert lp.text_offset == _offsets(tok, prompt) + _offsets(tok, completion, len(echoed))
    assert "prompt_logprobs" not in choice.model_extra  # not asked for by name


def test_echo_max_tokens_0_scores_the_prompt_without_generating(client, fake, tok):
    prompt = "def f(x): return x"
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    [inp] = fake.inputs
    assert inp.score_only and inp.params.max_tokens == 1 and inp.params.prompt_logprobs == 1
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert (
        lp.tokens == _strings(tok, ids)
        and lp.token_logprobs[0] is None
        and len(lp.token_logprobs) == len(ids)
    )
    assert lp.text_offset == _offsets(tok, ids)  # the BOS takes no room in the text
    assert all(
        prompt[o:].startswith(tok.decode([t])) for o, t in zip(lp.text_offset[1:], ids[1:], strict=True)
    )
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)


def test_echo_streams_the_prompt_in_the_first_chunk(client, fake, tok):
    prompt = [60, 61, 62]
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=1, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    echoed, completion = tok.decode(prompt), reversed_tokens(prompt, 4)
    assert chunks[0].text == echoed + tok.decode(completion[:2])
    assert chunks[0].logprobs.tokens == _strings(tok, prompt + completion[:2])
    assert chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == echoed + expected_text(tok, prompt, 4)
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert offsets == _offsets(tok, prompt) + _offsets(tok, completion, len(echoed))
    score = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, stream=True)
    [only] = [c.choices[0] for c in score]
    assert only.text == echoed and only.finish_reason == "length"


def test_prompt_logprobs(client, tok):
    out = client.completions.create(
        model=MODEL, prompt=[3, 4, 5], max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    got = out.choices[0].model_extra["prompt_logprobs"]
    # The top 1, and the prompt token after it when it is not the top 1.
    assert got[0] is None and [list(d) for d in got[1:]] == [["5", "4"], ["5"]]
    assert got[1]["4"]["logprob"] == LOGPROB_FLOOR  # -inf: JSON has no infinity
    assert got[2]["5"] == {"logprob": -0.25, "decoded_token": tok.decode([5])}


# ---- /v1/chat/completions ----------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_chat_prompt_matches_hf_chat_template(client, fake, tiny_model):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert fake.inputs[0].prompt_token_ids == list(want)
    assert want[0] == hf.bos_token_id and want[1] != hf.bos_token_id


def test_chat(client, fake, tok):
    parts = [{"role": "system", "content": "be brief"}]
    parts.append(
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
    )
    out = client.chat.completions.create(model=MODEL, messages=parts)
    [inp] = fake.inputs
    ids = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert inp.prompt_token_ids == ids  # text parts are joined
    assert inp.params.max_tokens == MAX_MODEL_LEN - len(ids)  # default: the rest of the context
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(tok, ids, inp.params.max_tokens)
    assert choice.finish_reason == "stop" and out.usage.prompt_tokens == len(ids)


def test_developer_role_renders_as_system(client, fake):
    developer = [{"role": "developer", "content": "be brief"}, MESSAGES[1]]
    client.chat.completions.create(model=MODEL, messages=developer, max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    as_developer, as_system = (inp.prompt_token_ids for inp in fake.inputs)
    assert as_developer == as_system


def test_chat_max_completion_tokens_wins(client, fake):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=4)
    assert fake.inputs[0].params.max_tokens == 4


def test_chat_stream_n2(client, fake, tok):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=3,
        n=2,
        stream=True,
        seed=11,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = {c.choices[0].index: c.choices[0].delta.role for c in chunks[:2]}
    assert first == {0: "assistant", 1: "assistant"}
    ids = fake.inputs[0].prompt_token_ids
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(ch.delta.content or "" for ch in mine) == expected_text(tok, ids, 3)
        assert [ch.finish_reason for ch in mine][-1] == "length"
    assert sorted(inp.params.seed for inp in fake.inputs) == [11, 12]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_logprobs(client, tok):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 2
    for entry in content:
        assert entry.logprob == -0.5
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert [t.logprob for t in entry.top_logprobs] == [-0.5, -1.0, -2.0]
    no_top = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, logprobs=True)
    assert no_top.choices[0].logprobs.content[0].top_logprobs == []


def test_token_bytes_of_byte_level_pieces(server, tok):
    strings = TokenStrings(tok)
    for token_id in range(5, tok.vocab_size, 97):
        text, raw = strings(token_id)
        assert raw.decode("utf-8", errors="replace") == text
        assert tok.decode([token_id], skip_special_tokens=False) == text
    assert strings(tok.bos_token_id) == (tok.bos_token, tok.bos_token.encode())


# ---- errors ------------------------------------------------------------------------------------

CMPL = {"model": MODEL, "prompt": "hello"}
CHAT = {"model": MODEL, "messages": MESSAGES}


BAD_REQUESTS = [
    ("/v1/completions", {**CMPL, "max_tokens": "x"}, "max_tokens", "integer"),
    ("/v1/completions", {**CMPL, "max_tokens": True}, "max_tokens", "integer"),
    ("/v1/completions", {**CMPL, "max_tokens": 0}, "max_tokens", ">= 1 (0 only with echo"),
    ("/v1/completions", {**CMPL, "max_tokens": 1.5}, "max_tokens", "integer"),
    ("/v1/completions", {**CMPL, "temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {**CMPL, "temperature": float("nan")}, "temperature", "finite"),
    ("/v1/completions", {**CMPL, "temperature": -1}, "temperature", "[0, 2]"),
    ("/v1/completions", {**CMPL, "temperature": 3}, "temperature", "[0, 2]"),
    ("/v1/completions", {**CMPL, "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/completions", {**CMPL, "top_k": 0}, "top_k", ">= 1"),
    ("/v1/completions", {**CMPL, "min_p": 1.5}, "min_p", "[0, 1]"),
    ("/v1/completions", {**CMPL, "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ("/v1/completions", {**CMPL, "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ("/v1/completions", {**CMPL, "logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {**CMPL, "logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {**CMPL, "n": 0}, "n", f"[1, {MAX_N}]"),
    ("/v1/completions", {**CMPL, "n": MAX_N + 1}, "n", f"[1, {MAX_N}]"),
    ("/v1/completions", {**CMPL, "stop": ["s"] * (MAX_STOP + 1)}, "stop", f"limit of {MAX_STOP}"),
    ("/v1/completions", {**CMPL, "stop": ["ok", ""]}, "stop", "empty"),
    ("/v1/completions", {**CMPL, "stop": 5}, "stop", "string"),
    ("/v1/completions", {**CMPL, "stop_token_ids": [-1]}, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {**CMPL, "seed": "x"}, "seed", "integer"),
    ("/v1/completions", {**CMPL, "seed": 2**64}, "seed", "2**63)"),  # the proto's int64
    ("/v1/completions", {**CMPL, "min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens"),
    ("/v1/completions", {**CMPL, "stream": "yes"}, "stream", "true or false"),
    ("/v1/completions", {**CMPL, "stream": True, "stream_options": 1}, "stream_options", "object"),
    (
        "/v1/completions",
        {**CMPL, "stream_options": {"include_usage": True}},
        "stream_options",
        "only allowed when stream is true",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "stream": False, "stream_options": {"include_usage": True}},
        "stream_options",
        "only allowed when stream is true",
    ),
    ("/v1/completions", {**CMPL, "mode": "fast"}, "mode", "colocated"),
    ("/v1/completions", {**CMPL, "kv_failure_policy": "retry"}, "kv_failure_policy", "recompute"),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "not supported"),
    ("/v1/completions", {**CMPL, "echo": "yes"}, "echo", "true or false"),
    ("/v1/completions", {**CMPL, "echo": True, "max_tokens": -1}, "max_tokens", ">= 0"),
    (
        "/v1/completions",
        {**CMPL, "echo": True, "max_tokens": 0, "min_tokens": 1},
        "min_tokens",
        "max_tokens (0)",
    ),
    ("/v1/completions", {**CMPL, "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ("/v1/completions", {**CMPL, "logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {**CMPL, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {**CMPL, "logit_bias": [1, 2]}, "logit_bias", "object"),
    ("/v1/completions", {**CMPL, "prompt": ""}, "prompt", "empty"),
    ("/v1/completions", {**CMPL, "prompt": []}, "prompt", "empty"),
    ("/v1/completions", {**CMPL, "prompt": ["a", ""]}, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL}, "prompt", "required"),
    ("/v1/completions", {**CMPL, "prompt": [1, "a"]}, "prompt", "list of token ids"),
    ("/v1/completions", {**CMPL, "prompt": [[5, 10**6]]}, "prompt", "vocabulary"),
    ("/v1/completions", {**CMPL, "max_tokens": MAX_MODEL_LEN}, "prompt", "max_model_len"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "non-empty list"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "non-empty list"),
    ("/v1/chat/completions", {**CHAT, "messages": ["hi"]}, "messages[0]", "object"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "function", "content": "x"}]},
        "messages[0].role",
        "one of",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
        "string",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
        "text part",
    ),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs", "true or false"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "[0, 2]"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", "with a name"),
    ("/v1/completions", {**CMPL, "tools": [{"type": "function"}]}, "tools", "not supported"),
]


@pytest.mark.parametrize(
    "path, body, param, in_message", BAD_REQUESTS, ids=[f"{param}:{msg}" for _, _, param, msg in BAD_REQUESTS]
)
def test_bad_request_is_400_naming_the_field(server, fake, path, body, param, in_message):
    status, got = post(server, path, body)
    assert status == 400, got
    error = got["error"]
    assert error["param"] == param and in_message in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert fake.inputs == []  # nothing reached the router


@pytest.mark.parametrize(
    "raw, in_message",
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON")],
)
def test_malformed_body_is_400(server, raw, in_message):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, got = post(server, path, raw=raw)
        assert status == 400 and in_message in got["error"]["message"]


def test_unknown_model_is_404(server, client):
    status, got = post(server, "/v1/completions", {**CMPL, "model": "gpt-4"})
    assert status == 404
    assert got["error"]["param"] == "model" and got["error"]["code"] == "model_not_found"
    assert "gpt-4" in got["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


def test_oversize_body_is_413(server):
    status, got = post(server, "/v1/completions", {**CMPL, "prompt": "x" * (65 * 1024)})
    assert status == 413 and str(64 * 1024) in got["error"]["message"]


@pytest.mark.parametrize(
    "error, status, code",
    [
        (ResourceExhausted("overloaded"), 429, "resource_exhausted"),
        (Unavailable("no worker"), 503, "unavailable"),
    ],
)
def test_service_error_before_first_delta_keeps_its_status(server, fake, error, status, code):
    fake.error = error
    for stream in (False, True):
        got_status, got = post(server, "/v1/completions", {**CMPL, "stream": stream})
        assert got_status == status and got["error"]["code"] == code
        assert got["error"]["message"] == str(error)


def test_service_error_mid_stream_is_an_error_event(client, fake):
    fake.error, fake.error_after = ServiceError("KV chunk corrupt"), 1
    stream = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=5, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="KV chunk corrupt"):
        for chunk in stream:
            got.append(chunk)
    assert len(got) == 1  # the delta before the error


def test_unexpected_exception_is_500_with_request_id(server, fake, caplog):
    fake.error = RuntimeError("boom")
    status, got = post(server, "/v1/completions", CMPL)
    assert status == 500 and got["error"]["type"] == "server_error"
    request_id = fake.inputs[0].request_id.rsplit("-", 1)[0]
    assert request_id in got["error"]["message"]
    assert "boom" not in got["error"]["message"]  # internals stay in the log


def test_unknown_route_is_json_404(server):
    status, content_type, text = get(server, "/v1/nothing")
    assert status == 404 and content_type.startswith("application/json")
    assert json.loads(text)["error"]["message"].startswith("Not Found")


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
def test_stream_chunks_are_the_bytes_of_the_whole_chunk_encoded(chat, include_usage):
    """_chunk_encoder encodes a stream's repeated fields once: every chunk is still exactly
    _sse(chunk_json(...)), with "usage": null where stream_options.include_usage."""
    from services.openai.responses import chunk_json
    from services.openai.server import _chunk_encoder, _sse

    rid, created, model = 'cmpl-"quoted"\u00e9', 1_700_000_000, "m\u00fcdel/\\x"
    chunk = _chunk_encoder(rid, created, model, chat, include_usage)
    usage_null = {"usage": None} if include_usage else {}
    for choices in (
        [{"index": 0, "text": 'caf\u00e9 \U0001f600 "\n', "logprobs": None, "finish_reason": None}],
        [{"index": 1, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}],
        [],
    ):
        assert chunk(choices) == _sse(chunk_json(rid, created, model, chat, choices, **usage_null))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunk([], usage=usage) == _sse(chunk_json(rid, created, model, chat, [], usage=usage))


# ---- client disconnect ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_without_cancellation(fake, registry):
    srv = Server(build_app(fake, registry), handler_cancellation=False)
    yield srv
    srv.stop()


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["start_http", "plain-runner"])
def test_client_disconnect_cancels_generate(request, fake, stream, handler_cancellation, n):
    """One choice runs on the handler's task (_one_choice), several on a task each (_run_choices):
    either way a client that goes away ends every generation within a second."""
    srv = request.getfixturevalue("server" if handler_cancellation else "server_without_cancellation")
    fake.hang = True
    body = json.dumps({**CMPL, "stream": stream, "n": n}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head + body)
        if stream:
            received = b""
            while b"data: " not in received:
                received += sock.recv(65536)
        else:
            assert _wait_for(lambda: len(fake.inputs) == n, 5)
    closed_at = time.monotonic()
    rids = [inp.request_id for inp in fake.inputs]
    assert _wait_for(lambda: all(fake.ended.get(r) in ("cancelled", "closed") for r in rids), 1.0), fake.ended
    assert time.monotonic() - closed_at < 1.0


# ---- models, health, metrics --------------------------------------------------------------------


def test_models(client, server):
    [model] = client.models.list().data
    assert (
        model.id == MODEL and model.object == "model" and model.model_extra["max_model_len"] == MAX_MODEL_LEN
    )
    assert client.models.retrieve(MODEL).id == MODEL
    assert get(server, "/v1/models/other")[0] == 404


def test_health(server):
    assert get(server, "/health")[0::2] == (200, '{"status": "ok"}')


def test_metrics(server):
    status, content_type, text = get(server, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert "pdserve_test_requests_total 3.0" in text


def test_metrics_without_registry(fake):
    srv = Server(build_app(fake))
    try:
        assert get(srv, "/metrics")[0::2] == (200, "")
    finally:
        srv.stop()


# ---- hostile bodies: 400 naming the field and the limit, never a 500 ------------------------------


HOSTILE_BODIES = [
    ("/v1/completions", {**CMPL, "stop": ["ok", "x" * 1025]}, "stop", "stop[1] has 1025 characters"),
    ("/v1/completions", {**CMPL, "seed": 2**63}, "seed", "[-2**63, 2**63)"),
    ("/v1/completions", {**CMPL, "top_k": 2**31}, "top_k", "< 2**31"),
    ("/v1/completions", {**CMPL, "prompt": "a\ud800"}, "prompt", "lone surrogate (\\ud800)"),
    ("/v1/completions", {**CMPL, "stop": ["\udfff"]}, "stop", "lone surrogate (\\udfff)"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi \ud83d"}]},
        "messages",
        "lone surrogate (\\ud83d)",
    ),
]


@pytest.mark.parametrize(
    "path, body, param, in_message",
    HOSTILE_BODIES,
    ids=[
        "stop-1025-chars",
        "seed-2**63",
        "top_k-2**31",
        "prompt-surrogate",
        "stop-surrogate",
        "chat-surrogate",
    ],
)
def test_hostile_body_is_400_naming_the_field(server, fake, path, body, param, in_message):
    status, got = post(server, path, body)  # json.dumps escapes lone surrogates as "\udXXX"
    assert status == 400, got
    assert got["error"]["param"] == param and in_message in got["error"]["message"], got
    assert fake.inputs == []


@pytest.mark.parametrize("depth", [65, 10_000])
def test_deeply_nested_body_is_400(server, fake, depth):
    raw = b'{"model": "%s", "prompt": %s}' % (MODEL.encode(), b"[" * (depth - 1) + b"]" * (depth - 1))
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, got = post(server, path, raw=raw)
        assert status == 400, got
        assert got["error"]["message"] == "prompt nests deeper than 64 levels"
        assert got["error"]["param"] == "prompt"
    assert fake.inputs == []
