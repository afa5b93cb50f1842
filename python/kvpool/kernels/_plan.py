"""Host-side split-KV planning for paged decode attention.

Few sequences with long contexts give too few (sequence, KV head) CTAs to fill the GPU; then
each sequence's tokens are cut into `num_splits` chunks of `chunk_tokens`, one CTA each, and the
partial outputs are merged by log-sum-exp (inside the launch by the tensor-core kernel, by a
second launch for the CUDA-core baseline). The plan depends only on host numbers
(num_seqs, heads, the longest sequence), so no device synchronisation is needed when the caller
knows max_seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

CTAS_PER_SM = 4  # CUDA-core baseline: resident CTAs per SM the plan aims to fill (one wave)
# Tensor-core kernel: one CTA per SM is the fill target and chunks are >= 256 tokens; the H200
# split sweep of the tensor-core kernel (bench/NOTES_kernels.md, run 3) was fastest there for
# 1 x 32768, 1 x 4096 (16 splits) and 16 x 512 (no split).
TC_CTAS_PER_SM = 1
MIN_CHUNK = 256  # tokens
MAX_SPLITS = 128  # the tensor-core kernel's fused merge holds at most this many partials


@dataclass(frozen=True)
class DecodePlan:
    chunk_tokens: int
    num_splits: int

    @property
    def split(self) -> bool:
        return self.num_splits > 1


def plan_decode(
    num_seqs: int,
    ctas_per_seq: int,
    max_seq_len: int,
    tokens_per_iter: int,
    num_sms: int,
    num_splits: int | None = None,
    ctas_per_sm: int = CTAS_PER_SM,
) -> DecodePlan:
    """Choose chunk_tokens / num_splits so that num_seqs * ctas_per_seq * num_splits CTAs fill
    `num_sms` SMs, keeping every chunk at least MIN_CHUNK tokens (unless forced by num_splits).
    At most MAX_SPLITS splits, forced or not."""
    max_seq_len = max(int(max_seq_len), 1)
    if num_splits is None:
        work = max(num_seqs * ctas_per_seq, 1)
        target = num_sms * ctas_per_sm
        # Round, not ceil: 512 CTAs on a 528-slot wave should not become 1024 split CTAs.
        num_splits = min(max(round(target / work), 1), -(-max_seq_len // MIN_CHUNK))
    num_splits = min(max(int(num_splits), 1), MAX_SPLITS)
    if num_splits == 1:
        return DecodePlan(chunk_tokens=max_seq_len, num_splits=1)
    chunk = -(-max_seq_len // num_splits)
    chunk = -(-chunk // tokens_per_iter) * tokens_per_iter
    num_splits = -(-max_seq_len // chunk)
    if num_splits == 1:
        return DecodePlan(chunk_tokens=max_seq_len, num_splits=1)
    return DecodePlan(chunk_tokens=chunk, num_splits=num_splits)
