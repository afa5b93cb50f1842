"""CUDA graphs of the hybrid runner's decode-only step (`HybridGraphsRunner`, a
HybridTransformersRunner that replays them; design: hybrid_models.md, "CUDA graphs of the
decode step").

A decode step of a small hybrid model is bound by the host: per layer transformers' Python,
the step's page writes and the decode plan's launch. A graph captured once per batch shape
replays the whole forward (embedding, every layer's K/V write at the step's slots and its
decode kernel with window, window-relative table and sinks, the final norm and lm_head).

What makes the step capturable, per shape (n decode rows; per token group the table width
rounded up to a power of two):
- Fixed device buffers: tokens, positions and per group the rows' slots (page, offset), table
  [n, width] (-1 past a row's pages: never read, the kernel reads a row's pages up to its
  seq_len), seq_lens (key_end) and first_page, in one int32 buffer (PackedLayout) that each
  replay overwrites with one copy from pinned memory, on the stream the replay runs on.
- A step (`HybridStep`) whose slots and decode tables are those buffers, and whose decode
  plans, made in the warm-up with a fixed max_seq_len (a full table's capacity, width x
  block_size; a window group's window + the kernel's tile slack, what its rows read at most),
  own their workspaces and merge counters on the capture stream and are kept with the graph.
- No padding rows: a shape is n exactly, so no row writes K/V that is not a request's (a
  padded row would need a page of its own to write into).
- Host checks the graph cannot make are made before each replay: every key a row reads lies
  in the pages its table holds (`check_keys_held`, per group and window the capture used).
Covered steps: decode rows only, every group a full or window group the decode kernel runs
(16-bit, `decode_kernel_fits`), no state groups (Qwen3-Next runs sequences one at a time),
no MLA (DeepSeek-V3's absorbed path allocates its output per run). Other steps run eagerly.
Graphs share one memory pool; each replay's logits are consumed before the next replay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kvpool
from kvpool.generation.hybrid_batch import HybridStepBatch
from kvpool.integrations.decode_graphs import capture
from kvpool.integrations.hybrid_gpu import decode_kernel_fits
from kvpool.integrations.hybrid_models import (
    HybridStep,
    HybridTransformersRunner,
    attention_as,
    check_keys_held,
    lm_logits,
)
from kvpool.integrations.packed_upload import PackedLayout, PinnedStaging
from kvpool.integrations.transformers import sample
from kvpool.kernels._window import WINDOW_SLACK


def _bucket(width: int) -> int:
    return 1 << max(0, (width - 1).bit_length())


def graph_shape(batch: HybridStepBatch) -> tuple[int, tuple[int, ...]]:
    """(decode rows, per token group its table width rounded up to a power of two)."""
    return batch.num_decode, tuple(_bucket(int(g.page_ids.shape[1])) for g in batch.groups)


def covers(runner: Any, batch: HybridStepBatch, max_batch: int) -> bool:
    """Whether a graph can run `batch` on `runner` (module docstring, "Covered steps")."""
    spec = runner.spec
    if batch.num_decode != batch.num_seqs or not 0 < batch.num_decode <= max_batch:
        return False
    if batch.states:
        return False
    for i, g in enumerate(spec.groups):
        if g.kind not in ("full", "sliding_window"):
            return False
        if not decode_kernel_fits(g, int(spec.block_size(i))):
            return False
    return True


class GraphStep:
    """The buffers and step of one shape. On a CUDA runner its forward is what a graph
    captures; on a host runner with HybridStep.plans_on_host (tests) the same buffers run the
    decode plans' float64 references, so the loading is checked without a GPU."""

    def __init__(self, runner: Any, batch: HybridStepBatch) -> None:
        n, widths = graph_shape(batch)
        self.runner, self.n, self.widths = runner, n, widths
        self.group_ids = [g.group for g in batch.groups]
        shapes: list[tuple[int, ...]] = [(1, n), (1, n)]
        dtypes: list[Any] = [np.int64, np.int64]
        for w in widths:
            shapes += [(n,), (n,), (n, w), (n,), (n,)]
            dtypes += [np.int64, np.int64, np.int32, np.int32, np.int32]
        self.layout = PackedLayout.of(shapes, dtypes)
        dev = runner.device
        self.device_buf = torch.zeros(self.layout.total, dtype=torch.int32, device=dev)
        self.staging = PinnedStaging() if dev.type == "cuda" else None
        views = self.layout.views(self.device_buf)
        self.ids, self.pos = views[0], views[1]
        self.step = HybridStep(runner.views, batch, dev)  # made on the first batch of the shape
        for k, (g, w) in enumerate(zip(self.group_ids, widths)):
            pages, offsets, table, lens, first = views[2 + 5 * k : 7 + 5 * k]
            self.step._slots[g] = (pages, offsets)
            self.step._decode_tables[g] = (table, lens, first, self._max_seq_len(g, w))

    def _max_seq_len(self, group: int, width: int) -> int:
        """The decode plan's max_seq_len, which sizes its split of the keys: a full table's
        capacity (width x block_size) bounds every seq_len it holds; a window table's rows
        read at most the window's keys (+ the tile slack) whatever their seq_len, which is
        what the plan covers for any longer context (kvpool.kernels._window)."""
        g = self.runner.spec.groups[group]
        if g.kind == "full":
            return width * int(self.runner.spec.block_size(group))
        return int(g.window) + WINDOW_SLACK

    def load(self, batch: HybridStepBatch) -> None:
        """The step's rows into the buffers (one copy from pinned memory on a CUDA runner)."""
        if self.staging is not None:
            host_t, host = self.staging.host(self.layout.total)
        else:
            host = np.zeros(self.layout.total, np.int32)
        views = self.layout.views(host)
        views[0][0], views[1][0] = batch.input_ids, batch.positions
        for k, g in enumerate(self.group_ids):
            gs = batch.group(g)
            pages, offsets, table, lens, first = views[2 + 5 * k : 7 + 5 * k]
            pages[:], offsets[:] = gs.slot_pages, gs.slot_offsets
            table[:] = -1
            table[:, : gs.page_ids.shape[1]] = gs.page_ids
            lens[:], first[:] = gs.key_end, gs.key_start // gs.block_size
        if self.staging is not None:
            self.staging.copy_to(self.device_buf, self.layout.total)
        else:
            self.device_buf.copy_(torch.from_numpy(host))
            # A host plan copies first_page when it is made (a CUDA plan reads it at every
            # run, as a graph needs): on the host the plans are made again per step.
            self.step._plans.clear()

    def check(self, batch: HybridStepBatch) -> None:
        """What the graph cannot check: each row's keys lie in its table's pages, for every
        (group, window) the captured forward attended with."""
        for g, window in self.step._checked:
            check_keys_held(batch.group(g), batch, window)

    def forward(self) -> torch.Tensor:
        """float32 logits [n, vocab] of the buffers' step."""
        model = self.runner.model
        with attention_as(model):
            out = model.model(
                input_ids=self.ids,
                position_ids=self.pos,
                use_cache=False,
                kvpool_hybrid_step=self.step,
            )
        return lm_logits(model, out.last_hidden_state[0])


