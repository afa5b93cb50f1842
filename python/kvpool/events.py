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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool._core import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

__all__ = ["encode_event_batch", "event_to_wire", "zmq_frames"]


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
