"""kernels/native/pool.h, the native kernels' own threads (native.use_pool): a call shared over
them gives the bits the calling thread gives alone, whatever the thread count, with several
callers at once and in a forked child (whose helper threads did not survive the fork)."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest
import torch

from engine.platform import load_native
from kernels import native
from tests.test_native_kernels import products  # noqa: F401  (the tile paths, or VDPBF16PS)

ALONE = 1 << 62  # a threshold no call reaches: every call on its caller's thread


@pytest.fixture(scope="module")
def loaded() -> bool:
    loaded = load_native()  # where the engines of the other tests build them
    assert loaded == native.supported()  # a CPU without AVX2 or AVX512F has no native kernels, no pool
    return loaded


@pytest.fixture
def shared(loaded, request):
    """-> a function running f() with every call shared over a pool of 2 threads (or the test's
    `threads`), then on its caller alone, returning both results (None where the CPU has no native
    kernels); the engine's settings are restored after."""
    if not loaded:
        yield None
        return
    threads = getattr(request, "param", 2)

    def both(f):
        native.use_pool(threads)
        native.pool_min_bytes(0)
        together = f()
        native.pool_min_bytes(ALONE)
        return together, f()

    before = native.use_pool(threads)
    yield both
    native.pool_min_bytes(None)
    native.use_pool(before)


pool_sizes = pytest.mark.parametrize("shared", [1, 2, 3], ids=lambda n: f"threads{n}", indirect=True)


def _operands(b: int, m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, m, k, generator=gen).bfloat16(), torch.randn(b, n, k, generator=gen).bfloat16()


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 512, 512), (1, 3, 1000, 96), (8, 1, 512, 64), (1, 17, 200, 64), (3, 2, 33, 40)],
    ids=lambda s: "B{}-M{}-N{}-K{}".format(*s),
)
@pool_sizes
@pytest.mark.usefixtures("products")
def test_shared_products_are_the_bits_of_one_thread(shared, shape):
    if shared is None:
        return
    x, w = _operands(*shape, seed=sum(shape))
    together, alone = shared(lambda: native.linear_bf16(x, w))
    assert torch.equal(together, alone)


def test_openmp_sharing_of_a_large_product_is_the_bits_of_the_pool(shared):
    """use_pool(0), the engine's default: calls from 4 MB of weight (an LM head) share their work
    over torch's OpenMP threads instead; the same chunks, the same bits."""
    if shared is None:
        return
    x, w = _operands(1, 2, 4160, 512, seed=5)  # 4.06 MB of weight
    native.use_pool(0)
    through_openmp = native.linear_bf16(x, w)
    assert torch.equal(through_openmp, shared(lambda: native.linear_bf16(x, w))[0])


def test_helpers_carry_their_name(shared):
    """The pool's helpers show in /proc as pdserve-native, so they can be told from torch's."""
    if shared is None:
        return
    shared(lambda: native.linear_bf16(*_operands(1, 1, 512, 512, seed=1)))
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    assert "pdserve-native" in names


@pool_sizes
@pytest.mark.usefixtures("products")
def test_shared_moe_and_attention_are_the_bits_of_one_thread(shared):
    if shared is None:
        return
    gen = torch.Generator().manual_seed(7)
    experts, hidden, inter, tokens = 6, 64, 48, 3
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16()
    pairs = [(0, 0, 0.5), (0, 2, 0.25), (2, 1, 1.0), (3, 0, 0.75), (5, 2, 0.125), (5, 1, 2.0)]

    def moe() -> torch.Tensor:
        out = torch.ones(tokens, hidden, dtype=torch.bfloat16)
        native.moe_pairs(x, w13, w2, out, *map(list, zip(*pairs, strict=True)))
        return out

    together, alone = shared(moe)
    assert torch.equal(together, alone) and not torch.equal(alone, torch.ones_like(alone))

    # Attention through VDPBF16PS, and in blocks of whole tiles (the tile path where it runs).
    for blocks, block_size, heads, lat, rope, lens in (
        (9, 4, 5, 32, 16, [13, 16]),
        (9, 16, 5, 64, 32, [50, 64]),
    ):
        cache = torch.randn(blocks, block_size, lat + rope, generator=gen).bfloat16()
        table = torch.randperm(blocks, generator=gen)[:8].view(2, 4).int()
        q = torch.randn(2, heads, lat + rope, generator=gen).bfloat16()
        lens = torch.tensor(lens, dtype=torch.int32)
        together, alone = shared(lambda: native.mla_decode(q, cache, table, lens, 0.2, lat))  # noqa: B023
        assert torch.equal(together, alone)


@pytest.mark.usefixtures("products")
def test_callers_on_several_threads_at_once_each_get_their_own_result(shared):
    """Engines on several Python threads of one process (colocated workers in tests) call the
    kernels at once: one call has the pool, the others run on their own thread; none sees
    another's work (nor, on the tile paths, another thread's tiles)."""
    if shared is None:
        return
    native.pool_min_bytes(0)
    operands = [_operands(1, 2, 300, 128, seed=i) for i in range(4)]
    wants = [native.linear_bf16(x, w) for x, w in operands]
    failures: list[str] = []

    def caller(i: int) -> None:
        x, w = operands[i]
        for call in range(200):
            if not torch.equal(native.linear_bf16(x, w), wants[i]):
                failures.append(f"caller {i}, call {call}")
                return

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers), "a caller hung"
    assert failures == []


def _product_in_child(queue, x: torch.Tensor, w: torch.Tensor) -> None:
    # Operands from the parent: torch's own ops may not run a parallel region in a forked child
    # (GNU OpenMP's threads do not survive a fork either). The pool settings are the parent's.
    queue.put(native.linear_bf16(x, w).view(torch.int16).tolist())


def test_a_forked_child_builds_its_own_pool(shared):
    """After a fork the child has none of the parent's helper threads: its calls must neither hang
    waiting for them nor lose their chunks."""
    if shared is None:
        return
    native.pool_min_bytes(0)
    x, w = _operands(1, 1, 512, 256, seed=3)
    want = native.linear_bf16(x, w)  # the parent's pool is up, its helpers running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_product_in_child, args=(queue, x, w))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert torch.equal(torch.tensor(got, dtype=torch.int16).view(torch.bfloat16), want)
