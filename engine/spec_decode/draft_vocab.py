"""A draft vocabulary: the tokens the MTP layer's drafts are taken from.

A draft's argmax reads the LM head's logits, and at batch 1 on a small model that product is a
large part of a draft (pdserve-tiny: a 4096 x 256 head, ~16 of a draft's ~35 us on the 2-core
EPYC). Most generated text is made of few tokens, so drafting from the most frequent ones
alone (FR-Spec, "frequency-ranked speculative sampling"; SGLang's `speculative_token_map`) keeps
nearly every accepted draft at a fraction of the product. Only the drafts change: the target still
verifies every token against its whole vocabulary, so greedy output stays the target's token for
token.

The file is JSON, `{"token_ids": [...], ...}` (other keys describe where it came from), written by
`pdserve draft-vocab` from token counts over a corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

MAX_FILE_BYTES = 16 << 20
"""Largest draft vocabulary file read (a 128k-token vocabulary's ids take ~1 MB)."""


def load_draft_vocab(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The file's token ids, int64 ascending; a clear error naming what is wrong otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ValueError(
            f"speculative_config draft_vocab: cannot read {str(path)!r} ({e.strerror})"
        ) from None
    if size > MAX_FILE_BYTES:
        raise ValueError(
            f"speculative_config draft_vocab: {str(path)!r} is {size} bytes, over {MAX_FILE_BYTES}"
        )
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config draft_vocab: {str(path)!r} is not JSON ({e})") from None
    ids = raw.get("token_ids") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"speculative_config draft_vocab: {str(path)!r} needs a non-empty list 'token_ids'")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"speculative_config draft_vocab: 'token_ids' in {str(path)!r} must be integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"speculative_config draft_vocab: {len(bad)} of 'token_ids' lie outside the model's vocabulary "
            f"[0, {vocab_size}), the first {bad[0]}"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"speculative_config draft_vocab: 'token_ids' in {str(path)!r} repeat a token")
    return torch.tensor(sorted(ids), dtype=torch.int64)


def corpus_texts(paths: Iterable[str | Path]) -> Iterable[str]:
    """The texts of corpus files: each JSON line's "text" of a `.jsonl` file, else the whole file."""
    for path in map(Path, paths):
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8")
            continue
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(
                        f"{path}:{n}: a .jsonl corpus line must be an object with a string 'text'"
                    )
                yield record["text"]


def count_tokens(texts: Iterable[str], encode, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token occurs in the texts, encode(text) -> ids."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        ids = torch.tensor(encode(text), dtype=torch.int64)
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> list[int]:
    """The `size` tokens counted most often (counts [V]: occurrences per token id), the tokens in
    `always` (e.g. end-of-sentence) among them, ties to the lower id; ascending."""
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise ValueError(f"size must be in [1, {vocab}] (the vocabulary), got {size}")
    always = sorted({int(t) for t in always if 0 <= int(t) < vocab})
    if len(always) > size:
        raise ValueError(f"size={size} is smaller than the {len(always)} tokens always kept")
    rank = counts.to(torch.int64).clone()
    rank[always] = torch.iinfo(torch.int64).max
    # stable: equal counts keep their id order, so ties go to the lower id
    order = torch.sort(rank, descending=True, stable=True).indices
    return sorted(order[:size].tolist())


def write_draft_vocab(path: str | Path, token_ids: list[int], **about) -> None:
    """The file load_draft_vocab reads; `about` (the model, the corpus, its coverage) is kept beside."""
    Path(path).write_text(json.dumps({**about, "size": len(token_ids), "token_ids": token_ids}) + "\n")
