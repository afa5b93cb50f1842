"""The KV transfer protocol: a sender moves one request's blocks into a receiver's pool.

    sender                                   receiver
    offer {request_id, num_tokens, layout,   -> check layout (refuse on mismatch),
           src_ids, mode, chunk_blocks}         tables.add(request_id, num_tokens)
                                                (refuse if that fails: nothing changed)
    (hybrid: spec, next_query and every
     group's pages instead of layout and
     src_ids; offers.py)
                                          <- accept {dst_ids, mode} | refuse {reason}
    data phase: gather + send per piece  ==  receive + scatter per piece (movers.py)
    handle.wait(): free the sender's         handle.wait(): the request is ready; on a dead
    blocks once its sends completed          peer or a timeout, abort and free its blocks

Nothing moves before the receiver has accepted, and a refusal or failure leaves both pools
consistent: the receiver frees what it allocated, the sender keeps its blocks. The peer is
untrusted: an offer is decoded and checked whole (offers.py: `decode_offer`,
`decode_hybrid_offer`) before anything is allocated. ``BlockTables`` and ``HybridTables`` go
through the same endpoints: kinds.py gives each kind's requests as one list of page ids.
From accept on, a transfer's blocks are held by a lease (leases.py) whose deadline
(``timeout_s`` after the accept) bounds the whole data phase, a silent peer included; every
failure ends the lease, returns its blocks and tells the other side (an ``abort`` message)
before the transport is torn down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from kvpool._core import BlockTables, HybridTables, InvalidArgumentError, KvError, TransferError
from kvpool.transfer.kinds import UniformRequests, requests_of
from kvpool.transfer.leases import RECV, SEND, Lease, LeaseBook
from kvpool.transfer.movers import make_mover
from kvpool.transfer.nixl_transport import settle_source
from kvpool.transfer.offers import (  # re-exported: the protocol's messages
    PROTOCOL_VERSION,
    Offer,
    decode_accept,
    decode_hybrid_offer,
    decode_offer,
    layout_fingerprint,
    layout_mismatch,
    spec_fingerprint,
    spec_mismatch,
)
from kvpool.transfer.pieces import AUTO, GROUPED, MODES, plan_pieces, resolve_mode
from kvpool.transfer.regions import Side, TpShard, tp_shard
from kvpool.transfer.transport import PeerGone, Transport

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_TIMEOUT_S",
    "PROTOCOL_VERSION",
    "KvReceiver",
    "KvSender",
    "Offer",
    "Transfer",
    "decode_accept",
    "decode_hybrid_offer",
    "decode_offer",
    "layout_fingerprint",
    "layout_mismatch",
    "spec_fingerprint",
    "spec_mismatch",
    "wait_all",
]

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0
_POLL_S = 0.0005


def _error(message: str, request_id: Any = None) -> TransferError:
    err = TransferError(message)
    err.request_id = request_id
    return err


class _Endpoint:
    def __init__(
        self,
        tables: BlockTables | HybridTables,
        transport: Transport,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        leases: LeaseBook | None = None,
        tp: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
            raise TypeError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.tables = tables
        self.requests = requests_of(tables)  # TypeError for anything else
        if tp is not None:
            if not isinstance(self.requests, UniformRequests):
                raise TransferError("tensor-parallel head ranges move uniform BlockTables only")
            self.requests.tp = tp_shard(tables.pool.layout, tp)
        self.pool = tables.pool
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.mover = make_mover(self.pool)
        if leases is not None and leases.tables is not tables:
            raise ValueError("a shared LeaseBook must be over the same BlockTables")
        self.leases = LeaseBook(tables) if leases is None else leases
        self.transfers: dict[int, Transfer] = {}  # live ones, by request id

    def reap_expired(self) -> list[int]:
        """Gives up every live transfer past its deadline that has not completed: returns
        their request ids (their blocks returned, the peer told)."""
        reaped = []
        now = self.clock()
        for t in list(self.transfers.values()):
            try:
                finished = t.done()
            except TransferError:  # it failed while polled: given up, blocks returned
                reaped.append(t.request_id)
                continue
            if now >= t.deadline and not finished:
                t.abort("the transfer passed its deadline")
                reaped.append(t.request_id)
        return reaped

    def tell_abort(self, request_id: Any, reason: str) -> None:
        """Tells the peer that this side gave the transfer up (best effort: it may be gone)."""
        try:
            self.transport.send_control(
                {"kind": "abort", "request_id": request_id, "reason": reason}
            )
        except Exception:
            pass  # the peer is gone or the channel broke: it learns from the teardown instead

    def give_up(self, lease: Lease, reason: str, return_blocks: Callable[[], None]) -> None:
        """Ends a failed transfer on this side: tell the peer, tear the transport down, wait
        for queued work, return the blocks (exactly once)."""
        self.tell_abort(lease.request_id, reason)
        self.transport.abort()
        self.mover.synchronize()
        if self.leases.end(lease):
            return_blocks()

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
        lease: Lease,
        completion: Any,
        on_success: Callable[[], None],
        on_failure: Callable[[], None],
    ) -> None:
        self._endpoint, self.request_id = endpoint, lease.request_id
        self.lease = lease
        self._completion = completion
        self._on_success, self._on_failure = on_success, on_failure
        self.state = "in_flight"  # -> "done" | "failed"
        # A sender's layer-by-layer transfer: the layers announced so far (else None).
        self._layers_announced: int | None = None
        endpoint.transfers[self.request_id] = self

    @property
    def deadline(self) -> float:
        return self.lease.deadline

    def done(self) -> bool:
        """Whether the data phase finished on this side (polls it; a completion that
        progresses when polled, as NIXL's layer-by-layer READ, progresses here). Raises
        TransferError, after giving the transfer up, if it failed meanwhile: the peer aborted
        or died, the deadline passed, a message was malformed."""
        if self.state != "in_flight":
            return self.state == "done"
        try:
            finished = self._completion.done()
        except (PeerGone, TimeoutError, OSError, TransferError) as e:
            why = "passed its deadline" if isinstance(e, TimeoutError) else "failed"
            self.fail(f"the transfer of request {self.request_id} {why}: {e}")
        if finished:
            self.state = "done"
            self._endpoint.transfers.pop(self.request_id, None)
            if self._endpoint.leases.end(self.lease):
                self._on_success()
        return self.state == "done"

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done; raises TransferError (after cleaning up) if the peer dies, the
        transfer's deadline passes or ``timeout`` (if given) passes first."""
        if self.state == "failed":
            raise _error(f"transfer of request {self.request_id} failed", self.request_id)
        clock = self._endpoint.clock
        limit = self.deadline if timeout is None else min(self.deadline, clock() + timeout)
        while not self.done():
            # A peer that finished and closed is not a failure if this side is done too.
            if not self._endpoint.transport.peer_alive() and not self.done():
                self.fail(f"the peer died during the transfer of request {self.request_id}")
            if clock() > limit:
                self.fail(f"the transfer of request {self.request_id} passed its deadline")
            time.sleep(_POLL_S)

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Gives the transfer up unless its completion was already seen (``done()`` returned
        True): the peer is told, the transport torn down, the blocks returned (the receiver
        frees them, even if the bytes had landed; the sender keeps them). No raise."""
        if self.state == "in_flight":
            self.state = "failed"
            self._endpoint.transfers.pop(self.request_id, None)
            cancel = getattr(self._completion, "cancel", None)
            if cancel is not None:
                cancel()  # a READ in flight ends before its blocks go back to the pool
            self._endpoint.give_up(self.lease, reason, self._on_failure)

    @property
    def layers_landed(self) -> int:
        """Receiver: the layers whose bytes have landed and are trusted (every layer once
        ``done()``; a layer-by-layer transfer counts up as ``done()`` is polled)."""
        landed = getattr(self._completion, "layers_landed", None)
        if landed is None or self.state == "done":
            return self._endpoint.pool.layout.num_layers
        return int(landed)

    def layers_ready(self, layers: int) -> None:
        """Sender of a layer-by-layer transfer (``send(..., layers_ready=)``): layers
        ``[0, layers)`` of the request's blocks are written and may be read; never written again
        while the transfer lives. ``layers`` never decreases, at most ``num_layers``. Raises
        TransferError (after giving the transfer up) if it failed meanwhile; TypeError /
        InvalidArgumentError for a bad count."""
        announced = self._layers_announced
        if announced is None:
            raise TransferError("layers_ready is for a sender's layer-by-layer transfer")
        num_layers = self._endpoint.pool.layout.num_layers
        if not isinstance(layers, int) or isinstance(layers, bool):
            raise TypeError(f"layers must be an int, got {type(layers).__name__}")
        if not announced <= layers <= num_layers:
            raise InvalidArgumentError(
                f"layers must be in {announced}..{num_layers} (announced {announced}), got {layers}"
            )
        self.done()  # raises if the receiver gave up meanwhile
        if self.state != "in_flight" or layers == announced:
            return
        try:
            self._endpoint.transport.send_control(
                {"kind": "layers_ready", "request_id": self.request_id, "layers": layers}
            )
        except (PeerGone, OSError) as e:
            self.fail(f"announcing layers of request {self.request_id}: {e}")
        self._layers_announced = layers

    def fail(self, reason: str) -> NoReturn:
        """Abort the transport, wait for the queued work to end, clean up, raise."""
        self.abort(reason)
        raise _error(reason, self.request_id)


class KvSender:
    """Sends requests of ``tables`` (``BlockTables``, or ``HybridTables``: every group of a
    request moves) over the sending pool through ``transport``.

    mode: "staged" (gather into staging chunks of ``chunk_bytes``, one send per chunk,
    pipelined), "grouped" (one send per run of blocks contiguous on both sides, in one group;
    no staging) or "auto" (the receiver picks grouped when the blocks form at most
    ``movers.AUTO_MAX_RUNS`` such runs, staged otherwise). ``timeout_s`` bounds the wait for
    the receiver's answer and, from its accept on, the whole data phase (the lease's
    deadline); ``clock`` is the monotonic clock deadlines are measured on; ``leases`` a book
    shared with other endpoints over the same tables (one per pool, so its invariant sees every
    transfer), a new one by default."""

    def __init__(
        self,
        tables: BlockTables | HybridTables,
        transport: Transport,
        *,
        mode: str = AUTO,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        leases: LeaseBook | None = None,
        tp: tuple[int, int] | None = None,
    ) -> None:
        if mode not in (*MODES, AUTO):
            raise ValueError(f"mode must be one of {(*MODES, AUTO)}, got {mode!r}")
        self._ep = _Endpoint(tables, transport, timeout_s, clock, leases, tp)
        self.mode = mode
        self.chunk_blocks = max(1, chunk_bytes // self._ep.pool.block_bytes)

    @property
    def leases(self) -> LeaseBook:
        """The leases of this side's transfers in flight (shared with the other endpoints
        given the same book, so that one pool's invariant sees all of them)."""
        return self._ep.leases

    def reap_expired(self) -> list[int]:
        """Gives up the live transfers past their deadline (see ``Transfer.abort``)."""
        return self._ep.reap_expired()

    def check_invariants(self) -> None:
        """free + evictable + used + in_flight == total on the sending pool (leases.py)."""
        self._ep.leases.check_invariants()

    def send(
        self,
        request_id: int,
        *,
        stream: Any = None,
        free_after: bool = True,
        layers_ready: int | None = None,
    ) -> Transfer:
        """Offers the request; once accepted, queues its data phase (reading the blocks after
        the work queued on ``stream``, the pool's stream by default) and returns the
        transfer. ``wait()`` on it frees the request's blocks here (``free_after``) once its
        sends completed. Raises TransferError, keeping the request, if the receiver refuses
        or the transport fails (an unusable answer is answered with an abort).

        ``layers_ready`` (a one-sided transport, NIXL, and BlockTables): send layer by layer
        while the KV is still being computed. Layers ``[0, layers_ready)`` may be read now;
        announce more with ``Transfer.layers_ready(k)`` as they are written; the receiver
        READs each range as it is announced and the transfer completes when the last layer
        has landed. ``send`` returns once the receiver accepted.

        On a one-sided transport and a CUDA pool, ``send`` first waits for ``stream``'s work
        (the receiver's READ is ordered by no stream of this process); a layer announced later
        with ``layers_ready(k)`` must likewise be written (its stream synchronized) first. NIXL
        may then pack a request of scattered blocks into its staging buffer, which the offer
        names (``staged_at``; nixl_staging.py), held until this side's transfer ends."""
        ep = self._ep
        if layers_ready is not None:
            self._check_layered(layers_ready)
        described, ids = ep.requests.describe(request_id)
        if layers_ready is not None:
            described["layers_ready"] = layers_ready
        staged: dict = {}
        if getattr(ep.transport, "one_sided", False):
            # The receiver READs once it accepts, ordered by no stream here: the KV queued on
            # ``stream`` must be written first (a CUDA pool; nothing to wait for on a host one).
            settle_source(ep.pool, stream)
            stage = getattr(ep.transport, "stage_source", None)
            if stage is not None and layers_ready is None:
                # NIXL: scattered blocks packed into the transport's staging buffer, read as
                # one region (nixl_staging.py); it is held until this side's transfer ends.
                staged = stage(int(request_id), ids)
        try:
            return self._offer(request_id, described, ids, staged, stream, free_after, layers_ready)
        finally:
            if staged:
                ep.transport.unstage(int(request_id))  # type: ignore[attr-defined]

    def _offer(
        self,
        request_id: int,
        described: dict,
        ids: np.ndarray,
        staged: dict,
        stream: Any,
        free_after: bool,
        layers_ready: int | None,
    ) -> Transfer:
        """``send`` from the offer on (the source settled and, if it is, staged)."""
        ep = self._ep
        try:
            ep.transport.send_control(
                {
                    "kind": "offer",
                    "version": PROTOCOL_VERSION,
                    "request_id": int(request_id),
                    **described,
                    **staged,
                    "mode": self.mode,
                    "chunk_blocks": self.chunk_blocks,
                    "timeout_s": ep.timeout_s,
                }
            )
        except (PeerGone, OSError) as e:
            raise _error(f"offering request {request_id}: {e}", request_id) from e
        reply = ep._control(
            f"waiting for the receiver's answer to request {request_id}", request_id
        )
        answer = decode_accept(reply, int(request_id), len(ids))
        if isinstance(answer, str):
            if not (isinstance(reply, dict) and reply.get("kind") == "refuse"):
                ep.tell_abort(request_id, answer)  # it may have allocated for an accept
            raise _error(answer, request_id)
        dst_ids, mode = answer
        pieces = plan_pieces(mode, ids, dst_ids, self.chunk_blocks)
        stream = ep.pool.stream if stream is None else stream
        lease = ep.leases.take(int(request_id), ids, ep.clock() + ep.timeout_s, SEND)

        def keep() -> None:  # failure: the request stays, with its blocks
            pass

        def release() -> None:
            if free_after:
                ep.tables.free(request_id)

        try:
            if layers_ready is not None:  # polled by Transfer.done: the caller keeps computing
                completion = ep.transport.await_message(  # type: ignore[attr-defined]
                    request_id,
                    "done",
                    lease.deadline,
                    ep.clock,
                    "the receiver did not finish reading before the deadline",
                )
            elif getattr(ep.transport, "one_sided", False):  # NIXL: the receiver reads
                completion = ep.transport.serve_blocks(request_id, lease.deadline, ep.clock)  # type: ignore[attr-defined]
            else:
                completion = ep.mover.send(ep.transport, ids, pieces, mode, stream, lease.deadline)
        except Exception as e:  # a transport or launch error: nothing is freed here
            ep.give_up(lease, f"{type(e).__name__}: {e}", keep)
            raise _error(
                f"sending request {request_id}: {type(e).__name__}: {e}", request_id
            ) from e
        transfer = Transfer(ep, lease, completion, release, keep)
        if layers_ready is not None:
            transfer._layers_announced = layers_ready
        return transfer

    def _check_layered(self, layers_ready: int) -> None:
        """Refuses (before offering anything) a layer-by-layer send this side cannot make."""
        ep = self._ep
        if not isinstance(layers_ready, int) or isinstance(layers_ready, bool):
            raise TypeError(f"layers_ready must be an int, got {type(layers_ready).__name__}")
        if not isinstance(ep.requests, UniformRequests):
            raise TransferError("layer-by-layer transfer moves uniform BlockTables only")
        if not getattr(ep.transport, "one_sided", False):
            raise TransferError("layer-by-layer transfer needs a one-sided transport (NIXL)")
        if not 0 <= layers_ready <= ep.pool.layout.num_layers:
            raise InvalidArgumentError(
                f"layers_ready must be in 0..{ep.pool.layout.num_layers}, got {layers_ready}"
            )


