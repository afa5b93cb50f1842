"""The MLA kernel (paged_mla_decode.cu) and append_latent on small inputs, to run under
compute-sanitizer (memcheck, racecheck): an fp8 (e4m3) latent group with float16 and bfloat16
queries and a bfloat16 group, decode (unsplit, one split, a forced split through mla_merge)
and extend (ragged qo_len), head tiles 16 and 64, over shuffled pages with ragged lengths
(1 token, a page end, mid-page, several pages) and -1 padding in the tables; append_latent with
skipped (-1) and past-the-pool slots. Outputs are poisoned with NaN first and must come back
finite (the sanitizer judges the memory accesses and the shared-memory hazards; this catches
unwritten rows).

    compute-sanitizer --tool racecheck --error-exitcode 9 python3 tools/sanitize_mla.py
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np
from kvpool import HybridTables, KvGroup, ModelKvSpec, Pool
from kvpool.kernels import (
    MlaScales,
    mla_append_latent,
    mla_decode_plan,
    mla_extend_plan,
    mla_page_tables,
)

SEQ_LENS = [1, 64, 65, 200]
QO_LENS = [1, 3, 17, 20]
SCALE = 1 / math.sqrt(192)
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def rows(rng: np.random.Generator, n: int, dtype: str) -> cp.ndarray:
    bits = cp.asarray(rng.integers(0, 0x3C00, size=(n, 576), dtype=np.uint16))  # |x| < 1
    bits |= cp.asarray(rng.integers(0, 2, size=(n, 576), dtype=np.uint16)) << 15
    return bits.view(cp.float16) if dtype == "float16" else bits


def poisoned(shape: tuple[int, ...], dtype: str) -> cp.ndarray:
    out = cp.empty(shape, dtype=cp.float16 if dtype == "float16" else cp.uint16)
    out.view(cp.uint16)[...] = NAN_BITS[dtype]
    return out


def finite(out: cp.ndarray, dtype: str) -> bool:
    bits = out.view(cp.uint16).astype(cp.uint32)
    if dtype == "bfloat16":
        return bool(((bits & 0x7F80) != 0x7F80).all())
    return bool(((bits & 0x7C00) != 0x7C00).all())


def run(group_dtype: str, q_dtype: str, rng: np.random.Generator) -> None:
    spec = ModelKvSpec([KvGroup.mla_latent([0], 512, 64, group_dtype)])
    pool = Pool.for_spec(spec, 16, device="cuda")
    tables = HybridTables(pool, spec)
    for i, n in enumerate(SEQ_LENS):
        tables.add(100 + i, 1)
        tables.add(i, n)
    pt, sl = mla_page_tables(tables, range(len(SEQ_LENS)), 0)
    pt = np.concatenate([pt, np.full((len(SEQ_LENS), 2), -1, np.int32)], axis=1)
    fp8 = group_dtype == "float8_e4m3fn"
    scales = MlaScales(pool, spec, 0, auto_calibrate=True) if fp8 else None
    slots = np.concatenate(
        [pt[i, np.arange(n) // 64] * 64 + np.arange(n) % 64 for i, n in enumerate(SEQ_LENS)]
    )
    slots = np.concatenate([slots, [-1, pool.num_blocks * 64 + 3]]).astype(np.int64)
    mla_append_latent(
        pool, spec, 0, rows(rng, len(slots), q_dtype), cp.asarray(slots), scales=scales
    )
    dpt, dsl = cp.asarray(pt), cp.asarray(sl)
    for heads, tile in ((16, None), (128, 64)):
        n = len(SEQ_LENS)
        for splits in (None, 1, 3):
            plan = mla_decode_plan(
                pool,
                spec,
                0,
                dpt,
                dsl,
                heads,
                scale=SCALE,
                num_splits=splits,
                head_tile=tile,
                scales=scales,
            )
            out = poisoned((n, heads, 512), q_dtype)
            qn, qp = rows(rng, n * heads, q_dtype), rows(rng, n * heads, q_dtype)
            plan.run(
                qn.reshape(n, heads, 576)[:, :, :512].copy(),
                qp.reshape(n, heads, 576)[:, :, :64].copy(),
                0,
                out=out,
            )
            cp.cuda.runtime.deviceSynchronize()
            assert finite(out, q_dtype), f"decode {group_dtype} {q_dtype} h{heads} s{splits}"
        ip = np.concatenate([[0], np.cumsum(QO_LENS)]).astype(np.int32)
        t = int(ip[-1])
        plan = mla_extend_plan(
            pool, spec, 0, ip, dpt, sl, heads, scale=SCALE, num_splits=2, scales=scales
        )
        out = poisoned((t, heads, 512), q_dtype)
        qn = rows(rng, t * heads, q_dtype).reshape(t, heads, 576)
        plan.run(qn[:, :, :512].copy(), qn[:, :, 512:].copy(), 0, out=out)
        cp.cuda.runtime.deviceSynchronize()
        assert finite(out, q_dtype), f"extend {group_dtype} {q_dtype} h{heads}"
    print("ok", group_dtype, q_dtype, flush=True)


def main() -> None:
    rng = np.random.default_rng(0)
    for group_dtype, q_dtype in (
        ("float8_e4m3fn", "bfloat16"),
        ("float8_e4m3fn", "float16"),
        ("bfloat16", "bfloat16"),
    ):
        run(group_dtype, q_dtype, rng)


if __name__ == "__main__":
    main()
