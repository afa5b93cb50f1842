"""Kernel sources, compile-time variants and the per-variant module cache.

The CUDA C++ sources live in the repository's top-level ``cuda/`` folder; the build embeds them in
the extension (``kvpool._core.kernel_sources()``), and they are compiled at run time by NVRTC
through ``cupy.RawModule``. For kernel development, ``KVPOOL_CUDA_DIR=path/to/cuda`` makes the
library read the sources from that folder instead, so an edit needs no rebuild. The same :func:`variant_options` feed the runtime compile and
the CI compile test, so CI compiles exactly what a GPU run compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# passed to the .cu: its fused merge's weight area
from kvpool.kernels._decode_split import MAX_DECODE_SPLITS

DTYPES = ("float16", "bfloat16")
# fp8 caches (KV_FP8 in the .cu: 1 e4m3fn, 2 e5m2); their queries and outputs are float16 or
# bfloat16, chosen by the caller's q. The tensor-core decode reads them with head_dim a multiple
# of 16 in 32..256 (16-byte fp8 chunks).
FP8_DTYPES = {"float8_e4m3fn": 1, "float8_e5m2": 2}
FP8_HEAD_DIMS = tuple(range(32, 257, 16))
FP8_NH2_MAX_DP = 128  # 16-head fp8 tiles: DP 192 needs 255 registers, DP 256 spills (sm_90)

# Tensor-core decode (paged_decode_tc.cu): the default path, and the supported set of the public
# entry point. head_dim is any multiple of 8 in 32..256 (compiled per padded width DP, a multiple
# of 16; the real head_dim is a run-time argument); block_size any power of two in 1..256 (a
# run-time shift); any group size (query-head tiles of <= 16 heads, the last one may be shorter).
TC = 2
TC_HEAD_DIMS = tuple(range(32, 257, 8))
TC_BLOCK_SIZES = tuple(1 << i for i in range(9))
TC_WARPS = 4
TC_TILE = 16  # tokens per warp tile
TC_NH2_MAX_DP = 192  # 16-head tiles need DP/2 more accumulator registers: DP 224/256 would spill
TC_STAGE_BUDGET = 96 * 1024  # shared memory the cp.async stages of one CTA aim for
SMEM_PER_SM = 227 * 1024  # sm_80 / sm_90: the most dynamic shared memory one CTA may have

# Tuning of the fp8 decode only (the 16-bit modules never take it), for sweeps on a GPU through
# kvpool.kernels._tuning: the warps per CTA, the cp.async stages per warp (2..4; 0: what
# TC_STAGE_BUDGET holds) and the CTAs per SM the split-KV plan aims to fill (0: TC_CTAS_PER_SM).
FP8_DECODE_WARPS = (2, 4, 6, 8)


@dataclass(frozen=True)
class Fp8DecodeTuning:
    """The defaults: 6 warps x 3 stages, the plan filling one CTA per SM. In the H200 sweep of
    `bench/kvbench.py --routine fp8_sweep` (bench/results/2026-12-01_270740b_h200/fp8_sweep.json) they were the
    fastest or within 3 % of it on the large shapes (1.70-1.77x our fp16 there, against
    1.61-1.73x for 4 warps x 4 stages); on 8x8192 1.47x against 1.21x (the best there, 4 warps
    filling 2 CTAs per SM, 1.60x); on 1x4096 they are slower (15.7 us against 13.0 us, 0.88x
    our fp16), where 8 warps were fastest (11.6 us) but lost 20-25 % on the large shapes."""

    warps: int = 6
    stages: int = 3  # 0: derived from TC_STAGE_BUDGET like the 16-bit modules
    fill: int = 1  # 0: the plan's TC_CTAS_PER_SM

    def __post_init__(self) -> None:
        if (
            self.warps not in FP8_DECODE_WARPS
            or self.stages not in (0, 2, 3, 4)
            or not 0 <= self.fill <= 4
        ):
            raise ValueError(
                f"{self}: warps in {FP8_DECODE_WARPS}, stages 2..4 (or 0), fill 1..4 (or 0)"
            )


# The fp8 decode's defaults (what runs unless kvpool.kernels._tuning says otherwise, and what
# CI compiles).
FP8_DECODE_DEFAULT = Fp8DecodeTuning()


# The CUDA-core decode (paged_decode.cu, _tuning's decode_pipeline 0/1) is a baseline for tests
# and benchmarks, with its own narrower set and a separate merge launch.
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_GQ = 8  # query heads one CUDA-core decode CTA keeps in registers
DECODE_WARPS = 4
PIPELINE = 1  # CUDA-core decode loads through per-thread cp.async stages (0: straight to registers)
COMMON_OPTIONS = ("-std=c++17",)


def supported_set() -> str:
    """The shapes the tensor-core decode runs, for error messages."""
    return (
        "dtype float16 or bfloat16, head_dim a multiple of 8 in 32..256, block_size a power "
        "of two in 1..256, any num_q_heads that is a multiple of num_kv_heads (head_dim 512 "
        "with K = V: kvpool.kernels.shared_kv_decode_plan / shared_kv_extend_plan)"
    )


def padded_head_dim(head_dim: int) -> int:
    """The compiled width of a head: head_dim rounded up to the mma K step (16)."""
    return -(-head_dim // 16) * 16


SOURCE_DIR_ENV = "KVPOOL_CUDA_DIR"


def source_dir() -> Path | None:
    """The folder named by ``KVPOOL_CUDA_DIR``, or None: then the embedded sources are used."""
    value = os.environ.get(SOURCE_DIR_ENV)
    return Path(value) if value else None


def _raw_source(name: str) -> str:
    folder = source_dir()
    if folder is not None:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{SOURCE_DIR_ENV}={folder}: no kernel source {name!r} there")
        return path.read_text()
    from .._core import kernel_sources

    embedded = kernel_sources()
    if name not in embedded:
        raise FileNotFoundError(f"no kernel source {name!r} in this build (has {sorted(embedded)})")
    return embedded[name]


INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.MULTILINE)


@functools.cache
def read_source(name: str) -> str:
    """The source text, with `#include "x.cuh"` lines of our own headers inlined (NVRTC then
    needs no include path, here, in CI and on the user's machine alike). Cached per process:
    set ``KVPOOL_CUDA_DIR`` before the first kernel is compiled."""
    text = _raw_source(name)
    return INCLUDE.sub(lambda m: read_source(m.group(1)), text)


def group_tile(group: int) -> int:
    """Query heads per decode CTA: the largest divisor of `group` that is at most MAX_GQ."""
    return max(d for d in range(1, MAX_GQ + 1) if group % d == 0)


@dataclass(frozen=True)
class DecodeVariant:
    dtype: str
    head_dim: int
    block_size: int
    gq: int  # query heads per CTA (group_tile of the GQA group)
    pipeline: int = PIPELINE

    source = "paged_decode.cu"
    kernel = "paged_decode"

    @property
    def threads(self) -> int:
        return 32 * DECODE_WARPS

    @property
    def tokens_per_iter(self) -> int:
        subgroups = DECODE_WARPS * (32 // (self.head_dim // 8))
        return subgroups * self.unroll

    @property
    def unroll(self) -> int:
        return 8 if self.gq <= 2 else (4 if self.gq <= 4 else 2)

    @property
    def dynamic_smem_bytes(self) -> int:
        """Dynamic shared memory per CTA (mirrors STAGES and the stage buffer in the .cu)."""
        if not self.pipeline:
            return 0
        threads = 32 * DECODE_WARPS
        stages = max(2, 12 // self.unroll)
        subgroups = DECODE_WARPS * (32 // (self.head_dim // 8))
        merge = 4 * subgroups * self.gq * (self.head_dim + 2)
        return max(stages * self.unroll * 2 * threads * 16, merge)

    def options(self) -> tuple[str, ...]:
        return COMMON_OPTIONS + (
            f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
            f"-DHEAD_DIM={self.head_dim}",
            f"-DBLOCK_SIZE={self.block_size}",
            f"-DGQ={self.gq}",
            f"-DNWARPS={DECODE_WARPS}",
            f"-DPIPELINE={self.pipeline}",
        )


def fp8_row_bytes(dp: int) -> tuple[int, int]:
    """Shared-memory bytes of one fp8 K row and one V row (mirrors K_ROW / V_ROW in
    fp8_fragments.cuh: the lane's unit widths set the padding that keeps loads conflict-free)."""
    ksteps = dp // 16
    k_vw = 16 if ksteps % 4 == 0 else 8 if ksteps % 2 == 0 else 4
    k_row = dp
    while k_row % (8 * k_vw) != 4 * k_vw:
        k_row += 16
    v_row = dp
    while v_row % 64 != 16:
        v_row += 16
    return k_row, v_row


def tc_head_tile(group: int, dp: int, fp8: bool = False) -> int:
    """Query heads per tensor-core decode CTA: the group cut into the fewest tiles of at most
    16 heads (8 for DP > TC_NH2_MAX_DP, or FP8_NH2_MAX_DP over an fp8 cache), as even as
    possible; the last tile may be shorter."""
    cap = 16 if dp <= (FP8_NH2_MAX_DP if fp8 else TC_NH2_MAX_DP) else 8
    tiles = -(-group // cap)
    return -(-group // tiles)


@dataclass(frozen=True)
class TcVariant:
    """A compiled tensor-core decode module: per dtype, padded head width `dp` and nh = 1
    (head tile <= 8) or 2 (<= 16). head_dim, block_size and the head tile are run-time.
    An fp8 cache dtype also names the query dtype `q_dtype` (float16 or bfloat16)."""

    dtype: str
    dp: int
    nh: int
    q_dtype: str | None = None
    warps: int = TC_WARPS
    fixed_stages: int = 0  # 0: as many stages (2..4) as TC_STAGE_BUDGET holds
    # Sliding-window / chunked local attention and window-relative tables (-DWINDOW=1): a
    # module of its own, so the full-attention modules keep their registers (several widths
    # sit at the 255-register limit). Attention sinks run in every module.
    window: bool = False

    @property
    def fp8(self) -> int:
        """0 for a 16-bit cache, else the .cu's KV_FP8 code."""
        return FP8_DTYPES.get(self.dtype, 0)

    source = "paged_decode_tc.cu"
    kernel = "paged_decode_tc"

    @property
    def smem_row_bytes(self) -> int:
        """Mirrors SCH/ROWB in the .cu: rows of a multiple of 8 chunks are swizzled, others get
        an odd chunk stride."""
        ch = self.dp // 8
        return 16 * (ch if ch % 8 == 0 else ch | 1)

    @property
    def stage_bytes(self) -> int:
        """One warp's K+V stage (mirrors STAGE_BYTES; fp8 rows: K_ROW and V_ROW)."""
        if self.fp8:
            return TC_TILE * sum(fp8_row_bytes(self.dp))
        return 2 * TC_TILE * self.smem_row_bytes

    @property
    def stages(self) -> int:
        if self.fixed_stages:
            return self.fixed_stages
        return max(2, min(4, TC_STAGE_BUDGET // (self.stage_bytes * self.warps)))

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def tokens_per_iter(self) -> int:
        return TC_TILE * self.warps

    @property
    def dynamic_smem_bytes(self) -> int:
        """Per-warp K+V tile stages (mirrors the .cu); the warp merge area and the fused
        merge's weights fit inside (static_assert there)."""
        stage = self.stages * self.stage_bytes * self.warps
        merge = 4 * self.warps * 16 * (self.dp + 2)
        return max(stage, merge, 4 * MAX_DECODE_SPLITS * 16)

    @property
    def ctas_per_sm(self) -> int:
        return max(1, min(4, SMEM_PER_SM // (self.dynamic_smem_bytes + 1024)))

    def options(self) -> tuple[str, ...]:
        fp8 = (f"-DKV_FP8={self.fp8}", f"-DQ_BF16={int(self.q_dtype == 'bfloat16')}")
        return (
            COMMON_OPTIONS
            + (fp8 if self.fp8 else ())
            + (
                f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
                f"-DDP={self.dp}",
                f"-DNH={self.nh}",
                f"-DNWARPS={self.warps}",
                f"-DSTAGES={self.stages}",
                f"-DMAX_SPLITS={MAX_DECODE_SPLITS}",
            )
            + (("-DWINDOW=1",) if self.window else ())
        )


def tc_variant(
    dtype: str,
    head_dim: int,
    group: int,
    q_dtype: str | None = None,
    tuning: Fp8DecodeTuning | None = None,
) -> tuple[TcVariant, int]:
    """The module and head tile for a (dtype, head_dim, group) in the supported set (q_dtype:
    the query dtype of an fp8 cache; tuning: the fp8 decode's warps and stages, default
    FP8_DECODE_DEFAULT, ignored for 16-bit caches)."""
    dp = padded_head_dim(head_dim)
    fp8 = dtype in FP8_DTYPES
    gq = tc_head_tile(group, dp, fp8)
    variant = TcVariant(dtype, dp, 1 if gq <= 8 else 2, q_dtype if fp8 else None)
    return (tuned(variant, tuning or FP8_DECODE_DEFAULT) if fp8 else variant), gq


def tuned(variant: TcVariant, tuning: Fp8DecodeTuning) -> TcVariant:
    """An fp8 decode module with the tuning's warps and stages (a fixed stage count that does
    not fit in shared memory at this width is lowered, down to 2)."""
    v = TcVariant(
        variant.dtype, variant.dp, variant.nh, variant.q_dtype, tuning.warps, tuning.stages
    )
    while v.fixed_stages > 2 and v.dynamic_smem_bytes > SMEM_PER_SM:
        v = TcVariant(v.dtype, v.dp, v.nh, v.q_dtype, v.warps, v.fixed_stages - 1)
    if v.dynamic_smem_bytes > SMEM_PER_SM:
        raise ValueError(
            f"fp8 decode tuning {tuning} needs {v.dynamic_smem_bytes} bytes of "
            f"shared memory per CTA at head width {v.dp} (at most {SMEM_PER_SM})"
        )
    return v


def tc_variants() -> list[TcVariant]:
    dps = sorted({padded_head_dim(d) for d in TC_HEAD_DIMS})
    return [
        TcVariant(dt, dp, nh)
        for dt in DTYPES
        for dp in dps
        for nh in (1, 2)
        if nh == 1 or dp <= TC_NH2_MAX_DP
    ]


def fp8_tc_variants() -> list[TcVariant]:
    """The fp8 decode modules CI compiles (each is one .cu path with two format constants and
    two query types, so a subset keeps CI short): e4m3 with fp16 queries at six widths (the
    smallest, an odd chunk count, the common ones, the largest) and both head tiles, the other
    three (format, query) pairs at 64 and 128."""
    main = [
        TcVariant("float8_e4m3fn", dp, nh, "float16")
        for dp in (32, 48, 64, 128, 192, 256)
        for nh in (1, 2)
        if nh == 1 or dp <= FP8_NH2_MAX_DP
    ]
    other = [
        TcVariant(dt, dp, 2, q)
        for dt, q in (
            ("float8_e4m3fn", "bfloat16"),
            ("float8_e5m2", "float16"),
            ("float8_e5m2", "bfloat16"),
        )
        for dp in (64, 128)
    ]
    return [tuned(v, FP8_DECODE_DEFAULT) for v in main + other]


def cuda_core_variants() -> list[DecodeVariant]:
    """A representative subset of the CUDA-core baseline (CI compiles these; the baseline
    compiles any of its 192 variants on demand): both dtypes, the three head dims at head tile 4
    and block size 16 (the block size changes one shift, the tile one loop bound), and the
    register-load path at head_dim 128."""
    return [
        DecodeVariant(dt, hd, 16, 4, p)
        for dt in DTYPES
        for hd in HEAD_DIMS
        for p in (0, 1)
        if p == PIPELINE or hd == 128
    ]


def window_tc_variants() -> list[TcVariant]:
    """The window modules CI compiles (the rest are built on demand): both dtypes at the head
    widths of the window models (gpt-oss 64, Llama 4 128, Gemma 3 256), both head tiles, and
    one fp8 module."""
    v16 = [
        TcVariant(dt, dp, nh, window=True)
        for dt in DTYPES
        for dp in (64, 128, 256)
        for nh in (1, 2)
        if nh == 1 or dp <= TC_NH2_MAX_DP
    ]
    fp8 = dataclasses.replace(
        tuned(TcVariant("float8_e4m3fn", 128, 2, "float16"), FP8_DECODE_DEFAULT), window=True
    )
    return [*v16, fp8]


def decode_variants() -> list[DecodeVariant | TcVariant]:
    """What the CI compile test builds: every tensor-core variant (all the default path can
    ask for), the window subset and the CUDA-core baseline subset."""
    return tc_variants() + fp8_tc_variants() + window_tc_variants() + cuda_core_variants()


# Paged prefill (paged_prefill.cu): 16 query rows (token x head) per warp. Wide CTAs (4 warps,
# 64 rows, K/V tiles of 64 tokens, 32 at D=256) for prompts; narrow CTAs (1 warp, 16 rows, K/V
# tiles of 32 tokens, 16 at D=256) when most of a wide tile would be padding (decode-like and
# speculative batches: a few query tokens x the group per sequence). PREFILL_STAGES cp.async
# stages.
# Block sizes: any power of two up to 256.
PREFILL_WIDE_WARPS = 4
PREFILL_NARROW_WARPS = 1
PREFILL_BN = {64: 64, 128: 64, 256: 32}  # wide CTAs; D=256 with 64-token tiles needs > 255 regs
PREFILL_NARROW_BN = {64: 32, 128: 32, 256: 16}  # 32 at D=256 spills on sm_90
PREFILL_STAGES = 2
# fp8 prefill modules may load K/V with cp.async into fp8 staging tiles and convert them per
# tile (KV_FP8_ASYNC in the .cu; kvpool.kernels._tuning's fp8_prefill_async); the default is the
# synchronous loads until measured otherwise.
FP8_PREFILL_ASYNC_DEFAULT = False


PREFILL_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# The Hopper prefill (paged_prefill_sm90.cu, sm_90a: wgmma, a producer warpgroup and two
# consumer warpgroups): 128 query rows per CTA, K/V tiles of SM90_BN tokens in SM90_STAGES
# stages, one CTA per SM. 16-bit caches only (fp8 caches keep paged_prefill.cu). It runs on
# compute capability 9.0 when _tuning's prefill_kernel asks for it, or by default when
# SM90_PREFILL_DEFAULT is set (see bench/NOTES_prefill.md for the measurements behind it).
SM90_WARPS = 12
SM90_ROWS = 128
SM90_BN = {64: 128, 128: 128, 256: 64}
# Stages per head_dim: the consumers hold two at a time (S of tile j with P V of tile j-1), so a
# third lets the producer load a tile ahead; at D=256 three do not fit (64 KB each).
SM90_STAGES = {64: 3, 128: 3, 256: 2}
SM90_ARCH = "sm_90a"
SM90_PREFILL_DEFAULT = True
# The Hopper prefill's K/V loads (KV_TMA in the .cu): TMA per page through two tensor maps over
# the pool (kvpool._core.tensor_map_tiled), for pages of at least SM90_TMA_MIN_BLOCK tokens (a
# box must start on a 1024-byte swizzle atom); smaller pages, and every module while
# SM90_TMA_DEFAULT is False, gather with cp.async. _tuning's prefill_tma chooses per plan.
SM90_TMA_MIN_BLOCK = 8
SM90_TMA_DEFAULT = False


@dataclass(frozen=True)
class PrefillVariant:
    """A compiled prefill module (the query-head tile and causality are run-time arguments).
    An fp8 cache dtype also names the query dtype `q_dtype` (float16 or bfloat16). `sm90`: the
    Hopper module (warps SM90_WARPS, 16-bit caches only); `tma`: its K/V loads by TMA
    (block_size >= SM90_TMA_MIN_BLOCK)."""

    dtype: str
    head_dim: int
    block_size: int
    warps: int = PREFILL_WIDE_WARPS
    q_dtype: str | None = None
    fp8_async: bool = False  # KV_FP8_ASYNC (fp8 caches only)
    sm90: bool = False
    tma: bool = False

    def __post_init__(self) -> None:
        if self.sm90 and (self.dtype not in DTYPES or self.warps != SM90_WARPS):
            raise ValueError(f"{self}: the sm90 prefill takes 16-bit caches and {SM90_WARPS} warps")
        if self.tma and (not self.sm90 or self.block_size < SM90_TMA_MIN_BLOCK):
            raise ValueError(
                f"{self}: TMA loads are the sm90 prefill's, for block_size >= {SM90_TMA_MIN_BLOCK}"
            )

    @property
    def source(self) -> str:
        return "paged_prefill_sm90.cu" if self.sm90 else "paged_prefill.cu"

    @property
    def kernel(self) -> str:
        return "paged_prefill_sm90" if self.sm90 else "paged_prefill"

    @property
    def arch(self) -> str | None:
        """The architecture the module must be built for (None: the device's, as CuPy does)."""
        return SM90_ARCH if self.sm90 else None

    @property
    def merge_variant(self) -> PrefillVariant:
        """The module whose merge_prefill_splits combines this module's KV splits (the merge
        depends only on the dtype and head_dim: the sm90 module uses the Ampere module's)."""
        if not self.sm90:
            return self
        return PrefillVariant(self.dtype, self.head_dim, self.block_size)

    @property
    def rows(self) -> int:
        return SM90_ROWS if self.sm90 else 16 * self.warps

    @property
    def kv_tile(self) -> int:
        if self.sm90:
            return SM90_BN[self.head_dim]
        tiles = PREFILL_NARROW_BN if self.warps == PREFILL_NARROW_WARPS else PREFILL_BN
        return tiles.get(self.head_dim, 32)  # the wrapper refuses other head dims

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dynamic_smem_bytes(self) -> int:
        """Q tile plus the K+V stages (mirrors Q_BYTES, KV_TILE_BYTES, KV_BUFS and
        STAGING_BYTES in the .cu; sm90: also 1024 bytes of alignment slack and the stages'
        mbarriers)."""
        row = 2 * self.head_dim
        if self.sm90:
            stages = SM90_STAGES[self.head_dim]
            return self.rows * row + stages * 2 * self.kv_tile * row + 1024 + 16 * stages
        if self.fp8_async:  # one fp16 K+V tile, STAGES fp8 K+V staging tiles
            return (
                self.rows * row
                + 2 * self.kv_tile * row
                + PREFILL_STAGES * 2 * self.kv_tile * self.head_dim
            )
        return self.rows * row + PREFILL_STAGES * 2 * self.kv_tile * row

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM the split plan aims to fill (by shared memory, at most 2 wide
        or 8 narrow CTAs; sm90: 1)."""
        if self.sm90:
            return 1
        cap = 2 if self.warps == PREFILL_WIDE_WARPS else 8
        return max(1, min(cap, (227 * 1024) // (self.dynamic_smem_bytes + 1024)))

    def options(self) -> tuple[str, ...]:
        if self.sm90:
            return COMMON_OPTIONS + (
                f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
                f"-DHEAD_DIM={self.head_dim}",
                f"-DBLOCK_SIZE={self.block_size}",
                f"-DBN={self.kv_tile}",
                f"-DSTAGES={SM90_STAGES[self.head_dim]}",
                f"-DKV_TMA={int(self.tma)}",
            )
        fp8 = FP8_DTYPES.get(self.dtype, 0)
        fp8_opts = (f"-DKV_FP8={fp8}", f"-DQ_BF16={int(self.q_dtype == 'bfloat16')}") + (
            ("-DKV_FP8_ASYNC=1",) if self.fp8_async else ()
        )
        return (
            COMMON_OPTIONS
            + (fp8_opts if fp8 else ())
            + (
                f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
                f"-DHEAD_DIM={self.head_dim}",
                f"-DBLOCK_SIZE={self.block_size}",
                f"-DNWARPS={self.warps}",
                f"-DBN={self.kv_tile}",
                f"-DSTAGES={PREFILL_STAGES}",
            )
        )


def sm90_prefill_variant(
    dtype: str, head_dim: int, block_size: int, tma: bool = False
) -> PrefillVariant:
    """The Hopper module; `tma` asks for TMA loads, which pages under SM90_TMA_MIN_BLOCK
    tokens do not take (they get the cp.async module)."""
    tma = tma and block_size >= SM90_TMA_MIN_BLOCK
    return PrefillVariant(dtype, head_dim, block_size, SM90_WARPS, sm90=True, tma=tma)


def sm90_prefill_variants() -> list[PrefillVariant]:
    """The Hopper prefill modules CI compiles (for sm_90a only): both dtypes and head dims at
    block size 16 with cp.async and with TMA loads, the smallest and largest block size at
    head_dim 128, and the TMA modules at the smallest TMA page and at the largest."""
    main = [
        sm90_prefill_variant(dt, hd, 16, tma)
        for dt in DTYPES
        for hd in HEAD_DIMS
        for tma in (False, True)
    ]
    edges = [
        sm90_prefill_variant("float16", 128, bs, tma)
        for bs in (PREFILL_BLOCK_SIZES[0], SM90_TMA_MIN_BLOCK, PREFILL_BLOCK_SIZES[-1])
        for tma in (False, True)
        if tma or bs != SM90_TMA_MIN_BLOCK
    ]
    return main + edges


def prefill_variants() -> list[PrefillVariant]:
    """The prefill variants CI compiles: wide and narrow for every dtype and head dim at the
    block sizes the decode kernels support, plus the smallest and largest other block size."""
    main = [
        PrefillVariant(dt, hd, bs, w)
        for dt in DTYPES
        for hd in HEAD_DIMS
        for bs in BLOCK_SIZES
        for w in (PREFILL_WIDE_WARPS, PREFILL_NARROW_WARPS)
    ]
    edges = [
        PrefillVariant("float16", 128, bs)
        for bs in (PREFILL_BLOCK_SIZES[0], PREFILL_BLOCK_SIZES[-1])
    ]
    fp8 = [
        PrefillVariant("float8_e4m3fn", hd, 16, w, "float16")
        for hd in HEAD_DIMS
        for w in (PREFILL_WIDE_WARPS, PREFILL_NARROW_WARPS)
    ]
    fp8 += [
        PrefillVariant(dt, 128, 16, PREFILL_WIDE_WARPS, q)
        for dt, q in (
            ("float8_e4m3fn", "bfloat16"),
            ("float8_e5m2", "float16"),
            ("float8_e5m2", "bfloat16"),
        )
    ]
    # The asynchronous fp8 loads (_tuning's fp8_prefill_async): every head dim wide, 128 narrow.
    fp8 += [
        PrefillVariant("float8_e4m3fn", hd, 16, w, "float16", True)
        for hd, w in (
            (64, PREFILL_WIDE_WARPS),
            (128, PREFILL_WIDE_WARPS),
            (256, PREFILL_WIDE_WARPS),
            (128, PREFILL_NARROW_WARPS),
        )
    ]
    return main + edges + fp8


def _label(v: DecodeVariant | TcVariant) -> str:
    if isinstance(v, TcVariant):
        q = f",q={v.q_dtype}" if v.q_dtype else ""
        return f"{v.kernel}[{v.dtype}{q},dp{v.dp},nh{v.nh}{',win' if v.window else ''}]"
    return f"{v.kernel}[{v.dtype},{v.head_dim},{v.block_size},{v.gq},p{v.pipeline}]"


def all_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source, options) for every module the CI compile test builds."""
    out = [(_label(v), read_source(v.source), v.options()) for v in decode_variants()]
    out += [
        (
            f"{v.kernel}[{v.dtype}{',q=' + v.q_dtype if v.q_dtype else ''},{v.head_dim},"
            f"{v.block_size},w{v.warps}{',async' if v.fp8_async else ''}]",
            read_source(v.source),
            v.options(),
        )
        for v in prefill_variants()
    ]
    out.append(("append_kv", read_source("append_kv.cu"), COMMON_OPTIONS))
    out.append(("copy_blocks", read_source("copy_blocks.cu"), COMMON_OPTIONS))
    out.append(("paged_metadata", read_source("paged_metadata.cu"), COMMON_OPTIONS))
    return out


def sm90_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source, options) of the sm_90a modules the CI compile test builds (for
    SM90_ARCH only; all_sources' modules are built for every architecture)."""
    return [
        (
            f"{v.kernel}[{v.dtype},{v.head_dim},{v.block_size}{',tma' if v.tma else ''}]",
            read_source(v.source),
            (*v.options(), "-ftz=true"),
        )
        for v in sm90_prefill_variants()
    ]


@functools.cache
def decode_module(variant: DecodeVariant | TcVariant | PrefillVariant) -> Any:
    import cupy

    arch = getattr(variant, "arch", None)
    if arch is not None:
        return _arch_module(read_source(variant.source), variant.options(), arch)
    return cupy.RawModule(code=read_source(variant.source), options=variant.options())


def _arch_module(source: str, options: tuple[str, ...], arch: str) -> Any:
    """A module built for `arch` (an architecture-specific target such as sm_90a, which
    CuPy's RawModule cannot ask for: it always appends the device's plain -arch): NVRTC through
    CuPy's binding to a cubin, written once to the temporary folder under its hash (RawModule
    loads a file lazily, per device, so the file stays) and loaded as a RawModule. The options
    are the variant's plus -ftz=true, which RawModule adds to its own builds."""
    import hashlib
    import tempfile

    import cupy
    from cupy_backends.cuda.libs import nvrtc  # type: ignore[import-not-found]  # CuPy's own

    opts = (*options, "-ftz=true", f"--gpu-architecture={arch}")
    prog = nvrtc.createProgram(source, "kernel.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {arch}: {nvrtc.getProgramLog(prog)}") from e
        cubin = bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    digest = hashlib.sha256(cubin).hexdigest()[:32]
    path = Path(tempfile.gettempdir()) / f"kvpool-{arch}-{digest}.cubin"
    if not path.is_file():
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(cubin)
        os.replace(part, path)  # atomic: another process may be writing the same file
    return cupy.RawModule(path=str(path))


@functools.cache
def plain_module(name: str) -> Any:
    import cupy

    return cupy.RawModule(code=read_source(f"{name}.cu"), options=COMMON_OPTIONS)


# MLA decode (paged_mla_decode.cu): DeepSeek-V3's latent cache, one row of MLA_LATENT_DIM +
# MLA_ROPE_DIM elements per token. A CTA serves a tile of 16 * mt query heads with mt * j warps
# (warp (m-tile, j): S over tokens slice j, O over output columns slice j), KV tiles of bn tokens
# in `stages` cp.async stages. The head tile and the module are chosen per head count by
# kvpool.kernels._mla (MLA_VARIANTS), any of MLA_VARIANT_CHOICES can be forced through _tuning.
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_DTYPES = DTYPES
# An fp8 latent cache (KV_FP8 in the .cu): e4m3 with one scale per layer (kernels/_mla_scales.py);
# its queries and outputs are float16 or bfloat16 (the variant's dtype, chosen by q).
MLA_FP8_DTYPES = ("float8_e4m3fn",)


@dataclass(frozen=True)
class MlaVariant:
    dtype: str
    mt: int  # m-tiles of 16 heads per CTA
    j: int  # warps per m-tile
    bn: int = 64
    stages: int = 2
    rope: int = MLA_ROPE_DIM  # 0: a shared K = V head of MLA_LATENT_DIM (kernels/_shared_kv.py)
    kv_fp8: bool = False  # an e4m3 latent cache; `dtype` is then the query's (float16/bfloat16)

    source = "paged_mla_decode.cu"
    kernel = "paged_mla_decode"

    @property
    def heads_per_cta(self) -> int:
        return 16 * self.mt

    @property
    def threads(self) -> int:
        return 32 * self.mt * self.j

    @property
    def tokens_per_iter(self) -> int:
        return self.bn

    @property
    def dynamic_smem_bytes(self) -> int:
        """Mirrors SMEM_BYTES in the .cu: the KV stages (fp8: the fp8 stages and one 16-bit
        tile), the Q tile, the P tile, the m-tiles' row maxima and sums."""
        row = 2 * (MLA_LATENT_DIM + self.rope)
        hb = self.heads_per_cta
        kv = (
            self.stages * self.bn * row // 2 + self.bn * row
            if self.kv_fp8
            else self.stages * self.bn * row
        )
        return kv + hb * row + hb * self.bn * 2 + 2 * self.j * hb * 4

    def options(self) -> tuple[str, ...]:
        return (
            COMMON_OPTIONS
            + (
                f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
                f"-DMT={self.mt}",
                f"-DJ={self.j}",
                f"-DBN={self.bn}",
                f"-DSTAGES={self.stages}",
                f"-DROPE={self.rope}",
            )
            + (("-DKV_FP8=1",) if self.kv_fp8 else ())
        )


# (mt, j) of the modules the plan may choose: 16-head tiles with 4 warps (64 output columns
# of registers a lane), 32-head tiles with 8 warps, 64-head tiles with 8 warps (128 a lane).
MLA_VARIANT_CHOICES = ((1, 4), (2, 4), (4, 2))


def mla_variants() -> list[MlaVariant]:
    """Every MLA decode module (16-bit and e4m3 caches, the latter for float16 and bfloat16
    queries) and every shared K = V head_dim 512 module (ROPE = 0; CI compiles them all)."""
    return [
        MlaVariant(dt, mt, j, rope=rope)
        for rope in (MLA_ROPE_DIM, 0)
        for dt in MLA_DTYPES
        for mt, j in MLA_VARIANT_CHOICES
    ] + [MlaVariant(dt, mt, j, kv_fp8=True) for dt in MLA_DTYPES for mt, j in MLA_VARIANT_CHOICES]


def mla_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source, options) of every MLA decode module, for every architecture."""
    return [
        (
            f"{v.kernel}[{v.dtype},mt{v.mt},j{v.j},bn{v.bn},s{v.stages},rope{v.rope}"
            f"{',e4m3' if v.kv_fp8 else ''}]",
            read_source(v.source),
            v.options(),
        )
        for v in mla_variants()
    ]
