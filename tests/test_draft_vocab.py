"""A draft vocabulary (speculative_config's draft_vocab, `pdserve draft-vocab`): MTP drafts are the
argmax over its tokens alone, greedy output stays the target's, and the file and the corpus are
read with clear errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.platform import use_native_kernels
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_vocab import (
    MAX_FILE_BYTES,
    corpus_texts,
    count_tokens,
    load_draft_vocab,
    most_frequent,
    write_draft_vocab,
)
from engine.tokenizer import Tokenizer
from services.cli import _spec_args, _spec_config, build_parser
from tests.test_spec_decode import watch_steps

TRAINED = "assets/pdserve-tiny"
TEXTS = ["The module provides", "This function returns a", "def main():"]
MAX_TOKENS = (21, 13, 17)


def _run(vocab: str | None, one_call: bool, monkeypatch, k: int = 2):
    """The texts' greedy tokens with k MTP drafts, and every step's (sampled, drafts), on the
    one-call native step or step by step."""
    steps, taken = watch_steps(monkeypatch, one_call)
    spec = {"method": "mtp", "num_speculative_tokens": k, "draft_vocab": vocab}
    on = use_native_kernels(torch.bfloat16, torch.device("cpu"))  # what the engine will run
    dtype = "bfloat16" if on else "float32"
    llm = LLM(TRAINED, dtype=dtype, num_kv_blocks=64, block_size=16, num_threads=1, speculative_config=spec)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    tokens = [o.token_ids for o in llm.generate(TEXTS, params)]
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert any(taken) == (one_call and on)  # the native one-call step ran, or never
    return tokens, steps, llm.engine.spec_stats


def _drafted(steps) -> set[int]:
    return {t for _, drafts in steps for ds in drafts.values() for t in ds}


@pytest.fixture(scope="module")
def full_vocab_run():
    with pytest.MonkeyPatch.context() as mp:
        return _run(None, True, mp)


@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "step-by-step"])
def test_a_draft_vocab_holding_every_draft_drafts_the_same(full_vocab_run, tmp_path, monkeypatch, one_call):
    """Where the draft vocabulary holds every token the whole vocabulary's drafts were, the argmax
    over its tokens is the same token (the ids mapped back through the vocabulary), so every step's
    drafts and tokens are the same, on the native one-call step and step by step."""
    tokens, steps, _ = full_vocab_run
    drafted = _drafted(steps)
    assert drafted
    others = [t for t in range(4096) if t not in drafted][::7]  # and tokens never drafted, ids interleaved
    path = tmp_path / "vocab.json"
    write_draft_vocab(path, sorted([*drafted, *others]))
    tokens_v, steps_v, _ = _run(str(path), one_call, monkeypatch)
    assert tokens_v == tokens and steps_v == steps


def test_a_small_draft_vocab_keeps_greedy_tokens_and_drafts_from_it(full_vocab_run, tmp_path, monkeypatch):
    """A draft vocabulary without half of the tokens drafted from the whole vocabulary: every draft
    is one of its tokens, fewer are accepted, the output is still the target's greedy tokens, and
    the native one-call step drafts what the steps one by one do."""
    tokens, steps, stats = full_vocab_run
    drafted = sorted(_drafted(steps))
    vocab = sorted({*drafted[::2], 1, 100, 2000})
    path = tmp_path / "vocab.json"
    write_draft_vocab(path, vocab)
    runs = {one_call: _run(str(path), one_call, monkeypatch) for one_call in (True, False)}
    for tokens_v, steps_v, stats_v in runs.values():
        assert tokens_v == tokens
        assert _drafted(steps_v) and _drafted(steps_v) <= set(vocab)
        assert stats_v.num_accepted_tokens / stats_v.num_draft_tokens < (
            stats.num_accepted_tokens / stats.num_draft_tokens
        )
    assert runs[True][1] == runs[False][1]


def test_use_draft_vocab_copies_the_head_rows_once():
    """The draft head is the LM head's rows of the vocabulary's tokens, set once."""
    llm = LLM(TRAINED, dtype="bfloat16", num_kv_blocks=8, block_size=16, num_threads=1)
    model = llm.engine.runner.model
    model.use_draft_vocab(torch.tensor([3, 9, 4000]))
    assert torch.equal(model.draft_head, model.lm_head.weight[[3, 9, 4000]])
    with pytest.raises(ValueError, match="already in use"):
        model.use_draft_vocab(torch.tensor([1]))
    assert model.mtp_drafter is None  # no MTP layer is loaded without speculative decoding


def _mtp_drafter():
    """-> the engine's native MTP drafter (None where it runs on torch), and whether the engine
    chose the native kernels."""
    llm = LLM(
        TRAINED,
        dtype="bfloat16",
        num_kv_blocks=8,
        block_size=16,
        num_threads=1,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    return llm.engine.runner.model.mtp_drafter, llm.engine.runner.native_kernels


def test_native_drafter_refuses_a_bad_draft_vocabulary():
    """The native drafter takes a draft vocabulary only whole and inside the vocabulary: its ids are
    read as token ids by the next pass's embedding."""
    import dataclasses

    drafter, native_kernels = _mtp_drafter()
    if drafter is None:  # the engine's own choice (another test may have loaded the library anyway)
        assert not native_kernels
        return
    head = drafter.lm_head[[2, 5]].contiguous()
    with pytest.raises(ValueError, match="needs both draft_head and draft_ids"):
        dataclasses.replace(drafter, draft_head=head)
    with pytest.raises(ValueError, match=r"draft_ids must lie in \[0, vocab=4096\)"):
        dataclasses.replace(drafter, draft_head=head, draft_ids=torch.tensor([2, 4096]))
    with pytest.raises(ValueError, match="draft_head must be contiguous CPU bfloat16"):
        dataclasses.replace(drafter, draft_head=head[:1], draft_ids=torch.tensor([2, 5]))
    with pytest.raises(ValueError, match="non-empty contiguous int64"):
        dataclasses.replace(drafter, draft_head=head, draft_ids=torch.tensor([2, 5], dtype=torch.int32))
    assert dataclasses.replace(drafter, draft_head=head, draft_ids=torch.tensor([2, 5])).draft_head is head


