"""English training text every Python install has offline: the standard library's documentation.

Two sources, both read without importing a single documented module (no import side effects, so
the corpus depends only on the Python version):

1. `pydoc_data.topics`: the language reference sections `help()` shows (prose, ~0.5 MB).
2. The docstrings of the standard library's own `.py` files, taken with `ast` in source order
   (module, then each class and function as they appear), from the files in sorted path order;
   test suites and site-packages are left out, and a docstring seen before is not repeated.

Each document becomes `<bos> text <eos>` with the project's tokenizer; the documents are
concatenated into one token stream per split. Held-out text is whole files (and whole topics):
every `VAL_EVERY`-th of each in sorted order, so validation loss measures text the model has not
seen rather than the other half of a sentence it has.
"""

from __future__ import annotations

import ast
import logging
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

VAL_EVERY = 20
"""Every VAL_EVERY-th source file and topic (offset VAL_OFFSET) is validation text."""
VAL_OFFSET = 7
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Document:
    """One unit of training text."""

    source: str
    """Where it came from: `topics:<name>` or the stdlib-relative path of a file."""
    text: str
    """The text, without special tokens."""


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of node and everything defined in it, in source order."""
    if isinstance(node, _DOC_NODES):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
    for child in ast.iter_child_nodes(node):
        yield from _docstrings(child)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's `.py` files without test suites, sorted by stdlib-relative path."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def topic_documents() -> list[Document]:
    """The language reference topics of `help()`, in sorted topic order."""
    from pydoc_data.topics import topics

    return [Document(f"topics:{name}", topics[name].strip()) for name in sorted(topics)]


def docstring_documents(max_files: int | None = None) -> list[list[Document]]:
    """Per stdlib file with new text (sorted, of the first max_files), its docstrings not seen in an earlier file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    per_file: list[list[Document]] = []
    for path in stdlib_files(root)[:max_files]:
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue  # e.g. lib2to3 fixtures in Python 2 syntax; skipping keeps the selection deterministic
        docs = []
        for text in _docstrings(tree):
            if text not in seen:
                seen.add(text)
                docs.append(Document(rel, text))
        if docs:
            per_file.append(docs)
    return per_file


def split_documents(max_files: int | None = None) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents: topics first, then docstrings file by file."""
    train: list[Document] = []
    val: list[Document] = []
    units: list[list[Document]] = [[d] for d in topic_documents()] if max_files is None else []
    units += docstring_documents(max_files)
    for i, unit in enumerate(units):
        (val if i % VAL_EVERY == VAL_OFFSET else train).extend(unit)
    return train, val


def tokenize(docs: list[Document], tokenizer: Tokenizer) -> torch.Tensor:
    """[N] int64: `<bos> doc <eos>` for every document, concatenated in order."""
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    assert eos is not None, "tokenizer has no end-of-sentence token"
    ids: list[int] = []
    for enc in tokenizer.encode_batch([d.text for d in docs]):  # the post-processor prepends <bos>
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


@dataclass(frozen=True)
class Corpus:
    """The tokenized training and validation streams."""

    train: torch.Tensor
    """[N_train] int64 token ids."""
    val: torch.Tensor
    """[N_val] int64 token ids."""
    train_docs: int
    """Documents in the training stream."""
    val_docs: int
    """Documents in the validation stream."""
    train_chars: int
    """Characters of training text."""

    def describe(self) -> dict:
        return {
            "sources": "pydoc_data.topics + docstrings of the stdlib .py files (ast, source order, deduplicated)",
            "train_docs": self.train_docs,
            "val_docs": self.val_docs,
            "train_chars": self.train_chars,
            "train_tokens": int(self.train.numel()),
            "val_tokens": int(self.val.numel()),
        }


def build_corpus(tokenizer: Tokenizer, max_files: int | None = None) -> Corpus:
    """The whole corpus; max_files (tests) limits it to the first docstring files and drops the topics."""
    train, val = split_documents(max_files)
    if not train or not val:
        raise ValueError(f"max_files={max_files} gives no training or no validation documents")
    corpus = Corpus(
        train=tokenize(train, tokenizer),
        val=tokenize(val, tokenizer),
        train_docs=len(train),
        val_docs=len(val),
        train_chars=sum(len(d.text) for d in train),
    )
    logger.info("corpus: %s", corpus.describe())
    return corpus


def sample_windows(
    stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """[B, length] windows of the stream at uniformly drawn start offsets (seeded: reproducible)."""
    if stream.numel() <= length:
        raise ValueError(f"token stream of {stream.numel()} tokens is too short for windows of {length}")
    starts = torch.randint(0, stream.numel() - length, (batch_size,), generator=generator)  # [B]
    return torch.stack([stream[s : s + length] for s in starts.tolist()])  # [B, length]


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """[count, length] evenly spaced windows covering the stream (the validation set)."""
    if stream.numel() <= length:
        raise ValueError(f"token stream of {stream.numel()} tokens is too short for windows of {length}")
    starts = torch.linspace(0, stream.numel() - length - 1, count).long()  # [count]
    return torch.stack([stream[s : s + length] for s in starts.tolist()])  # [count, length]
