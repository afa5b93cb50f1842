"""Host-side split-KV arithmetic of paged decode attention (pure: host numbers in, numbers out).

Few sequences with long contexts give too few (sequence, KV head) CTAs to fill the GPU; then
each sequence's tokens are cut into `num_splits` chunks of `chunk_tokens`, one CTA each, and the
partial outputs are merged by log-sum-exp (inside the launch by the tensor-core kernel, by a
second launch for the CUDA-core baseline). The split depends only on host numbers
(num_seqs, heads, the longest sequence), so no device synchronisation is needed when the caller
knows max_seq_len. :class:`kvpool.kernels.DecodePlan` holds one.
"""

from __future__ import annotations

from dataclasses import dataclass

CTAS_PER_SM = 4  # CUDA-core baseline: resident CTAs per SM the split aims to fill (one wave)
# Tensor-core kernel: one CTA per SM is the fill target and chunks are >= 256 tokens; the H200
# split sweep of the tensor-core kernel (bench/NOTES_kernels.md, run 3) was fastest there for
# 1 x 32768, 1 x 4096 (16 splits) and 16 x 512 (no split).
TC_CTAS_PER_SM = 1
MIN_CHUNK = 256  # tokens
# The tensor-core kernel's fused merge keeps this many partials' weights in shared memory (the
# .cu is compiled with it), so no decode plan has more splits, forced or not.
MAX_DECODE_SPLITS = 128


@dataclass(frozen=True)
class SplitKv:
    """How one decode launch cuts the sequences' tokens: `num_splits` chunks of `chunk_tokens`."""

    chunk_tokens: int
    num_splits: int

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def split_kv(
    num_seqs: int,
    ctas_per_seq: int,
    max_seq_len: int,
    tokens_per_iter: int,
    num_sms: int,
    num_splits: int | None = None,
    ctas_per_sm: int = CTAS_PER_SM,
) -> SplitKv:
    """Choose chunk_tokens / num_splits so that num_seqs * ctas_per_seq * num_splits CTAs fill
    `num_sms` SMs, keeping every chunk at least MIN_CHUNK tokens (unless forced by num_splits).
    At most MAX_DECODE_SPLITS splits, forced or not."""
    max_seq_len = max(int(max_seq_len), 1)
    if num_splits is None:
        work = max(num_seqs * ctas_per_seq, 1)
        target = num_sms * ctas_per_sm
        # Round, not ceil: 512 CTAs on a 528-slot wave should not become 1024 split CTAs.
        num_splits = min(max(round(target / work), 1), -(-max_seq_len // MIN_CHUNK))
    num_splits = min(max(int(num_splits), 1), MAX_DECODE_SPLITS)
    if num_splits == 1:
        return SplitKv(chunk_tokens=max_seq_len, num_splits=1)
    chunk = -(-max_seq_len // num_splits)
    chunk = -(-chunk // tokens_per_iter) * tokens_per_iter
    num_splits = -(-max_seq_len // chunk)
    if num_splits == 1:
        return SplitKv(chunk_tokens=max_seq_len, num_splits=1)
    return SplitKv(chunk_tokens=chunk, num_splits=num_splits)


def workspace_elems(num_seqs: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of split-KV workspace a decode plan with `num_splits` needs."""
    return num_seqs * min(num_splits, MAX_DECODE_SPLITS) * num_q_heads * (head_dim + 1)
