"""KV events on the wire: a pool's drained events in vLLM's msgpack format.

vLLM publishes its KV-cache events over ZMQ as msgpack-encoded ``KVEventBatch`` structs
(``vllm/distributed/kv_events.py``), which cache-aware routers decode with msgspec.
``encode_event_batch`` writes a :class:`kvpool.KvEventBatch` so that such a consumer decodes
it as it decodes vLLM's own, and ``zmq_frames`` adds the frames vLLM's ``ZmqEventPublisher``
sends around it. msgpack comes from the ``events`` extra (``pip install kvpool[events]``).

The schema, from vllm-project/vllm at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34,
``vllm/distributed/kv_events.py`` (msgspec Structs, ``omit_defaults=True``):

- ``KVCacheEvent`` subclasses are tagged (``tag=True``): a map whose first key ``"type"``
  holds the class name, then the fields in declaration order; a field with a default is
  left out while it equals its default (``omit_defaults``).
- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name (all required), then extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window (default None).
- ``BlockRemoved``: block_hashes, medium (required), group_idx (default None).
- ``AllBlocksCleared``: no fields.
- ``EventBatch``/``KVEventBatch``: ts (float), events, data_parallel_rank (default None).
  Declared at that commit without ``array_like``: a map. vLLM's earlier and later sources
  declare it ``array_like=True`` (a positional array ``[ts, events, rank?]``; at
  b4e69e0af33f4698e157a262cc787fe61983cd3d the events were array-like too, with fewer
  fields), so ``batch_array_like`` picks the envelope the consumer expects; it defaults to
  the array, the form vLLM's own subscriber example decodes.

kvpool's fields map one to one, except: ``group`` is sent as ``group_idx``; ``lora_name``
is None (kvpool keys LoRA by id); block hashes are kvpool's 32-byte keyed BLAKE3 (vLLM's
``ExternalBlockHash`` is ``bytes | int``); ``seq`` is not part of vLLM's events (the batch
number travels in the ZMQ frame instead).

``HybridCacheIndex`` is the router's side for a hybrid model (``HybridTables``): it applies
a snapshot (``HybridTables.kv_cache_snapshot()``) and the pool's events per group, and
answers the hit ``HybridTables.add_request`` would find for a prompt, by the same rule
(``rust/core/src/hybrid/hybrid.md``, "Prefix caching across groups"). Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool._core import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KvCacheSnapshot,
        KvEventBatch,
        ModelKvSpec,
    )

__all__ = ["HybridCacheIndex", "encode_event_batch", "event_to_wire", "zmq_frames"]

# Tokens per hashed chunk of a hybrid model's prompts (``HASH_CHUNK_TOKENS``).
CHUNK_TOKENS = 16


def event_to_wire(event: BlockStored | BlockRemoved | AllBlocksCleared) -> dict[str, Any]:
    """One event as the msgpack map vLLM's tagged struct encodes to (keys in its order)."""
    from kvpool._core import AllBlocksCleared, BlockRemoved, BlockStored

    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": None,
            "group_idx": event.group,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": event.group,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_event_batch(
    batch: KvEventBatch,
    ts: float,
    *,
    data_parallel_rank: int | None = None,
    batch_array_like: bool = True,
) -> bytes:
    """The msgpack bytes of vLLM's ``KVEventBatch(ts, events, data_parallel_rank)`` for
    ``batch``'s events. ``ts`` is the publisher's timestamp (seconds, as ``time.time()``);
    a rank of None is left out, as ``omit_defaults`` leaves it out."""
    import msgpack  # type: ignore[import-untyped]  # no stubs published

    events = [event_to_wire(e) for e in batch.events]
    envelope: list[Any] | dict[str, Any]
    if batch_array_like:
        envelope = [float(ts), events]
        if data_parallel_rank is not None:
            envelope.append(data_parallel_rank)
    else:
        envelope = {"ts": float(ts), "events": events}
        if data_parallel_rank is not None:
            envelope["data_parallel_rank"] = data_parallel_rank
    return msgpack.packb(envelope, use_bin_type=True)


def zmq_frames(batch: KvEventBatch, payload: bytes, topic: str = "") -> tuple[bytes, bytes, bytes]:
    """The multipart message vLLM's ``ZmqEventPublisher`` sends: topic, the batch's sequence
    number as 8 big-endian bytes, the payload."""
    return topic.encode("utf-8"), batch.batch_seq.to_bytes(8, "big"), payload


