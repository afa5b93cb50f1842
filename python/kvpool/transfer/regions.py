"""Where a transfer's bytes are inside the blocks: layer ranges and tensor-parallel head ranges,
as NIXL descriptors (``(address, bytes, device)`` rows) coalesced as far as the layout allows.

A block is ``[layer][K|V][token][kv_head][head_dim]`` (layer-major; the layout's strides):

- layers ``[a, b)`` of one block are one contiguous range (``(b - a) * layer`` bytes); all the
  layers of a run of blocks contiguous on both sides are one range (the run's blocks);
- KV heads ``[h0, h1)`` of one token of one K or V plane are one contiguous range; when one
  side holds other heads too (a TP shard to or from a wider pool), a block's head range is
  ``layers * 2 * block_size`` ranges, one per (layer, K|V, token). A side that holds exactly
  the heads moved keeps its rows whole, so only the wider side needs the fine descriptors, but
  NIXL pairs descriptors one to one, so both lists are cut the same way.

``TpShard`` is one side's tensor-parallel position (rank, size and the model's KV heads), as
an offer carries it; the heads it holds are ``KvLayout.tp_head_range``'s (tp.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool._core import KvLayout
from kvpool.transfer.pieces import GROUPED, plan_pieces


@dataclass(frozen=True)
class TpShard:
    """A pool's place in a tensor-parallel group: ``rank`` of ``size``, holding KV heads
    ``[first_head, first_head + num_heads)`` of the model's ``num_kv_heads``."""

    rank: int
    size: int
    num_kv_heads: int

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads // self.size

    @property
    def first_head(self) -> int:
        return self.rank * self.num_heads

    @property
    def heads(self) -> tuple[int, int]:
        return self.first_head, self.first_head + self.num_heads

    def wire(self) -> dict:
        """The offer's ``tp`` field."""
        return {
            "rank": self.rank,
            "size": self.size,
            "num_kv_heads": self.num_kv_heads,
            "heads": list(self.heads),
        }


def tp_shard(layout: KvLayout, tp: Any) -> TpShard:
    """The ``TpShard`` of a pool of ``layout`` that is rank ``tp[0]`` of ``tp[1]`` (``None``:
    rank 0 of 1). TypeError for a ``tp`` that is not two ints, ValueError for a rank out of
    range. Replicated heads (more ranks than KV heads) are not moved by head range: every rank
    of such a group holds a whole head, so each shard is a whole pool of one head."""
    if tp is None:
        return TpShard(0, 1, layout.num_kv_heads)
    if (
        not isinstance(tp, tuple)
        or len(tp) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in tp)
    ):
        raise TypeError(f"tp must be a (rank, size) tuple of ints, got {tp!r}")
    rank, size = tp
    if not 0 <= rank < size:
        raise ValueError(f"tp rank must be in 0..{size - 1}, got {rank}")
    return TpShard(rank, size, layout.num_kv_heads * size)


def _check_dense(layout: KvLayout) -> dict:
    """The layout's strides, checked to be the dense layer-major block this module assumes
    (an invariant of the core's KvLayout; a change there must fail here, not move wrong bytes)."""
    s = layout.strides()
    assert s["head"] == layout.head_dim * s["elem"], s
    assert s["token"] == layout.num_kv_heads * s["head"], s
    assert s["kv"] == layout.block_size * s["token"], s
    assert s["layer"] == 2 * s["kv"], s
    assert s["block"] == layout.num_layers * s["layer"] == layout.block_bytes, s
    return s


@dataclass(frozen=True)
class RowScatter:
    """Where packed rows land in a block: ``rows`` rows of ``row_bytes`` each, the first at byte
    ``offset`` of the block, ``pitch`` bytes apart (``gather_rows``)."""

    rows: int
    row_bytes: int
    offset: int
    pitch: int


@dataclass(frozen=True)
class Side:
    """One side of a transfer: its slab's base address, its pool's layout, the first of the
    model's KV heads its pool holds, and the request's block ids there."""

    base: int
    layout: KvLayout
    first_head: int
    ids: np.ndarray


def _offsets(side: Side, layers: tuple[int, int], heads: tuple[int, int]) -> np.ndarray:
    """Per (layer, K|V, token) of a block, the byte offset of heads ``heads`` in ``side``."""
    s = _check_dense(side.layout)
    layer = np.arange(*layers, dtype=np.uint64)[:, None, None] * s["layer"]
    kv = np.arange(2, dtype=np.uint64)[None, :, None] * s["kv"]
    token = np.arange(side.layout.block_size, dtype=np.uint64)[None, None, :] * s["token"]
    head = (heads[0] - side.first_head) * s["head"]
    return (layer + kv + token + head).reshape(-1)


