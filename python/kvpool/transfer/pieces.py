"""The pieces of a transfer, the same on both sides so every send meets a receive of the same
size: ``(start, count)`` runs over its block lists, cut by the transfer's mode.

- ``"staged"``: fixed-size chunks. The sender gathers each chunk's blocks into a slot of a
  contiguous staging buffer (one ``move_blocks`` launch), the transport sends the slot, the
  receiver receives into its own slot and scatters it into its blocks. Slots form a ring, so
  the gather of chunk j+1 and the scatter of chunk j-1 overlap the send of chunk j; CUDA events
  order everything on the device, with no host wait.
- ``"grouped"``: no staging; one send per run of blocks contiguous on both sides, all issued
  in one transport group (one NCCL launch).

The movers that carry the pieces: movers.py (host pools) and cuda_mover.py (CUDA pools).
"""

from __future__ import annotations

import numpy as np

STAGED, GROUPED, AUTO = "staged", "grouped", "auto"
MODES = (STAGED, GROUPED)
# "auto" sends a transfer grouped when its blocks form at most this many runs contiguous on
# both sides (no gather or scatter to pay for), staged otherwise.
AUTO_MAX_RUNS = 4


def resolve_mode(mode: str, src_ids: np.ndarray, dst_ids: np.ndarray) -> str:
    """The mode a transfer uses: `mode`, or for "auto" the one AUTO_MAX_RUNS picks."""
    if mode != AUTO:
        return mode
    runs = len(plan_pieces(GROUPED, src_ids, dst_ids, len(src_ids) or 1))
    return GROUPED if runs <= AUTO_MAX_RUNS else STAGED


def plan_pieces(
    mode: str, src_ids: np.ndarray, dst_ids: np.ndarray, chunk_blocks: int
) -> list[tuple[int, int]]:
    """The pieces of a transfer of ``src_ids[i] -> dst_ids[i]``."""
    n = len(src_ids)
    if mode == STAGED:
        return [(s, min(chunk_blocks, n - s)) for s in range(0, n, chunk_blocks)]
    pieces: list[tuple[int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            pieces.append((start, i - start))
            start = i
    return pieces
