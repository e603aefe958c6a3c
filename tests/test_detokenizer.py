"""IncrementalDetokenizer against tokenizer.decode on a small byte-level BPE trained here, whose
merges leave many multi-byte characters split across tokens."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import DetokenizerStep, IncrementalDetokenizer

CORPUS = (
    "héllo wörld 日本語 😀 naïve café — über straße ünïcödé Ωmega 中文字符 한국어 🎉🚀 "
    "the quick brown fox jumps over the lazy dog. STOP here, stop there; hello world again. "
) * 30
SPECIALS = ["<s>", "</s>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([CORPUS], trainer=trainer)
    return tokenizer


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    return [tok.token_to_id(BYTE_TO_CHAR[b]) for b in text.encode()]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes, which the ByteLevel alphabet is made of.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR = _bytes_to_unicode()


def stream(
    tok: Tokenizer,
    ids: list[int],
    *,
    prompt: list[int] | None = None,
    skip: bool = True,
    stop: list[str] | None = None,
    chunk: int = 1,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids `chunk` at a time until a stop matches, then finish(); returns the pieces."""
    detok = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens=skip, stop=stop or [])
    pieces = []
    for start in range(0, len(ids), chunk):
        out = detok.step(ids[start : start + chunk])
        assert isinstance(out, DetokenizerStep)
        pieces.append(out.text)
        if out.stop_matched is not None:
            assert out.stop_matched == detok.stop_matched
            return pieces, detok
    pieces.append(detok.finish())
    return pieces, detok


def test_tokenizer_really_splits_characters(tok):
    # Guards the premise of the tests below: some token decodes to part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in range(tok.get_vocab_size()))


# --- the stream is the full decode ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 5], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_random_ids_stream_to_full_decode(tok, skip, chunk):
    rng = random.Random(chunk * 2 + skip)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        pieces, detok = stream(tok, ids, prompt=prompt, skip=skip, chunk=chunk)
        full = tok.decode(ids, skip_special_tokens=skip)
        # The full decode, but for a character the output ended inside (its U+FFFD).
        assert "".join(pieces) == detok.text and full.startswith(detok.text), ids
        assert detok.text == full or (detok.text == full[:-1] and full.endswith("\ufffd")), ids


@pytest.mark.parametrize("split", ["bytes", "bpe"])
def test_valid_utf8_never_streams_replacement_char(tok, split):
    rng = random.Random(0)
    for _ in range(100):
        start = rng.randrange(len(CORPUS) - 60)
        text = CORPUS[start : start + rng.randrange(1, 60)]
        ids = byte_ids(tok, text) if split == "bytes" else tok.encode(text).ids
        pieces, detok = stream(tok, ids)
        assert not any("\ufffd" in piece for piece in pieces), pieces
        assert detok.text == text


def test_character_released_when_its_last_byte_arrives(tok):
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=[])
    texts = [detok.step([i]).text for i in byte_ids(tok, "a😀b")]
    assert texts == ["a", "", "", "", "😀", "b"]


def test_finish_holds_a_character_the_output_ended_inside(tok):
    """A request cut inside a character (max_tokens): its final text ends before it, streamed or
    not; a full decode would show U+FFFD for the bytes it never finished."""
    ids = byte_ids(tok, "ab") + byte_ids(tok, "日")[:2]
    pieces, detok = stream(tok, ids)
    assert pieces == ["a", "b", "", "", ""]
    assert detok.text == "ab" and tok.decode(ids) == "ab\ufffd"


def test_invalid_bytes_do_not_grow_the_window_forever(tok):
    # Lone continuation bytes never become a character: after a few tokens they stream as U+FFFD.
    ids = byte_ids(tok, "a") + [tok.token_to_id(BYTE_TO_CHAR[0x80])] * 30
    pieces, detok = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(len(p) for p in pieces[:-1]) > 1  # released before finish()


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_special_tokens(tok, skip):
    bos, eos = (tok.token_to_id(s) for s in SPECIALS)
    ids = [bos] + tok.encode("hi").ids + [eos, eos] + tok.encode(" wörld").ids + [eos]
    pieces, detok = stream(tok, ids, prompt=[bos], skip=skip)
    assert detok.text == ("hi wörld" if skip else "<s>hi</s></s> wörld</s>")
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