class _Graph:
    """A captured GraphStep."""

    def __init__(self, step: GraphStep, stream: torch.cuda.Stream, mempool: Any) -> None:
        self.step = step
        self.graph, self.logits = capture(step.forward, step.runner.device, stream, mempool)


class HybridDecodeGraphs:
    """A hybrid runner's captured decode steps, one per shape (graph_shape), captured on the
    first step of that shape."""

    def __init__(self, runner: Any, max_batch: int) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int):
            raise TypeError(f"max_graph_batch must be an int, got {type(max_batch).__name__}")
        if max_batch < 1:
            raise kvpool.InvalidArgumentError(f"max_graph_batch must be >= 1, got {max_batch}")
        self.runner, self.max_batch = runner, max_batch
        self.stream = torch.cuda.Stream(runner.device)
        self.mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, tuple[int, ...]], _Graph] = {}
        self.replays = 0

    @property
    def captured(self) -> list[tuple[int, tuple[int, ...]]]:
        """The shapes captured so far."""
        return list(self._graphs)

    def covers(self, batch: HybridStepBatch) -> bool:
        return covers(self.runner, batch, self.max_batch)

    @torch.inference_mode()
    def logits(self, batch: HybridStepBatch, *, replay: bool = True) -> torch.Tensor:
        """float32 logits [num_decode, vocab] of a covered step: its shape's graph replayed
        (replay=False: the same buffers and plans run eagerly, the tests' reference). Valid
        until the next call."""
        key = graph_shape(batch)
        g = self._graphs.get(key)
        if g is None:
            step = GraphStep(self.runner, batch)
            step.load(batch)
            g = self._graphs[key] = _Graph(step, self.stream, self.mempool)
        g.step.check(batch)
        g.step.load(batch)
        if not replay:
            # on the capture stream, the one the step's plans launch on: every op ordered
            current = torch.cuda.current_stream(self.runner.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                logits = g.step.forward()
            current.wait_stream(self.stream)
            logits.record_stream(current)  # read on the caller's stream
            return logits
        g.graph.replay()
        self.replays += 1
        return g.logits


class HybridGraphsRunner(HybridTransformersRunner):
    """HybridTransformersRunner on a CUDA pool that replays a CUDA graph, captured once per
    shape (graph_shape), for every decode-only step of at most max_graph_batch sequences it
    covers (`covers`); other steps (prefill chunks, state or MLA groups, groups the decode
    kernel does not run) run eagerly. A graph's logits are valid until the next step."""

    def __init__(
        self, model: Any, pool: Any, spec: Any = None, *, max_graph_batch: int = 32
    ) -> None:
        super().__init__(model, pool, spec)
        if self.device.type != "cuda":
            raise kvpool.InvalidArgumentError("CUDA graphs need a CUDA pool and model")
        self.graphs = HybridDecodeGraphs(self, max_graph_batch)

    def _graphed(self, batch: Any) -> bool:
        return isinstance(batch, HybridStepBatch) and self.graphs.covers(batch)

    @torch.inference_mode()
    def logits(self, batch: HybridStepBatch) -> torch.Tensor:
        if self._graphed(batch):
            return self.graphs.logits(batch)
        return super().logits(batch)

    @torch.inference_mode()
    def run(self, batch: HybridStepBatch) -> np.ndarray:
        if not self._graphed(batch):
            return super().run(batch)
        rows = torch.from_numpy(batch.sample_rows).to(self.device)
        logits = self.graphs.logits(batch)[rows]  # decode rows only: row k is sample row k
        return sample(logits, batch.temperatures, batch.seeds, batch.sample_positions).cpu().numpy()


__all__ = ["GraphStep", "HybridDecodeGraphs", "HybridGraphsRunner", "covers", "graph_shape"]
