"""engine/hugepages.py: the weights and the KV cache sit in regions that asked the kernel for huge
pages before their first touch, packed in placement order, with their values unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams, hugepages
from engine.hugepages import ALIGN, HUGE_PAGE, WeightArena, huge_empty, huge_zeros, place_parameters
from tests.bench_testing import run_python

LINUX = sys.platform.startswith("linux")


def advised_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings that carry the huge-page advice (VmFlags "hg")."""
    ranges, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                current = (start, end)
            elif line.startswith("VmFlags:") and "hg" in line.split()[1:]:
                ranges.append(current)
    return ranges


def _mappings() -> list[tuple[int, int]]:
    """[start, end) of every mapping of this process."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]


def thp_on() -> bool:
    """Transparent huge pages for regions that ask (madvise) or for all (always)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t, in bytes."""
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                current = start <= t.data_ptr() < end
            elif current and line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def advised(t: torch.Tensor) -> bool:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(start <= lo and hi <= end for start, end in advised_ranges())


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_huge_empty_is_aligned_sized_and_advised_before_use():
    t = huge_empty(3 * HUGE_PAGE + 100)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 100
    assert t.data_ptr() % HUGE_PAGE == 0
    lo = t.data_ptr()  # what the mappings around it are, should it fail (it did once in CI, not since)
    around = [(hex(a), hex(b)) for a, b in _mappings() if a <= lo + t.numel() and lo <= b]
    assert advised(t), f"madvise errno {hugepages.refused_errno}, {lo:#x} in {around}"
    t.fill_(7)  # the whole span is usable
    assert int(t[-1]) == 7 and int(t[0]) == 7
    small = huge_empty(1000)  # under one huge page: a plain allocation (wherever malloc puts it)
    assert small.numel() == 1000


def resident_bytes(t: torch.Tensor) -> int:
    """Rss of this process's mappings that hold t's bytes (/proc/self/smaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and lo < end
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_huge_zeros_is_zero_and_resident_only_where_written():
    """The KV cache's memory: zero everywhere, aligned and advised, and resident only in the 2 MiB
    pages written (or 4 KiB ones where the system gives no huge pages); a small one is zero too
    (its own mapping, never a reused heap chunk)."""
    t = huge_zeros(32 * HUGE_PAGE + 100)
    assert t.numel() == 32 * HUGE_PAGE + 100 and t.data_ptr() % HUGE_PAGE == 0 and advised(t)
    assert resident_bytes(t) < HUGE_PAGE
    t[5 * HUGE_PAGE + 7] = 1
    t[-1] = 2
    assert 2 * 4096 <= resident_bytes(t) <= 2 * HUGE_PAGE + 4096
    assert int(t[5 * HUGE_PAGE + 7]) == 1 and int(t[-1]) == 2
    assert not t[5 * HUGE_PAGE : 5 * HUGE_PAGE + 7].any() and not t[-HUGE_PAGE:-1].any()
    if thp_on():  # on huge pages (a shared mapping, shmem, gets none by default)
        assert huge_page_bytes(t) >= HUGE_PAGE
    garbage = torch.full((1 << 16,), 7, dtype=torch.uint8)
    del garbage  # a freed heap chunk a plain allocation could reuse
    assert not huge_zeros(1 << 16).any() and not huge_zeros(3 * HUGE_PAGE).any()


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
@pytest.mark.parametrize("populate_write", [True, False], ids=["madvise", "kernel-without-populate"])
def test_huge_zeros_prefault_is_resident_whole_and_zero(populate_write, monkeypatch):
    """prefault: every page resident before anything is written (on huge pages where the system
    gives them), the values still zero; through madvise(MADV_POPULATE_WRITE), or a write to each
    page where the kernel refuses it (before Linux 5.14)."""
    if not populate_write:
        real = hugepages._MADVISE

        def refusing(addr, length, advice):
            return -1 if advice == hugepages.MADV_POPULATE_WRITE else real(addr, length, advice)

        monkeypatch.setattr(hugepages, "_MADVISE", refusing)
    nbytes = 8 * HUGE_PAGE + 5000
    t = huge_zeros(nbytes, prefault=True)
    assert t.numel() == nbytes and advised(t)
    assert resident_bytes(t) >= nbytes
    if thp_on():
        assert huge_page_bytes(t) >= 8 * HUGE_PAGE
    assert not t.any()
    lazy = huge_zeros(nbytes)
    assert resident_bytes(lazy) < HUGE_PAGE


def test_arena_packs_tensors_in_order_with_their_values():
    arena = WeightArena(region_bytes=HUGE_PAGE)
    a = torch.randn(3, 5, dtype=torch.bfloat16)
    b = torch.arange(7, dtype=torch.float32)
    c = torch.randn(64, 33).t()  # not contiguous: placed contiguous
    pa, pb, pc = arena.place(a), arena.place(b), arena.place(c)
    assert torch.equal(pa, a) and torch.equal(pb, b) and torch.equal(pc, c)
    assert pc.is_contiguous() and all(t.data_ptr() % ALIGN == 0 for t in (pa, pb, pc))
    assert pa.data_ptr() < pb.data_ptr() < pc.data_ptr()  # one region, in placement order
    assert pb.data_ptr() - pa.data_ptr() == -(-a.numel() * 2 // ALIGN) * ALIGN
    assert pa.untyped_storage().data_ptr() == pc.untyped_storage().data_ptr()
    pa.zero_()
    assert a.abs().sum() > 0  # a copy, not the original
    big = arena.place(torch.ones(HUGE_PAGE // 2 + 1))  # over the region's room: a region of its own
    assert (
        arena.reserved_bytes >= 2 * HUGE_PAGE
        and big.untyped_storage().data_ptr() != pa.untyped_storage().data_ptr()
    )
    assert arena.placed_bytes == a.numel() * 2 + b.numel() * 4 + c.numel() * 4 + big.numel() * 4


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 8, bias=False)
        self.again = self.first  # the same module (and parameters) twice
        self.register_buffer("table", torch.arange(10.0))


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_place_parameters_keeps_values_and_parameter_objects():
    model = _Tied()
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    arena = WeightArena()
    place_parameters(model, arena)
    for name, (p, value) in params.items():
        now = dict(model.named_parameters())[name]
        assert now is p and isinstance(now, nn.Parameter) and torch.equal(now.data, value)
        assert advised(now)
    assert torch.equal(model.table, torch.arange(10.0)) and advised(model.table)
    expected = sum(v.numel() * v.element_size() for _, v in params.values()) + 40
    assert arena.placed_bytes == expected  # the shared Linear placed once


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_engine_weights_and_cache_are_advised_and_tokens_unchanged(tiny_model, monkeypatch):
    llm = LLM(tiny_model, dtype="bfloat16", num_kv_blocks=1024)
    runner = llm.engine.runner
    model = runner.model
    assert all(advised(p) for p in model.parameters())
    regions = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(regions) == 1  # the tiny model's weights fit one 64 MiB region
    attn = model.layers[0].self_attn
    assert advised(attn.w_uk_t) and advised(attn.w_uv)  # derived at load (a copy, a view), placed too
    assert all(c.numel() * 2 >= HUGE_PAGE and advised(c) for c in runner.kv_caches)  # 2.5 MiB a layer
    assert all(int(c.abs().sum()) == 0 for c in runner.kv_caches)  # zeroed
    assert all(resident_bytes(c) < HUGE_PAGE for c in runner.kv_caches)  # nothing written yet
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    placed = llm.generate(["The module provides"], params)[0].token_ids
    # The same model on plain allocations: the same tokens.
    monkeypatch.setattr("engine.runner.place_parameters", lambda model, arena, values=True: None)
    plain = LLM(tiny_model, dtype="bfloat16", num_kv_blocks=1024)
    plain_params = list(plain.engine.runner.model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in plain_params}) == len(plain_params)  # each its own
    assert plain.generate(["The module provides"], params)[0].token_ids == placed


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_engine_kv_prefault_makes_the_whole_cache_resident_at_start(tiny_model):
    llm = LLM(tiny_model, dtype="bfloat16", num_kv_blocks=1024, kv_prefault=True)
    caches = llm.engine.runner.kv_caches
    assert all(resident_bytes(c) >= c.numel() * c.element_size() for c in caches)
    assert all(int(c.abs().sum()) == 0 for c in caches)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lazy = LLM(tiny_model, dtype="bfloat16", num_kv_blocks=1024)
    assert llm.generate(["The module provides"], params)[0].token_ids == (
        lazy.generate(["The module provides"], params)[0].token_ids
    )


SPIN_PROBE = """
import os, engine
print(os.environ.get("GOMP_SPINCOUNT"), sorted(engine.DEFAULTED_ENV))
"""


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "30000 ['GOMP_SPINCOUNT', 'THP_MEM_ALLOC_ENABLE']"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None ['THP_MEM_ALLOC_ENABLE']"),
        ({"GOMP_SPINCOUNT": "5"}, "5 ['THP_MEM_ALLOC_ENABLE']"),
    ],
    ids=["default", "a-policy-named", "a-spin-named"],
)
def test_importing_engine_shortens_openmps_spin_unless_the_environment_names_one(env, expected):
    """GOMP_SPINCOUNT=30000 (libgomp reads it when torch loads it) where the environment names no
    OpenMP wait policy and no spin count; engine.DEFAULTED_ENV lists what it set."""
    unset = tuple({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "THP_MEM_ALLOC_ENABLE"} - set(env))
    out = run_python("-c", SPIN_PROBE, env=env, unset=unset)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


ALLOCATOR_PROBE = """
import engine, torch
from tests.test_hugepages import advised
t = torch.empty(3 << 20, dtype=torch.uint8)
print(t.data_ptr() % 4096 == 0 and advised(t))
"""


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
@pytest.mark.parametrize("setting, expected", [(None, "True"), ("0", "False")])
def test_importing_engine_puts_torchs_large_tensors_on_huge_pages_unless_told_not_to(setting, expected):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATOR_PROBE], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
