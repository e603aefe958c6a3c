"""kernels/native built without the AVX512-BF16 instructions (PDSERVE_NATIVE_BF16=0: what a CPU
with AVX512F but not them runs, Skylake-SP to Ice Lake) computes the bits the instructions do:
VDPBF16PS and VCVTNEPS2BF16 lane by lane, the products at 1 to 128 rows, the MLA decode attention,
and a whole decode step of a small model in one call (norms, rotary, products, attention, routing,
experts) with its LM head and greedy tokens.

The build for AVX2 (PDSERVE_NATIVE_AVX512=0: what a CPU without AVX-512 runs, AMD Zen 1 to 3,
Intel client cores) computes the same bits for the instructions and the attention, and its products
in an order of its own (kernels/native/products_avx2.h), bit for bit as a float32 reference of
that order here computes them; its decode steps agree with the AVX-512 build's to the difference
that order makes, with the same tokens wherever the top two logits are clearly apart.

The other build runs in a subprocess (the kernels are loaded once per process) and hands its
tensors back as safetensors."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import env
from engine.platform import load_native
from kernels import native
from tests.bench_testing import run_python
from tests.engine_testing import mla_caches
from tests.test_native_kernels import _decode_batch, _small_model


def _mla_decode_case(gen: torch.Generator, heads: int, lat: int, rope: int, lens: list[int]) -> torch.Tensor:
    """native.mla_decode on seeded inputs: one query token per sequence of `lens`, over a paged
    cache of 16-row blocks in shuffled order (two spare blocks)."""
    from kernels.mla import per_token_tables

    block_size, per_seq = 16, -(-max(lens) // 16)
    cache = torch.randn(len(lens) * per_seq + 2, block_size, lat + rope, generator=gen).bfloat16()
    table = torch.randperm(cache.shape[0], generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, lat + rope, generator=gen).bfloat16()
    tables = per_token_tables(table.int(), torch.tensor(lens, dtype=torch.int32), 1)
    return native.mla_decode(q, cache, *tables, 0.2, lat)


@torch.inference_mode()
def _outputs() -> dict[str, torch.Tensor]:
    """The kernels' outputs on seeded inputs, the same in any process (VDPBF16PS products: the
    emulated build has no AMX)."""
    native.use_amx(False)
    gen = torch.Generator().manual_seed(0)
    out = {}
    # The two instructions themselves, where a float32 difference is not hidden by a bf16 rounding:
    # a million multiply-add lanes over a wide range of magnitudes, and 4M float32 bit patterns
    # spread over all 2^32 (NaNs, infinities, denormals, ties) and their rounding.
    lanes = 1 << 20
    scale = 2.0 ** torch.randint(-20, 20, (2 * lanes,), generator=gen)
    a = (torch.randn(2 * lanes, generator=gen) * scale).bfloat16()
    b = torch.randn(2 * lanes, generator=gen).bfloat16()
    acc = torch.randn(lanes, generator=gen) * 2.0 ** torch.randint(-20, 20, (lanes,), generator=gen)
    out["dot_bf16"] = native.dot_bf16_lanes(acc, a, b)
    patterns = torch.arange(1 << 22, dtype=torch.int64) * 1021 + torch.randint(
        0, 1021, (1 << 22,), generator=gen
    )
    out["narrow"] = native.narrow_f32((patterns % (1 << 32)).to(torch.int32).view(torch.float32))
    # The products, on random operands and on cancelling ones: the second half of k repeats the
    # first with the weight negated, so each exact sum is 0 and what is left is the float32
    # additions' rounding, which depends on their order (the order shows in most outputs' bits).
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 17, 64, 128):
        for n, k, cancelling in (
            (70, 100, False),
            (64, 512, False),
            (33, 37, False),
            (64, 512, True),
            (33, 36, True),
        ):
            if cancelling:
                x = torch.randn(rows, k // 2, generator=gen) * 2.0 ** torch.randint(
                    -8, 8, (rows, k // 2), generator=gen
                )
                w = torch.randn(n, k // 2, generator=gen)
                x, w = torch.cat((x, x.flip(1)), 1).bfloat16(), torch.cat((w, -w.flip(1)), 1).bfloat16()
            else:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                w = torch.randn(n, k, generator=gen).bfloat16() * k**-0.5
            name = f"{rows}x{n}x{k}{'-cancelling' if cancelling else ''}"
            out[f"linear-{name}"] = native.linear_bf16(x, w)
            out[f"input-x-{name}"], out[f"input-w-{name}"] = x, w
    for heads, lat, rope, lens in ((9, 64, 32, [1, 17, 40, 130]), (3, 40, 8, [5, 2, 11])):
        out[f"mla_decode-{heads}x{lat}"] = _mla_decode_case(gen, heads, lat, rope, lens)
    for v2 in (False, True):
        for seqs in (1, 3, 32):
            cfg, model = _small_model(v2, seqs)
            assert model.native_stack is not None
            caches = [
                torch.randn(seqs * 50 + 3, 4, cfg.kv_cache_width, generator=gen).bfloat16() for _ in range(3)
            ]
            batch = _decode_batch(seqs, 1, 4, caches[0].shape[0], cfg.vocab_size, gen)
            assert model.runs_in_one_call(batch, mla_caches(caches))
            hidden = model(batch, mla_caches(caches))
            name = f"{'v2' if v2 else 'v3'}-{seqs}"
            out[f"hidden-{name}"] = hidden
            out[f"logits-{name}"] = model.lm_head(hidden)
            out[f"tokens-{name}"] = torch.tensor(model.greedy_tokens(hidden, cfg.vocab_size))
            for i, cache in enumerate(caches):
                out[f"cache{i}-{name}"] = cache
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers, so that NaNs compare too."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _avx2_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in the AVX2 build's order (kernels/native/products_avx2.h), in float32 tensor
    operations: each output in 16 partial sums, k's pair q in register (q // 8) % 2, lane q % 8,
    even product before odd; the two registers added; the lanes summed as
    ((0 + 2) + (1 + 3)) + ((4 + 6) + (5 + 7)); rounded to bf16."""
    k = x.shape[1]
    padded = -(-k // 32) * 32
    xf = torch.nn.functional.pad(x.float(), (0, padded - k))
    wf = torch.nn.functional.pad(w.float(), (0, padded - k))
    parts = torch.zeros(x.shape[0], w.shape[0], 2, 8)
    for step in range(0, padded, 32):
        for register in range(2):
            for odd in range(2):  # lane l holds pair step / 2 + 8 register + l
                ks = step + 16 * register + 2 * torch.arange(8) + odd
                parts[:, :, register] += xf[:, None, ks] * wf[None, :, ks]
    s = parts[:, :, 0] + parts[:, :, 1]
    lane = s.unbind(-1)
    return (
        ((lane[0] + lane[2]) + (lane[1] + lane[3])) + ((lane[4] + lane[6]) + (lane[5] + lane[7]))
    ).bfloat16()


def _other_build(
    tmp_path, child_env: dict[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this process's outputs, the other build's), the latter from a subprocess."""
    saved = tmp_path / "other.safetensors"
    run = run_python("-m", "tests.test_native_bf16_emulation", str(saved), timeout=600, env=child_env)
    assert run.returncode == 0, run.stderr[-3000:]
    before = native.uses_amx()
    try:
        ours = _outputs()
    finally:
        native.use_amx(before)
    theirs = load_file(saved)
    assert ours.keys() == theirs.keys()
    return ours, theirs


def _different(ours: dict, theirs: dict, names) -> list[str]:
    return [name for name in names if not torch.equal(_bits(ours[name]), _bits(theirs[name]))]


def test_the_emulation_computes_the_instructions_bits(tmp_path):
    build = load_native()
    assert build == native.supported()
    if not build or not native.has_avx512():  # no AVX512F here: no other build to compare with (the
        return  # references check this CPU's: test_this_cpus_build_computes_...)
    ours, emulated = _other_build(tmp_path, {"PDSERVE_NATIVE_BF16": "0"})
    different = _different(ours, emulated, ours)
    assert not different, f"the emulated build's bits differ in {different}"
    # The child ran the emulation; this process runs the instructions where the CPU has them.
    assert native.bf16_instructions() == (native.BF16_FLAG in native.cpu_flags() and env.native_bf16())


# What the AVX2 build's products change: the products and every decode step's outputs.
PRODUCT_OUTPUTS = ("linear-", "hidden-", "logits-", "tokens-", "cache")


def test_the_avx2_build_computes_the_instructions_bits_and_its_products_in_its_order(tmp_path):
    build = load_native()
    assert build == native.supported()
    if not build or not native.has_avx512():
        return
    ours, avx2 = _other_build(tmp_path, {"PDSERVE_NATIVE_AVX512": "0"})
    same = [name for name in ours if not name.startswith(PRODUCT_OUTPUTS)]
    assert "dot_bf16" in same and "narrow" in same and any(n.startswith("mla_decode") for n in same)
    different = _different(ours, avx2, same)
    assert not different, f"the AVX2 build's bits differ in {different}"
    products = [name for name in ours if name.startswith("linear-")]
    assert len(products) == 55
    for name in products:
        shape = name.removeprefix("linear-")
        want = _avx2_order(avx2[f"input-x-{shape}"], avx2[f"input-w-{shape}"])
        assert torch.equal(_bits(avx2[name]), _bits(want)), f"{name}: not the AVX2 order's bits"
    # Whole decode steps: each product within a bf16 rounding of the AVX-512 build's, through a
    # few layers. The largest difference seen (32 sequences, V3) was 1.4% of the largest value.
    steps = [name for name in ours if name.startswith(("hidden-", "logits-", "cache"))]
    assert len(steps) == 30
    for name in steps:
        scale = ours[name].float().abs().max()
        assert (avx2[name].float() - ours[name].float()).abs().max() <= 0.04 * scale, name
    for name in (n for n in ours if n.startswith("tokens-")):
        logits = ours[name.replace("tokens-", "logits-")].float()
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.08 * logits.abs().max()  # twice the difference allowed
        assert clear.any(), name
        assert torch.equal(avx2[name][clear], ours[name][clear]), name


def _dot_reference(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """VDPBF16PS lane by lane in float32 tensor operations: acc + a[2i+1] b[2i+1], then + a[2i]
    b[2i], each sum rounded once (a bf16 product is exact in float32)."""
    a, b = a.float().view(-1, 2), b.float().view(-1, 2)
    return (acc + a[:, 1] * b[:, 1]) + a[:, 0] * b[:, 0]


def _narrow_reference(x: torch.Tensor) -> torch.Tensor:
    """VCVTNEPS2BF16: float32 denormals become signed zeros, the rest rounds to nearest even."""
    tiny = (x.abs() < 2.0**-126) & (x != 0)
    return torch.where(tiny, torch.copysign(torch.zeros_like(x), x), x).bfloat16()


def test_this_cpus_build_computes_the_instructions_and_its_products_by_reference():
    """Whatever build this CPU loads (with the AVX512-BF16 instructions, their AVX512F emulation, or
    the AVX2 one), in this process: VDPBF16PS's and VCVTNEPS2BF16's bits lane by lane against a
    float32 reference of the instructions (the sums kept clear of denormals, which the instruction
    flushes and the emulation keeps; 4M float32 bit patterns over all 2^32, NaNs as NaNs), and, in
    the AVX2 build, its products bit for bit against the reference of their order. The tests above
    compare the builds with each other where the CPU runs the AVX-512 ones; this one needs none."""
    if not load_native():
        assert not native.supported()
        return
    gen = torch.Generator().manual_seed(5)
    lanes = 1 << 18
    a = (
        torch.randn(2 * lanes, generator=gen) * 2.0 ** torch.randint(-20, 20, (2 * lanes,), generator=gen)
    ).bfloat16()
    b = torch.randn(2 * lanes, generator=gen).bfloat16()
    acc = torch.randn(lanes, generator=gen) * 2.0 ** torch.randint(-20, 20, (lanes,), generator=gen)
    assert torch.equal(_bits(native.dot_bf16_lanes(acc, a, b)), _bits(_dot_reference(acc, a, b)))

    patterns = torch.arange(1 << 22, dtype=torch.int64) * 1024 + torch.randint(
        0, 1024, (1 << 22,), generator=gen
    )
    big = torch.finfo(torch.float32)
    specials = torch.tensor(
        [float("inf"), -float("inf"), 0.0, -0.0, big.tiny, -big.tiny, big.tiny / 2, big.max, -big.max]
        + [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0, 2.0**-125, 1 / 3]
    )  # infinities, zeros, the denormal edge, overflow on rounding, ties to even both ways
    x = torch.cat(((patterns % (1 << 32)).to(torch.int32).view(torch.float32), specials))
    got, want = native.narrow_f32(x), _narrow_reference(x)
    nan = x.isnan()
    assert nan.any() and (x[~nan].abs() < 2.0**-126).any() and x.isinf().any()
    assert got[nan].isnan().all()
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan]))

    if native.avx512():  # the AVX-512 products' order is checked against the other builds above
        return
    native.use_amx(False)  # no tiles in the AVX2 build: its own products
    for rows, n, k in ((1, 70, 100), (3, 33, 37), (17, 64, 512), (128, 40, 96)):
        xs = torch.randn(rows, k, generator=gen).bfloat16()
        w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
        assert torch.equal(_bits(native.linear_bf16(xs, w)), _bits(_avx2_order(xs, w))), (rows, n, k)


AVX512 = frozenset(native.REQUIRED_FLAGS)


@pytest.mark.parametrize(
    "flags, kernels, want",
    [
        (AVX512 | {"avx512_bf16"}, "1", torch.bfloat16),
        (AVX512 | {"amx_bf16"}, "0", torch.bfloat16),  # native bf16 arithmetic: bf16 with or without them
        (AVX512, "1", torch.bfloat16),  # the kernels' emulation
        (AVX512, "0", torch.float32),  # torch's emulated bf16 products: float32 is faster
        (frozenset({"avx2", "fma", "f16c"}), "1", torch.bfloat16),  # the AVX2 build's emulation
        (frozenset({"avx2", "fma", "f16c"}), "0", torch.float32),
        (frozenset({"sse4_2", "avx"}), "1", torch.float32),  # no build runs there
    ],
    ids=[
        "avx512-bf16",
        "amx-kernels-off",
        "avx512f",
        "avx512f-kernels-off",
        "avx2",
        "avx2-kernels-off",
        "avx",
    ],
)
def test_a_bf16_model_computes_in_bf16_where_the_cpu_or_the_kernels_do(monkeypatch, flags, kernels, want):
    from engine.platform import compute_dtype

    runs_here = load_native()
    if not runs_here:  # the kernels cannot run on this CPU, whatever the flags say
        monkeypatch.setattr(native, "load", lambda *a, **k: False)
        want = torch.float32 if not flags & {"avx512_bf16", "amx_bf16"} else want
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", kernels)
    compute_dtype.cache_clear()
    try:
        assert compute_dtype(torch.bfloat16, torch.device("cpu")) == want
        assert compute_dtype(torch.float32, torch.device("cpu")) == torch.float32
    finally:
        compute_dtype.cache_clear()


def _attentions(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The decode attentions that run through attention.h's loops (mla_decode, sparse_mla_decode,
    v4_attention), on seeded inputs: every head-group size (1 to 8 and a group of 8 and 1), W past
    whole 32-value chunks, L past whole 16 columns, odd and even lengths, a row no token reads
    holding NaN, -1 slots, and sinks."""
    out = {}
    for heads, lat, rope, lens in (
        (1, 64, 32, [1, 2, 3]),
        (2, 40, 8, [5, 2, 11]),
        (3, 512, 64, [17]),
        (4, 48, 24, [40, 7]),
        (5, 100, 20, [33, 1]),
        (6, 64, 32, [64]),
        (7, 16, 0, [9, 4]),
        (8, 512, 64, [1, 300, 1030]),
        (9, 72, 24, [130, 31]),
    ):
        out[f"mla-{heads}x{lat}+{rope}"] = _mla_decode_case(gen, heads, lat, rope, lens)
    cache = torch.randn(30, 16, 96, generator=gen).bfloat16()
    cache.view(-1, 96)[5] = float("nan")  # never chosen
    slots = torch.randint(6, 480, (6, 45), generator=gen)
    slots[1, ::3], slots[2], slots[3, :40] = -1, -1, -1
    q = torch.randn(6, 11, 96, generator=gen).bfloat16()
    out["sparse"] = native.sparse_mla_decode(q, cache, slots, 0.125, 72)
    window, entries = (
        torch.randn(6, 16, 48, generator=gen).bfloat16(),
        torch.randn(4, 8, 48, generator=gen).bfloat16(),
    )
    wslots, eslots = (
        torch.randint(-1, 96, (7, 20), generator=gen),
        torch.randint(-1, 32, (7, 9), generator=gen),
    )
    wslots[:, 0] = 3
    q, sinks = torch.randn(7, 3, 48, generator=gen).bfloat16(), 2 * torch.randn(3, generator=gen)
    out["v4"] = native.v4_attention(q, window, wslots, entries, eslots, sinks, 48**-0.5)
    return out


def test_the_avx2_builds_own_attention_computes_its_emulations_bits():
    """The AVX2 build's decode attention has loops of its own (attention.h attend_scores_avx2,
    attend_output_avx2) beside the AVX-512 builds' on avx2.h's emulation, whose bits
    test_the_avx2_build_computes_the_instructions_bits_... holds to the instructions' on a CPU with
    AVX-512: the two give the same bits here. An AVX-512 build has the one form, either setting."""
    if not load_native():
        return
    amx, amx_emulated = native.uses_amx(), native.amx_emulated()
    native.use_amx(False)  # the tiles (in software here) have an attention of their own
    try:
        runs = {}
        for generic in (True, False):
            before = native.use_attend_generic(generic)
            try:
                runs[generic] = _attentions(torch.Generator().manual_seed(0))
            finally:
                native.use_attend_generic(before)
    finally:
        native.use_amx(amx, amx_emulated)
    assert len(runs[False]) == 11
    different = _different(runs[True], runs[False], runs[False])
    assert not different, f"the AVX2 build's own attention differs from its emulation in {different}"
    assert all(not t.isnan().any() for t in runs[False].values())


if __name__ == "__main__":  # the other build's side: PDSERVE_NATIVE_BF16=0 or PDSERVE_NATIVE_AVX512=0
    torch.set_num_threads(1)
    assert load_native() and not native.bf16_instructions()
    assert native.avx512() == env.native_avx512()
    save_file({name: t.contiguous() for name, t in _outputs().items()}, sys.argv[1])
