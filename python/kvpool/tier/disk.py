"""A disk tier for KV blocks, below the host tier: blocks are kept in a file by content hash and
moved between a host pool's slab and the file by NIXL's POSIX plugin (the storage backend of
the ``nixl-cu13`` wheel), with a CRC-32C per block verified on every read.

- **Storage.** One data file of ``capacity_blocks`` slots of ``block_bytes`` each (sparse until
  written), registered with NIXL once; an in-memory index maps a block hash (kvpool's 32-byte
  prefix-cache hash) to its slot and checksum, in LRU order. A batch is one NIXL transfer
  with one descriptor per run of blocks contiguous both in the pool and in the file (a fresh
  tier and a fresh pool: one descriptor).
- **Integrity.** ``get`` READs into the caller's blocks, then checks each block's CRC-32C
  and the file's size: a flipped byte, a truncated file, a failed read are a **miss** for
  that block (its entry is dropped), never a hit with wrong KV. A missed block's bytes in
  the pool are unspecified: the caller computes it, as for any miss. The checksums are
  computed in Rust (``Pool.block_checksums``, ``EvictionStage.checksums``: CRC-32C by
  carry-less multiplication, the GIL released), not by zlib's CRC-32, which at about 2 GB/s
  was slower than the page-cache copy it checked. A move of ``OVERLAP_MIN_BYTES`` or more
  computes them on the tier's one worker thread beside NIXL's copy (a buffered transfer is
  copied within the call that posts it, so only another thread overlaps the two; a read's
  chunk is checked while the next one is read); a smaller move computes them on the calling
  thread, where the hand-off would cost more than it saves. ``CHECKSUM`` names the algorithm;
  ``FORMAT_VERSION`` 2 is the CRC-32C one (1 was zlib's). The data file carries no checksum:
  they live in the index.
- **Restarts.** By default the file outlives no tier (it is emptied when a tier opens it).
  A ``persistent=True`` tier writes its index (hash -> slot, CRC-32C, LRU order, and what
  file, layout and capacity it describes) to ``blocks.kv.index`` beside the data file on
  ``flush()`` and ``close()``: the data file is fsynced first, then the index is written to a
  temporary file, fsynced and renamed over the old one, so a crash leaves the old index or
  the new one, never half of one. A persistent tier opening a directory reloads that index
  if it matches (its own CRC-32, format version, checksum algorithm, layout, capacity, and the
  data file's size, inode and modification time as of the flush); otherwise it warns
  (``DiskIndexWarning``), discards the index and starts empty. The reloaded entries are
  verified lazily, on read, as every entry is: a block corrupted, cut short or rewritten since
  the flush (a crash after later writes, within the file's timestamp granularity) fails its
  CRC-32C and is a miss. A new process finds the blocks only if its pool hashes alike (the
  same ``prefix_hash_key``).
- **Capacity.** At most ``capacity_blocks`` blocks; a ``put`` past it evicts the least recently
  used (a hit or a repeated ``put`` refreshes a block).
- **Events.** Every block that enters the tier, or is reloaded with its index at open, is
  reported as ``BlockStored(medium="disk")``
  (no parent, no tokens: how vLLM's CPU offloading reports the blocks it stores) and every
  block that leaves it (evicted, corrupt, removed) as ``BlockRemoved(medium="disk")``, in this
  tier's own bounded queue (``take_kv_events``), numbered from 1. ``PrefixDiskCache`` moves
  them into its pool's queue (``Pool.append_kv_event``), where the core numbers them with its
  own, so a router reads one ordered stream and the pool's snapshot lists the disk's blocks.
- **Evicted blocks.** ``put_staged`` writes the blocks a pool's eviction stage holds
  (``Pool.attach_eviction_stage``: blocks the core dropped from its last in-memory tier,
  copied out with their hashes before their memory was reused) and gives the slots back.

Host pools only: a CUDA pool's blocks do not reach the disk (a CUDA pool takes no eviction
stage, ``Pool.attach_eviction_stage``, and ``put``/``get`` refuse it; GDS, VRAM to file, is not
in this module). What calls ``put``, ``put_staged`` and ``get`` is the caller's (``PrefixDiskCache``
calls them for a pool's prefix cache).
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from itertools import chain, islice, repeat
from pathlib import Path
from typing import Any

import numpy as np

from kvpool._core import (
    BlockRemoved,
    BlockStored,
    EvictionStage,
    InvalidArgumentError,
    KvLayout,
    Pool,
    TransferError,
)
from kvpool.transfer.nixl_transport import load_nixl
from kvpool.transfer.protocol import layout_fingerprint

MEDIUM = "disk"
CHECKSUM = "crc32c"
FORMAT_VERSION = 2
HASH_BYTES = 32
DEFAULT_MAX_QUEUED_EVENTS = 10_000
# O_DIRECT needs the buffer, offset and length aligned to the device's logical block; 4 KiB
# covers every device seen (512-byte and 4 KiB ones).
DIRECT_ALIGN = 4096
# A read is cut into chunks, so that the checksums of one chunk are computed while the next
# is read: a quarter of the read, within these bounds. Fewer, larger chunks cost less (each
# transfer costs tens of microseconds to post, and the page cache more per call than per
# byte): on the dev VM 64 MiB read in chunks of 16 MiB took 4-8% less time than in chunks of
# 8 MiB, 256 MiB in chunks of 32 MiB 2% less than in 16 MiB ones.
READ_CHUNK_BYTES = 32 << 20
READ_CHUNKS = 4
MIN_READ_CHUNK_BYTES = 1 << 20
# From this many bytes a move's checksums run on the tier's worker thread beside NIXL's copy
# (NIXL and the Rust checksum both release the GIL, so the two use two cores); below it the
# hand-off to the thread costs more than it saves (on the dev VM a read of 4 MiB in chunks
# took 1.4 ms with the worker, 0.8 ms without, 0.65 ms in one READ without; at 8 MiB the
# worker took 20-40% off the write, about nothing off the read).
OVERLAP_MIN_BYTES = 8 << 20
_POLL_S = 0.0001
_SPIN_S = 0.002
# The persisted index (``flush``): this magic, a 4-byte little-endian length and a JSON header,
# the entries (least recently used first) as records of ``_INDEX_RECORD``, then the zlib
# CRC-32 of everything before it (4 bytes, little-endian).
INDEX_NAME = "blocks.kv.index"
INDEX_MAGIC = b"KVPOOL-DISK-INDEX\n"
_INDEX_RECORD = np.dtype([("hash", "V32"), ("slot", "<u8"), ("crc", "<u4")])


class DiskIndexWarning(RuntimeWarning):
    """A persistent disk tier found an index it could not use (garbled, of another layout or
    capacity, or of a data file changed since); it discarded it and started empty."""


class _IndexMismatch(Exception):
    """Why a persisted index was not loaded (internal: becomes a DiskIndexWarning)."""


@dataclass
class _Entry:
    slot: int
    crc: int


class DiskTier:
    """``capacity_blocks`` blocks of ``layout`` in ``directory``/blocks.kv (both made, or the
    file emptied);
    see the module docstring. ``close()`` (or ``with``) releases the file and NIXL and joins
    the checksum worker.

    ``direct=True`` opens the file with O_DIRECT: the bytes go between the pool and the
    device without the page cache, and NIXL's I/O runs while the checksums are computed even
    on the calling thread. It needs blocks whose size is a multiple of 4 KiB in a pool whose
    slab starts on a 4 KiB boundary (``Pool.from_external`` over page-aligned memory; a
    kvpool host pool's own slab is aligned to 256 bytes), and a file system that takes
    O_DIRECT; otherwise InvalidArgumentError.

    ``persistent=True`` keeps the blocks across tiers (and processes): the index found beside
    the file is reloaded if it matches, and ``flush()`` / ``close()`` write it; see
    "Restarts" in the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike,
        layout: KvLayout,
        capacity_blocks: int,
        *,
        max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS,
        direct: bool = False,
        persistent: bool = False,
    ) -> None:
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout must be a KvLayout, got {type(layout).__name__}")
        for name, value in (
            ("capacity_blocks", capacity_blocks),
            ("max_queued_events", max_queued_events),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
        for name, flag in (("direct", direct), ("persistent", persistent)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.layout, self.capacity = layout, capacity_blocks
        self.block_bytes = layout.block_bytes
        self.direct, self.persistent = direct, persistent
        if direct and self.block_bytes % DIRECT_ALIGN:
            raise InvalidArgumentError(
                f"direct I/O needs blocks of a multiple of {DIRECT_ALIGN} bytes, not "
                f"{self.block_bytes}"
            )
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / "blocks.kv"
        self.index_path = Path(directory) / INDEX_NAME
        # A persistent tier keeps the file until it knows whether the index describes it.
        flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if direct else 0)
        flags |= 0 if persistent else os.O_TRUNC
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            if not direct:
                raise
            raise InvalidArgumentError(f"{self.path}: no O_DIRECT here ({e})") from e
        reloaded: list[tuple[bytes, _Entry]] = []
        try:
            if persistent:
                reloaded = self._load_index()
                if not reloaded:
                    os.ftruncate(self._fd, 0)  # what the file held is unknown: none of it
            else:
                self.index_path.unlink(missing_ok=True)  # it described the bytes just emptied
        except BaseException:
            os.close(self._fd)
            raise
        nixl = load_nixl()
        self._agent_name = f"kvpool-disk-{os.getpid()}-{id(self):x}"
        try:
            self._agent = nixl.nixl_agent(
                self._agent_name, nixl.nixl_agent_config(backends=["POSIX"])
            )
        except BaseException:
            os.close(self._fd)
            raise
        try:
            if os.fstat(self._fd).st_size != capacity_blocks * self.block_bytes:
                # Only when needed: even a same-size truncate moves the modification time,
                # which a reloaded index was checked against.
                os.ftruncate(self._fd, capacity_blocks * self.block_bytes)
            self._file_reg = self._agent.register_memory(
                [(0, capacity_blocks * self.block_bytes, self._fd, str(self.path))], "FILE"
            )
        except BaseException:
            os.close(self._fd)
            raise
        # base_ptr -> (the pool or stage, kept alive; its registration)
        self._pool_regs: dict[int, tuple[Pool | EvictionStage, Any]] = {}
        self._index: OrderedDict[bytes, _Entry] = OrderedDict(reloaded)  # LRU first
        held = {entry.slot for _, entry in reloaded}
        # A stack, lowest on top.
        self._free_slots = [s for s in range(capacity_blocks - 1, -1, -1) if s not in held]
        self._events: list[BlockStored | BlockRemoved] = []
        self._max_events = max_queued_events
        self._seq = 0
        self.stats = {
            "stored": 0,
            "hits": 0,
            "misses": 0,
            "corrupt": 0,
            "evicted": 0,
            "reloaded": len(reloaded),
        }
        self.descriptor_counts: list[int] = []  # per NIXL transfer, for tests and benchmarks
        self._checksum_worker: ThreadPoolExecutor | None = None
        self._closed = False
        if reloaded:
            self._event(BlockStored, [key for key, _ in reloaded])

    # -- the persisted index -----------------------------------------------------------------
    def _index_header(self) -> dict:
        """What a persisted index must describe to be this tier's (its data file apart)."""
        return {
            "format_version": FORMAT_VERSION,
            "checksum": CHECKSUM,
            "layout": layout_fingerprint(self.layout),
            "capacity_blocks": self.capacity,
        }

    def _data_file_identity(self) -> dict:
        st = os.fstat(self._fd)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}

    def _load_index(self) -> list[tuple[bytes, _Entry]]:
        """The persisted index's entries, LRU first, if there is one and it matches this tier
        and its data file; else [] (with a DiskIndexWarning if there was one)."""
        try:
            raw = self.index_path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            return self._parse_index(raw)
        except _IndexMismatch as e:
            warnings.warn(
                f"{self.index_path}: discarded ({e}); the disk tier starts empty",
                DiskIndexWarning,
                stacklevel=3,
            )
            return []

    def _parse_index(self, raw: bytes) -> list[tuple[bytes, _Entry]]:
        head = len(INDEX_MAGIC)
        if len(raw) < head + 8 or not raw.startswith(INDEX_MAGIC):
            raise _IndexMismatch("not a kvpool disk index")
        if zlib.crc32(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise _IndexMismatch("its CRC-32 does not match: damaged or cut short")
        length = int.from_bytes(raw[head : head + 4], "little")
        try:
            header = json.loads(raw[head + 4 : head + 4 + length])
            want = self._index_header()
            for field, value in want.items():
                if header[field] != value:
                    raise _IndexMismatch(f"{field} {header[field]!r}, the tier's {value!r}")
            if header["data_file"] != self._data_file_identity():
                raise _IndexMismatch(f"{self.path} changed since the index was written")
            count = int(header["entries"])
        except (ValueError, KeyError, TypeError) as e:
            raise _IndexMismatch(f"its header is unreadable ({type(e).__name__}: {e})") from None
        body = raw[head + 4 + length : -4]
        if count < 0 or len(body) != count * _INDEX_RECORD.itemsize:
            raise _IndexMismatch(f"{len(body)} bytes of entries for {count}")
        records = np.frombuffer(body, _INDEX_RECORD)
        slots = records["slot"]
        if count > self.capacity or (count and int(slots.max()) >= self.capacity):
            raise _IndexMismatch("an entry's slot is outside the capacity")
        keys = [bytes(h) for h in records["hash"]]
        if len(set(slots.tolist())) != count or len(set(keys)) != count:
            raise _IndexMismatch("a slot or a hash is listed twice")
        return [
            (k, _Entry(int(slot), int(crc)))
            for k, slot, crc in zip(keys, slots.tolist(), records["crc"].tolist(), strict=True)
        ]

    def flush(self) -> int:
        """A persistent tier: makes the blocks written so far durable (fsync) and writes the
        index beside the file (atomically: a temporary file renamed over the old index), so
        a tier opened later over this directory finds them. Returns how many entries it
        wrote. InvalidArgumentError on a tier that is not persistent."""
        self._check_open()
        if not self.persistent:
            raise InvalidArgumentError(
                "this disk tier is not persistent (persistent=False empties its file at the "
                "next open): there is no index to write"
            )
        os.fsync(self._fd)  # the blocks before the index that names them
        header = {
            **self._index_header(),
            "data_file": self._data_file_identity(),
            "entries": len(self._index),
        }
        records = np.zeros(len(self._index), _INDEX_RECORD)
        records["hash"] = np.frombuffer(b"".join(self._index), "V32")
        records["slot"] = [e.slot for e in self._index.values()]
        records["crc"] = [e.crc for e in self._index.values()]
        encoded = json.dumps(header).encode()
        raw = INDEX_MAGIC + len(encoded).to_bytes(4, "little") + encoded + records.tobytes()
        raw += zlib.crc32(raw).to_bytes(4, "little")
        temporary = self.index_path.with_name(INDEX_NAME + ".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.index_path)
        directory = os.open(self.index_path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
        return len(self._index)

    # -- the index ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[bytes]:
        """The cached hashes, least recently used first."""
        return list(self._index)

    def remove(self, block_hash: bytes) -> bool:
        """Drops a block; False if the tier did not hold it."""
        self._check_open()
        entry = self._index.pop(_check_hash(block_hash), None)
        if entry is None:
            return False
        self._free_slots.append(entry.slot)
        self._event(BlockRemoved, [block_hash])
        return True

    def clear(self) -> int:
        """Drops every block (after the pool's cache was reset: their KV is stale); one
        ``BlockRemoved`` for them. Returns how many."""
        self._check_open()
        keys = list(self._index)
        self._index.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        if keys:
            self._event(BlockRemoved, keys)
        return len(keys)

    def check_invariants(self) -> None:
        """Raises AssertionError unless every slot is either free or holds exactly one cached
        block: cached + free == capacity, no slot twice."""
        slots = [e.slot for e in self._index.values()]
        assert len(slots) + len(self._free_slots) == self.capacity, (
            f"{len(slots)} cached + {len(self._free_slots)} free != {self.capacity} slots"
        )
        assert len(set(slots) | set(self._free_slots)) == self.capacity, "a slot is held twice"
        assert all(0 <= s < self.capacity for s in slots + self._free_slots)

    # -- moves -------------------------------------------------------------------------------
    def put(self, pool: Pool, block_ids: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Stores the pool's blocks under their hashes (blocks already held are only made most
        recently used); evicts least recently used blocks past the capacity. Returns how many
        were written. The caller keeps the blocks unchanged until the call returns."""
        ids, keys = self._args(pool, block_ids, hashes)
        return self._store(pool, ids, keys)

    def put_staged(self, stage: EvictionStage) -> int:
        """Stores every block ``stage`` (a pool's ``eviction_stage``) holds under its hash,
        oldest eviction first, as ``put`` does, then gives the slots back to the stage (also
        when the write fails) under the take id: another thread's ``release`` cannot free
        them while NIXL writes them from the stage's memory. Returns how many were written."""
        self._check_open()
        if not isinstance(stage, EvictionStage):
            raise TypeError(f"stage must be an EvictionStage, got {type(stage).__name__}")
        if stage.block_bytes != self.block_bytes:
            raise InvalidArgumentError(
                f"the stage's blocks are {stage.block_bytes} bytes, the tier's {self.block_bytes}"
            )
        taken = stage.take()
        slots = [int(s) for s in taken.slots]
        if not slots:
            return 0
        try:
            return self._store(stage, slots, list(taken.block_hashes))
        finally:
            stage.release(taken.take_id, slots)

    def _store(self, source: Pool | EvictionStage, ids: list[int], keys: list[bytes]) -> int:
        """``put`` of checked blocks ``ids`` of ``source`` (a pool's blocks or a stage's slots)."""
        new: list[tuple[int, bytes]] = []
        seen: set[bytes] = set()
        for block_id, key in zip(ids, keys, strict=True):
            if key in self._index:
                self._index.move_to_end(key)
            elif key not in seen:
                seen.add(key)
                new.append((block_id, key))
        new = new[-self.capacity :]  # more than fit: the last ones are the most recent
        if not new:
            return 0
        victims: list[bytes] = []
        if len(self._free_slots) < len(new):  # the least recently used make room (one pass)
            victims = list(islice(self._index, len(new) - len(self._free_slots)))
            for key in victims:
                self._free_slots.append(self._index.pop(key).slot)
        if victims:
            self.stats["evicted"] += len(victims)
            self._event(BlockRemoved, victims)
        self._free_slots.sort(reverse=True)  # lowest slots first: runs stay contiguous
        slots = [self._free_slots.pop() for _ in new]
        pairs = [(block_id, slot) for (block_id, _), slot in zip(new, slots, strict=True)]
        new_ids = [block_id for block_id, _ in new]
        crcs: list[int] = []

        def checksums() -> None:  # after the post (computed in Rust, the GIL released)
            crcs.extend(_checksums(source, new_ids))

        # A large write's checksums run on the worker beside NIXL's copy (a buffered one is
        # done within the call that posts it, so only another thread overlaps them).
        beside = (
            self._worker().submit(_checksums, source, new_ids)
            if len(new) * self.block_bytes >= OVERLAP_MIN_BYTES
            else None
        )
        try:
            self._move(source, pairs, "WRITE", during=None if beside else checksums)
        except TransferError:
            self._free_slots.extend(slots)
            raise
        finally:
            if beside is not None:  # the worker reads the blocks: never return before it ends
                wait_futures([beside])
        if beside is not None:
            crcs = beside.result()
        for (_, key), slot, crc in zip(new, slots, crcs, strict=True):
            self._index[key] = _Entry(slot, crc)
        self.stats["stored"] += len(new)
        self._event(BlockStored, [key for _, key in new])
        return len(new)

    def get(self, pool: Pool, block_ids: Sequence[int], hashes: Sequence[bytes]) -> list[bool]:
        """Reads the blocks held under ``hashes`` into the pool's ``block_ids``; per block, True
        for a hit (the bytes verified against their checksum), False for a miss: not held, or
        found corrupt or cut short (then dropped from the tier). A missed block's bytes are
        unspecified. Hits become the most recently used."""
        ids, keys = self._args(pool, block_ids, hashes)
        hits = [False] * len(keys)
        wanted = [(i, self._index[k]) for i, k in enumerate(keys) if k in self._index]
        size = os.fstat(self._fd).st_size
        readable = []
        bad: list[bytes] = []
        for i, entry in wanted:
            if (entry.slot + 1) * self.block_bytes <= size:
                readable.append((i, entry))
            else:
                bad.append(keys[i])  # the file was cut short under this block
        # Chunk k+1 is read while chunk k is checked: on the worker beside NIXL's copy for a
        # large read, else after posting k+1 (an O_DIRECT read runs while the checksums do).
        chunk_bytes = min(
            READ_CHUNK_BYTES,
            max(MIN_READ_CHUNK_BYTES, len(readable) * self.block_bytes // READ_CHUNKS),
        )
        beside = len(readable) * self.block_bytes >= OVERLAP_MIN_BYTES
        if not beside and not self.direct:
            # A buffered READ is copied within its post: on one thread, chunks overlap nothing.
            chunk_bytes = max(1, len(readable)) * self.block_bytes
        per_chunk = max(1, chunk_bytes // self.block_bytes)
        chunks = [readable[k : k + per_chunk] for k in range(0, len(readable), per_chunk)]
        checked: list[tuple[list[tuple[int, _Entry]], Any]] = []
        pending = (
            self._post(pool, [(ids[i], e.slot) for i, e in chunks[0]], "READ") if chunks else None
        )
        try:
            for k, chunk in enumerate(chunks):
                failed = self._finish(pending)
                pending = None
                landed = chunk
                if failed is not None:  # salvage what reads alone (one block's range may be short)
                    landed = []
                    for i, entry in chunk:
                        if self._finish(self._post(pool, [(ids[i], entry.slot)], "READ")) is None:
                            landed.append((i, entry))
                        else:
                            bad.append(keys[i])
                landed_ids = [ids[i] for i, _ in landed]
                nxt = chunks[k + 1] if k + 1 < len(chunks) else None
                if beside and landed and nxt is None:
                    # The last chunk: nothing is left to read beside its checksums, so this
                    # thread takes half of them (the wait after the last read halves).
                    half = len(landed) // 2
                    if half:
                        worker = self._worker()
                        checked.append(
                            (landed[:half], worker.submit(_checksums, pool, landed_ids[:half]))
                        )
                    checked.append((landed[half:], _checksums(pool, landed_ids[half:])))
                elif beside and landed:
                    checked.append((landed, self._worker().submit(_checksums, pool, landed_ids)))
                if nxt:
                    pending = self._post(pool, [(ids[i], e.slot) for i, e in nxt], "READ")
                if not beside and landed:
                    checked.append((landed, _checksums(pool, landed_ids)))
        finally:
            # The worker reads the pool's blocks, NIXL writes them: neither outlives the call.
            wait_futures([sums for _, sums in checked if isinstance(sums, Future)])
            if pending is not None:
                self._finish(pending)
        for landed, sums in checked:
            if isinstance(sums, Future):
                sums = sums.result()
            for (i, entry), crc in zip(landed, sums, strict=True):
                if crc == entry.crc:
                    hits[i] = True
                    self._index.move_to_end(keys[i])
                else:
                    bad.append(keys[i])
        if bad:
            bad = list(dict.fromkeys(bad))
            for key in bad:
                self._free_slots.append(self._index.pop(key).slot)
            self.stats["corrupt"] += len(bad)
            self._event(BlockRemoved, bad)
        self.stats["hits"] += sum(hits)
        self.stats["misses"] += len(hits) - sum(hits)
        return hits

    # -- events ------------------------------------------------------------------------------
    def take_kv_events(self) -> list[BlockStored | BlockRemoved]:
        """This tier's events since the last call, oldest first (``seq`` from 1; a gap means
        the queue was full and dropped its oldest)."""
        events, self._events = self._events, []
        return events

    def _event(self, kind: type, keys: list[bytes]) -> None:
        self._seq += 1
        if kind is BlockStored:
            event: Any = BlockStored(
                keys, None, [], self.layout.block_size, None, MEDIUM, 0, self._seq
            )
        else:
            event = BlockRemoved(keys, MEDIUM, 0, self._seq)
        self._events.append(event)
        if len(self._events) > self._max_events:
            del self._events[0]  # bounded: the oldest goes, and its seq leaves a gap

    # -- NIXL --------------------------------------------------------------------------------
    def _args(
        self, pool: Pool, block_ids: Sequence[int], hashes: Sequence[bytes]
    ) -> tuple[list[int], list[bytes]]:
        self._check_open()
        if not isinstance(pool, Pool):
            raise TypeError(f"pool must be a kvpool.Pool, got {type(pool).__name__}")
        if str(pool.device) != "host":
            raise InvalidArgumentError(
                f"the disk tier moves host pools' blocks (the host tier's), not {pool.device}"
            )
        if pool.layout.block_bytes != self.block_bytes:
            raise InvalidArgumentError(
                f"the pool's blocks are {pool.layout.block_bytes} bytes, the tier's "
                f"{self.block_bytes}"
            )
        if self.direct and pool.base_ptr % DIRECT_ALIGN:
            raise InvalidArgumentError(
                f"direct I/O needs a pool slab aligned to {DIRECT_ALIGN} bytes; this one starts "
                f"at {pool.base_ptr:#x} (make the pool with Pool.from_external over aligned "
                "memory, or the tier with direct=False)"
            )
        ids = _as_list(block_ids, "block_ids")
        # Plain ints in range and 32-byte bytes pass in one sweep each; anything else is
        # checked one by one, so the error names the first bad value.
        if not (
            all(type(b) is int for b in ids)
            and (not ids or 0 <= min(ids) <= max(ids) < pool.num_blocks)
        ):
            ids = [_check_id(b, pool.num_blocks) for b in ids]
        keys = _as_list(hashes, "hashes")
        if not all(type(h) is bytes and len(h) == HASH_BYTES for h in keys):
            keys = [_check_hash(h) for h in keys]
        if len(ids) != len(keys):
            raise InvalidArgumentError(f"{len(ids)} block ids for {len(keys)} hashes")
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("block_ids repeat a block")
        return ids, keys

    def _register(self, source: Pool | EvictionStage) -> None:
        if source.base_ptr not in self._pool_regs:
            extent = source.num_blocks if isinstance(source, Pool) else source.num_slots
            registration = self._agent.register_memory(
                [(source.base_ptr, extent * self.block_bytes, 0, "")], "DRAM"
            )
            self._pool_regs[source.base_ptr] = (source, registration)  # kept alive

    def _move(
        self,
        source: Pool | EvictionStage,
        pairs: list[tuple[int, int]],
        op: str,
        during: Any = None,
    ) -> None:
        """One NIXL transfer of (block or slot, file slot) pairs, runs coalesced; ``during``
        runs while it is in flight. Raises TransferError if NIXL fails."""
        pending = self._post(source, pairs, op)
        if during is not None:
            during()
        failed = self._finish(pending)
        if failed is not None:
            raise failed

    def _post(self, source: Pool | EvictionStage, pairs: list[tuple[int, int]], op: str) -> Any:
        """Starts one NIXL transfer; returns what ``_finish`` takes."""
        if not pairs:
            return None
        self._register(source)
        bb, base = self.block_bytes, source.base_ptr
        # Runs contiguous in both the source and the file, found without a loop per block.
        flat = np.fromiter(chain.from_iterable(pairs), np.int64, 2 * len(pairs))
        blocks, slots = flat[0::2], flat[1::2]
        breaks = np.flatnonzero((np.diff(blocks) != 1) | (np.diff(slots) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        run_bytes = (np.diff(np.concatenate((starts, [len(pairs)]))) * bb).tolist()
        local = list(zip((base + blocks[starts] * bb).tolist(), run_bytes, repeat(0)))
        remote = list(zip((slots[starts] * bb).tolist(), run_bytes, repeat(self._fd)))
        self.descriptor_counts.append(len(local))
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "FILE"),
                self._agent_name,
            )
        except Exception as e:  # NIXL's errors are plain Exceptions
            return TransferError(f"NIXL could not prepare the disk {op}: {e}")
        try:
            return (handle, op, agent.transfer(handle))
        except Exception as e:
            self._release(handle)
            return TransferError(f"the disk {op} failed: {type(e).__name__}: {e}")

    def _finish(self, pending: Any) -> TransferError | None:
        """Waits for a transfer ``_post`` started; None once it is done, else the error."""
        if pending is None or isinstance(pending, TransferError):
            return pending
        handle, op, state = pending
        try:
            spin_until = time.perf_counter() + _SPIN_S
            while state == "PROC":
                state = self._agent.check_xfer_state(handle)
                # Spin first: a small I/O ends in microseconds, and a sleep (even of 0 s, on a
                # busy machine) gives the core away for far longer.
                if state == "PROC" and time.perf_counter() > spin_until:
                    time.sleep(_POLL_S)
            if state != "DONE":
                return TransferError(f"the disk {op} failed (NIXL state {state})")
            return None
        except Exception as e:
            return TransferError(f"the disk {op} failed: {type(e).__name__}: {e}")
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass  # a failed transfer's handle: NIXL has already given it up

    def _worker(self) -> ThreadPoolExecutor:
        """The thread that computes a large move's checksums beside NIXL's copy (made at the
        first such move, joined by ``close``)."""
        if self._checksum_worker is None:
            self._checksum_worker = ThreadPoolExecutor(1, thread_name_prefix="kvpool-disk-crc")
        return self._checksum_worker

    # -- teardown ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the disk tier is closed")

    def close(self) -> None:
        """Releases NIXL's registrations and the file; idempotent. A persistent tier first
        writes its index (``flush``; if that fails, the tier is still released and the error
        raised); any other tier's blocks are gone."""
        if self._closed:
            return
        try:
            if self.persistent:
                self.flush()
        finally:
            self._release_all()

    def _release_all(self) -> None:
        self._closed = True
        if self._checksum_worker is not None:
            self._checksum_worker.shutdown(wait=True)
            self._checksum_worker = None
        for _, registration in self._pool_regs.values():
            self._agent.deregister_memory(registration)
        self._pool_regs.clear()
        self._agent.deregister_memory(self._file_reg)
        # The agent goes now, not when this object is collected: its POSIX backend holds an
        # AIO context (256 of the kernel's fs.aio-max-nr events), and a closed tier kept
        # alive would hold it for good (256 closed tiers exhausted the default 65536 here).
        self._agent = None
        os.close(self._fd)
        self._index.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checksums(source: Pool | EvictionStage, ids: list[int]) -> list[int]:
    """The CRC-32C of blocks of a pool or slots of a stage (computed in Rust, the GIL
    released), as Python ints."""
    if isinstance(source, Pool):
        return source.block_checksums(ids).tolist()  # type: ignore[no-any-return]
    return source.checksums(ids).tolist()  # type: ignore[no-any-return]


def _as_list(values: Iterable[Any], what: str) -> list[Any]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be a sequence, got {type(values).__name__}")
    return list(values)


def _check_id(value: Any, num_blocks: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"a block id must be an int, got {type(value).__name__}")
    block_id = int(value)
    if not 0 <= block_id < num_blocks:
        raise InvalidArgumentError(f"block id {block_id} is outside the pool's {num_blocks}")
    return block_id


def _check_hash(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"a block hash must be bytes, got {type(value).__name__}")
    if len(value) != HASH_BYTES:
        raise InvalidArgumentError(f"a block hash is {HASH_BYTES} bytes, got {len(value)}")
    return value
