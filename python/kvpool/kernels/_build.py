"""Kernel sources, compile-time variants and the per-variant module cache.

The CUDA C++ sources live in the repository's top-level ``cuda/`` folder; the build embeds them in
the extension (``kvpool._core.kernel_sources()``), and they are compiled at run time by NVRTC
through ``cupy.RawModule``. For kernel development, ``KVPOOL_CUDA_DIR=path/to/cuda`` makes the
library read the sources from that folder instead, so an edit needs no rebuild. The same :func:`variant_options` feed the runtime compile and
the CI compile test, so CI compiles exactly what a GPU run compiles.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_GQ = 8  # query heads one decode CTA keeps in registers
DECODE_WARPS = 4
PIPELINE = 1  # CUDA-core decode loads through per-thread cp.async stages (0: straight to registers)
COMMON_OPTIONS = ("-std=c++17",)

# Tensor-core decode (paged_decode_tc.cu): the default path. `pipeline=TC` selects it explicitly;
# pipeline 0 / 1 select the CUDA-core kernel (paged_decode.cu) with its two load paths.
TC = 2
TC_WARPS = 4
TC_TILE = 16  # tokens per warp tile
TC_MAX_GQ = {64: 16, 128: 16, 256: 8}  # D=256 with 16 heads needs > 255 registers (spills)
TC_STAGES = {64: 4, 128: 3, 256: 2}  # cp.async stages per warp: 64, 96, 128 KB per CTA


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


def tc_group_tile(group: int, head_dim: int) -> int:
    """Query heads per tensor-core decode CTA: the largest divisor of `group` within the
    16 rows of the mma M dimension (8 for head_dim 256)."""
    cap = TC_MAX_GQ[head_dim]
    return max(d for d in range(1, cap + 1) if group % d == 0)


@dataclass(frozen=True)
class TcVariant:
    """A compiled tensor-core decode module; the head tile gq is a run-time argument, only
    nh = 1 (gq <= 8) or 2 (gq <= 16) head column tiles are compiled."""

    dtype: str
    head_dim: int
    block_size: int
    nh: int

    source = "paged_decode_tc.cu"
    kernel = "paged_decode_tc"

    @property
    def stages(self) -> int:
        return TC_STAGES[self.head_dim]

    @property
    def threads(self) -> int:
        return 32 * TC_WARPS

    @property
    def tokens_per_iter(self) -> int:
        return TC_TILE * TC_WARPS

    @property
    def dynamic_smem_bytes(self) -> int:
        """Per-warp K+V tile stages (mirrors the .cu); the merge area fits inside."""
        stage = self.stages * 2 * TC_TILE * self.head_dim * 2 * TC_WARPS
        merge = 4 * TC_WARPS * 16 * (self.head_dim + 2)
        return max(stage, merge)

    @property
    def ctas_per_sm(self) -> int:
        return max(1, min(4, (227 * 1024) // (self.dynamic_smem_bytes + 1024)))

    def options(self) -> tuple[str, ...]:
        return COMMON_OPTIONS + (
            f"-DKV_BF16={int(self.dtype == 'bfloat16')}",
            f"-DHEAD_DIM={self.head_dim}",
            f"-DBLOCK_SIZE={self.block_size}",
            f"-DNH={self.nh}",
            f"-DNWARPS={TC_WARPS}",
            f"-DSTAGES={self.stages}",
        )


def tc_variants() -> list[TcVariant]:
    return [
        TcVariant(dt, hd, bs, nh)
        for dt in DTYPES
        for hd in HEAD_DIMS
        for bs in BLOCK_SIZES
        for nh in (1, 2)
        if nh * 8 <= TC_MAX_GQ[hd]
    ]


def decode_variants() -> list[DecodeVariant | TcVariant]:
    """Every decode variant the wrappers can ask for (the CI compile test builds them all),
    plus the other load path for every tile size at one (dtype, head_dim, block_size)."""
    default = [
        DecodeVariant(dt, hd, bs, gq)
        for dt in DTYPES
        for hd in HEAD_DIMS
        for bs in BLOCK_SIZES
        for gq in range(1, MAX_GQ + 1)
    ]
    other = [DecodeVariant(dt, hd, 16, gq, 1 - PIPELINE)
             for dt in DTYPES for hd in HEAD_DIMS for gq in range(1, MAX_GQ + 1)]
    return default + other + tc_variants()


def _tile_label(v: DecodeVariant | TcVariant) -> str:
    return f"nh{v.nh}" if isinstance(v, TcVariant) else f"{v.gq},p{v.pipeline}"


def all_sources() -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, source, options) for every module the library compiles."""
    out = [
        (f"{v.kernel}[{v.dtype},{v.head_dim},{v.block_size},{_tile_label(v)}]",
         read_source(v.source), v.options())
        for v in decode_variants()
    ]
    out.append(("append_kv", read_source("append_kv.cu"), COMMON_OPTIONS))
    out.append(("copy_blocks", read_source("copy_blocks.cu"), COMMON_OPTIONS))
    return out


@functools.cache
def decode_module(variant: DecodeVariant | TcVariant) -> Any:
    import cupy

    return cupy.RawModule(code=read_source(variant.source), options=variant.options())


@functools.cache
def plain_module(name: str) -> Any:
    import cupy

    return cupy.RawModule(code=read_source(f"{name}.cu"), options=COMMON_OPTIONS)
