"""engine/heap.py: free heap goes back to the system once more than the limit lies free, and the
engine checks after every step without changing what it computes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine import LLM, SamplingParams
from engine.heap import PREFILL_END_LIMIT, HeapTrimmer

# In a fresh interpreter, so the heap and the resident size are this script's alone: freeing one
# 24 MiB block raises glibc's mmap threshold, so forty 8 MiB blocks then come from the heap; all
# but the last are freed, and the last keeps the heap from shrinking at its top.
FRAGMENT = textwrap.dedent(
    """
    import torch
    from engine.heap import HeapTrimmer

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024

    trimmer = HeapTrimmer(256 << 20, min_interval_s=0, check_interval_s=0)
    assert trimmer.active, "glibc >= 2.33 expected on the CI machines"
    big = torch.ones(6 << 20)  # 24 MiB, mmapped
    del big
    blocks = [torch.ones(2 << 20) for _ in range(40)]  # 8 MiB each, pages touched
    last = blocks[-1]
    del blocks
    before, free = rss_mib(), trimmer.free_bytes() >> 20
    quiet = HeapTrimmer(1 << 40, check_interval_s=0)  # a limit above what is free: nothing happens
    assert not quiet.maybe_trim() and quiet.trims == 0
    trimmed = trimmer.maybe_trim()
    print(before, free, rss_mib(), trimmed, trimmer.trims, trimmer.released_bytes >> 20, float(last[0]))
    """
)


def test_free_heap_above_the_limit_goes_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, check=True)
    before, free, after, trimmed, trims, released, _ = out.stdout.split()
    assert int(free) >= 300, f"the heap should hold the 39 freed blocks, free {free} MiB"
    assert trimmed == "True" and trims == "1" and int(released) == int(free)
    assert int(before) - int(after) >= 250, f"RSS {before} -> {after} MiB"


def _free_some_heap() -> None:
    junk = [bytearray(1 << 16) for _ in range(64)]  # 64 KiB each: below the mmap threshold
    del junk


def test_trims_are_spaced_in_time():
    trimmer = HeapTrimmer(1, min_interval_s=3600)
    assert trimmer.active
    _free_some_heap()
    assert trimmer.maybe_trim()
    _free_some_heap()
    assert trimmer.free_bytes() > 1
    assert not trimmer.maybe_trim(), "a second trim within the interval"
    assert trimmer.trims == 1


def test_free_heap_goes_back_when_the_prefills_end():
    """Below the limit, free heap stays while prompts run; once a step runs none after steps that
    did, what lies free above PREFILL_END_LIMIT goes back at once (the check interval waived)."""
    trimmer = HeapTrimmer(1 << 40, min_interval_s=0, check_interval_s=3600)
    junk = [bytearray(1 << 16) for _ in range(800)]  # 50 MiB in 64 KiB blocks: from the heap
    last = junk[-1]  # keeps the freed ones below the heap's top
    del junk
    assert trimmer.free_bytes() > PREFILL_END_LIMIT
    assert not trimmer.maybe_trim(prefilled=True), "below the limit while prompts run"
    assert not trimmer.maybe_trim(prefilled=True)
    assert trimmer.maybe_trim(prefilled=False), "the prefills ended"
    assert not trimmer.maybe_trim(prefilled=False), "once per end of prefills"
    assert trimmer.trims == 1 and len(last) == 1 << 16


def test_the_heap_is_looked_at_once_per_check_interval(monkeypatch):
    """mallinfo2 walks the free lists (a millisecond on a large fragmented heap): not every step."""
    trimmer = HeapTrimmer(1 << 40, min_interval_s=0, check_interval_s=3600)
    looks = []
    real = trimmer.free_bytes
    monkeypatch.setattr(trimmer, "free_bytes", lambda: looks.append(1) or real())
    for _ in range(5):
        assert not trimmer.maybe_trim()
    assert len(looks) == 1


def test_a_zero_limit_turns_it_off():
    trimmer = HeapTrimmer(0)
    assert not trimmer.active and trimmer.free_bytes() == 0 and not trimmer.maybe_trim()


def test_engine_trims_between_steps_and_computes_the_same(tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    results = {}
    for limit in (0, 1):  # never, and after almost every step
        llm = LLM(tiny_model, dtype="float32", num_kv_blocks=32, block_size=4, heap_free_limit_mib=limit)
        llm.engine.heap.min_interval_s = llm.engine.heap.check_interval_s = 0
        results[limit] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        trims = llm.engine.heap.trims
        assert (trims > 0) == (limit > 0), (limit, trims)
    assert results[0] == results[1]


def test_negative_limit_is_refused(tiny_model):
    with pytest.raises(ValueError, match="heap_free_limit_mib must be an integer >= 0"):
        LLM(tiny_model, heap_free_limit_mib=-1)
