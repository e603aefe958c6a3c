"""vLLM's /tokenize, /detokenize and /tokenizer_info on the OpenAI front, over the fake Frontend of
test_openai_front.py (the tiny model's real tokenizer), with raw HTTP and lm-eval's own probe:
text round-trips, messages give the chat template's ids (the very ids /v1/chat/completions sends),
what a client controls is bounded (400s naming the field and the limit), and a configured API key
is required, as on /v1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from engine.tokenizer import Tokenizer
from services.common.security import ApiKeys
from services.openai.server import build_app
from tests.test_openai_front import MODEL, FakeFrontend, Server

MAX_MODEL_LEN = 1024
"""Room for a chat with tools on the chat route too (the fake's own is 64)."""
KEY = "sk-tokenizer-test"
TEXTS = ["def f(x):\n    return x + 1", "héllo wörld ✓ 日本語 🙂", "  two  spaces\tand a tab", ""]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object", "properties": {"utc_offset": {"type": "integer"}}},
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What time is it in Paris?"},
]


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer(tiny_model)


class Fake(FakeFrontend):
    max_model_len = MAX_MODEL_LEN


@pytest.fixture(scope="module")
def fake(tok) -> FakeFrontend:
    return Fake(tok)


@pytest.fixture(scope="module")
def server(fake):
    srv = Server(build_app(fake))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(fake):
    srv = Server(build_app(fake, api_keys=ApiKeys((KEY,))))
    yield srv
    srv.stop()


def call(server: Server, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a POST (with a body) or GET."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("text", TEXTS, ids=["code", "unicode", "whitespace", "empty"])
def test_tokenize_then_detokenize_gives_the_text_back(server, tok, text):
    status, out = call(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert status == 200, out
    assert out == {
        "count": len(out["tokens"]),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tok.encode(text, add_special_tokens=False),
        "token_strs": None,
    }
    assert call(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}) == (200, {"prompt": text})
    # By default a prompt gets the tokenizer's BOS, which detokenizes as its text (kept).
    status, with_bos = call(server, "/tokenize", {"prompt": text})
    assert with_bos["tokens"] == [tok.bos_token_id, *out["tokens"]]
    assert call(server, "/detokenize", {"tokens": with_bos["tokens"]}) == (
        200,
        {"prompt": tok.bos_token + text},
    )


def test_token_strs_are_the_vocabularys_pieces(server, tok):
    status, out = call(server, "/tokenize", {"prompt": TEXTS[1], "return_token_strs": True})
    assert status == 200 and out["token_strs"] == [tok.tokenizer.id_to_token(i) for i in out["tokens"]]
    assert len(out["token_strs"]) == out["count"] and out["token_strs"][0] == tok.bos_token


def test_messages_give_the_chat_templates_ids_and_the_chat_routes_prompt(server, fake, tok, tiny_model):
    for tools, add_generation_prompt in ((None, True), (TOOLS, True), (None, False)):
        body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
        body |= {"tools": tools} if tools else {}
        status, out = call(server, "/tokenize", body)
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tools=tools)
        assert status == 200 and out["tokens"] == tok.encode(text, add_special_tokens=False)
        assert out["tokens"][0] == tok.bos_token_id and out["tokens"][1] != tok.bos_token_id
        if add_generation_prompt:  # the prompt the chat route generates from
            fake.reset()
            chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1} | (
                {"tools": tools} if tools else {}
            )
            assert call(server, "/v1/chat/completions", chat)[0] == 200
            assert fake.inputs[0].prompt_token_ids == out["tokens"]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    assert call(server, "/tokenize", {"messages": MESSAGES})[1]["tokens"] == list(want)


def test_tokenizer_info_is_the_tokenizer_config(server, tok):
    status, info = call(server, "/tokenizer_info")
    assert status == 200
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"]
    assert info["add_bos_token"] is True
    added = info.get("added_tokens_decoder", {})
    assert all(isinstance(v, str) for v in added.values())