def _write(tmp_path, payload) -> str:
    path = tmp_path / "v.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


@pytest.mark.parametrize(
    "payload, message",
    [
        ("{not json", "is not JSON"),
        ([1, 2], "needs a non-empty list 'token_ids'"),
        ({"token_ids": []}, "needs a non-empty list 'token_ids'"),
        ({"token_ids": [1, "2"]}, "must be integers"),
        ({"token_ids": [1, True]}, "must be integers"),
        (
            {"token_ids": [1, 4096, -1]},
            r"2 of 'token_ids' lie outside the model's vocabulary \[0, 4096\), the first 4096",
        ),
        ({"token_ids": [3, 1, 3]}, "repeat a token"),
    ],
)
def test_load_draft_vocab_names_what_is_wrong(tmp_path, payload, message):
    with pytest.raises(ValueError, match=f"speculative_config draft_vocab: .*{message}"):
        load_draft_vocab(_write(tmp_path, payload), 4096)


def test_load_draft_vocab_reads_ids_sorted_and_bounds_the_file(tmp_path, monkeypatch):
    assert load_draft_vocab(_write(tmp_path, {"token_ids": [9, 0, 4095], "size": 3}), 4096).tolist() == [
        0,
        9,
        4095,
    ]
    with pytest.raises(ValueError, match="cannot read"):
        load_draft_vocab(tmp_path / "missing.json", 4096)
    path = _write(tmp_path, {"token_ids": list(range(100))})
    monkeypatch.setattr("engine.spec_decode.draft_vocab.MAX_FILE_BYTES", 64)
    with pytest.raises(ValueError, match=r"bytes, over 64"):
        load_draft_vocab(path, 4096)
    assert MAX_FILE_BYTES >= 128_000 * 8  # a large vocabulary's ids fit


def test_engine_refuses_a_bad_draft_vocab_before_loading(tmp_path):
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 1,
        "draft_vocab": _write(tmp_path, {"token_ids": [5000]}),
    }
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        LLM(TRAINED, dtype="float32", num_kv_blocks=8, num_threads=1, speculative_config=spec)
    for bad in (3, "", "x" * 5000):
        with pytest.raises(ValueError, match="draft_vocab must be a file path"):
            SpeculativeConfig.parse({"method": "mtp", "draft_vocab": bad})
    assert SpeculativeConfig.parse({"method": "mtp", "draft_vocab": "v.json"}).draft_vocab == "v.json"


