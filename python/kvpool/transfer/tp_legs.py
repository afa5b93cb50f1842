"""Heterogeneous tensor parallelism over NIXL: one request moved between a prefill group and a
decode group of different TP sizes, each leg a pair of pools joined by one ``NixlTransport``.

- **Gather** (``KvGatherReceiver``): the TP ranks of a prefill group each hold some of the
  model's KV heads of every block (``KvSender(..., tp=(rank, size))``); one receiver pool
  (TP-1, or a decode rank holding more heads than a prefill rank) READs every sender's head
  range into its blocks, allocated once. Each leg's offer names its rank, size and heads; the
  legs must be the same request (id, tokens) and their heads must tile the receiver's exactly,
  else every leg is refused before anything is allocated. ``done`` goes to every sender only
  once every leg has been read, so a failed leg leaves every sender its whole request.
- **Split** (``KvSplitSender``): one sender pool offers the request to each rank of a decode
  group (``KvReceiver(..., tp=(rank, size))``), each READing its head range. The offer asks
  for a ``commit``: a receiver's request lands only once the sender has heard ``done`` from
  every leg and commits; a leg that fails makes the sender abort every leg, so no decode rank
  keeps a part of a request its peers do not have.

Every leg's blocks are under one lease per pool (the request's, as for one transfer), and a
failure on any leg tells every leg (``abort``) and tears every transport down, as a failure
of a single transfer does: every pool gets its blocks back (the receivers free theirs, the
senders keep their requests). What cannot be made atomic: a sender dying between its commits
leaves the legs already committed holding their part (transfer.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpool._core import BlockTables, KvError, TransferError
from kvpool.transfer.leases import RECV, SEND, LeaseBook
from kvpool.transfer.nixl_transport import settle_source
from kvpool.transfer.offers import PROTOCOL_VERSION, Offer, decode_accept
from kvpool.transfer.pieces import GROUPED, plan_pieces
from kvpool.transfer.protocol import (
    DEFAULT_TIMEOUT_S,
    Transfer,
    _Endpoint,
    _error,
    _json_safe,
    _shard,
    polled_read,
)
from kvpool.transfer.transport import PeerGone, Transport


class Legs(Transport):
    """Several one-sided transports as one for an endpoint's teardown: a control message goes
    to every leg (best effort: each leg is tried), the peers are alive while all are."""

    one_sided = True

    def __init__(self, legs: Sequence[Any]) -> None:
        self.legs = list(legs)
        if not self.legs or not all(getattr(leg, "one_sided", False) for leg in self.legs):
            raise TransferError("a TP transfer's legs must be one-sided transports (NIXL)")

    def send_control(self, message: dict) -> None:
        failures = []
        for leg in self.legs:
            try:
                leg.send_control(message)
            except Exception as e:
                failures.append(e)
        if failures:
            raise PeerGone(f"{len(failures)} of {len(self.legs)} legs: {failures[0]}")

    def peer_alive(self) -> bool:
        return all(leg.peer_alive() for leg in self.legs)

    def abort(self) -> None:
        for leg in self.legs:
            leg.abort()

    def close(self) -> None:
        for leg in self.legs:
            leg.close()


class AllLegs:
    """The completion of every leg's: done once each is; ``then`` runs once, when they all
    are (the gather's ``done`` to every sender, the split's ``commit`` to every receiver)."""

    def __init__(self, legs: list, then: Callable[[], None] | None = None) -> None:
        self.legs, self._then = legs, then
        self._finished = False

    @property
    def layers_landed(self) -> int | None:
        landed = [getattr(leg, "layers_landed", None) for leg in self.legs]
        return None if None in landed else min(landed)  # type: ignore[type-var]

    def done(self) -> bool:
        if not self._finished:
            if not all([leg.done() for leg in self.legs]):  # noqa: C419 - poll every leg
                return False
            if self._then is not None:
                self._then()
            self._finished = True
        return True

    def cancel(self) -> None:
        for leg in self.legs:
            cancel = getattr(leg, "cancel", None)
            if cancel is not None:
                cancel()

    def synchronize(self) -> None:
        pass


def _tiling_problem(offers: list[Offer], mine: tuple[int, int]) -> str | None:
    """Why the legs' heads do not tile the receiver's heads ``mine`` exactly, or None."""
    spans = sorted(
        (max(o.tp.heads[0], mine[0]), min(o.tp.heads[1], mine[1]))  # type: ignore[union-attr]
        for o in offers
    )
    at = mine[0]
    for lo, hi in spans:
        if lo != at:
            return (
                f"tp mismatch: the legs' heads {[list(s) for s in spans]} do not tile the "
                f"receiver's heads {list(mine)} (a gap or an overlap at head {min(lo, at)})"
            )
        at = hi
    if at != mine[1]:
        return f"tp mismatch: the legs' heads stop at {at}; the receiver needs {list(mine)}"
    return None


class _MultiLegEndpoint:
    """What KvGatherReceiver and KvSplitSender share: one ``_Endpoint`` over ``tables``
    whose transport is every leg of ``transports`` together (``Legs``)."""

    def __init__(
        self,
        tables: BlockTables,
        transports: Sequence[Any],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        leases: LeaseBook | None = None,
        tp: tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(tables, BlockTables):
            raise TypeError(f"tables must be BlockTables, not {type(tables).__name__}")
        self._legs = Legs(transports)
        self._ep = _Endpoint(tables, self._legs, timeout_s, clock, leases, tp)

    @property
    def leases(self) -> LeaseBook:
        return self._ep.leases

    def check_invariants(self) -> None:
        """free + evictable + used + in_flight == total on this pool (leases.py)."""
        self._ep.leases.check_invariants()


class KvGatherReceiver(_MultiLegEndpoint):
    """Receives requests into ``tables`` (uniform ``BlockTables``; ``tp``: this pool's shard,
    the whole model's heads by default) from several senders at once, one per transport in
    ``transports``, each holding part of the heads (a prefill group of another TP size)."""

    def _refuse_all(self, messages: list, reason: str) -> None:
        for leg, message in zip(self._legs.legs, messages):
            if message is None:
                continue  # that leg sent no offer: nothing to answer
            try:
                leg.send_control(
                    {
                        "kind": "refuse",
                        "request_id": _json_safe(message.get("request_id")),
                        "reason": reason,
                    }
                )
            except Exception:
                pass  # that sender is gone; the refusal stands anyway

    def recv(self, *, timeout: float | None = None) -> Transfer:
        """Waits (``timeout``, default ``timeout_s``) for one offer per leg, checks them whole
        and together (one request; heads tiling this pool's), allocates the request once,
        accepts on every leg and starts every leg's READ (of its heads, into the same blocks).
        ``wait()`` / ``done()`` on the transfer poll every leg. Raises TransferError, nothing
        allocated and every leg that offered told why, on any refusal."""
        ep, legs = self._ep, self._legs.legs
        messages: list = [None] * len(legs)
        offers: list[Offer] = []
        reason = None
        for index, leg in enumerate(legs):
            try:
                messages[index] = leg.recv_control(ep.timeout_s if timeout is None else timeout)
            except (PeerGone, TimeoutError, OSError) as e:
                reason = f"waiting for the offer of leg {index}: {e}"
                break
            offer = ep.requests.decode(messages[index], gather=True)  # type: ignore[call-arg]
            if isinstance(offer, str):
                reason = f"leg {index}: {offer}"
                break
            assert offer.sender_layout is not None  # a uniform offer always has it
            problem = leg.source_ids_problem(offer.src_ids, offer.sender_layout.block_bytes)
            if problem is not None:
                reason = f"leg {index}: {problem}"
                break
            offers.append(offer)
        request_id: Any = messages[0].get("request_id") if isinstance(messages[0], dict) else None
        if reason is None:
            reason = self._together_problem(offers)
        dst_ids = np.empty(0, np.int32)
        if reason is None:
            try:
                dst_ids = ep.requests.add(offers[0])
            except (KvError, TypeError) as e:
                reason = f"{type(e).__name__}: {e}"
        if reason is not None:
            self._refuse_all(messages, reason)
            raise _error(f"refused request {request_id!r}: {reason}", request_id)
        return self._accept(offers, dst_ids)

    def _together_problem(self, offers: list[Offer]) -> str | None:
        first = offers[0]
        for index, offer in enumerate(offers):
            if (offer.request_id, offer.num_tokens) != (first.request_id, first.num_tokens):
                return (
                    f"leg {index} offers request {offer.request_id} of {offer.num_tokens} "
                    f"tokens, leg 0 request {first.request_id} of {first.num_tokens}"
                )
            if offer.commit:
                return f"leg {index} asks for a commit, which a gather does not take"
        return _tiling_problem(offers, _shard(self._ep).heads)

    def _accept(self, offers: list[Offer], dst_ids: np.ndarray) -> Transfer:
        ep, legs = self._ep, self._legs.legs
        request_id = offers[0].request_id

        def release() -> None:
            ep.tables.free(request_id)

        try:
            timeout_s = min([ep.timeout_s] + [o.timeout_s or ep.timeout_s for o in offers])
            lease = ep.leases.take(request_id, dst_ids, ep.clock() + timeout_s, RECV)
        except TransferError:
            release()
            raise
        reads = []
        try:
            for leg in legs:
                leg.send_control(
                    {
                        "kind": "accept",
                        "request_id": request_id,
                        "dst_ids": dst_ids.tolist(),
                        "mode": GROUPED,
                    }
                )
            for leg, offer in zip(legs, offers):
                pieces = plan_pieces(GROUPED, offer.src_ids, dst_ids, len(dst_ids) or 1)
                reads.append(
                    polled_read(ep, offer, dst_ids, pieces, lease.deadline, leg, hold_done=True)
                )
                reads[-1].start()
        except Exception as e:
            for read in reads:
                read.cancel()
            ep.give_up(lease, f"the receiver's transfer failed: {e}", release)
            raise _error(
                f"receiving request {request_id} failed: {type(e).__name__}: {e}", request_id
            ) from e

        def tell_every_sender() -> None:
            for read in reads:
                read.finish()

        return Transfer(ep, lease, AllLegs(reads, tell_every_sender), lambda: None, release)


class KvSplitSender(_MultiLegEndpoint):
    """Sends requests of ``tables`` (uniform ``BlockTables``; ``tp``: this pool's shard, the
    whole model's heads by default) to several receivers at once, one per transport in
    ``transports``, each taking its head range (a decode group of another TP size); a request
    lands on the receivers only once every one of them has read its part."""

    def send(self, request_id: int, *, stream: Any = None, free_after: bool = True) -> Transfer:
        """Offers the request on every leg; once every receiver accepted, returns the
        transfer, whose ``wait()`` / ``done()`` poll every leg for ``done``, then commit on
        every leg and free the request here (``free_after``). Raises TransferError, keeping
        the request, if any receiver refuses (those that accepted are told to abort) or a
        leg fails.

        On a CUDA pool ``send`` first waits for the work queued on ``stream`` (the pool's
        stream by default: pass the stream that wrote the KV), as ``KvSender.send`` does: the
        receivers' READs are ordered by no stream of this process."""
        ep, legs = self._ep, self._legs.legs
        described, ids = ep.requests.describe(request_id)
        offer = {
            "kind": "offer",
            "version": PROTOCOL_VERSION,
            "request_id": int(request_id),
            **described,
            "mode": GROUPED,
            "chunk_blocks": max(1, len(ids)),
            "timeout_s": ep.timeout_s,
            "commit": True,
        }
        accepted: list[Any] = []
        problem = None
        settle_source(ep.pool, stream)  # a CUDA pool's KV written before any receiver READs it
        try:
            for leg in legs:
                leg.send_control(offer)
        except (PeerGone, OSError) as e:
            problem = f"offering request {request_id}: {e}"
        for index, leg in enumerate(legs):
            if problem is not None:
                break
            try:
                reply = leg.recv_control(ep.timeout_s)
            except (PeerGone, TimeoutError, OSError) as e:
                problem = f"waiting for receiver {index}'s answer to request {request_id}: {e}"
                break
            answer = decode_accept(reply, int(request_id), len(ids))
            if isinstance(answer, str):
                problem = f"receiver {index}: {answer}"
                if not (isinstance(reply, dict) and reply.get("kind") == "refuse"):
                    accepted.append(leg)  # it may have allocated for an accept
                break
            accepted.append(leg)
        if problem is not None:
            for leg in accepted:
                try:
                    leg.send_control(
                        {"kind": "abort", "request_id": int(request_id), "reason": problem}
                    )
                except Exception:
                    pass  # that receiver is gone: it frees on the end-of-file
            raise _error(problem, request_id)
        lease = ep.leases.take(int(request_id), ids, ep.clock() + ep.timeout_s, SEND)
        waits = [
            leg.await_message(
                int(request_id),
                "done",
                lease.deadline,
                ep.clock,
                f"receiver {index} did not finish reading before the deadline",
                f"receiver {index}",
            )
            for index, leg in enumerate(legs)
        ]

        def commit_every_leg() -> None:
            for leg in legs:
                leg.send_control({"kind": "commit", "request_id": int(request_id)})

        def release() -> None:
            if free_after:
                ep.tables.free(request_id)

        return Transfer(ep, lease, AllLegs(waits, commit_every_leg), release, lambda: None)
