"""A pool's prefix cache over a disk tier, joined through the pool's KV events.

The core evicts cached blocks inside its allocator (and drops them from its own host tier)
without telling Python their ids or bytes, so the disk tier cannot catch them there. What
Python does see are the KV events: every full block a request stores is reported, in order,
with its hash and its parent's. ``PrefixDiskCache`` wraps a ``BlockTables`` and learns each
request's block hashes from them:

- ``free(request_id)`` first writes the request's full blocks to the disk tier under their
  hashes (write-through on release, as vLLM's offloading connector stores a finished
  request), then frees them into the pool's cache as usual. While the pool still holds them
  they are hits there; once it has evicted them, they are still on disk.
- ``add_request`` adds the request as ``BlockTables.add_request`` does; for the full prompt
  blocks after the pool's hits it reads the disk tier into the request's fresh blocks and
  returns how many leading tokens now hold their KV: the pool's hits, then the disk's leading
  hits (a block that fails its checksum, and everything after it, is computed as usual).

The pool's events are drained by this object; ``take_kv_events`` hands them on (then the disk
tier's, medium "disk") to whatever reads them. Requests whose chain this object did not see
from its first block (added before it, or with events dropped for a full queue) are not
written to disk. Only plain (uniform) pools, only host pools (the disk tier's).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvpool._core import BlockStored, BlockTables, InvalidArgumentError
from kvpool.tier.disk import DiskTier


class PrefixDiskCache:
    """``tables`` (over a host pool with prefix caching) with ``tier`` below its cache; see the
    module docstring."""

    def __init__(self, tables: BlockTables, tier: DiskTier) -> None:
        if not isinstance(tables, BlockTables):
            raise TypeError(f"tables must be a BlockTables, got {type(tables).__name__}")
        if not isinstance(tier, DiskTier):
            raise TypeError(f"tier must be a DiskTier, got {type(tier).__name__}")
        if not tables.pool.prefix_caching:
            raise InvalidArgumentError("the pool has no prefix cache (enable_prefix_caching)")
        self.tables, self.tier, self.pool = tables, tier, tables.pool
        self.pool.enable_kv_cache_events()
        self._parents: dict[bytes, bytes | None] = {}  # every stored hash seen -> its parent
        self._chains: dict[int, list[bytes]] = {}  # request -> its full blocks' hashes
        self._events: list[Any] = []  # the pool's, for take_kv_events
        self.disk_hit_blocks = 0

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

    def _chain_before(self, block_hash: bytes | None, count: int) -> list[bytes] | None:
        """The ``count`` hashes before (and ending at) ``block_hash``, walking parents; None
        if one was never seen."""
        chain: list[bytes] = []
        while block_hash is not None and len(chain) < count:
            chain.append(block_hash)
            if block_hash not in self._parents:
                return None
            block_hash = self._parents[block_hash]
        return chain[::-1] if len(chain) == count and block_hash is None else None

    def add_request(
        self, request_id: int, token_ids: Iterable[int], **keys: Any
    ) -> tuple[Any, int]:
        """``BlockTables.add_request``, then the disk tier for the blocks after the pool's
        hits. Returns (the tables' AddResult, tokens whose KV is now in place)."""
        self._stored()  # earlier events are not this request's
        result = self.tables.add_request(request_id, token_ids, **keys)
        new = self._stored()
        block_size = self.pool.layout.block_size
        first_new = result.num_cached_tokens // block_size
        blocks = self.tables.blocks(request_id)
        if new:
            parent = self._parents[new[0]]
            before = self._chain_before(parent, first_new) if first_new else []
            if before is not None:
                self._chains[request_id] = before + new
        # With no new full block (every one a pool hit) the chain is not known here: its blocks
        # were written by the request that stored them, and this one writes nothing.
        ready = result.num_cached_tokens
        lead = 0
        while lead < len(new) and new[lead] in self.tier:
            lead += 1
        if lead:
            hits = self.tier.get(
                self.pool, [int(b) for b in blocks[first_new : first_new + lead]], new[:lead]
            )
            lead = hits.index(False) if False in hits else lead
            self.disk_hit_blocks += lead
            ready += lead * block_size
        return result, ready

    def append_tokens(self, request_id: int, n: int, token_ids: Iterable[int]) -> Any:
        """``BlockTables.append_tokens``; the blocks it fills join the request's chain."""
        self._stored()
        out = self.tables.append_tokens(request_id, n, token_ids)
        new = self._stored()
        chain = self._chains.get(request_id)
        if chain is not None and new:
            if self._parents[new[0]] == (chain[-1] if chain else None):
                chain.extend(new)
            else:
                del self._chains[request_id]  # not the chain seen: write nothing of it
        return out

    def free(self, request_id: int) -> int:
        """Writes the request's full blocks to the disk tier, then frees the request. Returns
        how many blocks were written (held ones are only refreshed)."""
        chain = self._chains.pop(request_id, None)
        written = 0
        if chain:
            blocks = self.tables.blocks(request_id)
            written = self.tier.put(self.pool, [int(b) for b in blocks[: len(chain)]], chain)
        self.tables.free(request_id)
        return written

    def block_hashes(self, request_id: int) -> list[bytes] | None:
        """The hashes of the request's full blocks, in order, if this object saw its chain."""
        chain = self._chains.get(request_id)
        return None if chain is None else list(chain)

    def take_kv_events(self) -> list[Any]:
        """The pool's events since the last call (medium "CPU"), then the disk tier's."""
        self._stored()
        events, self._events = self._events, []
        return events + self.tier.take_kv_events()
