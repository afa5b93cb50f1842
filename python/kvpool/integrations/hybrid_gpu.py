"""The CUDA side of the hybrid models path (kvpool.integrations.hybrid_models; design:
hybrid_models.md, "On the GPU"):

- `device_slab(pool)`: a CUDA pool's slab as a torch uint8 tensor on its device (zero-copy,
  through `__cuda_array_interface__`; the tensor keeps the pool alive), so the page views,
  K/V writes and state-slot reads of `PageViews` are the host path's, in device memory.
- `GroupPool`: one attention group of a hybrid spec seen as the uniform pool kvpool's decode
  kernels take (`layout` with the group's strides, `base_ptr` at the group's first K element,
  the pool's pages as blocks). Every stride comes from `ModelKvSpec.attention_offset_bytes`
  (the Rust page scheme), not re-derived here.
- `decode_kernel_fits(group, block_size)` / `prefill_kernel_fits` / `mla_kernel_fits(group)`:
  whether kvpool's tensor-core decode (full and window layers, sinks), its prefill kernel
  (windows, sinks) or `paged_mla_decode` runs a group's decode rows / prefill chunks; where
  not, the rows take the torch gather path on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool._core import ModelKvSpec, Pool
from kvpool.kernels import _build

KERNEL_DTYPES = ("float16", "bfloat16")


class _SlabInterface:
    """`__cuda_array_interface__` of a CUDA pool's whole slab as bytes; holds the pool, so a
    tensor made from it (torch keeps this object) keeps the memory alive."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.__cuda_array_interface__ = {
            "shape": (pool.num_blocks * pool.block_bytes,),
            "typestr": "|u1",
            "data": (int(pool.base_ptr), False),
            "strides": None,
            "version": 3,
            # The slab's contents are ordered by the caller's torch stream (writes, kernels
            # and reads of a step all run on it): nothing to wait for here.
            "stream": None,
        }


def device_slab(pool: Pool, device: torch.device) -> torch.Tensor:
    """A CUDA pool's slab as a torch uint8 tensor on `device` (zero-copy)."""
    return torch.as_tensor(_SlabInterface(pool), device=device)


class _GroupLayout:
    """What kvpool's decode kernels read of a KvLayout, for one attention group of a spec:
    its layers, shape, dtype, tokens per page, and the byte strides of the page scheme."""

    def __init__(self, spec: ModelKvSpec, group: int) -> None:
        g = spec.groups[group]
        assert g.num_kv_heads is not None and g.head_dim is not None and g.dtype is not None
        self.num_layers = len(g.layers)
        self.num_kv_heads, self.head_dim, self.dtype = g.num_kv_heads, g.head_dim, g.dtype
        bs = spec.block_size(group)
        assert bs is not None
        self.block_size = int(bs)

        def at(layer: int = 0, part: str = "k", token: int = 0, head: int = 0, dim: int = 0):
            return spec.attention_offset_bytes(group, 0, layer, part, token, head, dim)

        base = at()
        self.elem_bytes = at(dim=1) - base
        self._strides = {
            "block": spec.page_bytes,
            "layer": (at(layer=1) - base) if self.num_layers > 1 else 0,
            "kv": at(part="v") - base,
            "token": (at(token=1) - base) if self.block_size > 1 else 0,
            "head": (at(head=1) - base)
            if self.num_kv_heads > 1
            else self.head_dim * self.elem_bytes,
            "elem": self.elem_bytes,
        }
        if self.block_size == 1:  # one token a page: the token stride is never stepped
            self._strides["token"] = self.num_kv_heads * self.head_dim * self.elem_bytes
        self.base_offset = base

    def strides(self) -> dict[str, int]:
        return dict(self._strides)


class GroupPool:
    """One attention group of a hybrid pool as the uniform pool the decode kernels take:
    `layout` (the group's strides), `base_ptr` (its first K element in page 0; a layer's K
    is at `layer * strides["layer"]` from there), `num_blocks` (the pool's pages). Holds the
    pool. On a host pool, `k_view` / `v_view` (what the plans' float64 references read) are
    the page views' tensors of the group's `index`-th layer as NumPy."""

    def __init__(self, pool: Pool, spec: ModelKvSpec, group: int, views: Any = None) -> None:
        self.pool, self.group, self.views = pool, group, views
        self.layout = _GroupLayout(spec, group)
        self.base_ptr = int(pool.base_ptr) + self.layout.base_offset
        self.num_blocks = pool.num_blocks
        self.device = pool.device
        self._layers = spec.groups[group].layers

    def k_view(self, index: int) -> Any:
        return self.views.layer(self._layers[index])[0].numpy()

    def v_view(self, index: int) -> Any:
        return self.views.layer(self._layers[index])[1].numpy()

    def __repr__(self) -> str:
        return f"GroupPool(group={self.group}, {self.layout.strides()})"


def decode_kernel_fits(group: Any, block_size: int) -> bool:
    """Whether kvpool's tensor-core decode runs this full / window group's decode rows
    (float16 / bfloat16, head_dim in its set, a power-of-two page of at most 256 tokens)."""
    return (
        group.dtype in KERNEL_DTYPES
        and group.head_dim in _build.TC_HEAD_DIMS
        and 1 <= block_size <= 256
        and block_size & (block_size - 1) == 0
    )


def prefill_kernel_fits(group: Any, block_size: int) -> bool:
    """Whether kvpool's prefill kernel (paged_prefill.cu: windows, window-relative tables and
    sinks) runs this full / window group's prefill chunks (float16 / bfloat16, head_dim 64,
    128 or 256, a power-of-two page of at most 256 tokens)."""
    return (
        group.dtype in KERNEL_DTYPES
        and group.head_dim in _build.HEAD_DIMS
        and block_size in _build.PREFILL_BLOCK_SIZES
    )


def mla_kernel_fits(group: Any) -> bool:
    """Whether paged_mla_decode runs this MLA group (DeepSeek-V3's 512 + 64, 16-bit)."""
    return group.dtype in KERNEL_DTYPES and (group.latent_dim, group.rope_dim) == (512, 64)


__all__ = [
    "GroupPool",
    "decode_kernel_fits",
    "device_slab",
    "mla_kernel_fits",
    "prefill_kernel_fits",
]
