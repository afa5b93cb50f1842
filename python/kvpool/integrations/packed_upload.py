"""A step's host metadata to the GPU in one copy (part of the transformers integration).

A step needs up to eight small integer arrays on the device (tokens, positions, slots, block
tables, lengths, offsets). Copied one by one they cost eight transfers from pageable memory;
here they are laid out in one int32 buffer (every array at a 16-byte boundary, so that an
int64 slice can be viewed as int64 without a copy and no kernel meets a misaligned array), written into a pinned staging buffer and sent in
one asynchronous copy. The staging buffer is reused: before it is overwritten the previous
copy out of it is waited for (an event), so the host never races a pending transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each array lives in the int32 buffer: offsets and lengths in int32 units."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    total: int

    @staticmethod
    def of(shapes, dtypes) -> PackedLayout:
        offsets, at = [], 0
        for shape, dt in zip(shapes, dtypes):
            words = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize // 4
            at = -(-at // 4) * 4  # 16-byte boundaries
            offsets.append(at)
            at += words
        return PackedLayout(
            tuple(tuple(s) for s in shapes),
            tuple(np.dtype(d) for d in dtypes),
            tuple(offsets),
            max(at, 1),
        )

    def views(self, buf):
        """The arrays as views of `buf` (a NumPy or torch int32 buffer of >= total elements)."""
        out = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets):
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize // 4
            part = buf[off : off + n]
            if dt.itemsize == 8:
                part = part.view(np.int64 if isinstance(buf, np.ndarray) else torch.int64)
            out.append(part.reshape(shape))
        return out


class PinnedStaging:
    """A growable pinned int32 host buffer and the event of the last copy out of it."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def host(self, total: int) -> tuple[torch.Tensor, np.ndarray]:
        """The buffer (torch, NumPy view) with room for `total` int32, free to overwrite."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.numel() < total:
            self._host = torch.empty(
                max(total, 2 * (0 if self._host is None else self._host.numel()), 4096),
                dtype=torch.int32,
                pin_memory=True,
            )
        return self._host, self._host.numpy()

    def copy_to(self, dst: torch.Tensor, total: int) -> None:
        """Asynchronous copy of the first `total` int32 into `dst` on the current stream."""
        assert self._host is not None
        dst[:total].copy_(self._host[:total], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(dst.device))


def upload(staging: PinnedStaging, arrays, device: torch.device) -> list[torch.Tensor]:
    """Device copies (views of one fresh int32 buffer) of int32 / int64 NumPy `arrays`."""
    layout = PackedLayout.of([a.shape for a in arrays], [a.dtype for a in arrays])
    host_t, host = staging.host(layout.total)
    for view, a in zip(layout.views(host), arrays):
        view[...] = a
    dev = torch.empty(layout.total, dtype=torch.int32, device=device)
    staging.copy_to(dev, layout.total)
    return layout.views(dev)
