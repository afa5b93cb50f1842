"""CPU checks of the Hopper prefill's host side: the generated wgmma header is the generator's
output, the knob's values, and which kernel a plan picks for its tiles."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvpool.kernels import _build, _tuning

ROOT = Path(__file__).resolve().parent.parent


def test_the_wgmma_header_is_the_generators_output():
    gen = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"])
    assert gen.returncode == 0, "cuda/wgmma_sm90.cuh is stale: run python tools/gen_wgmma.py"


def test_the_prefill_kernel_knob_takes_three_values():
    assert _tuning.current().prefill_kernel == "auto"
    for value in _tuning.PREFILL_KERNELS:
        with _tuning.override(prefill_kernel=value) as t:
            assert t.prefill_kernel == value
    with pytest.raises(ValueError, match="prefill_kernel"), _tuning.override(prefill_kernel="sm75"):
        pass


@pytest.mark.parametrize("d", _build.HEAD_DIMS)
def test_sm90_variants_fit_one_cta_per_sm(d):
    v = _build.sm90_prefill_variant("bfloat16", d, 16)
    assert v.sm90 and v.arch == "sm_90a" and v.threads == 384 and v.rows == 128
    assert v.dynamic_smem_bytes <= _build.SMEM_PER_SM and v.ctas_per_sm == 1
    assert v.kernel == "paged_prefill_sm90" and v.source == "paged_prefill_sm90.cu"
    assert not v.merge_variant.sm90 and v.merge_variant.head_dim == d
    assert f"-DBN={_build.SM90_BN[d]}" in v.options()
    with pytest.raises(ValueError, match="16-bit"):
        _build.PrefillVariant("float8_e4m3fn", d, 16, _build.SM90_WARPS, "float16", sm90=True)


@pytest.mark.parametrize("d", _build.HEAD_DIMS)
@pytest.mark.parametrize("bs", _build.PREFILL_BLOCK_SIZES)
def test_the_producers_shuffled_page_ids_are_each_rows_own(d, bs):
    """paged_prefill_sm90.cu's producer: lane l of a warp holds table entries l, l + 32, ... of
    a tile (PAGES_PER_LANE registers); the thread copying row `row` (rows i * PROD_RPI + row0)
    takes register (i * PROD_RPI) / (32 * BLOCK_SIZE), a compile-time index, from lane
    (row / BLOCK_SIZE) % 32. The same arithmetic here, for every thread, row and block size:
    the entry it gets is the page that holds the row's token (tiles start at multiples of BN)."""
    bn = _build.SM90_BN[d]
    rpi = 128 // (d // 8)  # PROD_RPI: 128 producer threads, d / 8 16-byte chunks per row
    tile_pages = 1 if bs >= bn else bn // bs
    per_lane = -(-tile_pages // 32)
    assert (32 * bs) % rpi == 0 and rpi <= 32  # the kernel's static_assert
    for t0 in (0, bn, 7 * bn):
        for tid in range(128):
            row0 = tid // (d // 8)
            for i in range(bn // rpi):
                row = i * rpi + row0
                p = 0 if bs >= bn else row // bs
                reg = (i * rpi) // (32 * bs)
                assert reg < per_lane and reg == p // 32
                entry = 32 * reg + p % 32
                assert entry < tile_pages
                assert t0 // bs + entry == (t0 + row) // bs


def test_the_tma_knob_is_a_bool_and_tma_modules_need_pages_of_eight():
    assert _tuning.current().prefill_tma is _build.SM90_TMA_DEFAULT
    with pytest.raises(ValueError, match="prefill_tma"), _tuning.override(prefill_tma=1):
        pass
    assert _build.sm90_prefill_variant("float16", 128, 8, True).tma
    assert "-DKV_TMA=1" in _build.sm90_prefill_variant("float16", 128, 8, True).options()
    assert "-DKV_TMA=0" in _build.sm90_prefill_variant("float16", 128, 16).options()
    assert not _build.sm90_prefill_variant("float16", 128, 4, True).tma  # cp.async instead
    with pytest.raises(ValueError, match="TMA"):
        _build.PrefillVariant("float16", 128, 4, _build.SM90_WARPS, sm90=True, tma=True)
    with pytest.raises(ValueError, match="TMA"):
        _build.PrefillVariant("float16", 128, 16, tma=True)  # the Ampere module has none
    labels = [label for label, _, _ in _build.sm90_sources()]
    assert "paged_prefill_sm90[float16,128,8,tma]" in labels
    assert "paged_prefill_sm90[bfloat16,256,16,tma]" in labels


def _swizzled(rows: int, row: int, chunk: int) -> int:
    """swz128 of paged_prefill_sm90.cu: (row, 16-byte chunk) of a tile of `rows` rows."""
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


@pytest.mark.parametrize("d", _build.HEAD_DIMS)
@pytest.mark.parametrize("bs", [b for b in _build.PREFILL_BLOCK_SIZES if b >= 8])
def test_tma_boxes_land_where_the_wgmma_tiles_read(d, bs):
    """The KV_TMA producer: box (page p, column block c) of a tile starting at token t0 goes to
    p * BOX_TOKENS * 128 + c * BN * 128 and holds tokens tok0 .. tok0 + BOX_TOKENS - 1 of the
    tile's page p (tok0 = t0 % bs when a page holds more than a tile, else 0), columns 64c ..
    64c + 63. The hardware's 128-byte swizzle puts 16-byte chunk k of box row r at
    ((k ^ ((address >> 7) & 7)) << 4) from the row's start (the address of the row in a
    1024-aligned stage). Every (row, chunk) of the tile must land at swz128's offset, each
    exactly once, holding the token the consumers expect there."""
    bn = _build.SM90_BN[d]
    box_tokens = min(bs, bn)
    tile_pages = 1 if bs >= bn else bn // bs
    for t0 in (0, bn, 5 * bn):
        seen = {}
        for p in range(tile_pages):
            tok0 = t0 % bs if bs >= bn else 0
            for c in range(d // 64):
                base = p * box_tokens * 128 + c * bn * 128
                assert base % 1024 == 0  # a swizzle atom: the kernel's static_assert
                for r in range(box_tokens):
                    token = (t0 // bs + p) * bs + tok0 + r  # what the box row holds
                    for k in range(8):
                        row_at = base + r * 128
                        seen[row_at + ((k ^ ((row_at >> 7) & 7)) << 4)] = (token, 8 * c + k)
        want = {
            _swizzled(bn, row, chunk): (t0 + row, chunk)
            for row in range(bn)
            for chunk in range(d // 8)
        }
        assert seen == want


@pytest.mark.parametrize("bs", [8, 16, 256])
def test_the_tensor_maps_address_the_pools_k_and_v_views(bs):
    """kv_map_specs (the dims, strides and boxes the plan encodes) address the very bytes the
    pool's k_view / v_view hold: for elements spread over every dimension, the map's address
    of (column, KV head, token, layer, block) is the view's address of [block, token, head,
    column]; the box is 64 columns x one page (or one tile)."""
    import types

    import kvpool
    from kvpool.kernels._prefill import kv_map_specs

    layout = kvpool.KvLayout(3, 4, 128, bs, "float16")
    pool = kvpool.Pool(layout, 10)
    info = types.SimpleNamespace(
        base_ptr=pool.base_ptr,
        strides=layout.strides(),
        head_dim=128,
        num_kv_heads=4,
        block_size=bs,
        num_layers=3,
        num_blocks=10,
    )
    specs = kv_map_specs(info, 128)  # type: ignore[arg-type]
    rng = np.random.default_rng(bs)
    for name, view_of in (("k_map", pool.k_view), ("v_map", pool.v_view)):
        m = specs[name]
        assert m.dims == [128, 4, bs, 3, 10] and m.box_dims == [64, 1, min(bs, 128), 1, 1]
        for layer in range(3):
            a = np.asarray(view_of(layer))
            base = a.__array_interface__["data"][0]
            for _ in range(20):
                b, t, h, c = (int(rng.integers(n)) for n in (10, bs, 4, 128))
                coord = [c, h, t, layer, b]
                at = m.global_address + 2 * c
                at += sum(s * x for s, x in zip(m.strides_bytes, coord[1:], strict=True))
                want = base + int(np.dot(a.strides, (b, t, h, c)))
                assert at == want, (name, layer, b, t, h, c)


def test_tensor_map_tiled_refuses_bad_values_and_wrong_types():
    from kvpool import _core
    from kvpool.exceptions import CudaUnavailableError, InvalidArgumentError, LayoutError

    good = dict(
        global_address=1 << 20,
        dtype="float16",
        dims=[128, 8, 16, 2, 100],
        strides_bytes=[256, 2048, 65536, 131072],
        box_dims=[64, 1, 16, 1, 1],
        swizzle_bytes=128,
    )
    for change, match in (
        (dict(swizzle_bytes=96), "swizzle_bytes 96"),
        (dict(box_dims=[128, 1, 16, 1, 1]), "swizzle span"),
        (dict(box_dims=[64, 1, 512, 1, 1]), "box_dims"),
        (dict(strides_bytes=[256, 2050, 65536, 131072]), "strides_bytes"),
        (dict(dims=[128, 8, 16, 2, -1]), "dims"),
        (dict(global_address=(1 << 20) + 8), "aligned"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            _core.tensor_map_tiled(**{**good, **change})
    with pytest.raises(LayoutError, match="dtype"):
        _core.tensor_map_tiled(**{**good, "dtype": "int7"})
    with pytest.raises(TypeError):
        _core.tensor_map_tiled(**{**good, "dims": [128, 8, "16", 2, 100]})
    if not _core.cuda_available():
        with pytest.raises(CudaUnavailableError):
            _core.tensor_map_tiled(**good)
    else:
        assert len(_core.tensor_map_tiled(**good)) == 128


def test_the_sm90_parameter_block_carries_the_maps_by_value_and_the_layer():
    """The kernel takes k_map and v_map by value (128 bytes each): the parameter block points
    at the struct's own 128-byte fields, in the kernel's order, and the Ampere kernel's block
    leaves them out."""
    import ctypes

    from kvpool.kernels._launch import param_block
    from kvpool.kernels._prefill_args import SM80_ONLY, SM90_ONLY, PrefillArgs

    assert PrefillArgs.k_map.size == PrefillArgs.v_map.size == 128
    args = PrefillArgs()
    args.k_map[:] = list(range(16))
    base = ctypes.addressof(args)
    sm90 = [p - base for p in param_block(args, SM80_ONLY)]
    sm80 = [p - base for p in param_block(args, SM90_ONLY)]
    names = [f[0] for f in PrefillArgs._fields_ if f[0] not in SM80_ONLY]
    assert names[-3:] == ["k_map", "v_map", "layer"]
    assert sm90[-3:] == [
        PrefillArgs.k_map.offset,
        PrefillArgs.v_map.offset,
        PrefillArgs.layer.offset,
    ]
    assert ctypes.c_uint64.from_address(base + sm90[-3] + 8 * 15).value == 15
    assert PrefillArgs.k_map.offset not in sm80 and len(sm80) == len(PrefillArgs._fields_) - 3
