"""Modelled step time of a hybrid model, and the per-step bytes its requests need.

The roofline of costmodel.py, with what a hybrid model reads: a decode step reads every
weight once (`num_params`: a batch of hundreds touches nearly every expert of an MoE) and,
per running request, the keys its next query sees in each token group (the window of a
sliding-window group, the current chunk of a chunked one, everything of a full or MLA
group) and each recurrent state twice (read, then written); a token costs 2 x
`active_params` FLOPs. It depends on the model only, not on where the KV lives, so the
three schemes of a hybrid run share it and differ only in whom they can run.

The loop gives a step cost only its counts, so `HybridStepCost` reads the running
sequences' lengths from the scheduler it is bound to (`bind`), after the step's
admissions, which is when the loop calls it; it also records the bytes those sequences'
live tokens and states need, the numerator of the hybrid report's KV utilization.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.sim.costmodel import H200, Hardware
from kvpool.sim.hybrid_presets import CHUNKED_LOCAL, SLIDING_WINDOW, HybridModel


def live_key_bytes(model: HybridModel, lens: np.ndarray, elem_bytes: int) -> np.ndarray:
    """Per sequence of `lens` tokens: the bytes of the tokens the query at `lens` (the next
    one) sees, over every token group, without itself (LayerGroup.first_live_token's rules,
    over arrays)."""
    out = np.zeros(len(lens), dtype=np.float64)
    for g in model.token_groups():
        if g.kind == SLIDING_WINDOW:
            first = np.maximum(0, lens + 1 - g.window)
        elif g.kind == CHUNKED_LOCAL:
            first = lens // g.window * g.window
        else:
            first = np.zeros_like(lens)
        out += (lens - first) * float(g.token_bytes(elem_bytes) or 0)
    return out


class HybridStepCost:
    """Callable (prefill tokens, decode seqs, KV tokens) -> modelled seconds (see the module)."""

    def __init__(self, model: HybridModel, elem_bytes: int = 2, hardware: Hardware = H200) -> None:
        self.model = model
        self.elem_bytes = elem_bytes
        self.hardware = hardware
        self.state_bytes = float(model.state_bytes())
        self._scheduler: Any = None
        self.needed_bytes: list[float] = []  # per step: bytes the running sequences need

    def bind(self, scheduler: Any) -> HybridStepCost:
        self._scheduler = scheduler
        return self

    def __call__(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        hw = self.hardware
        running = self._scheduler.running if self._scheduler is not None else []
        lens = np.fromiter((s.kv_tokens for s in running), dtype=np.int64, count=len(running))
        live = live_key_bytes(self.model, lens, self.elem_bytes)
        states = self.state_bytes * len(running)
        self.needed_bytes.append(float(live.sum()) + states)
        if prefill_tokens + decode_seqs == 0:
            return hw.step_overhead_s
        kv_read = float(live.sum()) + 2 * states
        memory_s = (self.model.num_params * 2 + kv_read) / (hw.hbm_bytes_per_s * hw.efficiency)
        compute_s = (
            (prefill_tokens + decode_seqs)
            * 2.0
            * self.model.active_params
            / (hw.dense_flops * hw.efficiency)
        )
        return max(memory_s, compute_s) + hw.step_overhead_s

    def describe(self) -> dict[str, object]:
        hw = self.hardware
        return {
            "kind": "modelled",
            "hardware": hw.name,
            "hbm_bytes_per_s": hw.hbm_bytes_per_s,
            "dense_flops": hw.dense_flops,
            "efficiency": hw.efficiency,
            "step_overhead_s": hw.step_overhead_s,
            "formula": "max((2 bytes x num_params + keys the next queries see + 2 x states) "
            "/ (bw * eff), tokens * 2 * active_params / (flops * eff)) + overhead",
        }
