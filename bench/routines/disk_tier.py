"""The disk tier (kvpool.tier.DiskTier: NIXL's POSIX plugin, a CRC-32C per block) against a plain
sequential file write and read of the same bytes on the same file system, in the same run.

For each block size (64 KiB, 2 MiB) and number of blocks (1 .. 4096, at most ``--max-bytes``
per case):

- ``tier_write``: ``DiskTier.put`` of n blocks of a host pool (fresh hashes each repetition,
  so every block is written; the tier's capacity is n, so each repetition overwrites the
  previous one's slots), checksums included.
- ``tier_read``: ``DiskTier.get`` of those n blocks into another pool, every checksum verified.
- ``plain_write`` / ``plain_read``: one ``os.pwrite`` / ``os.preadv`` of the same n blocks'
  bytes (the pool's slab, contiguous) at offset 0 of a file of the same size in the same
  directory (the baseline: what the bytes cost to move without the tier).

Three modes, each side the same in each: ``buffered`` (kvpool's own host pools; the page cache
between the bytes and the device, warm for both sides: each reads what it just wrote),
``cold`` (the same, but before each read, tier's and plain's alike, both files are fsynced and
the page cache dropped, ``echo 1 > /proc/sys/vm/drop_caches``: the read comes from the
device; only where that file is writable, i.e. as root, and only for cases of 4 to 128 MiB, so
as not to empty a shared machine's cache too often) and ``direct`` (O_DIRECT on both sides,
pools made with ``Pool.from_external`` over page-aligned memory, as O_DIRECT needs). Neither
side's timed write calls fsync (the tier's index is in memory, so nothing on disk outlives
the process anyway; the cold mode's fsyncs are outside the timings). Tier and
baseline alternate repetition by repetition, so load from other work hits both; the median
of each is reported, with ``ratio`` = baseline time / tier time (1.0: the tier costs
nothing more). Block bytes are random and checked after every tier read. ``checksum``
times the tier's checksum (``Pool.block_checksums``, CRC-32C in Rust) against zlib's CRC-32
(what the tier used before) over the same 64 MiB; ``load_average`` is read at the start and
the end (the machine is shared). Usage:

    python bench/kvbench.py --routine disk_tier [--out DIR] [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
from provenance import provenance

SIZES = [1, 4, 16, 64, 256, 1024, 4096]
BLOCK_BYTES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
COLD_MIN_BYTES, COLD_MAX_BYTES = 4 << 20, 128 << 20


def _layout(block_bytes: int):
    import kvpool

    layers, heads, block_size = 2, 8, 16
    head_dim = block_bytes // (2 * layers * heads * block_size * 2)
    layout = kvpool.KvLayout(layers, heads, head_dim, block_size)
    assert layout.block_bytes == block_bytes
    return layout


def _slab(pool, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(pool.base_ptr))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--quick", action="store_true", help="sizes up to 64 blocks, 3 repetitions")
    ap.add_argument("--max-bytes", type=int, default=512 << 20, help="bytes per case, at most")
    ap.add_argument("--dir", type=Path, help="where the files go (default: a temporary folder)")
    args = ap.parse_args(argv)

    import kvpool
    from kvpool.tier import DiskTier, disk

    prov = provenance("bench/routines/disk_tier.py")
    load_at_start = os.getloadavg()
    rows, skipped = [], []
    sizes = [n for n in SIZES if n <= 64] if args.quick else SIZES
    rng = np.random.default_rng(0)
    base = Path(tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir=args.dir))
    can_drop = _drop_page_cache()
    for mode, (label, block_bytes) in (
        (m, item) for m in ("buffered", "cold", "direct") for item in BLOCK_BYTES.items()
    ):
        fit = [n for n in sizes if n * block_bytes <= args.max_bytes]
        if mode == "cold":
            if not can_drop:
                skipped.append(f"cold {label}: /proc/sys/vm/drop_caches is not writable here")
                continue
            fit = [n for n in fit if COLD_MIN_BYTES <= n * block_bytes <= COLD_MAX_BYTES]
        skipped += [f"{mode} {label} x {n}" for n in sizes if n not in fit]
        if not fit:
            continue
        layout = _layout(block_bytes)
        direct, cold = mode == "direct", mode == "cold"
        for n in fit:
            load_1m = os.getloadavg()[0]
            nbytes = n * block_bytes
            if direct:  # page-aligned memory under the pools, as O_DIRECT needs
                memory = [mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)]
                arrays = [np.frombuffer(m, np.uint8) for m in memory]
                src, dst = (
                    kvpool.Pool.from_external(layout, a, num_blocks=n, device="host")
                    for a in arrays
                )
            else:
                src = kvpool.Pool(layout, n, device="host")
                dst = kvpool.Pool(layout, n, device="host")
            src_slab, dst_slab = _slab(src, nbytes), _slab(dst, nbytes)
            src_slab[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            dst_slab[:] = 0
            ids = list(range(n))
            reps = 3 if args.quick or cold else (11 if nbytes <= 64 << 20 else 5)
            folder = base / f"{mode}-{label}-{n}"
            folder.mkdir()
            plain_path = folder / "plain.bin"
            flags = os.O_CREAT | os.O_RDWR | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            fd = os.open(plain_path, flags, 0o600)
            os.ftruncate(fd, nbytes)
            times: dict[str, list[float]] = {
                k: [] for k in ("tier_write", "plain_write", "tier_read", "plain_read")
            }
            with DiskTier(folder, layout, n, direct=direct) as tier:
                for rep in range(reps + 1):  # the first repetition warms up, not counted
                    keys = [rep.to_bytes(4, "little") + i.to_bytes(28, "little") for i in ids]
                    t0 = time.perf_counter()
                    assert tier.put(src, ids, keys) == n
                    t1 = time.perf_counter()
                    assert os.pwrite(fd, src_slab, 0) == nbytes
                    t_plain_write = time.perf_counter() - t1
                    if cold:
                        _flush_and_drop(tier.path, fd)
                    t2 = time.perf_counter()
                    hits = tier.get(dst, ids, keys)
                    t3 = time.perf_counter()
                    assert all(hits) and np.array_equal(dst_slab, src_slab), "tier bytes differ"
                    dst_slab[:] = 0
                    if cold:
                        _flush_and_drop(tier.path, fd)
                    t4 = time.perf_counter()
                    assert os.preadv(fd, [dst_slab], 0) == nbytes
                    t5 = time.perf_counter()
                    assert np.array_equal(dst_slab, src_slab), "plain bytes differ"
                    dst_slab[:] = 0
                    if rep:
                        times["tier_write"].append(t1 - t0)
                        times["plain_write"].append(t_plain_write)
                        times["tier_read"].append(t3 - t2)
                        times["plain_read"].append(t5 - t4)
                descriptors = tier.descriptor_counts[-1]
            os.close(fd)
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
            for op in ("write", "read"):
                tier_s = statistics.median(times[f"tier_{op}"])
                plain_s = statistics.median(times[f"plain_{op}"])
                rows.append(
                    {
                        "mode": mode,
                        "op": op,
                        "block": label,
                        "blocks": n,
                        "bytes": nbytes,
                        "descriptors": descriptors,
                        "reps": reps,
                        "load_1m_at_start": load_1m,
                        "tier_median_us": tier_s * 1e6,
                        "plain_median_us": plain_s * 1e6,
                        "tier_gbytes_per_s": nbytes / tier_s / 1e9,
                        "plain_gbytes_per_s": nbytes / plain_s / 1e9,
                        "ratio": plain_s / tier_s,
                    }
                )
            del src, dst, src_slab, dst_slab
    base.rmdir()
    checksum = _checksum_speed(kvpool, rng, quick=args.quick)
    result = {
        "routine": "disk_tier",
        "provenance": prov,
        "what": "DiskTier put/get (NIXL POSIX, CRC-32C per block) vs one pwrite/preadv",
        "checksum_beside_copy_from_bytes": disk.OVERLAP_MIN_BYTES,
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "checksum": checksum,
        "file_system": _file_system(base.parent),
        "target": "ratio >= 0.8 (plain time / tier time)",
        "skipped": skipped,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"checksum over {checksum['bytes']} bytes: CRC-32C (Rust) {checksum['crc32c_gbytes_per_s']:.2f}"
        f" GB/s, zlib CRC-32 {checksum['zlib_crc32_gbytes_per_s']:.2f} GB/s"
    )
    for r in rows:
        print(
            f"{r['mode']:<8} {r['op']:<5} {r['block']:>5} x {r['blocks']:>4}  tier {r['tier_gbytes_per_s']:>6.2f}"
            f" GB/s  plain {r['plain_gbytes_per_s']:>6.2f} GB/s  ratio {r['ratio']:.2f}"
        )
    return 0


def _drop_page_cache() -> bool:
    """Drops the page cache (clean pages only: fsync first); False where that is not allowed."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _flush_and_drop(tier_path: Path, plain_fd: int) -> None:
    """Both files' bytes to the device, then out of the page cache, so the next read is cold."""
    tier_fd = os.open(tier_path, os.O_RDONLY)
    try:
        os.fsync(tier_fd)
    finally:
        os.close(tier_fd)
    os.fsync(plain_fd)
    assert _drop_page_cache()


