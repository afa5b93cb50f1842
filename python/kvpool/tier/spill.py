"""A pool's prefix cache over a disk tier: what the core evicts reaches the disk, and a later
request reads it back by hash.

Blocks reach the disk two ways:

- **Evictions** (always): ``PrefixDiskCache`` attaches the pool's eviction stage
  (``Pool.attach_eviction_stage``), so every cached block the core drops from its last
  in-memory tier (the pool's host tier, if it has one, else the pool) is copied with its hash
  into a stage slot before its memory is reused. Each call of this object first writes what
  the stage holds to the disk tier (``DiskTier.put_staged``); ``write_evicted`` does it alone.
  A stage that fills between two calls overwrites its oldest blocks (counted in
  ``stage.stats()["dropped"]``): those blocks are lost to the disk, never wrong.
- **Write-through on release** (``write_through=True``, the default): ``free(request_id)``
  also writes the request's full blocks under the hashes its ``BlockStored`` events gave (as
  vLLM's offloading connector stores a finished request); an eviction of a block already on
  disk then only refreshes it there. With ``write_through=False`` the disk takes blocks only
  as the core evicts them (fewer writes; a block never evicted is never written).

``add_request`` adds the request as ``BlockTables.add_request`` does; for the full prompt
blocks after the pool's hits it reads the disk tier into the request's fresh blocks and
returns how many leading tokens now hold their KV: the pool's hits, then the disk's leading
hits (a block that fails its checksum, and everything after it, is computed as usual).

Events: the pool's events are drained by this object; the disk tier's (medium "disk") are
appended to the pool's queue as they happen (``Pool.append_kv_event``, numbered by the core;
those of blocks a persistent tier reloaded at open, when this object is made),
so ``take_kv_events`` is one ordered stream and ``pool.kv_cache_snapshot()`` lists the
disk-resident blocks too. ``reset_prefix_cache`` resets the pool and empties the disk (one
``AllBlocksCleared`` covers both); a reset of the pool alone leaves stale blocks on disk.
Write-through applies to requests whose chain this object saw from its first block (added
through it, with no events dropped for a full queue). Only plain (uniform) host pools.

Disk failures: the disk is a cache below the pool, so a disk write that fails (NIXL's
``TransferError``) never fails the call that made it. ``add_request``, ``append_tokens`` and
``free`` do their work on the tables in full and return as usual; the failed write is counted
in ``disk_write_failures`` and kept in ``last_disk_error``, and the blocks it was writing are
lost to the disk (never to the pool: the stage's slots are given back, the pool's blocks stay
where the tables put them). ``free`` frees the request whatever happens on the disk, also when
it raises (a closed tier). ``write_evicted``, called directly, raises. A closed tier makes
``add_request`` and ``append_tokens`` raise before they change anything. A read that fails is
a miss (``DiskTier.get``).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from kvpool._core import (
    BlockStored,
    BlockTables,
    EvictionStage,
    InvalidArgumentError,
    TransferError,
)
from kvpool.tier.disk import DiskTier

# The default stage: the pool's blocks, at most 1024 and at most 256 MiB of them (at least
# one). The stage's memory is committed when it is attached (zeroed), so large blocks get
# fewer slots: 5 MiB blocks get 51, not 5 GiB.
DEFAULT_STAGE_SLOTS = 1024
DEFAULT_STAGE_BYTES = 256 << 20


def default_stage_slots(num_blocks: int, block_bytes: int) -> int:
    """The slots of a stage ``PrefixDiskCache`` attaches when given no ``stage_slots``."""
    return max(1, min(num_blocks, DEFAULT_STAGE_SLOTS, DEFAULT_STAGE_BYTES // block_bytes))


class PrefixDiskCache:
    """``tables`` (over a host pool with prefix caching) with ``tier`` below its cache; see the
    module docstring. ``stage_slots`` sizes the pool's eviction stage if the pool has none yet
    (default: the pool's blocks, at most 1024 and at most 256 MiB of them,
    ``default_stage_slots``); a pool that has one keeps it, and a ``stage_slots`` other than
    its size is ``InvalidArgumentError``. Every check is made before the stage is attached:
    a refused call changes nothing."""

    def __init__(
        self,
        tables: BlockTables,
        tier: DiskTier,
        *,
        write_through: bool = True,
        stage_slots: int | None = None,
    ) -> None:
        if not isinstance(tables, BlockTables):
            raise TypeError(f"tables must be a BlockTables, got {type(tables).__name__}")
        if not isinstance(tier, DiskTier):
            raise TypeError(f"tier must be a DiskTier, got {type(tier).__name__}")
        if not tables.pool.prefix_caching:
            raise InvalidArgumentError("the pool has no prefix cache (enable_prefix_caching)")
        if not isinstance(write_through, bool):
            raise TypeError(f"write_through must be a bool, got {type(write_through).__name__}")
        pool = tables.pool
        if tier.block_bytes != pool.layout.block_bytes:
            raise InvalidArgumentError(
                f"the pool's blocks are {pool.layout.block_bytes} bytes, the tier's "
                f"{tier.block_bytes}"
            )
        tier._check_open()
        stage = pool.eviction_stage
        if stage is None:
            slots = (
                default_stage_slots(pool.num_blocks, pool.layout.block_bytes)
                if stage_slots is None
                else stage_slots
            )
            stage = pool.attach_eviction_stage(slots)
        elif stage_slots is not None and stage_slots != stage.num_slots:
            raise InvalidArgumentError(
                f"the pool already has an eviction stage of {stage.num_slots} slots, not "
                f"{stage_slots} (a pool has one stage)"
            )
        self.stage: EvictionStage = stage
        self.tables, self.tier, self.pool = tables, tier, pool
        self.write_through = write_through
        self.pool.enable_kv_cache_events()
        self._parents: dict[bytes, bytes | None] = {}  # every stored hash seen -> its parent
        self._chains: dict[int, list[bytes]] = {}  # request -> its full blocks' hashes
        self._events: list[Any] = []  # the pool's, for take_kv_events
        self.disk_hit_blocks = 0
        self.disk_write_failures = 0  # disk writes that failed (see the module docstring)
        self.last_disk_error: TransferError | None = None
        # A persistent tier reopened over an old directory reported its reloaded blocks
        # (BlockStored, medium "disk"): they join the pool's stream and snapshot now.
        self._forward_tier_events()

    def _stored(self) -> list[bytes]:
        """The hashes of blocks stored since the last look, in order (events kept)."""
        events = self.pool.take_kv_events()
        self._events.extend(events)
        new: list[bytes] = []
        for event in events:
            if isinstance(event, BlockStored) and event.token_ids:  # the pool's own stores
                parent = event.parent_block_hash
                for block_hash in event.block_hashes:
                    self._parents[block_hash] = parent
                    parent = block_hash
                    new.append(block_hash)
        return new

    def add_request(
        self, request_id: int, token_ids: Iterable[int], **keys: Any
    ) -> tuple[Any, int]:
        """``BlockTables.add_request``, then the disk tier for the blocks after the pool's
        hits. Returns (the tables' AddResult, tokens whose KV is now in place)."""
        self.tier._check_open()  # a closed tier fails here, before the tables change
        self._stored()  # earlier events are not this request's
        result = self.tables.add_request(request_id, token_ids, **keys)
        new = self._stored()
        self._write_evicted_or_count()  # what this allocation evicted, before the lookup
        block_size = self.pool.layout.block_size
        first_new = result.num_cached_tokens // block_size
        blocks = self.tables.blocks(request_id)
        # `new` holds the blocks this call stored, in prompt order: the ones swapped in from
        # the host tier (counted in num_cached_tokens already), then the fresh full ones.
        # Their place in the prompt comes from the parent chain, never from counting.
        before = self._ancestors(new[0]) if new else None
        chained = all(self._parents[b] == a for a, b in pairwise(new))
        fresh: list[bytes] = []
        if before is not None and chained:
            self._chains[request_id] = before + new
            if len(before) <= first_new:
                fresh = new[first_new - len(before) :]
        # With no new full block (every one a pool hit) the chain is not known here: its blocks
        # were written by the request that stored them, and this one writes nothing.
        ready = result.num_cached_tokens
        lead = 0
        while lead < len(fresh) and fresh[lead] in self.tier:
            lead += 1
        if lead:
            hits = self.tier.get(
                self.pool, [int(b) for b in blocks[first_new : first_new + lead]], fresh[:lead]
            )
            lead = hits.index(False) if False in hits else lead
            self.disk_hit_blocks += lead
            ready += lead * block_size
            self._forward_tier_events()  # corrupt blocks left the tier
        return result, ready

    def _ancestors(self, block_hash: bytes) -> list[bytes] | None:
        """The hashes before ``block_hash`` in its chain, first block first; None if one of
        them was never seen."""
        chain: list[bytes] = []
        parent = self._parents.get(block_hash)
        while parent is not None:
            chain.append(parent)
            if parent not in self._parents or len(chain) > len(self._parents):
                return None
            parent = self._parents[parent]
        return chain[::-1]

    def append_tokens(self, request_id: int, n: int, token_ids: Iterable[int]) -> Any:
        """``BlockTables.append_tokens``; the blocks it fills join the request's chain."""
        self.tier._check_open()
        self._stored()
        out = self.tables.append_tokens(request_id, n, token_ids)
        new = self._stored()
        self._write_evicted_or_count()
        chain = self._chains.get(request_id)
        if chain is not None and new:
            if self._parents[new[0]] == (chain[-1] if chain else None):
                chain.extend(new)
            else:
                del self._chains[request_id]  # not the chain seen: write nothing of it
        return out

    def free(self, request_id: int) -> int:
        """Frees the request; with write-through, first writes its full blocks to the disk
        tier. Returns how many blocks were written (held ones are only refreshed). The request
        is freed whatever the disk does (a failed write is counted, see the module
        docstring); its chain is forgotten only once the write is over."""
        written = 0
        try:
            written += self._write_evicted_or_count()
            chain = self._chains.get(request_id)
            if chain and self.write_through:
                blocks = self.tables.blocks(request_id)
                ids = [int(b) for b in blocks[: len(chain)]]
                try:
                    written += self.tier.put(self.pool, ids, chain)
                except TransferError as e:
                    self._count_failure(e)
                finally:
                    self._forward_tier_events()  # blocks it evicted from the disk left it
        finally:
            self._chains.pop(request_id, None)
            self.tables.free(request_id)
        return written

    def write_evicted(self) -> int:
        """Writes what the eviction stage holds (blocks the core evicted since the last call)
        to the disk tier; returns how many blocks were written. A failed write raises
        ``TransferError``; its blocks are lost to the disk and the stage's slots given back."""
        try:
            return self.tier.put_staged(self.stage)
        finally:
            self._forward_tier_events()

    def _write_evicted_or_count(self) -> int:
        """``write_evicted`` for the calls whose work is done: a failed write is counted."""
        try:
            return self.write_evicted()
        except TransferError as e:
            self._count_failure(e)
            return 0

    def _count_failure(self, error: TransferError) -> None:
        self.disk_write_failures += 1
        self.last_disk_error = error

    def reset_prefix_cache(self) -> int:
        """Resets the pool's prefix cache (``Pool.reset_prefix_cache``: raises, changing
        nothing, while a cached block is referenced) and empties the disk tier, whose blocks
        are as stale; the pool's one ``AllBlocksCleared`` covers both. Returns the pool's
        count."""
        self._forward_tier_events()
        dropped = self.pool.reset_prefix_cache()
        self.tier.clear()
        self.tier.take_kv_events()  # covered by AllBlocksCleared
        self._chains.clear()
        return dropped

    def _forward_tier_events(self) -> None:
        """Appends the disk tier's events to the pool's queue, in order."""
        for event in self.tier.take_kv_events():
            self.pool.append_kv_event(event)

    def block_hashes(self, request_id: int) -> list[bytes] | None:
        """The hashes of the request's full blocks, in order, if this object saw its chain."""
        chain = self._chains.get(request_id)
        return None if chain is None else list(chain)

    def take_kv_events(self) -> list[Any]:
        """The pool's events since the last call, the disk tier's among them (medium "disk"),
        in the order the pool numbered them."""
        self._forward_tier_events()
        self._stored()
        events, self._events = self._events, []
        return events
