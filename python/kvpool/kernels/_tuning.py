"""Knobs for tests and benchmark sweeps, not for users: which decode kernel runs, the prefill
CTA's query rows, which prefill kernel runs (Ampere or Hopper) and how the Hopper one loads K/V, the fp8 decode's warps / stages /
fill and the fp8 prefill's loads.

A plan reads the knobs when it is made (decode_plan, prefill_plan, and the one-call forms,
which make a plan), so they apply to the plans made inside :func:`override`::

    from kvpool.kernels import _tuning

    with _tuning.override(decode_pipeline=1):  # the CUDA-core baseline with cp.async stages
        plan = kvpool.decode_plan(pool, block_tables, seq_lens, num_q_heads)
    plan.run(q, layer)  # still the CUDA-core kernel

The setting is a context variable: it is undone when the ``with`` block ends and does not leak
into other threads. Outside any override every knob has its default (what users run).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from kvpool.kernels import _build

PREFILL_ROWS = (16 * _build.PREFILL_WIDE_WARPS, 16 * _build.PREFILL_NARROW_WARPS)
PREFILL_KERNELS = ("auto", "sm80", "sm90")


@dataclass(frozen=True)
class Tuning:
    """decode_pipeline: _build.TC (2) the tensor-core decode (the default), 1 / 0 the CUDA-core
    baseline with cp.async stages / register loads. prefill_rows_per_cta: None chooses per batch
    (64 query rows, or 16 when most of 64 would be padding); 64 or 16 forces it. fp8_decode: the
    fp8 decode modules' warps, stages and plan fill. fp8_prefill_async: fp8 prefill modules load
    K/V with cp.async into fp8 staging tiles. prefill_tma: the Hopper prefill loads K/V pages
    by TMA (pages of at least _build.SM90_TMA_MIN_BLOCK tokens; smaller ones keep cp.async)."""

    decode_pipeline: int = _build.TC
    prefill_rows_per_cta: int | None = None
    prefill_kernel: str = "auto"
    fp8_decode: _build.Fp8DecodeTuning = _build.FP8_DECODE_DEFAULT
    fp8_prefill_async: bool = _build.FP8_PREFILL_ASYNC_DEFAULT
    prefill_tma: bool = _build.SM90_TMA_DEFAULT

    def __post_init__(self) -> None:
        if self.decode_pipeline not in (0, 1, _build.TC) or isinstance(self.decode_pipeline, bool):
            raise ValueError(f"decode_pipeline must be 0, 1 or {_build.TC}")
        if self.prefill_rows_per_cta not in (None, *PREFILL_ROWS):
            raise ValueError(f"prefill_rows_per_cta must be None or one of {PREFILL_ROWS}")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}")
        if not isinstance(self.fp8_decode, _build.Fp8DecodeTuning):
            raise ValueError("fp8_decode must be a _build.Fp8DecodeTuning")
        if not isinstance(self.fp8_prefill_async, bool):
            raise ValueError("fp8_prefill_async must be a bool")
        if not isinstance(self.prefill_tma, bool):
            raise ValueError("prefill_tma must be a bool")


DEFAULT = Tuning()
_CURRENT: contextvars.ContextVar[Tuning] = contextvars.ContextVar("kvpool_tuning", default=DEFAULT)


def current() -> Tuning:
    """The knobs a plan made now takes."""
    return _CURRENT.get()


@contextlib.contextmanager
def override(**knobs: object) -> Iterator[Tuning]:
    """Plans made inside the block take these knobs (Tuning's field names; the rest keep their
    current values)."""
    tuning = dataclasses.replace(current(), **knobs)  # type: ignore[arg-type]
    token = _CURRENT.set(tuning)
    try:
        yield tuning
    finally:
        _CURRENT.reset(token)
