"""OpenAI request bodies to engine inputs (responses.py builds the answers), and the error body.

Nothing here does I/O, so `server.py` stays a thin layer of handlers. Parsing is strict about
types and ranges (an `ApiError` names the field in `param` and the limit in its message) and
lenient about fields it does not know, as OpenAI's API is. Fields that would silently change the
meaning of a request if ignored (`suffix`, `best_of`, `echo` on chat, and `tools` on completions)
are rejected instead. Structured output (`response_format`, ...) is read by structured.py, tool
calling (`tools`, `tool_choice`, tool messages) by tools.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.tokenizer import Tokenizer
from services.openai.structured import StructuredOutputError, structured_outputs
from services.router.api import (
    CHAT_ROLES,
    MAX_STOP,
    MAX_TEMPERATURE,
    ConstraintCheck,
    Frontend,
    GenerateInput,
    KvFailurePolicy,
    ServingMode,
    check_prompt_bytes,
    check_prompt_logprobs,
    echo_text,
    prepare_echo,
)
from services.router.tools import ToolError, ToolRequest, conflict, tool_call_id, tool_calls, tool_request

MAX_N = 16
"""Most samples per prompt (`n`)."""
MAX_PROMPTS = 64
"""Most prompts in one batched /v1/completions request."""
DEFAULT_MAX_TOKENS = 16
"""/v1/completions' max_tokens when none is given (OpenAI's default). Chat defaults to the rest of
the context window instead."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in a request body (a chat request needs 4)."""
API_SEED_RANGE = (-(2**63), 2**63)
"""Seeds this API takes (half-open): the proto's int64. The offline engine takes more (u64 too)."""
MAX_TOP_K = 2**31 - 1
"""Largest top_k: the proto's int32."""
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """A request error the client sees as OpenAI's error body, with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Field names an engine ValueError may start with ("temperature must be ..."): the param it names.
_PARAMS = {
    *(f.name for f in dataclasses.fields(SamplingParams)),
    *("prompt", "messages", "n", "model", "stream_options", "max_completion_tokens", "top_logprobs"),
}


def param_from_message(message: str) -> str | None:
    """The request field a ValueError message starts with, if it is one ("prompt_token_ids[3] ..." → prompt)."""
    match = re.match(r"[a-z_]+", message)
    if match is None:
        return None
    word = match.group(0)
    if word.startswith("prompt_token_ids"):
        return "prompt"
    return word if word in _PARAMS else None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, nested at most MAX_JSON_DEPTH deep, whose strings (keys
    included) are all valid Unicode: JSON's \\u escapes can spell lone surrogates, which no
    tokenizer or encoder accepts."""

    def too_deep(field: str | None) -> ApiError:
        where = f"{field} nests" if field else "request body nests"
        return ApiError(f"{where} deeper than {MAX_JSON_DEPTH} levels", field)  # None: not in a field

    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # nested past the parser's own limit (~1000)
        raise too_deep(_deep_field(raw)) from None
    if not isinstance(body, dict):
        raise ApiError(f"request body must be a JSON object, got {type(body).__name__}")
    # Iterative walk: (value, depth, the top-level field it belongs to).
    todo: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while todo:
        value, depth, field = todo.pop()
        if isinstance(value, str):
            _check_unicode(value, field)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(field)
        if isinstance(value, list):
            todo.extend((item, depth + 1, field) for item in value)
            continue
        for key, item in value.items():
            _check_unicode(key, field)
            todo.append((item, depth + 1, key if field is None else field))
    return body


def _deep_field(raw: bytes) -> str | None:
    """The top-level field of a JSON object text in which it nests past MAX_JSON_DEPTH (None: not
    inside one): a linear scan, for a body too deep for the parser to say."""
    depth, key, in_string, escaped, start = 0, None, False, False, 0
    for i, byte in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # the closing quote
                in_string = False
                if depth == 1:
                    candidate = raw[start:i]
            continue
        if byte == 0x22:
            in_string, start = True, i + 1
        elif byte == 0x3A and depth == 1:  # a top-level key's colon
            key = candidate.decode("utf-8", "replace")
        elif byte in (0x7B, 0x5B):  # { [
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif byte in (0x7D, 0x5D):
            depth -= 1
    return None


def _check_unicode(text: str, field: str | None) -> None:
    """Raise naming the top-level field that text is in (None: text is a top-level field name)."""
    bad = _SURROGATE.search(text)
    if bad is not None:
        where = field if field is not None else "a field name"
        raise ApiError(
            f"{where} contains a lone surrogate (\\u{ord(bad.group()):04x}), which is not valid Unicode",
            field,
        )


# ---- field readers: None means absent, as OpenAI clients send null for unset fields -------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise ApiError(f"{name} must be an integer, got {_show(value)}", name)
    if value < lo or (hi is not None and value > hi):
        limit = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ApiError(f"{name} must be an integer {limit}, got {value}", name)
    return value


