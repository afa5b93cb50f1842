"""The test and sweep knobs of kvpool.kernels._tuning, no GPU: defaults outside an override,
the fp8 decode tuning changing only fp8 modules, bad values refused, and the knobs reaching
the plans made inside an override (and only those)."""

from __future__ import annotations

import threading

import kvpool
import numpy as np
import pytest
from kvpool.kernels import _build, _tuning
from kvpool.kernels._build import Fp8DecodeTuning, tc_variant


def test_defaults_outside_an_override():
    assert _tuning.current() == _tuning.DEFAULT == _tuning.Tuning()
    t = _tuning.current()
    assert t.decode_pipeline == _build.TC and t.prefill_rows_per_cta is None
    assert t.fp8_decode == Fp8DecodeTuning() and t.fp8_prefill_async is False
    plain, _ = tc_variant("float8_e4m3fn", 128, 4, "float16")
    assert "-DNWARPS=6" in plain.options() and "-DSTAGES=3" in plain.options()


def test_override_is_undone_and_stays_in_its_thread():
    seen = []
    with _tuning.override(decode_pipeline=1, prefill_rows_per_cta=16) as t:
        assert _tuning.current() is t and t.decode_pipeline == 1
        other = threading.Thread(target=lambda: seen.append(_tuning.current()))
        other.start()
        other.join()
        with _tuning.override(decode_pipeline=0):
            assert _tuning.current().prefill_rows_per_cta == 16  # the outer knob kept
        assert _tuning.current().decode_pipeline == 1
    assert seen == [_tuning.DEFAULT]
    assert _tuning.current() == _tuning.DEFAULT


def test_a_tuning_changes_only_fp8_modules():
    tuning = Fp8DecodeTuning(warps=8, stages=3, fill=2)
    v, gq = tc_variant("float8_e4m3fn", 128, 4, "float16", tuning)
    assert gq == 4 and "-DNWARPS=8" in v.options() and "-DSTAGES=3" in v.options()
    assert v.threads == 256 and v.tokens_per_iter == 128
    assert v.dynamic_smem_bytes == 3 * 8 * 16 * sum(_build.fp8_row_bytes(128))
    for dtype in _build.DTYPES:
        assert tc_variant(dtype, 128, 4, None, tuning) == tc_variant(dtype, 128, 4)


@pytest.mark.parametrize(
    "fields",
    [
        {"warps": 5},
        {"stages": 1},
        {"stages": 5},
        {"fill": 9},
        {"warps": -4},
    ],
)
def test_bad_fp8_decode_tunings_are_refused(fields):
    with pytest.raises(ValueError, match="warps in"):
        Fp8DecodeTuning(**fields)


@pytest.mark.parametrize(
    "knobs",
    [
        {"decode_pipeline": 7},
        {"decode_pipeline": True},
        {"prefill_rows_per_cta": 32},
        {"fp8_decode": "warps=4"},
        {"fp8_prefill_async": 1},
    ],
)
def test_bad_knobs_are_refused(knobs):
    with pytest.raises(ValueError), _tuning.override(**knobs):
        pass
    assert _tuning.current() == _tuning.DEFAULT


def test_fixed_stages_are_lowered_to_fit_shared_memory():
    v, _ = tc_variant("float8_e4m3fn", 256, 4, "float16", Fp8DecodeTuning(warps=8, stages=4))
    assert 2 <= v.stages < 4 and v.dynamic_smem_bytes <= _build.SMEM_PER_SM
    assert f"-DSTAGES={v.stages}" in v.options()


def test_ci_compiles_the_default_fp8_modules():
    for v in _build.fp8_tc_variants():
        assert (v.warps, v.fixed_stages) == (
            _build.FP8_DECODE_DEFAULT.warps,
            _build.FP8_DECODE_DEFAULT.stages,
        )
        assert v == tc_variant(v.dtype, v.dp, 16 if v.nh == 2 else 8, v.q_dtype)[0]


def test_fp8_prefill_async_modules():
    for hd in _build.HEAD_DIMS:
        for w in (_build.PREFILL_WIDE_WARPS, _build.PREFILL_NARROW_WARPS):
            sync = _build.PrefillVariant("float8_e4m3fn", hd, 16, w, "float16")
            async_ = _build.PrefillVariant("float8_e4m3fn", hd, 16, w, "float16", True)
            assert "-DKV_FP8_ASYNC=1" in async_.options()
            assert "-DKV_FP8_ASYNC=1" not in sync.options()
            # one fp16 tile + two fp8 staging tiles: the synchronous form's two fp16 tiles
            assert async_.dynamic_smem_bytes == sync.dynamic_smem_bytes
            assert async_.kv_tile == sync.kv_tile and async_.ctas_per_sm == sync.ctas_per_sm


def test_rows_per_cta_reaches_the_plans_made_inside_the_override():
    pool = kvpool.Pool(kvpool.KvLayout(1, 2, 64, 16, "float16"), 8)
    args = (pool, np.array([0, 200], np.int32), np.zeros((1, 13), np.int32), np.array([200]), 8)
    assert kvpool.prefill_plan(*args).rows_per_cta == 64
    with _tuning.override(prefill_rows_per_cta=16):
        forced = kvpool.prefill_plan(*args)
    assert forced.rows_per_cta == 16 and forced.work.q_tile_tokens == 16 // forced.work.head_tile
    assert kvpool.prefill_plan(*args).rows_per_cta == 64


def test_the_knobs_left_the_public_signatures():
    import inspect

    for fn in (
        kvpool.paged_attention_decode,
        kvpool.paged_attention_prefill,
        kvpool.decode_plan,
        kvpool.prefill_plan,
    ):
        params = inspect.signature(fn).parameters
        assert "pipeline" not in params and "rows_per_cta" not in params, fn.__name__
