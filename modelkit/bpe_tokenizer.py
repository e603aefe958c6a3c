"""A deterministic byte-level BPE tokenizer in DeepSeek-V3's format, trained on the standard library.

The project's default models must be buildable offline, so the training text is something every
Python install has: the source of the standard library's top-level modules, read in sorted order and
capped at `CORPUS_CHARS`. The same Python version therefore gives the same tokenizer.json, byte for
byte. The BPE trainer was checked to give identical merges with 1, 2 and 8 rayon threads (word counts
are merged before training and ties between pairs are broken by pair id), so the thread count is
left alone; the builder's tests compare the sha256 of two builds to keep that claim honest.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

# Trainer order fixes the ids: bos 0, eos 1, pad 2 as in DeepSeek-V3; User/Assistant follow
# (V3 has them at 128803/128804, which a 4k vocabulary cannot hold).
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

CORPUS_CHARS = 4_000_000
"""Cap on the training text: ~4 MB trains a 32k vocabulary in a few seconds on one core."""

# DeepSeek-V3's chat template without the tool-call branches: bos, the system prompts joined by a
# blank line, then <｜User｜>text and <｜Assistant｜>text<｜end▁of▁sentence｜> per turn. Written with
# whitespace control everywhere so it renders the same under transformers and plain jinja2.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', is_first_sp=true) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.is_first_sp -%}"
    "{%- set ns.system_prompt = message['content'] -%}{%- set ns.is_first_sp = false -%}"
    "{%- else -%}"
    "{%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] -%}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system_prompt -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + message['content'] + '" + EOS_TOKEN + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
)


def stdlib_corpus(max_chars: int = CORPUS_CHARS) -> list[str]:
    """The text of the standard library's top-level modules, in sorted file order, up to max_chars.

    Only top-level `*.py` files: they never include site-packages or the test suite, and sorting by
    name makes the selection independent of directory listing order.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # skip rather than fail: the selection stays deterministic for a given install
        if total + len(text) > max_chars:
            break
        texts.append(text)
        total += len(text)
    if not texts:
        raise RuntimeError(f"no readable standard library sources under {root}")
    return texts


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer of exactly vocab_size tokens (special tokens included)."""
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is below the minimum {min_size} (specials + 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: DeepSeek's tokenizer does not add one, and decode(encode(x)) must give x back.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} not reached: the stdlib corpus ({CORPUS_CHARS} chars) "
            f"gave {tokenizer.get_vocab_size()} tokens"
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    assert bos_id == 0 and tokenizer.token_to_id(EOS_TOKEN) == 1, "special token ids moved"
    # Prepend bos like DeepSeek-V3's tokenizer.json, so the engine (which uses `tokenizers` directly)
    # and transformers agree; bos is special, so decode(skip_special_tokens=True) drops it.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for `PreTrainedTokenizerFast`, in DeepSeek-V3's spelling."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        # Byte-level BPE already round-trips spaces exactly; the cleanup would eat " ." and the like.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
