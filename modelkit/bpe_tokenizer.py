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


def _jinja_str(text: str) -> str:
    """text as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


# DeepSeek-V3's tool-call markers. They are text to this tokenizer (not added tokens): the model
# writes them as ordinary byte-level pieces, and no decode option strips them.
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

# What the template tells the model about `tools` (DeepSeek-V3's own template does not render
# them; its hosted API adds them to the system prompt): each function as JSON, then the call syntax.
TOOLS_INTRO = (
    "## Tools\n\nYou may call these functions. Each is given as JSON: its name, what it does, and "
    "its parameters as a JSON schema.\n"
)
TOOLS_USAGE = (
    f"\n\nTo call functions, write {TOOL_CALLS_BEGIN}, then for each call {TOOL_CALL_BEGIN}function"
    f"{TOOL_SEP}NAME\n```json\nARGUMENTS\n```{TOOL_CALL_END} (one call per line), then {TOOL_CALLS_END}."
)

_CALL = (
    "'" + TOOL_CALL_BEGIN + "' + call['type'] + '" + TOOL_SEP + "' + call['function']['name']"
    " + '\\n```json\\n' + call['function']['arguments'] + '\\n```" + TOOL_CALL_END + "'"
)
# DeepSeek-V3's chat template (tokenizer_config.json of deepseek-ai/DeepSeek-V3): bos, the system
# prompts joined by a blank line, then <｜User｜>text and <｜Assistant｜>text<｜end▁of▁sentence｜> per
# turn. An assistant turn's tool calls follow its text inside the tool-calls markers, one per line
# with the arguments in a json fence; the `tool` results after it sit inside the tool-outputs
# markers, and the turn after them (or the generation prompt) opens with <｜tool▁outputs▁end｜>
# instead of <｜Assistant｜>. Three departures from DeepSeek's text, each where it renders wrongly:
# a turn with one call is closed too (DeepSeek's closes only after the second), every turn with
# calls opens the same way (DeepSeek's only the first in a conversation), and tool outputs that a
# user turn follows are closed. Rendered with `tools`, the system prompt ends with the functions
# (TOOLS_INTRO, TOOLS_USAGE). Written with whitespace control everywhere so it renders the same
# under transformers and plain jinja2.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_prompt='', is_first_sp=true, is_tool=false, is_output_first=true) -%}"
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
    "{%- if tools -%}"
    "{%- if ns.system_prompt -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- " + _jinja_str(TOOLS_INTRO) + " -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool['function'] | tojson) -}}{%- endfor -%}"
    "{{- " + _jinja_str(TOOLS_USAGE) + " -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if ns.is_tool -%}{{- '" + TOOL_OUTPUTS_END + "' -}}{%- set ns.is_tool = false -%}{%- endif -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if ns.is_tool -%}{{- '" + TOOL_OUTPUTS_END + "' -}}{%- set ns.is_tool = false -%}"
    "{%- else -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
    "{%- if message['content'] is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message['tool_calls'] -%}"
    "{{- '" + TOOL_CALLS_BEGIN + "' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- " + _CALL + " -}}"
    "{%- endfor -%}"
    "{{- '" + TOOL_CALLS_END + "' -}}"
    "{%- endif -%}"
    "{{- '" + EOS_TOKEN + "' -}}"
    "{%- set ns.is_output_first = true -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if ns.is_output_first -%}{{- '" + TOOL_OUTPUTS_BEGIN + "' -}}{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '" + TOOL_OUTPUT_BEGIN + "' + message['content'] + '" + TOOL_OUTPUT_END + "' -}}"
    "{%- set ns.is_tool = true -%}{%- set ns.is_output_first = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.is_tool -%}{{- '" + TOOL_OUTPUTS_END + "' -}}"
    "{%- elif add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
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