def kv_descriptors(
    local: Side,
    remote: Side,
    pieces: list,
    layers: tuple[int, int],
    heads: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL's Nx3 descriptor arrays (local, remote) moving layers ``layers`` and the model's KV
    heads ``heads`` of ``remote.ids[i]`` into ``local.ids[i]``; ``pieces`` are the runs of
    blocks contiguous on both sides (pieces.py, grouped). Row ``k`` of one array pairs with row
    ``k`` of the other and both have the same bytes."""
    num_layers = local.layout.num_layers
    whole_rows = (
        local.layout.num_kv_heads == remote.layout.num_kv_heads == heads[1] - heads[0]
        and local.first_head == remote.first_head == heads[0]
    )
    if whole_rows and layers == (0, num_layers):  # whole blocks: one row per run
        return tuple(  # type: ignore[return-value]
            _rows(
                [side.base + int(side.ids[start]) * side.layout.block_bytes for start, _ in pieces],
                [count * side.layout.block_bytes for _, count in pieces],
            )
            for side in (local, remote)
        )
    if whole_rows:  # a layer range: one row per block
        layer_bytes = _check_dense(local.layout)["layer"]
        return tuple(  # type: ignore[return-value]
            _rows(
                side.base
                + side.ids.astype(np.uint64) * side.layout.block_bytes
                + layers[0] * layer_bytes,
                np.full(len(side.ids), (layers[1] - layers[0]) * layer_bytes, np.uint64),
            )
            for side in (local, remote)
        )
    nbytes = (heads[1] - heads[0]) * _check_dense(local.layout)["head"]
    out = []
    for side in (local, remote):
        starts = side.base + side.ids.astype(np.uint64) * side.layout.block_bytes
        addresses = (starts[:, None] + _offsets(side, layers, heads)[None, :]).reshape(-1)
        out.append(_rows(addresses, np.full(len(addresses), nbytes, np.uint64)))
    return out[0], out[1]


def _rows(addresses: Any, lengths: Any) -> np.ndarray:
    addresses = np.asarray(addresses, np.uint64)
    rows = np.zeros((len(addresses), 3), np.uint64)
    rows[:, 0] = addresses
    rows[:, 1] = np.asarray(lengths, np.uint64)
    return rows


def gather_rows(
    local: Side, remote: Side, layers: tuple[int, int], heads: tuple[int, int], staging: int
) -> tuple[np.ndarray, np.ndarray, RowScatter] | None:
    """The READ of a gather through this side's staging buffer at address ``staging``: the
    remote side holds exactly the heads moved and this side more (a TP shard into a wider
    pool), so the remote rows are whole (layers ``layers`` of each block: one descriptor per
    block, or per run of blocks for every layer) and land packed in the buffer, block after
    block, to be scattered into this side's blocks as ``RowScatter`` says (one row per (layer,
    K|V, token); nixl_staging.py's ``scatter_rows``). None for any other
    shape (then ``kv_descriptors`` cuts both sides into rows)."""
    h0, h1 = heads
    if not (
        remote.first_head == h0
        and remote.layout.num_kv_heads == h1 - h0 < local.layout.num_kv_heads
    ):
        return None
    s_local, s_remote = _check_dense(local.layout), _check_dense(remote.layout)
    first, stop = layers
    per_block = (stop - first) * s_remote["layer"]  # the remote block's layers, whole
    if first == 0 and stop == remote.layout.num_layers:  # whole blocks: a row per run
        runs = plan_pieces(GROUPED, remote.ids, remote.ids, len(remote.ids))
        starts = np.array([start for start, _ in runs], np.uint64)
        counts = np.array([count for _, count in runs], np.uint64)
        remote_rows = _rows(
            remote.base
            + remote.ids[starts.astype(np.int64)].astype(np.uint64) * remote.layout.block_bytes,
            counts * per_block,
        )
        local_rows = _rows(staging + starts * per_block, remote_rows[:, 1])
    else:  # a layer range: a row per block
        n = len(remote.ids)
        remote_rows = _rows(
            remote.base
            + remote.ids.astype(np.uint64) * remote.layout.block_bytes
            + first * s_remote["layer"],
            np.full(n, per_block, np.uint64),
        )
        local_rows = _rows(
            staging + np.arange(n, dtype=np.uint64) * per_block, np.full(n, per_block, np.uint64)
        )
    scatter = RowScatter(
        rows=(stop - first) * 2 * local.layout.block_size,  # (layer, K|V, token)
        row_bytes=s_remote["token"],  # the moved heads of one token
        offset=first * s_local["layer"] + (h0 - local.first_head) * s_local["head"],
        pitch=s_local["token"],
    )
    return local_rows, remote_rows, scatter
