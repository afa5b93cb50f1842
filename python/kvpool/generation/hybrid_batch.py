"""One forward pass of a hybrid model (a `kvpool.ModelKvSpec` of several groups) as arrays.

The packed order and the sampled rows are StepBatch's (kvpool.generation.batch): the decode
tokens first, one per decoding sequence, then the prefill chunks; a step has one "sequence"
per decode row and per chunk, in that order. What differs is the paged metadata: a hybrid
request holds one table per group, and a window group's table starts at the first page a
query of the step still reads (`first_page`), not at page 0. So each token group carries its
own slots (where the step's K/V are written) and, per sequence, the page ids of its table
and the position of the first key they hold (`HybridGroupStep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpool._core import HybridTables


@dataclass(frozen=True, slots=True)
class HybridGroupStep:
    """One token group's part of a step.

    - slot_pages, slot_offsets (int64 [num_tokens]): the page id and the offset in it where
      each token of the step writes its K/V (from HybridTables.slot_mapping).
    - page_ids (int64 [num_seqs, max_pages], padded with -1): per sequence its table's page
      ids in order; page_ids[s, j] holds positions key_start[s] + j * block_size onwards.
    - key_start (int64 [num_seqs]): the position of the first key the table holds
      (first_page * block_size; 0 for a full group).
    - key_end (int64 [num_seqs]): the sequence's tokens after this step (keys stop there).
    """

    group: int
    block_size: int
    slot_pages: np.ndarray
    slot_offsets: np.ndarray
    page_ids: np.ndarray
    key_start: np.ndarray
    key_end: np.ndarray


@dataclass(frozen=True, slots=True)
class HybridStateStep:
    """One state group's part of a step: per sequence the page ids of its state slot
    (int64 [num_seqs, pages_per_slot]; where a layer's bytes lie in them:
    ModelKvSpec.state_location)."""

    group: int
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class HybridStepBatch:
    """Host arrays describing one step of a hybrid model (see the module docstring).

    - input_ids, positions (int64 [num_tokens]); num_decode as StepBatch's.
    - seq_indptr (int64 [num_seqs + 1]): the packed rows of each sequence (decode rows are
      sequences of one token); seq_request_ids (int64 [num_seqs]).
    - token_seq (int64 [num_tokens]): the sequence of each packed row.
    - groups: one HybridGroupStep per token group of the spec.
    - sample_rows, temperatures, seeds, decode_request_ids, sample_request_ids: as StepBatch's.
    - states: one HybridStateStep per state group of the spec.
    """

    input_ids: np.ndarray
    positions: np.ndarray
    num_decode: int
    seq_indptr: np.ndarray
    seq_request_ids: np.ndarray
    token_seq: np.ndarray
    groups: tuple[HybridGroupStep, ...]
    sample_rows: np.ndarray
    temperatures: np.ndarray
    seeds: np.ndarray
    decode_request_ids: np.ndarray
    sample_request_ids: np.ndarray
    states: tuple[HybridStateStep, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_request_ids.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(self.sample_rows.shape[0])

    @property
    def sample_positions(self) -> np.ndarray:
        return self.positions[self.sample_rows]

    def select(self, k: int) -> HybridStepBatch:
        """The step of sequence `k` alone (its rows, tables and state slots; nothing
        sampled): what a runner that must run sequences one at a time feeds the model."""
        lo, hi = int(self.seq_indptr[k]), int(self.seq_indptr[k + 1])
        none = np.zeros(0, np.int64)
        rid = self.seq_request_ids[k : k + 1]
        return HybridStepBatch(
            input_ids=self.input_ids[lo:hi],
            positions=self.positions[lo:hi],
            num_decode=int(k < self.num_decode),
            seq_indptr=np.array([0, hi - lo], np.int64),
            seq_request_ids=rid,
            token_seq=np.zeros(hi - lo, np.int64),
            groups=tuple(
                HybridGroupStep(
                    g.group,
                    g.block_size,
                    g.slot_pages[lo:hi],
                    g.slot_offsets[lo:hi],
                    g.page_ids[k : k + 1],
                    g.key_start[k : k + 1],
                    g.key_end[k : k + 1],
                )
                for g in self.groups
            ),
            sample_rows=none,
            temperatures=np.zeros(0, np.float32),
            seeds=none,
            decode_request_ids=rid if k < self.num_decode else none,
            sample_request_ids=none,
            states=tuple(HybridStateStep(s.group, s.slots[k : k + 1]) for s in self.states),
        )

    def group(self, index: int) -> HybridGroupStep:
        """The step of spec group `index` (a token group)."""
        for g in self.groups:
            if g.group == index:
                return g
        raise KeyError(f"group {index} is not a token group of this step")


def build_hybrid_step(
    tables: HybridTables,
    decode: list[tuple[int, int, int]],
    prefill: list[tuple[int, list[int], int]],
    temperatures: list[float],
    seeds: list[int],
    sample_prefill: list[bool] | None = None,
) -> HybridStepBatch:
    """decode: (request_id, token, position) per decoding sequence; prefill: (request_id,
    chunk tokens, start position) per chunk; sample_prefill: per chunk, whether its last token
    is sampled. temperatures and seeds: one per sampled row. The tables must already hold the
    step's tokens (the loop grows them before the model runs), as build_step's."""
    flags = sample_prefill or [False] * len(prefill)
    if len(flags) != len(prefill):
        raise ValueError(f"sample_prefill has {len(flags)} flags for {len(prefill)} chunks")
    seqs: list[tuple[int, np.ndarray, np.ndarray]] = [  # (request, tokens, positions)
        (rid, np.array([tok], np.int64), np.array([pos], np.int64)) for rid, tok, pos in decode
    ]
    for rid, chunk, start in prefill:
        seqs.append(
            (
                rid,
                np.asarray(chunk, np.int64),
                np.arange(start, start + len(chunk), dtype=np.int64),
            )
        )
    lens = np.array([len(s[1]) for s in seqs], np.int64)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    input_ids = np.concatenate([s[1] for s in seqs]) if seqs else np.zeros(0, np.int64)
    positions = np.concatenate([s[2] for s in seqs]) if seqs else np.zeros(0, np.int64)
    spec = tables.spec
    groups, states = [], []
    for g in range(spec.num_groups):
        bs = spec.block_size(g)
        if bs is None:  # a state group: its slot, nothing per token
            per_slot = int(spec.pages_per_slot(g))  # type: ignore[arg-type]
            slot_rows = np.zeros((len(seqs), per_slot), np.int64)
            for i, (rid, _, _) in enumerate(seqs):
                slot_rows[i] = tables.state_slot(rid, g)
            states.append(HybridStateStep(g, slot_rows))
            continue
        slots, rows, starts, ends = [], [], [], []
        for rid, _, pos in seqs:
            slots.append(tables.slot_mapping(rid, g, pos))
            first_page, page_ids, num_tokens = tables.table(rid, g)
            rows.append(page_ids.astype(np.int64))
            starts.append(first_page * bs)
            ends.append(num_tokens)
        width = max((len(r) for r in rows), default=0)
        table = np.full((len(seqs), max(width, 1)), -1, np.int64)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        slot = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        groups.append(
            HybridGroupStep(
                group=g,
                block_size=bs,
                slot_pages=slot // bs,
                slot_offsets=slot % bs,
                page_ids=table,
                key_start=np.array(starts, np.int64),
                key_end=np.array(ends, np.int64),
            )
        )
    chunk_last = indptr[len(decode) + 1 :] - 1  # the last packed row of each chunk
    sampled_chunks = [i for i, f in enumerate(flags) if f]
    sample_rows = np.concatenate(
        [np.arange(len(decode), dtype=np.int64), chunk_last[sampled_chunks]]
    ).astype(np.int64)
    if len(temperatures) != len(sample_rows) or len(seeds) != len(sample_rows):
        raise ValueError(
            f"{len(sample_rows)} sampled rows, {len(temperatures)} temperatures, {len(seeds)} seeds"
        )
    decode_ids = np.array([d[0] for d in decode], np.int64)
    return HybridStepBatch(
        input_ids=input_ids,
        positions=positions,
        num_decode=len(decode),
        seq_indptr=indptr,
        seq_request_ids=np.array([s[0] for s in seqs], np.int64),
        token_seq=np.repeat(np.arange(len(seqs), dtype=np.int64), lens),
        groups=tuple(groups),
        sample_rows=sample_rows,
        temperatures=np.array(temperatures, np.float32),
        seeds=np.array(seeds, np.int64),
        decode_request_ids=decode_ids,
        sample_request_ids=np.concatenate(
            [decode_ids, np.array([prefill[i][0] for i in sampled_chunks], np.int64)]
        ),
        states=tuple(states),
    )
