"""Token ids to streamed text, one request at a time, with stop strings.

Two things are held back from the stream:
- UTF-8 that is not complete yet. A byte-level BPE token can end in the middle of a multi-byte
  character, which the tokenizer decodes as U+FFFD; while the decoded window ends in U+FFFD the
  tokens are kept until a later one completes the character (vLLM's prefix_offset/read_offset).
- Text that could still become a stop string: the longest suffix of the text that is a proper
  prefix of some stop string, so the stream never shows part of a stop string. Each stop string's
  KMP automaton (its failure function, built once) follows the text as it arrives, so a step costs
  O(new characters) per stop string and memory stays O(total stop length), however long the
  stop strings; the held text is always shorter than the longest stop string.

Only a bounded window of tokens is decoded per step (the tokens since the last-but-one release),
so a step costs the same at output token 10 and 10,000.

tokenizers' `decoders.DecodeStream` runs the same window algorithm, but has no way to flush the
held-back tail at the end, raises when a window's text does not extend its prefix's, and keeps a
window of invalid bytes growing without bound; hence this class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

# Prompt tokens decoded in front of the first output token: decoders that look at the previous
# token (Metaspace dropping a leading space, say) then give output text as it reads after the
# prompt. vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET.
_PROMPT_CONTEXT_TOKENS = 5
# A character still incomplete spans at most 3 bytes, so at most 3 byte-level tokens (plus a
# skipped special token or two). A window ending in U+FFFD for more tokens than this holds invalid
# bytes that no later token can complete: release them, as a full decode would show them.
_MAX_HELD_TOKENS = 8
_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerStep:
    text: str
    """Text released by this step: complete characters, no part of a stop string."""
    stop_matched: str | None
    """The stop string found in this step, if any; the text ends just before it and the
    request should finish."""


class IncrementalDetokenizer:
    """Streams one request's output text. Not thread-safe: one owner (the request's output
    processor) calls step() per engine step, then finish() once if no stop string matched."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str],
    ):
        if isinstance(stop, str):
            raise ValueError(f"stop must be a sequence of strings, not the string {stop!r}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._stop_failure = [_failure_function(s) for s in self._stop]
        # Per stop string: how many of its leading characters the text so far ends with (its KMP
        # state). Always < its length, since a full match ends the output.
        self._stop_state = [0] * len(self._stop)

        # The window: ids[:read_offset] are released, ids[prefix_offset:read_offset] are kept as
        # decoding context, ids[read_offset:] are held (their text ended in U+FFFD, or was empty).
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_REPLACEMENT):
            # Prompt ids that end mid-character would absorb the output's first bytes, and the
            # output must read as it decodes on its own.
            self._ids, self._prefix_text = [], ""
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held_text = ""  # decoded, complete text kept back as a possible stop-string start
        self._pieces: list[str] = []
        self._text = ""
        self.stop_matched: str | None = None
        """The stop string that ended the output, once one has."""
        self._finished = False

    @property
    def text(self) -> str:
        """All text released so far; never includes a matched stop string or anything after."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    def step(self, new_token_ids: Sequence[int]) -> DetokenizerStep:
        """Append this step's tokens (usually one) and return the text they release."""
        if self._finished:
            raise ValueError("step() called after the output ended (stop string matched or finish())")
        self._ids.extend(new_token_ids)
        released = self._release(self._decode_new(flush=False), flush=False)
        return DetokenizerStep(text=released, stop_matched=self.stop_matched)

    def finish(self) -> str:
        """End of the request: release everything held back but a character the output ended
        inside (its U+FFFD: bytes the output never finished, which the stream never shows either,
        as vLLM's final text does not) and return it. Returns "" after a stop match or a second
        call."""
        if self._finished:
            return ""
        unfinished = self._ends_inside_a_character()
        new_text = self._decode_new(flush=True)
        if unfinished:  # its U+FFFD: the last character of the text
            new_text = new_text[:-1]
        released = self._release(new_text, flush=True)
        self._finished = True
        return released

    def _ends_inside_a_character(self) -> bool:
        """Whether the held text ends inside a character at its last 1-3 tokens (their bytes the
        start of a character the output never finished, or a lone byte): the full decode's last
        U+FFFD stands for them. More held invalid bytes are not one character."""
        held = len(self._ids) - self._read_offset
        if not held or not self._decode(self._ids[self._prefix_offset :]).endswith(_REPLACEMENT):
            return False
        end = len(self._ids)
        return any(
            not self._decode(self._ids[self._prefix_offset : end - k]).endswith(_REPLACEMENT)
            for k in range(1, min(3, held) + 1)
        )

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, flush: bool) -> str:
        """Text of the held tokens that is complete now (all of it when flushing)."""
        text = self._decode(self._ids[self._prefix_offset :])
        # Wait while the text ends in an incomplete character, or the tokens added nothing (a
        # skipped special token: keeping the old context then keeps e.g. a Metaspace leading
        # space right). Past _MAX_HELD_TOKENS waiting cannot help and would grow the window.
        waiting = text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text)
        end = len(self._ids)
        if waiting and not flush:
            if end - self._read_offset <= _MAX_HELD_TOKENS:
                return ""
            end = self._forced_end()
            text = self._decode(self._ids[self._prefix_offset : end])
        new_text = text[len(self._prefix_text) :]
        # Slide the window: the tokens just released become the next context.
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return new_text

    def _forced_end(self) -> int:
        """Where to cut a window that has waited too long: after the last token whose text ends
        in a complete character (UTF-8 restarts cleanly there, so no character is split), else
        before the last 3 tokens, which hold any incomplete character's (at most 3) bytes."""
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            text = self._decode(self._ids[self._prefix_offset : end])
            if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
                return end
        return len(self._ids) - 3

    def _release(self, new_text: str, *, flush: bool) -> str:
        """Stop-string check on held text + new_text; returns what may be streamed now."""
        if not self._stop:
            self._pieces.append(new_text)
            return new_text
        # Any match not seen before ends in new_text, so it starts in held_text or after it:
        # text released earlier was never a prefix of a stop string (each automaton's state is at
        # most len(held_text) before new_text). The first match to complete wins; within a step,
        # the one starting earliest, then the one listed first.
        window = self._held_text + new_text
        match = None
        for order, stop in enumerate(self._stop):
            end = self._advance(order, new_text)
            if end is not None:
                found = (len(self._held_text) + end + 1 - len(stop), order, stop)
                match = found if match is None else min(match, found)
        if match is not None:
            pos, _, self.stop_matched = match
            released, self._held_text = window[:pos], ""
            self._finished = True
        else:
            keep = 0 if flush else max(self._stop_state)
            assert keep <= len(window), (keep, len(window))
            released, self._held_text = window[: len(window) - keep], window[len(window) - keep :]
        self._pieces.append(released)
        return released

    def _advance(self, order: int, text: str) -> int | None:
        """Run text through stop string `order`'s automaton. Returns the index in text where the
        stop string's first full match ends, or None (its state is then updated). Amortized
        O(len(text)): each character moves the state up by at most one."""
        stop, failure, state = self._stop[order], self._stop_failure[order], self._stop_state[order]
        for i, char in enumerate(text):
            while state and stop[state] != char:
                state = failure[state - 1]
            if stop[state] == char:
                state += 1
                if state == len(stop):
                    return i
        self._stop_state[order] = state
        return None


def _failure_function(stop: str) -> list[int]:
    """KMP's failure function: entry i is the length of the longest proper prefix of stop[: i + 1]
    that is also a suffix of it. O(len(stop)) time and memory."""
    failure = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = failure[k - 1]
        if stop[i] == stop[k]:
            k += 1
        failure[i] = k
    return failure
