"""CUDA graphs of the decode-only step of TransformersRunner (`cuda_graphs=True`).

A decode step of a small model is bound by the host: every layer costs Python in transformers
and in the attention function, while the GPU work is a few hundred microseconds. A captured
graph replays the whole forward (embedding, every layer's append_kv and paged decode, the final
norm and lm_head) in one call.

What makes the step capturable:
- Fixed shapes per bucket: a step of n decode rows runs in the bucket of the next power of two
  B >= n; rows n..B-1 are padding (token 0 at position 0, slot -1 so append_kv skips them,
  length 1 over block 0: finite garbage that no real row reads, as every row is independent).
- Fixed device buffers: tokens, positions, slots, the block table [B, width] and the lengths
  live in one int32 buffer (PackedLayout) that every replay overwrites with one copy from
  pinned memory, on the stream the replay runs on.
- A fixed decode plan: max_seq_len = width * block_size (the block table's capacity, an upper
  bound of every length it can hold), num_splits chosen per bucket, and a workspace owned by
  the bucket's graph. The tensor-core kernel's merge counters belong to the capture stream
  (allocated in the warm-up on that stream, left zero by every launch), so the graph reuses them.
- Warm-up on the capture stream before capture: kernels compile, counters are allocated.
Graphs share one memory pool; each replay's logits are consumed (sampled, copied to the host)
before the next replay, so one graph's intermediates may reuse another's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvpool.generation.batch import StepBatch
from kvpool.integrations.attention import KvpoolStep, attention_switched
from kvpool.integrations.packed_upload import PackedLayout, PinnedStaging
from kvpool.kernels import MAX_DECODE_SPLITS, workspace_elems

MIN_CHUNK = 256  # tokens per split at least, as the library's own plan


def capture(
    forward: Any, device: torch.device, stream: torch.cuda.Stream, mempool: Any
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``forward()`` captured as a CUDA graph on ``stream`` into ``mempool``, after two warm-up
    runs there (kernels compiled, plans made on the capture stream); the graph and the output
    its replays rewrite."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # relaxed: the kernels' argument checks look up the attributes of the graph pool's fresh
    # pointers (cudaPointerGetAttributes, cached per pointer), a query, not stream work
    with torch.cuda.graph(graph, pool=mempool, stream=stream, capture_error_mode="relaxed"):
        out = forward()
    return graph, out


class _BucketGraph:
    """The graph of one (bucket, block-table width) and its input buffers."""

    def __init__(
        self, runner: Any, bucket: int, width: int, stream: torch.cuda.Stream, mempool: Any
    ) -> None:
        dev, pool = runner.device, runner.pool
        self.bucket, self.width = bucket, width
        self.layout = PackedLayout.of(
            [(1, bucket), (1, bucket), (bucket,), (bucket, width), (bucket,)],
            [np.int64, np.int64, np.int64, np.int32, np.int32],
        )
        self.device_buf = torch.zeros(self.layout.total, dtype=torch.int32, device=dev)
        self.staging = PinnedStaging()
        ids, pos, slots, table, lens = self.layout.views(self.device_buf)
        slots.fill_(-1)
        lens.fill_(1)
        cfg = runner.model.config.get_text_config()
        lay = pool.layout
        max_seq_len = width * lay.block_size
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        splits = max(
            1,
            min(
                round(sms / (bucket * lay.num_kv_heads)),
                -(-max_seq_len // MIN_CHUNK),
                MAX_DECODE_SPLITS,
            ),
        )
        self.workspace = torch.empty(
            workspace_elems(bucket, cfg.num_attention_heads, lay.head_dim, splits),
            dtype=torch.float32,
            device=dev,
        )
        no_prefill = np.zeros((0, width), np.int32)
        shell = StepBatch(
            np.zeros(bucket, np.int64),
            np.zeros(bucket, np.int64),
            np.full(bucket, -1, np.int64),
            bucket,
            np.zeros((bucket, width), np.int32),
            np.ones(bucket, np.int32),
            np.zeros(1, np.int32),
            no_prefill,
            np.zeros(0, np.int32),
            np.zeros(bucket, np.float32),
            np.zeros(bucket, np.int64),
        )
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=dev)
        self.step = KvpoolStep(
            pool,
            shell,
            dev,
            runner.prefill,
            [slots, table, lens, zeros(1), zeros(0, width), zeros(0)],
            max_seq_len=max_seq_len,
            num_splits=splits,
            workspace=self.workspace,
        )
        self.ids, self.pos = ids, pos
        self.runner = runner
        self.graph, self.logits = capture(self.forward, dev, stream, mempool)

    def forward(self) -> torch.Tensor:
        hidden = self.runner.forward_hidden(self.ids, self.pos, self.step)
        return self.runner.model.lm_head(hidden).float()

    def load(self, batch: StepBatch) -> None:
        """Write the step's rows (and padding after them) into the graph's input buffer."""
        n = batch.num_decode
        host_t, host = self.staging.host(self.layout.total)
        ids, pos, slots, table, lens = self.layout.views(host)
        ids[0, :n], pos[0, :n], slots[:n] = batch.input_ids, batch.positions, batch.slot_mapping
        table[:n], lens[:n] = batch.decode_block_table, batch.decode_seq_lens
        ids[0, n:], pos[0, n:], slots[n:], table[n:], lens[n:] = 0, 0, -1, 0, 1
        self.staging.copy_to(self.device_buf, self.layout.total)

    def run_eager(self) -> torch.Tensor:
        """The captured work without the graph (same buffers, shapes and plan): the test's
        reference for a replay."""
        return self.forward()


class DecodeGraphs:
    """The runner's captured decode steps, one per (power-of-two bucket, block-table width),
    captured on first use."""

    def __init__(self, runner: Any, max_batch: int) -> None:
        if isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {max_batch!r}")
        self.runner, self.max_batch = runner, max_batch
        self.stream = torch.cuda.Stream(runner.device)
        self.mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _BucketGraph] = {}

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(bucket, width) of every graph captured so far."""
        return list(self._graphs)

    def covers(self, batch: StepBatch) -> bool:
        return batch.num_prefill == 0 and 0 < batch.num_decode <= self.max_batch

    def bucket_graph(self, batch: StepBatch) -> _BucketGraph:
        key = (1 << (batch.num_decode - 1).bit_length(), batch.decode_block_table.shape[1])
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _BucketGraph(self.runner, *key, self.stream, self.mempool)
        return g

    @torch.inference_mode()
    def logits(self, batch: StepBatch, *, replay: bool = True) -> torch.Tensor:
        """float32 logits [num_decode, vocab]: the graph replayed on the step (replay=False:
        the same padded step run eagerly, for tests). Valid until the next call. A capture and
        an eager run attend with "kvpool" (attention_switched) whoever calls them."""
        with attention_switched(self.runner.model):
            g = self.bucket_graph(batch)
            g.load(batch)
            if not replay:
                return g.run_eager()[: batch.num_decode]
        g.graph.replay()
        return g.logits[: batch.num_decode]