def _checksum_speed(kvpool, rng, *, quick: bool) -> dict:
    """Median time of the tier's checksum of 1024 blocks of 64 KiB (``Pool.block_checksums``)
    and of zlib's CRC-32 of the same bytes, interleaved."""
    layout = _layout(64 << 10)
    n = 1024
    pool = kvpool.Pool(layout, n, device="host")
    slab = _slab(pool, n * layout.block_bytes)
    slab[:] = rng.integers(0, 256, slab.size, dtype=np.uint8)
    ids = np.arange(n, dtype=np.int32)
    ours, zlibs = [], []
    for rep in range(4 if quick else 12):
        t0 = time.perf_counter()
        pool.block_checksums(ids)
        t1 = time.perf_counter()
        for b in range(n):
            zlib.crc32(slab[b * layout.block_bytes : (b + 1) * layout.block_bytes])
        t2 = time.perf_counter()
        if rep:
            ours.append(t1 - t0)
            zlibs.append(t2 - t1)
    nbytes = slab.size
    return {
        "bytes": nbytes,
        "blocks": n,
        "crc32c_median_us": statistics.median(ours) * 1e6,
        "zlib_crc32_median_us": statistics.median(zlibs) * 1e6,
        "crc32c_gbytes_per_s": nbytes / statistics.median(ours) / 1e9,
        "zlib_crc32_gbytes_per_s": nbytes / statistics.median(zlibs) / 1e9,
    }


def _file_system(path: Path) -> str | None:
    """The mount (device, type) holding ``path``, from /proc/mounts."""
    try:
        best = ("", "")
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, f"{device} {kind} at {mount}")
        return best[1] or None
    except OSError:
        return None