BAD = [  # "V" in tokens stands for the vocabulary size, "LONG" for a prompt just too long to fit
    (
        "/detokenize",
        {"tokens": [5, "V"]},
        "tokens",
        "tokens[1] is {V}, not a token id in the vocabulary [0, {V})",
    ),
    ("/detokenize", {"tokens": [-1]}, "tokens", "tokens[0] is -1, not a token id in the vocabulary"),
    ("/detokenize", {"tokens": [True]}, "tokens", "tokens[0] is True"),
    ("/detokenize", {"tokens": ["7"]}, "tokens", "tokens[0] is '7'"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "tokens must be a list of token ids"),
    ("/detokenize", {}, "tokens", "tokens must be a list"),
    (
        "/detokenize",
        {"tokens": [1] * (MAX_MODEL_LEN + 1)},
        "tokens",
        f"tokens has {MAX_MODEL_LEN + 1} ids, more than the limit of max_model_len ({MAX_MODEL_LEN})",
    ),
    ("/tokenize", {}, "prompt", "send either prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt", "send either prompt"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt must be a string"),
    ("/tokenize", {"prompt": "LONG"}, "prompt", f"cannot fit in max_model_len ({MAX_MODEL_LEN} tokens)"),
    (
        "/tokenize",  # within the byte bound, past the tokens (one per "?!" pair and more)
        {"prompt": "SPELLED"},
        "prompt",
        f"tokens, more than the limit of max_model_len ({MAX_MODEL_LEN})",
    ),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "true or false"),
    ("/tokenize", {"messages": []}, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "code"}]}, "tools[0].type", "must be 'function'"),
    (
        "/tokenize",
        {"messages": MESSAGES, "continue_final_message": True},
        "continue_final_message",
        "not supported",
    ),
]


@pytest.mark.parametrize("path, body, param, message", BAD, ids=[f"{p}:{m[:30]}" for p, _, _, m in BAD])
def test_a_bad_request_is_a_400_naming_the_field_and_limit(server, fake, tok, path, body, param, message):
    vocab = fake.vocab_size
    if isinstance(body.get("tokens"), list):
        body = {"tokens": [vocab if t == "V" else t for t in body["tokens"]]}
    if body.get("prompt") == "LONG":
        body = {"prompt": "a" * (tok.max_prompt_bytes(MAX_MODEL_LEN) + 1)}
    if body.get("prompt") == "SPELLED":  # characters that each take a token of their own
        body = {"prompt": " ".join("?" * (MAX_MODEL_LEN + 1))}
        assert len(body["prompt"].encode()) <= tok.max_prompt_bytes(MAX_MODEL_LEN)
        assert len(tok.encode(body["prompt"])) > MAX_MODEL_LEN
    status, out = call(server, path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert message.format(V=vocab) in out["error"]["message"], out


def test_an_unknown_model_is_404(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, out = call(server, path, body | {"model": "gpt-4"})
        assert status == 404 and out["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "path, body",
    [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]}), ("/tokenizer_info", None)],
    ids=["tokenize", "detokenize", "tokenizer_info"],
)
def test_a_configured_api_key_is_required(keyed, path, body):
    for key, message in ((None, "missing API key"), ("sk-wrong", "invalid API key")):
        status, out = call(keyed, path, body, key)
        assert status == 401 and out["error"]["code"] == "invalid_api_key", out
        assert message in out["error"]["message"]
    assert call(keyed, path, body, KEY)[0] == 200


def test_lm_evals_probe_finds_the_endpoints_with_the_key(keyed, server, tok):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")
    assert check_remote_tokenizer_support(keyed.url + "/v1/completions", auth_token=KEY)
    assert not check_remote_tokenizer_support(keyed.url + "/v1/completions", max_retries=1)
    remote = RemoteTokenizer(keyed.url + "/v1/completions", auth_token=KEY, max_retries=1)
    ids = remote.encode(TEXTS[1])
    assert ids == tok.encode(TEXTS[1], add_special_tokens=False) and remote.decode(ids) == TEXTS[1]
    assert (remote.eos_token_id, remote.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)
