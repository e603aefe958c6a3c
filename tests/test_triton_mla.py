"""The Triton MLA decode kernel (under TRITON_INTERPRET=1 on CPU) against the naive float64
reference and the PyTorch path of tests/test_kernels_torch.py (STYLE 8, DESIGN §4).

Cases are odd on purpose: B = 3, H = 3 or 7 (s_q * H = 21 rows spans two row blocks), s_q = 3
(causal MTP verification, queries that see nothing), empty and one-token sequences, exact block
multiples and one past them, shuffled block tables, block sizes 16 and 64 (a tile of keys lies in
one cache block) and 4 and 24 (it does not). Every cache slot a sequence does not own and
every table padding column holds NaN: the kernel must never read them. The interpreter costs
milliseconds per program, so grids stay at a few dozen programs.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.mla import default_num_splits, mla_decode
from tests.kernel_testing import DTYPE_ID, DTYPES, TOL, one_thread  # noqa: F401 (fixture)
from tests.test_kernels_torch import LAT, ROPE, gen, mla_naive, paged_cache

LSE_TOL = dict(atol=1e-5, rtol=1e-5)  # the lse stays float32 whatever the input dtype

SEQ_LENS = {  # name -> seq_lens [B] as a function of the block size
    "0,1,bs+1": lambda bs: [0, 1, bs + 1],  # empty, a single token, one past a block multiple
    "bs,2,2bs+1": lambda bs: [bs, 2, 2 * bs + 1],  # an exact multiple, fewer keys than s_q = 3
}


def nan_poisoned(kv_cache: torch.Tensor, table: torch.Tensor, seq_lens: list[int]):
    """-> (a copy of kv_cache with NaN in every slot no sequence owns, table with its padding
    columns pointing at a fully-NaN spare block)."""
    bs = kv_cache.shape[1]
    owned = torch.zeros(kv_cache.shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
    table = table.clone()
    for b, n in enumerate(seq_lens):
        used = math.ceil(n / bs)
        for j in range(used):
            owned[int(table[b, j]), : min(bs, n - j * bs)] = True
    spare = int((~owned.any(dim=1)).nonzero()[0])  # paged_cache leaves three spare blocks
    for b, n in enumerate(seq_lens):
        table[b, math.ceil(n / bs) :] = spare
    poisoned = kv_cache.clone()
    poisoned[~owned] = float("nan")
    return poisoned, table


def make_case(seq_lens: list[int], s_q: int, heads: int, bs: int, dtype: torch.dtype, seed: int = 7):
    g = gen(seed)
    kv_cache, table, rows = paged_cache(seq_lens, bs, dtype, g)
    q = torch.randn(len(seq_lens), s_q, heads, LAT + ROPE, generator=g).to(dtype)
    return q, kv_cache, table, rows, torch.tensor(seq_lens, dtype=torch.int32)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


# Every combination of shape and split count, each in one of the three dtypes in turn: the dtype
# only changes the loads and the final store, and the interpreter is too slow to cross them all.
SHAPES = [
    (lens, s_q, heads, bs, splits)
    for lens in SEQ_LENS
    for s_q in (1, 3)
    for heads in (3, 7)
    for bs in (16, 64)
    for splits in (1, 4)
] + [  # block sizes that are no multiple of 16: a tile of keys spans cache blocks
    ("bs,2,2bs+1", 3, 3, 4, 3),
    ("0,1,bs+1", 3, 5, 24, 2),
]
MLA_CASES = [
    pytest.param(
        lens,
        s_q,
        heads,
        bs,
        DTYPES[i % len(DTYPES)],
        splits,
        id=f"B3-S{s_q}-H{heads}-bs{bs}-lens[{','.join(map(str, SEQ_LENS[lens](bs)))}]"
        f"-{DTYPE_ID[DTYPES[i % len(DTYPES)]]}-splits{splits}",
    )
    for i, (lens, s_q, heads, bs, splits) in enumerate(SHAPES)
]


@pytest.mark.parametrize("lens,s_q,heads,bs,dtype,splits", MLA_CASES)
def test_mla_decode_triton(lens, s_q, heads, bs, dtype, splits):
    seq_lens = SEQ_LENS[lens](bs)
    q, kv_cache, table, rows, lens_t = make_case(seq_lens, s_q, heads, bs, dtype)
    scale = (LAT + ROPE) ** -0.5
    o_want, lse_want = mla_naive(q, rows, seq_lens, scale)
    # The PyTorch path multiplies masked probabilities by the cache rows, so it only gets finite garbage.
    o_torch, lse_torch = mla_decode(q, kv_cache, table, lens_t, scale, LAT, impl="torch")

    poisoned, nan_table = nan_poisoned(kv_cache, table, seq_lens)
    o, lse = mla_decode(q, poisoned, nan_table, lens_t, scale, LAT, impl="triton", num_splits=splits)
    assert o.shape == (3, s_q, heads, LAT) and lse.shape == (3, s_q, heads)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all()
    assert_close(o, o_want, TOL[dtype])
    assert_close(lse, lse_want, LSE_TOL)  # -inf exactly where nothing is visible
    assert (o[lse_want == -math.inf] == 0).all()
    assert_close(o, o_torch, TOL[dtype])
    assert_close(lse, lse_torch, LSE_TOL)


def test_split_counts_agree():
    """1, 3 and 8 splits give one result; with 8, some ranges are empty (49 keys are 4 tiles)."""
    seq_lens, bs = [0, 3 * 16 + 1, 100], 16
    q, kv_cache, table, rows, lens_t = make_case(seq_lens, 3, 5, bs, torch.float32, seed=13)
    o_one, lse_one = mla_decode(q, kv_cache, table, lens_t, 0.2, LAT, impl="triton", num_splits=1)
    for splits in (3, 8):
        o, lse = mla_decode(q, kv_cache, table, lens_t, 0.2, LAT, impl="triton", num_splits=splits)
        # Splitting changes only the float32 summation order.
        assert_close(o, o_one, dict(atol=1e-6, rtol=1e-6))
        assert_close(lse, lse_one, dict(atol=1e-6, rtol=1e-6))
    o_want, lse_want = mla_naive(q, rows, seq_lens, 0.2)
    assert_close(o_one, o_want, TOL[torch.float32])
    assert_close(lse_one, lse_want, LSE_TOL)


def test_return_lse_false_and_default_splits():
    seq_lens = [5, 17, 0]
    q, kv_cache, table, _, lens_t = make_case(seq_lens, 1, 3, 16, torch.float32)
    o, lse = mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, impl="triton")  # heuristic: 1 split on CPU
    o_no_lse, no_lse = mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, impl="triton", return_lse=False)
    assert no_lse is None
    torch.testing.assert_close(o_no_lse, o, atol=0, rtol=0)
    auto, _ = mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, impl="auto")  # CPU tensors: the torch path
    torch_o, _ = mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, impl="torch")
    torch.testing.assert_close(auto, torch_o, atol=0, rtol=0)
    assert_close(o, torch_o, TOL[torch.float32])


def test_power_of_two_widths_and_empty_batch():
    """L = 32 and R = 16 fill their tiles exactly (no column masks); B = 0 launches nothing."""
    g = gen(17)
    lat, rope = 32, 16
    kv_cache = torch.randn(5, 16, lat + rope, generator=g)
    table = torch.tensor([[3, 1, 2], [0, 4, 4]], dtype=torch.int32)
    lens_t = torch.tensor([40, 9], dtype=torch.int32)
    q = torch.randn(2, 3, 3, lat + rope, generator=g)
    want_o, want_lse = mla_decode(q, kv_cache, table, lens_t, 0.1, lat, impl="torch")
    for splits in (1, 2):
        o, lse = mla_decode(q, kv_cache, table, lens_t, 0.1, lat, impl="triton", num_splits=splits)
        assert_close(o, want_o, TOL[torch.float32])
        assert_close(lse, want_lse, LSE_TOL)

    o, lse = mla_decode(q[:0], kv_cache, table[:0], lens_t[:0], 0.1, lat, impl="triton")
    assert o.shape == (0, 3, 3, lat) and lse.shape == (0, 3, 3)


def test_checks_name_the_field():
    q, kv_cache, table, _, lens_t = make_case([5], 1, 3, 16, torch.float32)
    call = lambda **kw: mla_decode(
        kw.get("q", q),
        kw.get("kv_cache", kv_cache),
        kw.get("table", table),
        kw.get("lens", lens_t),
        0.3,
        kw.get("lat", LAT),
        impl="triton",
        num_splits=kw.get("splits"),
    )
    with pytest.raises(ValueError, match="block_table"):
        call(table=table.long())
    with pytest.raises(ValueError, match="seq_lens"):
        call(lens=lens_t.long())
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=kv_cache[..., :-1])
    with pytest.raises(ValueError, match="kv_lora_rank"):
        call(lat=LAT + ROPE)
    with pytest.raises(ValueError, match="num_splits"):
        call(splits=0)
    with pytest.raises(ValueError, match="contiguous"):
        call(q=q.transpose(2, 3).contiguous().transpose(2, 3))


@pytest.mark.parametrize(
    "batch,row_blocks,max_keys,sms,want",
    [
        (1, 1, 8192, 132, 32),  # one long sequence: as many splits as allowed
        (1, 1, 1024, 132, 4),  # short table: at least MIN_KEYS_PER_SPLIT keys per split
        (8, 2, 8192, 132, 9),  # 16 programs -> ceil(132 / 16) splits
        (256, 8, 8192, 132, 1),  # the batch alone fills the GPU
        (4, 1, 16, 132, 1),
        (3, 1, 4096, 1, 1),  # CPU (interpreter): one split
    ],
    ids=lambda v: str(v),
)
def test_default_num_splits(batch, row_blocks, max_keys, sms, want):
    assert default_num_splits(batch, row_blocks, max_keys, sms) == want