class HybridCacheIndex:
    """What a hybrid model's pool caches, per group, rebuilt from its snapshot and events.

    ``load_snapshot`` replaces the state with ``HybridTables.kv_cache_snapshot()``;
    ``apply`` applies events in order, skipping those at or below the snapshot's ``seq``
    (the snapshot reflects them already). ``hit_tokens`` answers the hit
    ``HybridTables.add_request`` would find for a prompt of ``num_tokens`` tokens whose
    chunk hashes (chain hashes at 16, 32, ... tokens) are ``chunk_hashes``: the longest
    multiple of 16 below ``num_tokens`` that every group can serve, on either tier. A token
    group of ``bs`` tokens a page needs, for each page ``k`` holding a token the query at
    ``h`` sees, the chunk ending at ``min(ceil16((k + 1) * bs), h)`` (a full or MLA group: every page
    below ``h``; a window or chunked-local group: the pages of the last window or chunk
    before ``h``); a state group needs its checkpoint at ``h``.

    Exact where every token group's page holds a multiple of 16 tokens: each key of such a
    page is a chunk its events name. A page of another size is also cached under keys no
    event names (the chunk it ends on belongs to the next page), so where such a key and
    the chunk named at its boundary go separately the answer can differ.

    ``chain`` gives a prompt's chunk hashes from the tokens the pool's ``BlockStored``
    events carried (``(lora_id, parent, tokens) -> hash``, kept across removals since a
    hash never changes), as far as they were seen; a router that shares the pool's
    ``prefix_hash_key`` can hash prompts itself instead (and must, under cache salts: the
    events carry no salt).
    """

    def __init__(self, spec: ModelKvSpec) -> None:
        # Per group: None for a state group, else (tokens a page, first token the query at
        # h sees as a function of h).
        self._groups: list[tuple[int, str, int] | None] = []
        for g, group in enumerate(spec.groups):
            block_size = spec.block_size(g)
            if block_size is None:
                self._groups.append(None)
            else:
                span = group.window or group.chunk or 0
                self._groups.append((block_size, group.kind, span))
        self.seq = 0
        self.cached: dict[tuple[int, bytes], str] = {}
        self._chunks: dict[tuple[int | None, bytes | None, tuple[int, ...]], bytes] = {}

    def load_snapshot(self, snapshot: KvCacheSnapshot) -> None:
        """Replaces what is cached with ``snapshot``'s blocks, consistent with its ``seq``."""
        self.cached = {(b.group, b.block_hash): b.medium for b in snapshot.blocks}
        self.seq = snapshot.seq

    def apply(self, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Applies ``events`` in order; those numbered at or below ``seq`` are skipped."""
        from kvpool._core import AllBlocksCleared, BlockRemoved, BlockStored

        for event in events:
            if event.seq and event.seq <= self.seq:
                continue
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.cached[(event.group, h)] = event.medium
                self._learn(event)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    if self.cached.get((event.group, h)) == event.medium:
                        del self.cached[(event.group, h)]
            elif isinstance(event, AllBlocksCleared):
                self.cached.clear()
            else:
                raise TypeError(f"not a KV event: {type(event).__name__}")
            self.seq = max(self.seq, event.seq)

    def _learn(self, event: BlockStored) -> None:
        size = event.block_size
        if not event.token_ids or len(event.token_ids) != size * len(event.block_hashes):
            return
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size : (i + 1) * size])
            self._chunks[(event.lora_id, parent, tokens)] = h
            parent = h

    def chain(self, token_ids: Sequence[int], lora_id: int | None = None) -> list[bytes]:
        """The chunk hashes of ``token_ids``' whole chunks, as far as events named them."""
        hashes: list[bytes] = []
        parent: bytes | None = None
        for at in range(CHUNK_TOKENS, len(token_ids) + 1, CHUNK_TOKENS):
            chunk = tuple(int(t) for t in token_ids[at - CHUNK_TOKENS : at])
            h = self._chunks.get((lora_id, parent, chunk))
            if h is None:
                break
            hashes.append(h)
            parent = h
        return hashes

    def _serves(self, group: int, h: int, chunk_hashes: Sequence[bytes]) -> bool:
        def cached_at(boundary: int) -> bool:
            return (group, chunk_hashes[boundary // CHUNK_TOKENS - 1]) in self.cached

        rule = self._groups[group]
        if rule is None:
            return cached_at(h)
        block_size, kind, span = rule
        if kind == "sliding_window":
            first_live = max(0, h + 1 - span)
        elif kind == "chunked_local":
            first_live = h - h % span
        else:
            first_live = 0
        if first_live >= h:
            return True
        for k in range(first_live // block_size, -(-h // block_size)):
            end = (k + 1) * block_size
            boundary = -(-end // CHUNK_TOKENS) * CHUNK_TOKENS if end <= h else h
            if not cached_at(boundary):
                return False
        return True

    def hit_tokens(self, chunk_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Tokens ``HybridTables.add_request`` would find cached for this prompt."""
        max_hit = min(max(num_tokens - 1, 0) // CHUNK_TOKENS, len(chunk_hashes)) * CHUNK_TOKENS
        for h in range(max_hit, 0, -CHUNK_TOKENS):
            if all(self._serves(g, h, chunk_hashes) for g in range(len(self._groups))):
                return h
        return 0
