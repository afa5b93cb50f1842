"""KV geometry of real models and the memory budget that gives the number of blocks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import kvpool


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """What the KV cache of one model looks like (from the model's config.json)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int  # for the measured decode attention (GQA group = num_q_heads / num_kv_heads)
    num_params: float  # for the modelled step time only (weights read per step)

    def layout(self, block_size: int = 16, dtype: str = "float16") -> kvpool.KvLayout:
        return kvpool.KvLayout(self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype)

    def token_bytes(self, dtype_bytes: int = 2) -> int:
        """KV bytes of one token over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3-8b", 32, 8, 128, 32, 8.03e9),
        ModelPreset("llama-3-70b", 80, 8, 128, 64, 70.6e9),
        ModelPreset("mistral-7b", 32, 8, 128, 32, 7.24e9),
        ModelPreset("qwen2.5-7b", 28, 4, 128, 28, 7.62e9),
    )
}


def get_preset(name: str) -> ModelPreset:
    key = name.lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'16GiB' -> 17179869184; '1.5 GB' -> 1500000000; plain integers are bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (K/KB, M/MB, G/GB, T/TB)
    are powers of 1000, so "16G" is 16e9 bytes while "16GiB" is 16 * 2**30. Units are
    case-insensitive. The size must be at least one byte.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"memory size must be a string or an integer, got {text!r}")
    if isinstance(text, int):
        if text < 1:
            raise ValueError(f"memory size must be positive, got {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 16GiB, 500MiB or 2e9")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):  # 1e400 reads as infinity
        raise ValueError(f"memory size {text!r} is too large to be a number of bytes")
    if value < 1:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def num_blocks_for(kv_memory_bytes: int, layout: kvpool.KvLayout) -> int:
    """How many whole blocks of `layout` fit in the budget."""
    return kv_memory_bytes // layout.block_bytes
