"""One forward pass as arrays: the packed tokens of a step and the paged-attention metadata.

Packed order: the decode tokens first (one per decoding sequence), then the prefill chunks, each
a run of consecutive positions of one sequence. Attention of token i of sequence s covers that
sequence's positions 0..position[i] (causal), read from the pool through the block table.

Sampled rows: every decode token, then the last token of each prefill chunk that completes a
prompt (its logits decide the request's first output token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool._core import BlockTables


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Host arrays describing one step; a model runner moves what it needs to its device.

    - input_ids, positions, slot_mapping: int64 [num_tokens] (slot = block_id * block_size + offset)
    - num_decode: the first num_decode tokens are decode tokens, one per sequence; their
      decode_block_table (int32 [num_decode, width]) and decode_seq_lens (int32, including the
      new token) feed the paged decode kernel; their logits are sampled.
    - prefill_qo_indptr (int32 [num_prefill + 1], offsets into the prefill tokens, FlashInfer's
      convention), prefill_block_table (int32 [num_prefill, width]), prefill_seq_lens (int32:
      cached prefix + chunk) describe the prefill chunks.
    - sample_rows (int64): the packed rows whose logits are sampled, in order: the decode
      rows 0..num_decode - 1, then the last row of each prefill chunk that completes its
      prompt; a runner returns one token per sampled row.
    - temperatures, seeds (one per sampled row): sampling parameters; temperature 0 is greedy.
    - decode_request_ids (int64, one per decode row) and sample_request_ids (one per sampled
      row): whose token each row decides (for runners that keep per-request state or record
      what they decided).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    num_decode: int
    decode_block_table: np.ndarray
    decode_seq_lens: np.ndarray
    prefill_qo_indptr: np.ndarray
    prefill_block_table: np.ndarray
    prefill_seq_lens: np.ndarray
    temperatures: np.ndarray
    seeds: np.ndarray
    decode_request_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sample_rows: np.ndarray | None = None  # None: the decode rows (set by __post_init__)
    sample_request_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.sample_rows is None:
            object.__setattr__(self, "sample_rows", np.arange(self.num_decode, dtype=np.int64))
        if self.sample_request_ids is None:
            object.__setattr__(self, "sample_request_ids", self.decode_request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_prefill(self) -> int:
        return int(self.prefill_qo_indptr.shape[0]) - 1

    @property
    def num_sampled(self) -> int:
        return int(self.sample_rows.shape[0])  # type: ignore[union-attr]

    @property
    def sample_positions(self) -> np.ndarray:
        """The position of each sampled row (what the sampler's noise is keyed on)."""
        return self.positions[self.sample_rows]


def slots_of(block_row: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Slot mapping of `positions` of one sequence whose block table row is `block_row`."""
    return block_row[positions // block_size].astype(np.int64) * block_size + positions % block_size


def build_step(
    tables: BlockTables,
    decode: list[tuple[int, int, int]],
    prefill: list[tuple[int, list[int], int]],
    temperatures: list[float],
    seeds: list[int],
    sample_prefill: list[bool] | None = None,
) -> StepBatch:
    """decode: (request_id, token, position) per decoding sequence; prefill: (request_id,
    chunk tokens, start position) per chunk; sample_prefill: per chunk, whether its last token
    is sampled (it completes a prompt). temperatures and seeds: one per sampled row (decode
    rows, then the sampled chunks). The tables must already hold every slot."""
    bs = tables.pool.layout.block_size
    dec_table = tables.block_table([d[0] for d in decode]) if decode else np.zeros((0, 1), np.int32)
    dec = np.array([d[1:] for d in decode], np.int64).reshape(-1, 2)  # (token, position)
    dec_pos = dec[:, 1]
    ids, pos = [dec[:, 0]], [dec_pos]
    slots = [dec_table[np.arange(len(decode)), dec_pos // bs].astype(np.int64) * bs + dec_pos % bs]
    pre_ids = [c[0] for c in prefill]
    pre_table = tables.block_table(pre_ids) if prefill else np.zeros((0, 1), np.int32)
    indptr = [0]
    for i, (_, chunk, start) in enumerate(prefill):
        p = np.arange(start, start + len(chunk), dtype=np.int64)
        ids.append(np.asarray(chunk, np.int64))
        pos.append(p)
        slots.append(slots_of(pre_table[i], p, bs))
        indptr.append(indptr[-1] + len(chunk))
    flags = sample_prefill or [False] * len(prefill)
    if len(flags) != len(prefill):
        raise ValueError(f"sample_prefill has {len(flags)} flags for {len(prefill)} chunks")
    chunk_last = len(decode) + np.array(indptr[1:], np.int64) - 1
    sampled_chunks = [i for i, f in enumerate(flags) if f]
    sample_rows = np.concatenate(
        [np.arange(len(decode), dtype=np.int64), chunk_last[sampled_chunks]]
    ).astype(np.int64)
    if len(temperatures) != len(sample_rows) or len(seeds) != len(sample_rows):
        raise ValueError(
            f"{len(sample_rows)} sampled rows, {len(temperatures)} temperatures, {len(seeds)} seeds"
        )
    decode_ids = np.array([d[0] for d in decode], np.int64)
    return StepBatch(
        input_ids=np.concatenate(ids),
        positions=np.concatenate(pos),
        slot_mapping=np.concatenate(slots),
        num_decode=len(decode),
        decode_block_table=np.ascontiguousarray(dec_table, np.int32),
        decode_seq_lens=(dec_pos + 1).astype(np.int32),
        prefill_qo_indptr=np.array(indptr, np.int32),
        prefill_block_table=np.ascontiguousarray(pre_table, np.int32),
        prefill_seq_lens=np.array([c[2] + len(c[1]) for c in prefill], np.int32),
        temperatures=np.array(temperatures, np.float32),
        seeds=np.array(seeds, np.int64),
        decode_request_ids=decode_ids,
        sample_rows=sample_rows,
        sample_request_ids=np.concatenate(
            [decode_ids, np.array([prefill[i][0] for i in sampled_chunks], np.int64)]
        ),
    )