def _number(
    body: dict, name: str, default: float, lo: float, hi: float | None, lo_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ApiError(f"{name} must be a finite number, got {_show(value)}", name)
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        low = f"({lo:g}" if lo_open else f"[{lo:g}"
        limit = f"in {low}, {hi:g}]" if hi is not None else (f"> {lo:g}" if lo_open else f">= {lo:g}")
        raise ApiError(f"{name} must be {limit}, got {value!r}", name)
    return float(value)


def read_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {_show(value)}", name)
    return value


def _enum(body: dict, name: str, enum: type, default):
    value = body.get(name)
    if value is None:
        return default
    allowed = [e.value for e in enum]
    if value not in allowed:
        raise ApiError(f"{name} must be one of {allowed}, got {_show(value)}", name)
    return enum(value)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError("stop must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise ApiError(f"stop has {len(stop)} strings, more than the limit of {MAX_STOP}", "stop")
    if not all(stop):
        raise ApiError("stop strings must not be empty", "stop")
    return stop


def _token_ids(body: dict, name: str, vocab_size: int) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise ApiError(f"{name} must be a list of integers", name)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"{name} entry {bad} is outside the vocabulary [0, {vocab_size})", name)
    return ids


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token id (as a string key) -> bias in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    bias = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise ApiError(f"logit_bias key {_show(key)} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise ApiError(f"logit_bias key {tok} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise ApiError(
                f"logit_bias[{key}] must be a number in [-100, 100], got {_show(value)}", "logit_bias"
            )
        bias[tok] = float(value)
    return bias or None


def _reject_unsupported(body: dict, chat: bool) -> None:
    unsupported = {
        "echo": chat and body.get("echo") not in (None, False),
        "suffix": body.get("suffix") not in (None, ""),
        "best_of": body.get("best_of") not in (None, 1),
        "tools": not chat and bool(body.get("tools")),
    }
    for name, bad in unsupported.items():
        if bad:
            raise ApiError(f"{name} is not supported by this server", name)


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(
            f"The model {_show(model)} does not exist; this server serves {model_name!r}",
            "model",
            status=404,
            code="model_not_found",
        )


# ---- requests -------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A validated /v1/completions or /v1/chat/completions request in engine terms."""

    chat: bool
    """Chat completion (message/delta choices) rather than text completion."""
    prompts: list[list[int]]
    """Token ids of each prompt; chat has exactly one."""
    params: SamplingParams
    """Shared by every choice; generate_inputs offsets the seed per sample."""
    n: int
    """Samples per prompt; choice index = prompt index * n + sample index."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: send a usage chunk before [DONE]."""
    mode: ServingMode = ServingMode.AUTO
    kv_failure_policy: KvFailurePolicy = KvFailurePolicy.FAIL
    echo: list[str] | None = None
    """/v1/completions `echo`: each prompt's text, returned before its completion (and with
    logprobs, its tokens' logprobs before the completion's). None: no echo."""
    score_only: bool = False
    """max_tokens 0 with echo: score the prompts, generate nothing (GenerateInput.score_only)."""
    prompt_logprobs: int | None = None
    """The request's own `prompt_logprobs` (the response's field of that name); params may ask
    the engine for more when echo needs them."""
    tools: ToolRequest | None = None
    """Chat `tools`: the output is parsed for calls unless tool_choice is "none"."""
    checks: list[ConstraintCheck] = dataclasses.field(default_factory=list)
    """Constraints the grammar library must accept before the request runs (the front awaits
    Frontend.check_constraints)."""

    @property
    def top_logprobs(self) -> int | None:
        """Alternatives per token in the response's logprobs; None when logprobs were not asked for."""
        return self.params.logprobs

    def generate_inputs(self, request_id: str) -> list[GenerateInput]:
        """One GenerateInput per choice, with request id `{request_id}-{index}`. With a seed, sample
        i uses seed + i (wrapped into the seed range) so the n samples differ, as in vLLM. The n
        samples of a prompt share its prefill: the first computes it, the others wait for it and
        take its blocks from the prefix cache (GenerateInput.after)."""
        inputs = []
        for p, prompt in enumerate(self.prompts):
            first_prefilled = asyncio.Event() if self.n > 1 else None
            for i in range(self.n):
                params = dataclasses.replace(self.params)
                if params.seed is not None:
                    lo, hi = API_SEED_RANGE
                    params.seed = (params.seed + i - lo) % (hi - lo) + lo
                request = f"{request_id}-{p * self.n + i}"
                inputs.append(
                    GenerateInput(
                        request,
                        list(prompt),
                        params,
                        self.mode,
                        self.kv_failure_policy,
                        score_only=self.score_only,
                        prefilled=first_prefilled if i == 0 else None,
                        after=first_prefilled if i > 0 else None,
                    )
                )
        return inputs


def check_logprob_entries(parsed: ParsedRequest) -> None:
    """Refuse a response whose prompt logprobs (echo with logprobs, or prompt_logprobs) would pass
    the limit (check_prompt_logprobs), naming the field that asks for them."""
    field = "logprobs" if parsed.echo is not None else "prompt_logprobs"
    tokens = sum(len(p) for p in parsed.prompts) * parsed.n
    try:
        check_prompt_logprobs(tokens, parsed.params.prompt_logprobs, field)
    except ValueError as e:
        raise ApiError(str(e), field) from None


def check_text_bytes(text: str, tokenizer: Tokenizer, max_model_len: int) -> None:
    try:
        check_prompt_bytes(len(text.encode("utf-8", "surrogatepass")), tokenizer, max_model_len)
    except ValueError as e:
        raise ApiError(str(e), "prompt") from None


def generations(body: dict, chat: bool) -> tuple[int, int]:
    """(prompts, n) a request asks for, read cheaply before anything is tokenized: its admission
    weight is their product. ApiError for a bad `n`."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and not all(_is_int(t) for t in prompt)
    return (len(prompt) if batched and not chat else 1), _int(body, "n", 1, 1, MAX_N)


def _completion_prompts(
    body: dict, tokenizer: Tokenizer, vocab_size: int, max_model_len: int
) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids, and its text when it was given as text."""
    prompt = body.get("prompt")
    usage = "prompt must be a string, a list of token ids, or a list of either (a batch)"
    if prompt is None:
        raise ApiError("prompt is required", "prompt")
    if prompt == "" or prompt == []:
        raise ApiError("prompt must not be empty", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise ApiError(usage, "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(f"prompt holds {len(prompt)} prompts, more than the limit of {MAX_PROMPTS}", "prompt")
    prompts, texts = [], []
    for p in prompt:
        if isinstance(p, str) and p:
            check_text_bytes(p, tokenizer, max_model_len)
            prompts.append(tokenizer.encode(p))
            texts.append(p)
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            bad = next((t for t in p if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ApiError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
            prompts.append(list(p))
            texts.append(None)
        elif p == "" or p == []:
            raise ApiError("prompt must not be empty", "prompt")
        else:
            raise ApiError(usage, "prompt")
    return prompts, texts


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}}", where)
        texts.append(part["text"])
    return "".join(texts)


def _chat_message(message: Any, i: int) -> dict:
    """One request message as the template takes it: role, content, and an assistant's
    `tool_calls` or a tool result's `tool_call_id`."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ApiError(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        where = f"{where}.role"
        raise ApiError(f"{where} must be one of {list(CHAT_ROLES)}, got {_show(role)}", where)
    out: dict[str, Any] = {"role": CHAT_ROLES[role]}
    content = message.get("content")
    try:
        calls = tool_calls(message, where) if role == "assistant" else []
        if role == "tool":
            out["tool_call_id"] = tool_call_id(message, where)
    except ToolError as e:
        raise ApiError(str(e), e.param) from None
    if calls:
        out["tool_calls"] = calls
        # A call's content may be null: DeepSeek's own template tells null from "".
        out["content"] = None if content is None else _message_text(content, f"{where}.content")
    else:
        out["content"] = _message_text(content, f"{where}.content")
    return out


def chat_prompt_ids(
    body: dict,
    tokenizer: Tokenizer,
    max_model_len: int,
    tools: ToolRequest | None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Render the messages (and tools) with the model's chat template. The template writes the BOS
    itself, so the text is encoded without special tokens: the ids HF's
    apply_chat_template(tokenize=True) gives (add_special_tokens: a BOS too where the text has none,
    as /tokenize may ask)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {role, content} objects", "messages")
    rendered = [_chat_message(message, i) for i, message in enumerate(messages)]
    texts = [m["content"] or "" for m in rendered]
    texts += [c["function"]["arguments"] for m in rendered for c in m.get("tool_calls", ())]
    if tools is not None:
        texts.append(json.dumps(tools.tools, ensure_ascii=False))
    check_text_bytes("".join(texts), tokenizer, max_model_len)
    add_generation_prompt = read_bool(body, "add_generation_prompt", True)
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            add_generation_prompt=add_generation_prompt,
            tools=tools.tools if tools is not None else None,
        )
    except (jinja2.TemplateError, ValueError) as e:
        raise ApiError(f"messages could not be rendered with the chat template: {e}", "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise ApiError("messages render to an empty prompt", "messages")
    return ids


def _sampling(
    body: dict, max_tokens: int, logprobs: int | None, vocab_size: int
) -> tuple[SamplingParams, list[ConstraintCheck]]:
    """The sampling fields, and the structured-output constraint's check (none or one)."""
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k == 0 or not -1 <= top_k <= MAX_TOP_K):
        raise ApiError(
            f"top_k must be -1 (disabled) or an integer >= 1 and < 2**31, got {_show(top_k)}", "top_k"
        )
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and API_SEED_RANGE[0] <= seed < API_SEED_RANGE[1]):
        raise ApiError(f"seed must be an integer in [-2**63, 2**63), got {_show(seed)}", "seed")
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=-1 if top_k is None else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, None, lo_open=True),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        max_tokens=max_tokens,
        min_tokens=_int(body, "min_tokens", 0, 0),
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids", vocab_size),
        ignore_eos=read_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        prompt_logprobs=_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS),
        skip_special_tokens=read_bool(body, "skip_special_tokens", True),
        logit_bias=_logit_bias(body, vocab_size),
    )
    check = _structured_outputs(body)
    if check is not None:
        params.structured_outputs = check.params
    try:  # the engine's own checks (min_tokens <= max_tokens, ...) as a backstop
        params.validate(vocab_size)
    except ValueError as e:
        raise ApiError(str(e), param_from_message(str(e))) from None
    return params, [] if check is None else [check]