# --- stop strings --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,stop,expected_text,expected_stop",
    [
        ("hello wörld foo", ["wörld"], "hello ", "wörld"),
        ("héllo world", ["héllo"], "", "héllo"),  # at the very start
        ("hello world", ["world", "llo"], "he", "llo"),  # earliest position wins
        ("hello world", ["wor", "world"], "hello ", "wor"),  # same position: first listed
        ("a 日本語 b", ["本語"], "a 日", "本語"),
        ("abcabd", ["abd"], "abc", "abd"),  # a false start is released once it fails
        ("no match here", ["xyz"], "no match here", None),
    ],
    ids=["across-tokens", "at-start", "earliest", "tie-first-listed", "multibyte", "false-start", "no-match"],
)
@pytest.mark.parametrize("split", ["bytes", "bpe"])
def test_stop_strings(tok, text, stop, expected_text, expected_stop, split):
    ids = byte_ids(tok, text) if split == "bytes" else tok.encode(text).ids
    pieces, detok = stream(tok, ids, stop=stop)
    assert detok.text == "".join(pieces) == expected_text
    assert detok.stop_matched == expected_stop


def test_partial_stop_is_held_until_it_fails(tok):
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["STOP"])
    texts = [detok.step(byte_ids(tok, c)).text for c in "aSTOb"]
    assert texts == ["a", "", "", "", "STOb"]
    detok.step(byte_ids(tok, "ST"))
    assert detok.text == "aSTOb"  # "ST" could still become STOP
    assert detok.finish() == "ST"
    assert detok.text == "aSTObST" and detok.stop_matched is None


@pytest.mark.parametrize("chunk", [1, 3], ids=lambda c: f"chunk{c}")
def test_random_stop_properties(tok, chunk):
    """On random tokens: the text ends right before the first stop string to appear, no stop
    string occurs in the text, and nothing streamed is ever taken back."""
    rng = random.Random(chunk)
    vocab = tok.get_vocab_size()
    stops = ["ö", "lo w", "日本", " the", "STOP", "ll"]
    matched = 0
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        stop = rng.sample(stops, 2)
        pieces, detok = stream(tok, ids, stop=stop, chunk=chunk)
        assert "".join(pieces) == detok.text
        assert not any(s in detok.text for s in stop)
        full = tok.decode(ids)
        if detok.stop_matched is None:  # all of it, but for a character the output ended inside
            assert detok.text in (full, full[:-1]) and full.startswith(detok.text)
        else:
            matched += 1
            assert full.startswith(detok.text + detok.stop_matched)
    assert matched > 30  # the property was exercised


def test_step_after_stop_is_an_error(tok):
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=["lo"])
    assert detok.step(tok.encode("hello").ids).stop_matched == "lo"
    assert detok.finish() == ""
    with pytest.raises(ValueError, match="step"):
        detok.step([1])


@pytest.mark.parametrize("stop", [[""], "STOP"], ids=["empty-string", "bare-string"])
def test_bad_stop_argument(tok, stop):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=stop)


# --- cost per step -------------------------------------------------------------------------------


