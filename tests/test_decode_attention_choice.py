"""engine/platform.py pick_decode_attention: where the products run on the AMX tile unit, the decode
attention goes on whichever of the tiles and VDPBF16PS the engine measured faster at load
(PDSERVE_NATIVE_AMX_ATTENTION=auto, the default), or where the variable pins it. The timing itself
is the machine's (tests/test_native_kernels.py runs it on software tiles); here it is replaced by
given figures, so what is asserted is the choice made from them."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, env, platform
from engine.config import ModelConfig
from kernels import native


class FakeUnit:
    """The tile unit as pick_decode_attention sees it: the products on it (not emulated), the two
    paths' times as given, and each use_amx_attention call recorded."""

    def __init__(self, monkeypatch, tiles_ms: float, vdpbf16ps_ms: float, unit: bool = True, emulated=False):
        self.timed: list[tuple] = []
        self.set: list[bool] = []
        self.seconds = {"tiles": tiles_ms / 1e3, "vdpbf16ps": vdpbf16ps_ms / 1e3}
        monkeypatch.setattr(native, "uses_amx", lambda: unit)
        monkeypatch.setattr(native, "amx_emulated", lambda: emulated)
        monkeypatch.setattr(native, "attention_case", lambda *shape, **_: shape)
        monkeypatch.setattr(native, "time_attention_paths", self._time)
        monkeypatch.setattr(native, "use_amx_attention", self.set.append)
        platform._attention_on_tiles.cache_clear()  # measured once per process and shape

    def _time(self, case, kv_lora_rank):
        self.timed.append(case)
        return self.seconds


@pytest.fixture(autouse=True)
def _fresh_measurements():
    platform._attention_on_tiles.cache_clear()
    yield
    platform._attention_on_tiles.cache_clear()


def test_auto_keeps_the_faster_path(monkeypatch, caplog):
    monkeypatch.setenv(env.AMX_ATTENTION_VAR, "auto")
    unit = FakeUnit(monkeypatch, tiles_ms=7.8, vdpbf16ps_ms=3.1)
    with caplog.at_level(logging.INFO, logger="engine.platform"):
        platform.pick_decode_attention(8, 512, 64, 16, 256)
    # One layer of the engine's most sequences, ATTENTION_CONTEXT tokens each, the model's shape.
    assert unit.timed == [(256, platform.ATTENTION_CONTEXT, 8, 512, 64, 16)]
    assert unit.set == [False]
    assert (
        "decode attention on VDPBF16PS" in caplog.text and "7.80 ms" in caplog.text and "3.10" in caplog.text
    )

    unit = FakeUnit(monkeypatch, tiles_ms=2.0, vdpbf16ps_ms=3.1)
    platform.pick_decode_attention(8, 512, 64, 16, 256)
    assert unit.set == [True]


def test_auto_keeps_the_tiles_in_a_near_tie(monkeypatch):
    """VDPBF16PS must take at most 1 / TILES_MARGIN of the tiles' time to be chosen."""
    monkeypatch.delenv(env.AMX_ATTENTION_VAR, raising=False)  # auto is the default
    unit = FakeUnit(monkeypatch, tiles_ms=3.1 * platform.TILES_MARGIN * 0.99, vdpbf16ps_ms=3.1)
    platform.pick_decode_attention(8, 512, 64, 16, 64)
    assert unit.set == [True]
    unit = FakeUnit(monkeypatch, tiles_ms=3.1 * platform.TILES_MARGIN * 1.01, vdpbf16ps_ms=3.1)
    platform.pick_decode_attention(8, 512, 64, 16, 64)
    assert unit.set == [False]


def test_auto_measures_once_per_shape_and_at_most_the_tile_units_rows(monkeypatch):
    monkeypatch.setenv(env.AMX_ATTENTION_VAR, "auto")
    unit = FakeUnit(monkeypatch, tiles_ms=8, vdpbf16ps_ms=3)
    platform.pick_decode_attention(8, 512, 64, 16, 1000)
    platform.pick_decode_attention(8, 512, 64, 16, 1000)  # a second engine in the process
    platform.pick_decode_attention(8, 512, 64, 32, 1000)  # another block size
    assert [case[0] for case in unit.timed] == [native.AMX_ROWS] * 2
    assert [case[-1] for case in unit.timed] == [16, 32]
    assert unit.set == [False, False, False]  # each engine still sets the answer


@pytest.mark.parametrize("value", ["1", "0"])
def test_a_pinned_setting_is_not_timed(monkeypatch, value):
    """PDSERVE_NATIVE_AMX_ATTENTION=1 or 0: native.load already set it; nothing is measured."""
    monkeypatch.setenv(env.AMX_ATTENTION_VAR, value)
    unit = FakeUnit(monkeypatch, tiles_ms=8, vdpbf16ps_ms=3)
    platform.pick_decode_attention(8, 512, 64, 16, 256)
    assert unit.timed == [] and unit.set == []
    assert env.native_amx_attention() == {"1": "tiles", "0": "vdpbf16ps"}[value]


@pytest.mark.parametrize("unit, emulated", [(False, False), (True, True)], ids=["no unit", "software tiles"])
def test_nothing_is_timed_off_the_unit(monkeypatch, unit, emulated):
    """Without the products on the unit there is no tile path to choose; on software tiles (the
    tests' `amx` products) the tile path stays what is tested."""
    monkeypatch.setenv(env.AMX_ATTENTION_VAR, "auto")
    fake = FakeUnit(monkeypatch, tiles_ms=8, vdpbf16ps_ms=3, unit=unit, emulated=emulated)
    platform.pick_decode_attention(8, 512, 64, 16, 256)
    assert fake.timed == [] and fake.set == []


@pytest.mark.parametrize("value", ["yes", "", "tiles", "2"])
def test_a_bad_setting_names_the_variable_and_its_values(monkeypatch, value):
    monkeypatch.setenv(env.AMX_ATTENTION_VAR, value)
    with pytest.raises(ValueError, match=r"PDSERVE_NATIVE_AMX_ATTENTION must be one of auto, 1, 0, got"):
        env.native_amx_attention()


def test_the_engine_asks_with_its_models_shape_and_most_sequences(monkeypatch, tiny_model):
    asked = []
    monkeypatch.setattr("engine.runner.pick_decode_attention", lambda *a: asked.append(a))
    LLM(tiny_model, dtype="bfloat16", block_size=16, num_kv_blocks=64, max_num_seqs=40)
    cfg = ModelConfig.from_pretrained(tiny_model)
    want = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 16, 40)
    assert asked == ([want] if native.loaded() else [])  # only where the native kernels run