def _structured_outputs(body: dict):
    """response_format, structured_outputs or guided_* (services/openai/structured.py)."""
    try:
        return structured_outputs(body)
    except StructuredOutputError as e:
        raise ApiError(str(e), e.param) from None


def _common(body: dict) -> dict[str, Any]:
    stream = read_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    if options is not None and not stream:  # OpenAI and vLLM refuse it too: it would be ignored
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError("stream_options.include_usage must be true or false", "stream_options")
    return {
        "n": _int(body, "n", 1, 1, MAX_N),
        "stream": stream,
        "include_usage": stream and bool(include_usage),
        "mode": _enum(body, "mode", ServingMode, ServingMode.AUTO),
        "kv_failure_policy": _enum(body, "kv_failure_policy", KvFailurePolicy, KvFailurePolicy.FAIL),
    }


def parse_completion(body: dict, frontend: Frontend) -> ParsedRequest:
    """A /v1/completions body. Raises ApiError; frontend.validate is the caller's next step.
    With echo, max_tokens may be 0: the prompts are scored (lm-eval's loglikelihood requests)."""
    check_model(body, frontend.model_name)
    _reject_unsupported(body, chat=False)
    echo = read_bool(body, "echo", False)
    tokenizer = frontend.tokenizer
    prompts, texts = _completion_prompts(body, tokenizer, frontend.vocab_size, frontend.max_model_len)
    if not echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0:
        raise ApiError(
            "max_tokens must be an integer >= 1 (0 only with echo, to score the prompt), got 0", "max_tokens"
        )
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, 0 if echo else 1)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    params, checks = _sampling(body, max(max_tokens, 1), logprobs, frontend.vocab_size)
    parsed = ParsedRequest(
        chat=False,
        prompts=prompts,
        params=params,
        prompt_logprobs=params.prompt_logprobs,
        checks=checks,
        **_common(body),
    )
    if echo:
        params.max_tokens = max_tokens  # checked as 1 above; prepare_echo runs 0 (score only) as 1
        try:
            parsed.score_only = prepare_echo(params)
        except ValueError as e:
            raise ApiError(str(e), param_from_message(str(e))) from None
        parsed.echo = [echo_text(t, ids, params, tokenizer) for t, ids in zip(texts, prompts, strict=True)]
    check_logprob_entries(parsed)
    return parsed


