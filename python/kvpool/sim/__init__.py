"""The simulator: workloads (synthetic and trace files), a roofline cost model, model presets
(uniform ones, and hybrid ones of several KV groups: hybrid_sim.md), and the runs that serve
one workload with each kvpool.scheduler backend at the same KV memory and report how they
compare (`kvpool simulate`, cli.py; the report, report.py).

It drives the real scheduler on real pools; only time is modelled (costmodel.py), or measured
for the attention kernels on a GPU (measured.py).
"""

from kvpool.sim.costmodel import H200, Hardware, RooflineCost
from kvpool.sim.hybrid_config import ConfigError, model_from_config, model_from_file
from kvpool.sim.hybrid_presets import HYBRID_PRESETS, HybridModel, LayerGroup
from kvpool.sim.presets import PRESETS, ModelPreset, get_preset, num_blocks_for, parse_bytes
from kvpool.sim.sharing import generate_multiturn, with_token_streams
from kvpool.sim.tokens import TokenStream
from kvpool.sim.traces import TRACE_FORMATS, read_trace
from kvpool.sim.workload import TraceError, describe, generate, load_trace

__all__ = [
    "H200",
    "HYBRID_PRESETS",
    "PRESETS",
    "TRACE_FORMATS",
    "ConfigError",
    "Hardware",
    "HybridModel",
    "LayerGroup",
    "ModelPreset",
    "RooflineCost",
    "TokenStream",
    "TraceError",
    "describe",
    "generate",
    "generate_multiturn",
    "get_preset",
    "load_trace",
    "model_from_config",
    "model_from_file",
    "num_blocks_for",
    "parse_bytes",
    "read_trace",
    "with_token_streams",
]
