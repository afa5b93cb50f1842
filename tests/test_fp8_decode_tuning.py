"""KVPOOL_FP8_DECODE (the fp8 decode's tuning) and KVPOOL_FP8_PREFILL_ASYNC, no GPU. Unset, the fp8
modules take Fp8DecodeTuning's defaults; set, only fp8 modules change; bad values are refused with a message naming
the variable."""

from __future__ import annotations

import pytest
from kvpool.kernels import _build
from kvpool.kernels._build import FP8_DECODE_ENV, Fp8DecodeTuning, fp8_decode_tuning, tc_variant


def test_unset_or_empty_is_the_default(monkeypatch):
    monkeypatch.delenv(FP8_DECODE_ENV, raising=False)
    assert fp8_decode_tuning() == Fp8DecodeTuning()
    monkeypatch.setenv(FP8_DECODE_ENV, " ")
    tuning = fp8_decode_tuning()
    assert tuning == Fp8DecodeTuning()
    plain, _ = tc_variant("float8_e4m3fn", 128, 4, "float16")
    tuned, _ = tc_variant("float8_e4m3fn", 128, 4, "float16", tuning)
    assert tuned.options() == plain.options()
    assert "-DNWARPS=6" in plain.options() and "-DSTAGES=3" in plain.options()


def test_a_tuning_changes_only_fp8_modules(monkeypatch):
    monkeypatch.setenv(FP8_DECODE_ENV, "warps=8,stages=3,fill=2")
    tuning = fp8_decode_tuning()
    assert tuning == Fp8DecodeTuning(warps=8, stages=3, fill=2)
    v, gq = tc_variant("float8_e4m3fn", 128, 4, "float16", tuning)
    assert gq == 4 and "-DNWARPS=8" in v.options() and "-DSTAGES=3" in v.options()
    assert v.threads == 256 and v.tokens_per_iter == 128
    assert v.dynamic_smem_bytes == 3 * 8 * 16 * sum(_build.fp8_row_bytes(128))
    for dtype in _build.DTYPES:
        assert tc_variant(dtype, 128, 4, None, tuning) == tc_variant(dtype, 128, 4)


@pytest.mark.parametrize(
    "text", ["warps=5", "stages=1", "stages=5", "fill=9", "warps=x", "warp=4", "warps", "warps=-4"]
)
def test_bad_values_are_refused(monkeypatch, text):
    monkeypatch.setenv(FP8_DECODE_ENV, text)
    with pytest.raises(ValueError, match=FP8_DECODE_ENV):
        fp8_decode_tuning()


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


def test_fp8_prefill_async_switch(monkeypatch):
    monkeypatch.delenv(_build.FP8_PREFILL_ASYNC_ENV, raising=False)
    assert _build.fp8_prefill_async() is _build.FP8_PREFILL_ASYNC_DEFAULT
    monkeypatch.setenv(_build.FP8_PREFILL_ASYNC_ENV, "1")
    assert _build.fp8_prefill_async() is True
    monkeypatch.setenv(_build.FP8_PREFILL_ASYNC_ENV, "0")
    assert _build.fp8_prefill_async() is False
    monkeypatch.setenv(_build.FP8_PREFILL_ASYNC_ENV, "yes")
    with pytest.raises(ValueError, match=_build.FP8_PREFILL_ASYNC_ENV):
        _build.fp8_prefill_async()
    for hd in _build.HEAD_DIMS:
        for w in (_build.PREFILL_WIDE_WARPS, _build.PREFILL_NARROW_WARPS):
            sync = _build.PrefillVariant("float8_e4m3fn", hd, 16, w, "float16")
            async_ = _build.PrefillVariant("float8_e4m3fn", hd, 16, w, "float16", True)
            assert "-DKV_FP8_ASYNC=1" in async_.options()
            assert "-DKV_FP8_ASYNC=1" not in sync.options()
            # one fp16 tile + two fp8 staging tiles: the synchronous form's two fp16 tiles
            assert async_.dynamic_smem_bytes == sync.dynamic_smem_bytes
            assert async_.kv_tile == sync.kv_tile and async_.ctas_per_sm == sync.ctas_per_sm