def parse_chat(body: dict, frontend: Frontend) -> ParsedRequest:
    """A /v1/chat/completions body. max_completion_tokens wins over max_tokens; with neither, the
    request may use the rest of the context window (as vLLM)."""
    check_model(body, frontend.model_name)
    _reject_unsupported(body, chat=True)
    try:
        tools = tool_request(body)
    except ToolError as e:
        raise ApiError(str(e), e.param) from None
    prompt = chat_prompt_ids(body, frontend.tokenizer, frontend.max_model_len, tools)
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", max(1, frontend.max_model_len - len(prompt)), 1)
    want_logprobs = read_bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not want_logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", "top_logprobs")
    params, checks = _sampling(body, max_tokens, (top or 0) if want_logprobs else None, frontend.vocab_size)
    constraint = tools.constraint() if tools is not None else None
    if constraint is not None:  # tool_choice "required" or a named function
        if params.structured_outputs is not None:
            error = conflict(tools)
            raise ApiError(str(error), error.param)
        params.structured_outputs = constraint
        checks = tools.checks()
    parsed = ParsedRequest(
        chat=True,
        prompts=[prompt],
        params=params,
        prompt_logprobs=params.prompt_logprobs,
        tools=tools,
        checks=checks,
        **_common(body),
    )
    check_logprob_entries(parsed)
    return parsed
