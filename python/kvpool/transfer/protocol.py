"""The KV transfer protocol: a sender moves one request's blocks into a receiver's pool.

    sender                                   receiver
    offer {request_id, num_tokens, layout,   -> check layout (refuse on mismatch),
           src_ids, mode, chunk_blocks}         tables.add(request_id, num_tokens)
                                                (refuse if that fails: nothing changed)
                                          <- accept {dst_ids, mode} | refuse {reason}
    data phase: gather + send per piece  ==  receive + scatter per piece (movers.py)
    handle.wait(): free the sender's         handle.wait(): the request is ready; on a dead
    blocks once its sends completed          peer or a timeout, abort and free its blocks

Nothing moves before the receiver has accepted, and a refusal or failure leaves both pools
consistent: the receiver frees what it allocated, the sender keeps its blocks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvpool._core import BlockTables, KvError, KvLayout, TransferError
from kvpool.transfer.movers import make_mover
from kvpool.transfer.pieces import AUTO, MODES, plan_pieces, resolve_mode
from kvpool.transfer.transport import PeerGone, Transport

PROTOCOL_VERSION = 1
DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.0005


def layout_fingerprint(layout: KvLayout) -> dict:
    """What two pools must share for a block to mean the same bytes on both."""
    return {
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "block_size": layout.block_size,
        "dtype": layout.dtype,
        "block_bytes": layout.block_bytes,
    }


def layout_mismatch(sender: dict, receiver: dict) -> str | None:
    """Why two fingerprints differ (every differing field), or None."""
    diffs = [
        f"{k} {sender.get(k)!r} (sender) != {receiver[k]!r} (receiver)"
        for k in receiver
        if sender.get(k) != receiver[k]
    ]
    return "layout mismatch: " + ", ".join(diffs) if diffs else None


def _error(message: str, request_id: Any = None) -> TransferError:
    err = TransferError(message)
    err.request_id = request_id
    return err


class _Endpoint:
    def __init__(self, tables: BlockTables, transport: Transport, timeout_s: float) -> None:
        self.tables = tables
        self.pool = tables.pool
        self.transport = transport
        self.timeout_s = timeout_s
        self.mover = make_mover(self.pool)

    def _control(self, what: str, request_id: Any, timeout: float | None = None) -> dict:
        try:
            return self.transport.recv_control(self.timeout_s if timeout is None else timeout)
        except (PeerGone, TimeoutError, OSError) as e:
            raise _error(f"{what}: {e}", request_id) from e


class Transfer:
    """One side of a transfer in flight. ``done()`` polls; ``wait()`` blocks until the data
    phase finished on this side (then the sender's blocks are freed, the receiver's request is
    ready) or failed (then the transport is aborted and the pools are made consistent)."""

    def __init__(
        self,
        endpoint: _Endpoint,
        request_id: int,
        completion: Any,
        on_success: Any,
        on_failure: Any,
    ) -> None:
        self._endpoint, self.request_id = endpoint, request_id
        self._completion = completion
        self._on_success, self._on_failure = on_success, on_failure
        self.state = "in_flight"  # -> "done" | "failed"

    def done(self) -> bool:
        if self.state == "in_flight" and self._completion.done():
            self.state = "done"
            self._on_success()
        return self.state == "done"

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done; raises TransferError (after cleaning up) if the peer dies or
        ``timeout`` (default: the endpoint's) passes first."""
        if self.state == "failed":
            raise _error(f"transfer of request {self.request_id} failed", self.request_id)
        limit = self._endpoint.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.done():
            # A peer that finished and closed is not a failure if this side is done too.
            if not self._endpoint.transport.peer_alive() and not self.done():
                self.fail(f"the peer died during the transfer of request {self.request_id}")
            if time.monotonic() > deadline:
                self.fail(
                    f"the transfer of request {self.request_id} did not complete within {limit} s"
                )
            time.sleep(_POLL_S)

    def fail(self, reason: str) -> None:
        """Abort the transport, wait for the queued work to end, clean up, raise."""
        self.state = "failed"
        self._endpoint.transport.abort()
        self._endpoint.mover.synchronize()
        self._on_failure()
        raise _error(reason, self.request_id)


