"""Every kernel family on small inputs, to run under compute-sanitizer (memcheck, racecheck).

For each dtype, head dim and block size: the tensor-core decode (unsplit, one split and a forced
split through the fused merge) and, where they support the shape, both CUDA-core decodes
(cp.async stages, register loads), over shuffled tables with ragged lengths (1 token, mid-block,
block end, several blocks) and -1 padding, with a group of 3 (a ragged head tile); append_kv with
skipped (-1) and past-the-pool slots; copy_blocks. The default head dims include padded widths
(40 -> 48, 80) and the block sizes pages smaller than the 16-token tile (1, 2). Outputs are poisoned with NaN first and must come
back finite (the sanitizer judges the memory accesses; this catches unwritten rows).

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/sanitize_kernels.py \
        [--dtypes float16,bfloat16] [--head-dims 40,80,128] [--block-sizes 1,2,16]
"""

from __future__ import annotations

import argparse

import cupy as cp
import kvpool
import numpy as np
from kvpool.kernels import _build, _tuning, append_kv, copy_blocks, paged_attention_decode

SEQ_LENS = [1, 15, 17, 100, 600]  # 600: several splits through the fused merge
HQ, HKV = 6, 2  # GQA group 3: a head tile that is not a power of two
# Blocks are a multiple of 256 bytes: 8 layers x K,V x 2 heads x 2 bytes x head_dim (a multiple
# of 8) x block_size is, for every block size; only layers 0 and 1 are filled and read.
NUM_LAYERS = 8
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}
PIPELINES = {"tensor-core": _build.TC, "cuda-core cp.async": 1, "cuda-core registers": 0}


def elems(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> cp.ndarray:
    bits = cp.asarray(rng.integers(0, 0x3C00, size=shape, dtype=np.uint16))  # finite, |x| < 1
    return bits.view(cp.float16) if dtype == "float16" else bits


def run_case(rng: np.random.Generator, dtype: str, d: int, bs: int) -> None:
    need = [-(-n // bs) for n in SEQ_LENS]
    num_blocks = sum(need) + 4
    pool = kvpool.Pool(kvpool.KvLayout(NUM_LAYERS, HKV, d, bs, dtype), num_blocks, device="cuda")
    for layer in range(2):
        for view in (pool.k_view(layer), pool.v_view(layer)):
            a = cp.asarray(view)
            a[...] = elems(rng, a.shape, dtype).view(a.dtype)
    tables = np.full((len(SEQ_LENS), max(need) + 2), -1, dtype=np.int32)
    ids, at = rng.permutation(num_blocks), 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[at : at + n]
        at += n
    bt, lens = cp.asarray(tables), cp.asarray(np.array(SEQ_LENS, dtype=np.int32))
    q = elems(rng, (len(SEQ_LENS), HQ, d), dtype)
    for name, pipeline in PIPELINES.items():
        if pipeline != _build.TC and (d not in _build.HEAD_DIMS or bs not in _build.BLOCK_SIZES):
            continue  # the CUDA-core baseline runs its own shape set only
        for splits in (None, 1, 3):
            out = cp.empty(q.shape, dtype=q.dtype)
            out.view(cp.uint16)[...] = NAN_BITS[dtype]
            with _tuning.override(decode_pipeline=pipeline):  # the one-call form's plan takes it
                paged_attention_decode(
                    q, pool, 1, bt, lens, out=out, num_splits=splits, max_seq_len=max(SEQ_LENS)
                )
            host = cp.asnumpy(out.view(cp.uint16))
            exp = (host >> (10 if dtype == "float16" else 7)) & (
                0x1F if dtype == "float16" else 0xFF
            )
            if (exp == (0x1F if dtype == "float16" else 0xFF)).any():
                raise AssertionError(
                    f"{name} decode left NaN rows ({dtype}, d={d}, bs={bs}, splits={splits})"
                )
    slots = cp.asarray(np.array([5, -1, num_blocks * bs - 1, num_blocks * bs + 7], dtype=np.int64))
    kv = elems(rng, (4, HKV, d), dtype)
    append_kv(kv, kv, pool, 0, slots)
    copy_blocks(pool, np.array([[0, 1], [2, 3]]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--head-dims", default="40,80,128")
    ap.add_argument("--block-sizes", default="1,2,16")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cases = 0
    for dtype in args.dtypes.split(","):
        for d in (int(x) for x in args.head_dims.split(",")):
            for bs in (int(x) for x in args.block_sizes.split(",")):
                run_case(rng, dtype, d, bs)
                cases += 1
    cp.cuda.Device().synchronize()
    print(
        f"sanitize case done: {cases} (dtype, head_dim, block_size) cases, "
        f"{len(PIPELINES)} decode kernels x 2 split modes, append_kv, copy_blocks each"
    )


if __name__ == "__main__":
    main()