def test_most_frequent_ranks_by_count_ties_to_the_lower_id():
    counts = torch.tensor([5, 0, 7, 7, 1, 0, 3])
    assert most_frequent(counts, 3) == [0, 2, 3]
    assert most_frequent(counts, 2) == [2, 3]
    assert most_frequent(counts, 4, always=[5]) == [0, 2, 3, 5]  # kept though never counted
    assert most_frequent(counts, 1, always=[99]) == [2]  # outside the vocabulary: ignored
    with pytest.raises(ValueError, match=r"size must be in \[1, 7\]"):
        most_frequent(counts, 8)
    with pytest.raises(ValueError, match="smaller than the 2 tokens always kept"):
        most_frequent(counts, 1, always=[1, 5])


def test_corpus_texts_and_counts(tmp_path):
    (tmp_path / "a.txt").write_text("plain text\nacross lines")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    texts = list(corpus_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]))
    assert texts == ["plain text\nacross lines", "one", "two"]
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n["no"]\n')
    with pytest.raises(
        ValueError, match=r"c.jsonl:2: a .jsonl corpus line must be an object with a string 'text'"
    ):
        list(corpus_texts([tmp_path / "c.jsonl"]))
    counts = count_tokens(["ab", "b", "zz"], lambda t: [ord(c) - ord("a") for c in t], 3)
    assert counts.tolist() == [1, 2, 0]  # z is outside a 3-token vocabulary: not counted


def test_cli_writes_the_corpus_top_tokens_and_the_flag_reaches_the_engine(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    text = "Return a new list of the items. The default value is None. " * 3 + "If the argument is a string."
    corpus.write_text(text)
    out = tmp_path / "v.json"
    args = build_parser().parse_args(
        ["draft-vocab", "--model", TRAINED, "--size", "8", "--corpus", str(corpus), "--out", str(out)]
    )
    assert args.func(args) == 0
    written = json.loads(out.read_text())
    # The reference: HF tokenizers' own encoding, counted with a Counter; ties to the lower id.
    tok = Tokenizer(TRAINED)
    counts = Counter(tok.tokenizer.encode(text, add_special_tokens=False).ids)
    eos = 1  # config.json's eos_token_id, always kept
    ranked = sorted((c for c in counts.items() if c[0] != eos), key=lambda c: (-c[1], c[0]))
    assert written["token_ids"] == sorted([eos, *(t for t, _ in ranked[:7])])
    assert written["size"] == 8 and written["corpus_tokens"] == sum(counts.values())
    assert "8 of 4096 tokens" in capsys.readouterr().out
    spec = build_parser().parse_args(
        [
            "generate",
            "--model",
            TRAINED,
            "--prompt",
            "x",
            "--speculative",
            "mtp",
            "--speculative-draft-vocab",
            str(out),
        ]
    )
    assert _spec_config(spec)["speculative_config"]["draft_vocab"] == str(out)
    missing = build_parser().parse_args(["draft-vocab", "--model", TRAINED, "--size", "8", "--out", str(out)])
    assert missing.func(missing) == 2
    too_big = build_parser().parse_args(
        ["draft-vocab", "--model", TRAINED, "--size", "5000", "--corpus", str(corpus), "--out", str(out)]
    )
    assert too_big.func(too_big) == 2
    assert "--size must be in [1, 4096]" in capsys.readouterr().err


def test_serve_passes_the_speculative_flags_to_its_workers(tmp_path):
    """`pdserve serve --speculative ...` gives every worker the flags that make the same
    speculative_config (the draft vocabulary by its absolute path)."""
    vocab = tmp_path / "v.json"
    flags = [
        "--speculative",
        "mtp",
        "--num-speculative-tokens",
        "2",
        "--speculative-disable-by-batch-size",
        "8",
    ]
    serve = build_parser().parse_args(["serve", *flags, "--speculative-draft-vocab", str(vocab)])
    passed = _spec_args(serve)
    worker = build_parser().parse_args(["worker", "--role", "decode", "--model", TRAINED, *passed])
    assert (
        _spec_config(worker)
        == _spec_config(serve)
        == {
            "speculative_config": {
                "method": "mtp",
                "num_speculative_tokens": 2,
                "disable_by_batch_size": 8,
                "draft_vocab": str(vocab),
            }
        }
    )
    assert _spec_args(build_parser().parse_args(["serve"])) == []