class KvSender:
    """Sends requests of ``tables`` (over the sending pool) through ``transport``.

    mode: "staged" (gather into staging chunks of ``chunk_bytes``, one send per chunk,
    pipelined), "grouped" (one send per run of blocks contiguous on both sides, in one group;
    no staging) or "auto" (the receiver picks grouped when the blocks form at most
    ``movers.AUTO_MAX_RUNS`` such runs, staged otherwise)."""

    def __init__(
        self,
        tables: BlockTables,
        transport: Transport,
        *,
        mode: str = AUTO,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if mode not in (*MODES, AUTO):
            raise ValueError(f"mode must be one of {(*MODES, AUTO)}, got {mode!r}")
        self._ep = _Endpoint(tables, transport, timeout_s)
        self.mode = mode
        self.chunk_blocks = max(1, chunk_bytes // self._ep.pool.layout.block_bytes)

    def send(self, request_id: int, *, stream: Any = None, free_after: bool = True) -> Transfer:
        """Offers the request; once accepted, queues its data phase (reading the blocks after
        the work queued on ``stream``, the pool's stream by default) and returns the
        transfer. ``wait()`` on it frees the request's blocks here (``free_after``) once its
        sends completed. Raises TransferError, keeping the request, if the receiver refuses
        or the transport fails."""
        ep = self._ep
        ids = np.asarray(ep.tables.blocks(request_id), dtype=np.int32)
        num_tokens = ep.tables.num_tokens(request_id)
        try:
            ep.transport.send_control(
                {
                    "kind": "offer",
                    "version": PROTOCOL_VERSION,
                    "request_id": int(request_id),
                    "num_tokens": int(num_tokens),
                    "layout": layout_fingerprint(ep.pool.layout),
                    "src_ids": ids.tolist(),
                    "mode": self.mode,
                    "chunk_blocks": self.chunk_blocks,
                }
            )
        except (PeerGone, OSError) as e:
            raise _error(f"offering request {request_id}: {e}", request_id) from e
        reply = ep._control(
            f"waiting for the receiver's answer to request {request_id}", request_id
        )
        if reply.get("kind") == "refuse":
            raise _error(
                f"the receiver refused request {request_id}: {reply.get('reason')}", request_id
            )
        if reply.get("kind") != "accept" or reply.get("request_id") != int(request_id):
            raise _error(f"unexpected answer to request {request_id}: {reply}", request_id)
        dst_ids = np.asarray(reply["dst_ids"], dtype=np.int32)
        mode = reply.get("mode")
        if mode not in MODES or len(dst_ids) != len(ids):
            raise _error(
                f"unexpected answer to request {request_id}: mode {mode!r}, "
                f"{len(dst_ids)} blocks for {len(ids)}",
                request_id,
            )
        pieces = plan_pieces(mode, ids, dst_ids, self.chunk_blocks)
        stream = ep.pool.stream if stream is None else stream

        def keep() -> None:  # failure: the request stays, with its blocks
            pass

        def release() -> None:
            if free_after:
                ep.tables.free(request_id)

        try:
            completion = ep.mover.send(ep.transport, ids, pieces, mode, stream)
        except Exception as e:  # a transport or launch error: nothing is freed here
            ep.transport.abort()
            ep.mover.synchronize()
            raise _error(
                f"sending request {request_id}: {type(e).__name__}: {e}", request_id
            ) from e
        return Transfer(ep, request_id, completion, release, keep)


class KvReceiver:
    """Receives requests into ``tables`` (over the receiving pool) through ``transport``."""

    def __init__(
        self, tables: BlockTables, transport: Transport, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._ep = _Endpoint(tables, transport, timeout_s)

    def recv(self, *, stream: Any = None, timeout: float | None = None) -> Transfer:
        """Waits for the next offer, checks it, allocates the request's blocks, accepts and
        queues the data phase; work queued on ``stream`` (the pool's stream by default)
        afterwards sees the KV. Raises TransferError, with nothing allocated, on a refused
        offer (which the sender is told about) or a dead peer."""
        ep = self._ep
        offer = ep._control("waiting for an offer", None, timeout)
        # Untrusted (from the peer): tables.add validates it; a bad one refuses the offer.
        request_id: Any = offer.get("request_id")
        reason = self._check(offer)
        if reason is None:
            try:
                ep.tables.add(request_id, offer["num_tokens"])
            except (KvError, TypeError) as e:  # a TypeError: a request id of the wrong type
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            try:
                ep.transport.send_control(
                    {"kind": "refuse", "request_id": request_id, "reason": reason}
                )
            except (PeerGone, OSError):
                pass  # the sender is gone; the refusal stands anyway
            raise _error(f"refused request {request_id}: {reason}", request_id)
        dst_ids = np.asarray(ep.tables.blocks(request_id), dtype=np.int32)
        src_ids = np.asarray(offer["src_ids"], dtype=np.int32)

        def release() -> None:
            ep.tables.free(request_id)

        mode = resolve_mode(offer["mode"], src_ids, dst_ids)
        try:
            ep.transport.send_control(
                {
                    "kind": "accept",
                    "request_id": request_id,
                    "dst_ids": dst_ids.tolist(),
                    "mode": mode,
                }
            )
            pieces = plan_pieces(mode, src_ids, dst_ids, offer["chunk_blocks"])
            stream = ep.pool.stream if stream is None else stream
            completion = ep.mover.recv(ep.transport, dst_ids, pieces, mode, stream)
        except Exception as e:
            ep.transport.abort()
            ep.mover.synchronize()
            release()
            raise _error(
                f"receiving request {request_id}: {type(e).__name__}: {e}", request_id
            ) from e
        return Transfer(ep, request_id, completion, lambda: None, release)

    def _check(self, offer: dict) -> str | None:
        """Why an offer cannot be accepted, or None."""
        ep = self._ep
        if offer.get("kind") != "offer" or offer.get("version") != PROTOCOL_VERSION:
            return f"not an offer of protocol version {PROTOCOL_VERSION}: {offer.get('kind')!r}"
        mismatch = layout_mismatch(offer.get("layout", {}), layout_fingerprint(ep.pool.layout))
        if mismatch:
            return mismatch
        if offer.get("mode") not in (*MODES, AUTO):
            return f"unknown mode {offer.get('mode')!r}"
        bs = ep.pool.layout.block_size
        num_tokens, src_ids = offer.get("num_tokens"), offer.get("src_ids")
        if (
            not isinstance(num_tokens, int)
            or num_tokens < 0
            or not isinstance(src_ids, list)
            or len(src_ids) != -(-num_tokens // bs)
        ):
            return f"{len(src_ids or [])} blocks offered for {num_tokens} tokens"
        if not isinstance(offer.get("chunk_blocks"), int) or offer["chunk_blocks"] < 1:
            return "chunk_blocks must be a positive int"
        return None
