"""vLLM's tokenizer endpoints on the OpenAI server: POST /tokenize, POST /detokenize and GET
/tokenizer_info, at the root as vLLM serves them (lm-eval's `remote` tokenizer backend finds a
server by /tokenizer_info's eos_token, encodes with /tokenize {"prompt", "add_special_tokens":
false} and decodes with /detokenize {"tokens"}; its local-completions model picks that backend by
itself when the server answers them).

- /tokenize: {model?, prompt: a string} or {model?, messages, add_generation_prompt?, tools?} ->
  {count, max_model_len, tokens, token_strs}. add_special_tokens defaults to true for a prompt and
  false for messages (the template writes the BOS); token_strs holds the vocabulary's pieces with
  return_token_strs, else null. Messages render as /v1/chat/completions renders them, tools
  included, so the ids are its prompt's.
- /detokenize: {model?, tokens} -> {prompt}, special tokens kept in the text.
- /tokenizer_info: the tokenizer's tokenizer_config.json, special tokens as their text (the
  added-token table as id -> text), with tokenizer_class and the chat_template the server renders.

Bounds as on the generation routes: a prompt (or messages) of more bytes than max_model_len
tokens could take is refused before it is tokenized, and one of more than max_model_len tokens
after; at most max_model_len tokens are decoded,
each inside the vocabulary; every error is a 400 naming the field and the limit. The routes sit
behind the API key when one is configured (`PATHS`), and tokenizing holds admission as a request.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.openai.limits import read_body
from services.openai.protocol import (
    ApiError,
    chat_prompt_ids,
    check_model,
    check_text_bytes,
    parse_json,
    read_bool,
)
from services.router.api import Frontend
from services.router.tools import ToolError, tool_request

PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
"""The routes this module serves; they need the API key as /v1/* routes do."""


def tokenize(body: dict, frontend: Frontend) -> dict:
    """POST /tokenize's answer for a parsed body; ApiError naming the field."""
    check_model(body, frontend.model_name)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ApiError("send either prompt (a string) or messages (a chat)", "prompt")
    want_strs = read_bool(body, "return_token_strs", False)
    tok = frontend.tokenizer
    if messages is not None:
        if read_bool(body, "continue_final_message", False):
            raise ApiError("continue_final_message is not supported by this server", "continue_final_message")
        try:
            tools = tool_request({"tools": body.get("tools")})
        except ToolError as e:
            raise ApiError(str(e), e.param) from None
        add = read_bool(body, "add_special_tokens", False)
        ids = chat_prompt_ids(body, tok, frontend.max_model_len, tools, add_special_tokens=add)
    else:
        if not isinstance(prompt, str):
            raise ApiError("prompt must be a string", "prompt")
        check_text_bytes(prompt, tok, frontend.max_model_len)
        ids = tok.encode(prompt, add_special_tokens=read_bool(body, "add_special_tokens", True))
    if len(ids) > frontend.max_model_len:  # the byte bound lets through what no request could run
        field = "messages" if messages is not None else "prompt"
        raise ApiError(
            f"{field} has {len(ids)} tokens, more than the limit of max_model_len ({frontend.max_model_len})",
            field,
        )
    return {
        "count": len(ids),
        "max_model_len": frontend.max_model_len,
        "tokens": ids,
        "token_strs": [tok.tokenizer.id_to_token(i) for i in ids] if want_strs else None,
    }


def detokenize(body: dict, frontend: Frontend) -> dict:
    """POST /detokenize's answer for a parsed body; ApiError naming `tokens` and the limit."""
    check_model(body, frontend.model_name)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise ApiError("tokens must be a list of token ids", "tokens")
    if len(ids) > frontend.max_model_len:
        raise ApiError(
            f"tokens has {len(ids)} ids, more than the limit of max_model_len ({frontend.max_model_len})",
            "tokens",
        )
    vocab = frontend.vocab_size
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            shown = repr(t) if len(repr(t)) <= 40 else repr(t)[:37] + "..."
            raise ApiError(f"tokens[{i}] is {shown}, not a token id in the vocabulary [0, {vocab})", "tokens")
    return {"prompt": frontend.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(frontend: Frontend) -> dict:
    """GET /tokenizer_info: tokenizer_config.json as vLLM returns it (special tokens as text), the
    chat template the server renders, and tokenizer_class."""
    tok = frontend.tokenizer
    info = {k: _as_text(v) for k, v in tok.config.items() if k not in ("vocab_file", "merges_file")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info["chat_template"] = tok.chat_template
    return info


def _as_text(value: Any) -> Any:
    """A token written as {"content": ...} (an AddedToken) as its text, anywhere in value."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    return value


class TokenizerRoutes:
    """The handlers; parsing and (de)tokenizing run off the event loop, under admission."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.info = tokenizer_info(frontend)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._run(request, detokenize)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def _run(self, request: web.Request, fn) -> web.Response:
        client = self.frontend.client(request.headers.get("Authorization"), request.remote)
        body = await self.frontend.prepare(client, parse_json, await read_body(request))
        async with self.frontend.admit(1, None):
            return web.json_response(await self.frontend.prepare(client, fn, body, self.frontend))
