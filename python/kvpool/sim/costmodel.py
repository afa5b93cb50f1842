"""Modelled step time: a roofline of one forward pass on a given GPU.

A decode step reads every weight once and the KV of every scheduled token; a prefill token
costs 2 x params FLOPs. The step takes the larger of the memory time and the compute time, plus
a fixed launch overhead. This is a model, not a measurement: it makes "tokens per second"
comparable between the schedulers, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.sim.presets import ModelPreset


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    dense_flops: float  # float16 tensor-core peak
    efficiency: float  # fraction of both peaks a real engine reaches
    step_overhead_s: float


H200 = Hardware("NVIDIA H200 (roofline model)", 4.8e12, 989e12, 0.6, 2e-4)


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """Callable (prefill tokens, decode seqs, KV tokens read) -> modelled seconds."""

    preset: ModelPreset
    hardware: Hardware = H200
    dtype_bytes: int = 2  # weights
    kv_dtype_bytes: int = 2  # the KV cache (1 for fp8)

    def __call__(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        hw = self.hardware
        if prefill_tokens + decode_seqs == 0:
            return hw.step_overhead_s
        weight_bytes = self.preset.num_params * self.dtype_bytes
        kv_bytes = kv_tokens * self.preset.token_bytes(self.kv_dtype_bytes)
        memory_s = (weight_bytes + kv_bytes) / (hw.hbm_bytes_per_s * hw.efficiency)
        compute_s = (
            (prefill_tokens + decode_seqs)
            * 2.0
            * self.preset.num_params
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
            "formula": "max((weights + KV read) / (bw * eff), tokens * 2 * params / (flops * eff)) + overhead",
        }

    def prefill_seconds(self, tokens: int) -> float:
        """The compute term of prefilling `tokens` tokens: what recomputing them costs."""
        hw = self.hardware
        return tokens * 2.0 * self.preset.num_params / (hw.dense_flops * hw.efficiency)