class CountingTokenizer:
    """Records the length of every decode call on the wrapped tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("split", ["bytes", "bpe"])
def test_step_decodes_a_bounded_window(tok, split):
    counting = CountingTokenizer(tok)
    text = CORPUS * 2
    ids = byte_ids(tok, text) if split == "bytes" else tok.encode(text).ids
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(counting, ids[:1000], skip_special_tokens=True, stop=["xyz", "STOPP"])
    for i in ids:
        detok.step([i])
    assert detok.finish() == ""
    assert detok.text == text
    # Each step decodes the context, the held tokens and the new one: a handful, never the output.
    assert max(counting.lengths) <= 8
    assert len(counting.lengths) <= 2 * len(ids) + 4  # two per step, plus __init__ and finish()


# --- stop strings against a brute-force reference ------------------------------------------------


def naive_first_match(text: str, before: int, stop: list[str]) -> tuple[int, str] | None:
    """The match that completes first once text grew past `before` characters: among those ending
    in the new characters, the earliest start, then the first listed."""
    found = []
    for order, s in enumerate(stop):
        pos = text.find(s, max(0, before - len(s) + 1))
        if pos >= 0:
            found.append((pos, order, s))
    return (min(found)[0], min(found)[2]) if found else None


def naive_hold(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def check_against_naive(tok, ids: list[int], stop: list[str], chunk: int, hold_every: int = 1) -> str | None:
    """Stream ids through a detokenizer with `stop` and one without (whose pieces are the text each
    step adds), and check every step's released text and match against the reference; the hold
    (a slow brute force for long stop strings) is checked every `hold_every` steps and at the end."""
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=stop)
    plain = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=[])
    text, released = "", 0
    steps = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    for k, piece in enumerate([*steps, None]):
        before = len(text)
        text += plain.step(piece).text if piece is not None else plain.finish()
        out = detok.step(piece) if piece is not None else None
        got, got_match = (out.text, out.stop_matched) if out is not None else (detok.finish(), None)
        match = naive_first_match(text, before, stop)
        if match is not None:
            assert (got, got_match) == (text[released : match[0]], match[1]), (k, stop)
            assert detok.text == text[: match[0]]
            return match[1]
        assert got_match is None
        released += len(got)
        assert detok.text == text[:released]
        if piece is None:
            assert released == len(text)
        elif k % hold_every == 0:
            assert len(text) - released == naive_hold(text, stop), (k, stop)
        assert len(text) - released < max(map(len, stop))  # the held text stays bounded
    return None


@pytest.mark.parametrize("chunk", [1, 3], ids=lambda c: f"chunk{c}")
def test_stop_strings_match_naive_reference(tok, chunk):
    # A tiny alphabet makes partial matches, false starts and overlapping stops common; "é" and
    # "日" are split over byte tokens, so some steps add no text at all.
    rng = random.Random(100 + chunk)
    alphabet = "aab é日"
    matched = 0
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stop = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7)))
            for _ in range(rng.randrange(1, 5))
        ]
        ids = byte_ids(tok, text) if rng.random() < 0.5 else tok.encode(text).ids
        matched += check_against_naive(tok, ids, stop, chunk) is not None
    assert 100 < matched < 390  # both outcomes exercised


def _stored_size(value: object) -> int:
    """Characters / entries held by a value, nested containers included."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(1 + _stored_size(k) + _stored_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return sum(1 + _stored_size(v) for v in value)
    return 1


@pytest.mark.parametrize("ends_in_stop", [False, True], ids=["no-match", "match"])
def test_long_stop_strings_cost_linear(tok, ends_in_stop):
    """16 stop strings of 1024 characters: 2,000 steps of text built from their prefixes (long
    partial matches that fail late) stay cheap, keep O(total stop length) state, and agree with
    the brute-force reference."""
    rng = random.Random(7 + ends_in_stop)
    shared = "".join(rng.choice("ab") for _ in range(512))
    stop = [shared + "".join(rng.choice("ab") for _ in range(512)) for _ in range(16)]
    text = ""
    while len(text) < 2000:
        s = rng.choice(stop)
        text += s[: rng.randrange(1, len(s))] + rng.choice(["", "a", "b"])
    text = text[:2000]
    if ends_in_stop:
        text = text[: 2000 - 1024] + stop[5]
    ids = byte_ids(tok, text)
    assert len(ids) == 2000

    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=stop)
    total = sum(map(len, stop))
    state = {k: v for k, v in vars(detok).items() if k not in ("_tokenizer", "_text", "_pieces")}
    assert _stored_size(state) <= 4 * total  # no structure quadratic in the stop length
    start = time.perf_counter()
    for i in ids:
        out = detok.step([i])
        if out.stop_matched is not None:
            break
    detok.finish()
    elapsed = time.perf_counter() - start
    state = {k: v for k, v in vars(detok).items() if k not in ("_tokenizer", "_text", "_pieces")}
    assert _stored_size(state) <= 4 * total
    assert elapsed < 1.0  # ~0.04 s; the quadratic hold-back took ~1.5 s here

    assert check_against_naive(tok, ids, stop, chunk=1, hold_every=97) == (stop[5] if ends_in_stop else None)
