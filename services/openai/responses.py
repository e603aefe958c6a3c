"""Engine deltas to OpenAI response bodies: choices, logprobs in both formats, usage, chunks.

Nothing here does I/O. `ChoiceOutput` follows one choice through its deltas, so the streaming and
the non-streaming paths build their JSON the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tokenizers import decoders

from engine.tokenizer import Tokenizer
from services.router.api import Delta, Frontend, Usage
from services.router.tool_parser import ToolCallParser
from services.router.tools import ToolRequest

LOGPROB_FLOOR = -9999.0
"""-inf (and NaN) logprobs are sent as this: JSON has no infinity (vLLM does the same)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, reversed: how byte-level BPE pieces map to bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


class TokenStrings:
    """Token id → (text, raw bytes) for logprobs. A byte-level piece maps back to its exact bytes,
    which may end inside a UTF-8 character (its text then shows U+FFFD, as in vLLM)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer.tokenizer
        self._bytes_of = _byte_decoder() if isinstance(self._tok.decoder, decoders.ByteLevel) else None
        self._cache: dict[int, tuple[str, bytes]] = {}
        self.special = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        """Ids of the special tokens: skip_special_tokens leaves them out of the text."""

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        if token_id not in self._cache:
            piece = self._tok.id_to_token(token_id) or ""
            if self._bytes_of is not None and all(c in self._bytes_of for c in piece):
                raw = bytes(self._bytes_of[c] for c in piece)
            else:  # added/special tokens are stored as plain text
                raw = (self._tok.decode([token_id], skip_special_tokens=False) or piece).encode()
            self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return self._cache[token_id]


def _lp(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) or value < LOGPROB_FLOOR else float(value)


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]


def _top_and_chosen(logprobs: dict[int, float], chosen: int, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens, and the chosen one after them when it is not among them: up to
    n + 1 entries, as OpenAI's legacy logprobs (and vLLM) give; n = 0 gives the chosen alone."""
    top = _top(logprobs, n)
    if chosen in logprobs and all(t != chosen for t, _ in top):
        top.append((chosen, logprobs[chosen]))
    return top


