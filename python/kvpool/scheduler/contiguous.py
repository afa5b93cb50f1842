"""The baseline: every admitted request reserves one contiguous KV region up front.

This is the allocation paging replaces (FasterTransformer, early Orca-style servers): a region
is carved from one byte range by first fit. What a request reserves (`reserve`):

- "max_model_len": the longest sequence the server accepts (no knowledge of the output length);
- "pow2": the request's prompt + output rounded up to a power of two, at most max_model_len
  (size classes, as a buddy allocator hands out);
- "request": exactly the request's prompt + output, the best case for contiguous allocation
  (a server that knows every output length in advance).

Regions of different sizes leave holes, so external fragmentation is real: admission can fail
while the free bytes would suffice.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.scheduler.core import DecodeObserver, Scheduler, SchedulerConfig
from kvpool.scheduler.request import Request
from kvpool.scheduler.seq import Seq

RESERVE_MODES = ("max_model_len", "pow2", "request")


class FirstFit:
    """First-fit allocation of byte ranges in [0, capacity); holes coalesce on free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.starts: list[int] = [0] if capacity > 0 else []  # hole starts, sorted
        self.sizes: list[int] = [capacity] if capacity > 0 else []
        self.free_bytes = capacity

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new region of `nbytes`, or None when no hole is large enough."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        for i, size in enumerate(self.sizes):
            if size >= nbytes:
                start = self.starts[i]
                if size == nbytes:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += nbytes
                    self.sizes[i] -= nbytes
                self.free_bytes -= nbytes
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        i = bisect.bisect_left(self.starts, start)
        prev_end = self.starts[i - 1] + self.sizes[i - 1] if i > 0 else -1
        if (
            start < 0
            or start + nbytes > self.capacity
            or prev_end > start
            or (i < len(self.starts) and start + nbytes > self.starts[i])
        ):
            raise ValueError(
                f"free of [{start}, {start + nbytes}) overlaps a hole or leaves the range"
            )
        self.free_bytes += nbytes
        if prev_end == start:  # merge with the hole before
            i -= 1
            self.sizes[i] += nbytes
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, nbytes)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]

    def largest_hole(self) -> int:
        return max(self.sizes, default=0)

    def check_invariants(self) -> None:
        """Raise AssertionError if the holes are inconsistent (explicit checks, kept under -O)."""
        if sum(self.sizes) != self.free_bytes:
            raise AssertionError("hole sizes do not add up to free_bytes")
        if len(self.starts) != len(self.sizes):
            raise AssertionError("hole starts and sizes differ in length")
        for i in range(len(self.starts)):
            if self.sizes[i] <= 0:
                raise AssertionError(f"empty hole at {self.starts[i]}")
            if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] >= self.starts[i + 1]:
                raise AssertionError(
                    f"holes at {self.starts[i]} and {self.starts[i + 1]} overlap or touch"
                )
        if self.starts and (self.starts[0] < 0 or self.starts[-1] + self.sizes[-1] > self.capacity):
            raise AssertionError("a hole leaves [0, capacity)")


class ContiguousKv:
    """One reserved region per running sequence; decode never allocates, so it never preempts."""

    name = "contiguous"

    def __init__(
        self,
        capacity_bytes: int,
        token_bytes: int,
        max_model_len: int,
        reserve: str = "max_model_len",
    ) -> None:
        if reserve not in RESERVE_MODES:
            raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {reserve!r}")
        self.space = FirstFit(capacity_bytes)
        self.token_bytes = token_bytes
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.regions: dict[int, tuple[int, int]] = {}  # request id -> (offset, reserved tokens)
        self.reserved_tokens = 0
        self.alloc_s = 0.0
        self.blocked_by_fragmentation = 0  # failed admissions that the free bytes would have fit
        self.probe: DecodeObserver | None = None  # optional; needs block-aligned regions
        self.block_bytes = 0  # block size in bytes of the CUDA pool the probe reads
        self.block_size = 0

    def validate(self, config: SchedulerConfig) -> None:
        if config.max_model_len * self.token_bytes > self.space.capacity:
            raise ValueError(
                f"the KV budget of {self.space.capacity} bytes cannot hold one request of "
                f"max_model_len {config.max_model_len} ({config.max_model_len * self.token_bytes} bytes)"
            )

    def watermark_blocks(self, fraction: float) -> int:
        return 0  # reservations cover all growth, nothing to keep back

    def _reservation(self, seq: Seq) -> int:
        need = seq.request.prompt_tokens + seq.request.output_tokens
        if self.reserve == "request":
            return need
        if self.reserve == "pow2":
            return min(self.max_model_len, 1 << (need - 1).bit_length())
        return self.max_model_len

    def try_admit(self, seq: Seq, first_chunk: int, watermark_blocks: int) -> bool:
        tokens = self._reservation(seq)
        nbytes = tokens * self.token_bytes
        t0 = time.perf_counter()
        offset = self.space.alloc(nbytes)
        self.alloc_s += time.perf_counter() - t0
        if offset is None:
            if self.space.free_bytes >= nbytes:
                self.blocked_by_fragmentation += 1
            return False
        self.regions[seq.request_id] = (offset, tokens)
        self.reserved_tokens += tokens
        return True

    def prefill_shortfall(self, seq: Seq, n: int) -> int:
        return 0

    def extend(self, seq: Seq, n: int) -> None:
        pass  # the region was reserved at admission

    def decode_shortfall(self, seqs: Sequence[Seq]) -> int:
        return 0

    def decode(self, seqs: Sequence[Seq]) -> None:
        if self.probe is not None:
            self.probe(*self._as_block_table(seqs))

    def _as_block_table(self, seqs: Sequence[Seq]) -> tuple[np.ndarray, np.ndarray]:
        """Each region seen as a run of consecutive blocks, so the paged kernel can read it."""
        width = -(-self.max_model_len // self.block_size)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        seq_lens = np.empty(len(seqs), dtype=np.int32)
        for row, seq in enumerate(seqs):
            first = self.regions[seq.request_id][0] // self.block_bytes
            tokens = seq.kv_tokens + 1  # this step's token is in the cache when attention runs
            n = -(-tokens // self.block_size)
            table[row, :n] = np.arange(first, first + n, dtype=np.int32)
            seq_lens[row] = tokens
        return table, seq_lens

    def release(self, seq: Seq) -> None:
        offset, tokens = self.regions.pop(seq.request_id)
        t0 = time.perf_counter()
        self.space.free(offset, tokens * self.token_bytes)
        self.alloc_s += time.perf_counter() - t0
        self.reserved_tokens -= tokens

    def usage(self) -> tuple[int, int]:
        return len(self.regions), self.reserved_tokens

    def check_drained(self) -> None:
        if self.regions or self.space.free_bytes != self.space.capacity:
            raise AssertionError(f"{len(self.regions)} regions still reserved")
        self.space.check_invariants()


def contiguous_scheduler(
    capacity_bytes: int,
    token_bytes: int,
    requests: Sequence[Request],
    config: SchedulerConfig = SchedulerConfig(),
    reserve: str = "max_model_len",
    **kw: Any,
) -> Scheduler:
    backend = ContiguousKv(capacity_bytes, token_bytes, config.max_model_len, reserve)
    return Scheduler(backend, requests, config, **kw)
