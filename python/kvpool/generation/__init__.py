"""Continuous-batching generation on a kvpool pool: the loop (`generate`, and its online form
`GenerationSession`: requests added while it runs, tokens streamed per step), the per-step batch
a model runner executes (`StepBatch`), batch-independent sampling, and a NumPy toy model.

A model runner is anything with `run(StepBatch) -> tokens` (`run(HybridStepBatch)` for a
hybrid model, `generate(..., spec=)`); the transformers one lives in
kvpool.integrations.transformers (optional extra) so that this package needs no torch.
"""

from kvpool.generation.batch import StepBatch, build_step, slots_of
from kvpool.generation.hybrid_batch import HybridGroupStep, HybridStepBatch, build_hybrid_step
from kvpool.generation.loop import (
    GenerationRequest,
    GenerationResult,
    GenerationSession,
    ModelRunner,
    TokenEvent,
    generate,
)
from kvpool.generation.sampling import gumbel_noise, sample
from kvpool.generation.toy import ToyModel

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "GenerationSession",
    "HybridGroupStep",
    "HybridStepBatch",
    "ModelRunner",
    "StepBatch",
    "TokenEvent",
    "ToyModel",
    "build_hybrid_step",
    "build_step",
    "generate",
    "gumbel_noise",
    "sample",
    "slots_of",
]