class ChoiceOutput:
    """One choice's output so far: `add` turns each Delta into the choice part of a stream chunk,
    `choice` gives the whole choice of a non-streaming response.

    With `echo` (the prompt's text and token ids), the first chunk starts with the prompt's text
    and, with logprobs, the prompt tokens' logprobs (the first token's null) in the legacy
    completions shape; text_offset then indexes the echoed text and goes on into the completion.
    A special token the text leaves out (skip_special_tokens) takes no room in it.

    With `tools` (chat, tool_choice not "none") the text goes through a ToolCallParser: content
    deltas carry the text before the calls, `tool_calls` deltas the calls, and a choice that made
    calls and stopped finishes with "tool_calls"."""

    def __init__(
        self,
        chat: bool,
        index: int,
        top_logprobs: int | None,
        strings: TokenStrings,
        echo: tuple[str, list[int]] | None = None,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool = True,
        tools: ToolRequest | None = None,
    ):
        self.chat, self.index, self.top_logprobs, self._strings = chat, index, top_logprobs, strings
        self._tools = ToolCallParser(tools.max_calls) if chat and tools is not None and tools.parse else None
        self._echo = echo
        self._prompt_top = prompt_logprobs
        self._skip_special = skip_special_tokens
        self.text: list[str] = []
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: Usage | None = None
        self.prompt_logprobs: list | None = None
        self._text_offset = 0
        self._logprobs: dict[str, list] | None = None
        if top_logprobs is not None:
            keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            self._logprobs = {key: [] for key in keys}

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else self.num_tokens

    def add(self, delta: Delta) -> dict | None:
        """Record a delta; the chunk choice for it, or None when it carries nothing to send."""
        echoed, logprobs = "", None
        if self._echo is not None:  # the first delta: the prompt goes first
            echoed, prompt_ids = self._echo
            self._echo = None
            if self._logprobs is not None:
                assert delta.prompt_logprobs is not None, (
                    "echo with logprobs asks the engine for prompt logprobs"
                )
                logprobs = self._completion_logprobs(prompt_ids, delta.prompt_logprobs)
                self._text_offset = len(echoed)
        text = echoed + delta.text
        self.num_tokens += len(delta.token_ids)
        self.text.append(text)
        calls = []
        if self._tools is not None:
            released, finish_reason = self._tools.feed_delta(text, delta.finish_reason)
            text, calls = released.content, [call.json() for call in released.calls]
            delta = dataclasses.replace(delta, finish_reason=finish_reason)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason
        self.usage = delta.usage or self.usage
        if self._logprobs is not None and delta.logprobs is not None:
            if self.chat:
                logprobs = {"content": self._chat_logprobs(delta.token_ids, delta.logprobs)}
            else:
                more = self._completion_logprobs(delta.token_ids, delta.logprobs)
                logprobs = {k: logprobs[k] + more[k] for k in more} if logprobs else more
        if logprobs is not None:
            for key, values in logprobs.items():
                self._logprobs[key].extend(values)
        if not (text or calls or delta.token_ids or delta.finish_reason or delta.prompt_logprobs is not None):
            return None
        if self.chat:
            choice = {"index": self.index, "delta": {"content": text} if text else {}}
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice = {"index": self.index, "text": text}
        choice |= {
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }
        if delta.prompt_logprobs is not None and self._prompt_top is not None:
            self.prompt_logprobs = self._prompt_logprobs(delta.prompt_logprobs)
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice

    def choice(self) -> dict:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self._tools is not None:
                content, calls = self._tools.content, self._tools.calls
                choice["message"]["content"] = content if content or not calls else None
                if calls:
                    choice["message"]["tool_calls"] = [call.json() for call in calls]
        else:
            choice["text"] = text
        choice |= {
            "logprobs": self._logprobs,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float] | None]
    ) -> dict[str, list]:
        """Legacy completions logprobs; a None entry (the first prompt token) gives nulls."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lps in zip(token_ids, logprobs, strict=True):
            text = self._strings(tok)[0]
            out["tokens"].append(text)
            if lps is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_lp(lps.get(tok, next(iter(lps.values())))))
                top = _top_and_chosen(lps, tok, self.top_logprobs)
                out["top_logprobs"].append({self._strings(t)[0]: _lp(v) for t, v in top})
            out["text_offset"].append(self._text_offset)
            if not (self._skip_special and tok in self._strings.special):
                self._text_offset += len(text)
        return out

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> list[dict]:
        def entry(tok: int, value: float) -> dict:
            text, raw = self._strings(tok)
            return {"token": text, "logprob": _lp(value), "bytes": list(raw)}

        return [
            entry(tok, lps.get(tok, next(iter(lps.values()))))
            | {"top_logprobs": [entry(t, v) for t, v in _top(lps, self.top_logprobs)]}
            for tok, lps in zip(token_ids, logprobs, strict=True)
        ]

    def _prompt_logprobs(self, prompt_logprobs: list[dict[int, float] | None]) -> list:
        """vLLM's prompt_logprobs field: per position, the prompt token (an entry's first key)
        and the top prompt_logprobs alternatives."""
        return [
            None
            if lps is None
            else {
                str(t): {"logprob": _lp(v), "decoded_token": self._strings(t)[0]}
                for t, v in _top_and_chosen(lps, next(iter(lps)), self._prompt_top)
            }
            for lps in prompt_logprobs
        ]


def usage_json(prompts: list[list[int]], n: int, outputs: list[ChoiceOutput]) -> dict:
    """Usage of the whole request: each prompt counted once (as OpenAI), every choice's tokens;
    cached tokens per prompt are the best of its samples; kv_transfer_bytes is the total moved."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(o.completion_tokens for o in outputs)
    cached = sum(
        max((o.usage.cached_tokens if o.usage else 0) for o in outputs[p * n : (p + 1) * n])
        for p in range(len(prompts))
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "kv_transfer_bytes": sum(o.usage.kv_transfer_bytes for o in outputs if o.usage),
    }


def response_json(
    request_id: str, created: int, model: str, chat: bool, choices: list[dict], **extra
) -> dict:
    """A non-streaming response; extra holds usage."""
    kind = "chat.completion" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def chunk_json(request_id: str, created: int, model: str, chat: bool, choices: list[dict], **extra) -> dict:
    """One streamed chunk; extra holds usage when stream_options.include_usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices, **extra}


def models_json(frontend: Frontend, created: int) -> dict:
    """GET /v1/models: OpenAI's list format with the one model this server serves."""
    return {"object": "list", "data": [model_json(frontend, created)]}


def model_json(frontend: Frontend, created: int) -> dict:
    return {
        "id": frontend.model_name,
        "object": "model",
        "created": created,
        "owned_by": "pdserve",
        "root": frontend.model_name,
        "max_model_len": frontend.max_model_len,
    }
