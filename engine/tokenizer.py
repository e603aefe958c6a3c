"""The model's tokenizer: tokenizer.json (HF `tokenizers`) plus tokenizer_config.json settings.

Only the `tokenizers` library is used, never transformers. The chat template is the Jinja
template from tokenizer_config.json, rendered with the variables HF templates expect.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.config: dict = config
        """tokenizer_config.json as read ({} without one)."""
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest token string in the vocabulary (at least 1). A text of B
        bytes encodes to at least B / max_token_bytes tokens (a byte-level or sentencepiece token
        stands for at most its own string's bytes), which bounds a prompt's length before paying
        for its tokenization; normalizers that compose characters can shrink a text, so callers
        allow slack."""
        return max(
            (len(t.encode("utf-8")) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1
        )

    def max_prompt_bytes(self, max_tokens: int) -> int:
        """Longest text (UTF-8 bytes) that may still encode to at most max_tokens tokens: exact
        without a normalizer, 4x slack with one (normalization can compose characters)."""
        slack = 1 if self.tokenizer.normalizer is None else 4
        return max_tokens * self.max_token_bytes * slack

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it throughout: a 1 MB text
        # froze every other thread of the process for a second), so services tokenize in a
        # worker thread without stalling their event loop.
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The conversation as the template renders it. `tools`: OpenAI's tool objects
        ({"type": "function", "function": {...}}), passed as HF passes them; a template that does
        not use them leaves them out."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        return env.from_string(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """HF's `tojson` filter: plain json.dumps. Jinja's own escapes <, >, & and ' for HTML, which
    would change the text the model sees."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