class KvReceiver:
    """Receives requests into ``tables`` (``BlockTables``, or ``HybridTables``: every group of
    a request lands, window and chunk groups holding the live pages at the offer's
    ``next_query``) over the receiving pool through ``transport``.
    ``timeout_s`` bounds each transfer from its accept to its last byte (the lease's
    deadline): a peer that stays connected but sends nothing cannot hold blocks longer."""

    def __init__(
        self,
        tables: BlockTables | HybridTables,
        transport: Transport,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        leases: LeaseBook | None = None,
        tp: tuple[int, int] | None = None,
    ) -> None:
        self._ep = _Endpoint(tables, transport, timeout_s, clock, leases, tp)

    @property
    def leases(self) -> LeaseBook:
        """The leases of this side's transfers in flight (shared with the other endpoints
        given the same book, so that one pool's invariant sees all of them)."""
        return self._ep.leases

    def reap_expired(self) -> list[int]:
        """Gives up the live transfers past their deadline (see ``Transfer.abort``)."""
        return self._ep.reap_expired()

    def check_invariants(self) -> None:
        """free + evictable + used + in_flight == total on the receiving pool (leases.py)."""
        self._ep.leases.check_invariants()

    def recv(self, *, stream: Any = None, timeout: float | None = None) -> Transfer:
        """Waits (``timeout``, default ``timeout_s``) for the next offer, checks it whole,
        allocates the request's blocks, accepts and queues the data phase; work queued on
        ``stream`` (the pool's stream by default) afterwards sees the KV. Raises
        TransferError, with nothing allocated, on a refused or malformed offer (which the
        sender is told about), a dead or silent peer or a passed deadline."""
        ep = self._ep
        message = ep._control("waiting for an offer", None, timeout)
        offer = ep.requests.decode(message)
        request_id: Any = message.get("request_id") if isinstance(message, dict) else None
        reason = offer if isinstance(offer, str) else None
        source_problem = getattr(ep.transport, "source_ids_problem", None)
        if isinstance(offer, Offer) and source_problem is not None:
            # Ids outside the sender's registered slab (or staging buffer), or blocks of other
            # bytes than it has.
            sender_bytes = None if offer.sender_layout is None else offer.sender_layout.block_bytes
            reason = source_problem(offer.src_ids, sender_bytes, offer.staged_at)
        one_sided = getattr(ep.transport, "one_sided", False)
        if isinstance(offer, Offer) and reason is None and _polled(offer, ep) and not one_sided:
            reason = (
                "layer-by-layer, head-range and committed transfers need a one-sided "
                "transport (NIXL)"
            )
        dst_ids = np.empty(0, np.int32)
        if isinstance(offer, Offer) and reason is None:
            try:
                dst_ids = ep.requests.add(offer)
            except (KvError, TypeError) as e:
                reason = f"{type(e).__name__}: {e}"
        if reason is not None or not isinstance(offer, Offer):
            try:
                ep.transport.send_control(
                    {"kind": "refuse", "request_id": _json_safe(request_id), "reason": reason}
                )
            except Exception:
                pass  # the sender is gone; the refusal stands anyway
            raise _error(f"refused request {request_id!r}: {reason}", request_id)
        request_id = offer.request_id

        def release() -> None:
            ep.tables.free(request_id)

        try:
            timeout_s = min(ep.timeout_s, offer.timeout_s or ep.timeout_s)
            lease = ep.leases.take(request_id, dst_ids, ep.clock() + timeout_s, RECV)
        except TransferError:
            release()
            raise
        # A one-sided transport reads runs contiguous on both sides in place: no staging.
        mode = GROUPED if one_sided else resolve_mode(offer.mode, offer.src_ids, dst_ids)
        try:
            ep.transport.send_control(
                {
                    "kind": "accept",
                    "request_id": request_id,
                    "dst_ids": dst_ids.tolist(),
                    "mode": mode,
                }
            )
            pieces = plan_pieces(mode, offer.src_ids, dst_ids, offer.chunk_blocks)
            stream = ep.pool.stream if stream is None else stream
            if one_sided and _polled(offer, ep):
                completion = polled_read(ep, offer, dst_ids, pieces, lease.deadline)
                completion.start()
            elif one_sided:
                completion = ep.transport.read_blocks(  # type: ignore[attr-defined]
                    request_id,
                    offer.src_ids,
                    dst_ids,
                    pieces,
                    lease.deadline,
                    ep.clock,
                    staged_at=offer.staged_at,
                )
            else:
                completion = ep.mover.recv(
                    ep.transport, dst_ids, pieces, mode, stream, lease.deadline
                )
        except Exception as e:
            why = "passed its deadline" if isinstance(e, TimeoutError) else "failed"
            ep.give_up(lease, f"the receiver's transfer {why}: {e}", release)
            raise _error(
                f"receiving request {request_id} {why}: {type(e).__name__}: {e}", request_id
            ) from e
        return Transfer(ep, lease, completion, lambda: None, release)


def _shard(ep: _Endpoint) -> TpShard:
    tp = getattr(ep.requests, "tp", None)
    return tp or TpShard(0, 1, ep.pool.layout.num_kv_heads)


def _polled(offer: Offer, ep: _Endpoint) -> bool:
    """Whether an offer's data phase is a ``LayeredRead`` (layer by layer, a head range, or a
    request landing only on the sender's commit) rather than one whole READ."""
    return (
        offer.layers_ready is not None
        or offer.commit
        or (offer.tp is not None and offer.tp.heads != _shard(ep).heads)
    )


def polled_read(
    ep: _Endpoint,
    offer: Offer,
    dst_ids: np.ndarray,
    pieces: list,
    deadline: float,
    transport: Any = None,
    hold_done: bool = False,
) -> Any:
    """The receiver's ``LayeredRead`` of an offer's blocks: the layers ready (all unless the
    offer is layer by layer) and the heads both sides hold (the receiver's, or a gather leg's
    part of them)."""
    mine = _shard(ep)
    theirs = offer.tp or mine
    heads = (max(mine.heads[0], theirs.heads[0]), min(mine.heads[1], theirs.heads[1]))
    assert offer.sender_layout is not None  # a uniform offer always has it
    transport = ep.transport if transport is None else transport
    local = Side(ep.pool.base_ptr, ep.pool.layout, mine.first_head, dst_ids)
    remote = Side(transport.remote_base, offer.sender_layout, theirs.first_head, offer.src_ids)
    ready = ep.pool.layout.num_layers if offer.layers_ready is None else offer.layers_ready
    return transport.read_layers(
        offer.request_id,
        local,
        remote,
        pieces,
        heads,
        ready,
        offer.commit,
        deadline,
        ep.clock,
        hold_done,
    )


def wait_all(transfers: Sequence[Transfer], timeout: float | None = None) -> None:
    """Waits for several transfers polled together (one process holding several ranks'
    receivers of a split request: each completes only once the sender commits, after every
    rank has read). Raises the first failure's TransferError (that transfer cleaned up; the
    others are left to their own deadlines or the peer's abort)."""
    if not transfers:
        return
    clock = transfers[0]._endpoint.clock
    limit = None if timeout is None else clock() + timeout
    while True:
        finished = [t.done() for t in transfers]  # poll every one each round
        if all(finished):
            return
        for t in transfers:
            if t.state == "in_flight" and not t._endpoint.transport.peer_alive() and not t.done():
                t.fail(f"the peer died during the transfer of request {t.request_id}")
            if t.state == "in_flight" and clock() > min(t.deadline, limit or t.deadline):
                t.fail(f"the transfer of request {t.request_id} passed its deadline")
        time.sleep(_POLL_S)


def _json_safe(value: Any) -> Any:
    """A peer's value echoed back in a control message: kept when JSON carries it as is."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)
