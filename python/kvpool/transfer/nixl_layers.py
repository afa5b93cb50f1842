"""Completions of NIXL transfers that progress while the caller polls them (``done()``), so a
receiver can decode while the sender is still computing: layer-by-layer READs
(``LayeredRead``) and waits for one control message (``AwaitMessage``: the receiver's
``done``, the sender's ``commit``).

Layer by layer, within the one-sided READ protocol (transfer.md):

    sender                                      receiver
    offer {..., layers_ready: k0}        --->   accept; READ layers [0, k0) of every block
    layers_ready {request_id, layers: k} --->   READ layers [landed, k) (one READ at a time;
                                                announcements that came meanwhile join it)
                                         <---   done, once the last layer landed
    (commit, for a split request)        --->   the request is ready

Layer ``l`` of a block is one contiguous range (regions.py), so a range of layers is one
descriptor per block (per (layer, K|V, token) row when heads are sliced too). A gather (a TP
shard's heads into a wider pool) with a staging buffer on this side READs the shard's blocks
whole into the buffer instead (one descriptor per block, or per run for every layer) and
scatters the rows into place after (``regions.gather_rows``, nixl_staging.py), where the
transport's ``staging_cost`` says that pays. A layer counts
as landed only once its READ completed before the deadline and, after that, the sender had
neither aborted nor closed: the same test a whole-request READ passes (nixl_transport.py).

``done()`` raises PeerGone (the sender aborted or died), TimeoutError (the deadline passed)
or TransferError (a malformed announcement); ``Transfer.done`` then gives the transfer up,
which first ``cancel``s a READ in flight, so nothing lands in blocks returned to the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvpool._core import TransferError
from kvpool.transfer.nixl_staging import RECEIVING
from kvpool.transfer.regions import RowScatter, Side, gather_rows, kv_descriptors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class AwaitMessage:
    """Completes when the peer's ``kind`` message about ``request_id`` arrives."""

    def __init__(
        self,
        transport: Any,
        request_id: int,
        kind: str,
        deadline: float,
        clock: Callable[[], float],
        late: str,
        peer: str,
    ) -> None:
        self._transport, self._request_id, self._kind = transport, request_id, kind
        self._deadline, self._clock, self._late, self._peer = deadline, clock, late, peer
        self._seen = False

    def done(self) -> bool:
        if not self._seen:
            self._seen = (
                self._transport.poll_message(self._request_id, (self._kind,), self._peer)
                is not None
            )
            if not self._seen and self._clock() >= self._deadline:
                raise TimeoutError(self._late)
        return self._seen

    def synchronize(self) -> None:
        pass


class LayeredRead:
    """The receiver's READ of a request layer by layer (see the module docstring).
    ``layers_landed`` counts the layers whose bytes are in the receiver's blocks and trusted;
    ``reads`` lists ``(first_layer, stop_layer, descriptors)`` per READ posted."""

    def __init__(
        self,
        transport: Any,
        request_id: int,
        local: Side,
        remote: Side,
        pieces: list,
        heads: tuple[int, int],
        layers_ready: int,
        commit: bool,
        deadline: float,
        clock: Callable[[], float] = time.monotonic,
        hold_done: bool = False,
    ) -> None:
        self._transport, self.request_id = transport, request_id
        # A gather leg: ``done`` is sent by ``finish`` once every leg has read (so that no
        # sender frees its part of a request another leg failed to deliver).
        self._hold_done = hold_done
        self.read_complete = False
        self._local, self._remote, self._pieces, self._heads = local, remote, pieces, heads
        self.num_layers = local.layout.num_layers
        self.layers_ready, self.layers_landed = layers_ready, 0
        self._deadline, self._clock = deadline, clock
        self._handle: Any = None
        self._reading = (0, 0)
        self._commit: AwaitMessage | None = (
            AwaitMessage(
                transport,
                request_id,
                "commit",
                deadline,
                clock,
                "the sender did not commit the request before the deadline",
                "the sender",
            )
            if commit
            else None
        )
        self._read_done = False
        self.reads: list[tuple[int, int, int]] = []
        # The READ in flight lands in the transport's staging buffer, to be scattered so.
        self._scatter: RowScatter | None = None

    def _late(self) -> TimeoutError:
        return TimeoutError(
            f"the NIXL READ was not complete before the deadline ({self.layers_landed} of "
            f"{self.num_layers} layers landed)"
        )

    def _take_announcements(self) -> None:
        while True:
            message = self._transport.poll_message(self.request_id, ("layers_ready",), "the sender")
            if message is None:
                return
            layers = message.get("layers")
            if not (_is_int(layers) and self.layers_ready <= layers <= self.num_layers):
                raise TransferError(
                    f"a bad layers_ready {layers!r} after {self.layers_ready} of "
                    f"{self.num_layers} layers"
                )
            self.layers_ready = layers

    def start(self) -> None:
        """Posts the READ of the layers ready now (the first poll does it otherwise)."""
        if self._handle is None and self.layers_landed < self.layers_ready:
            first, stop = self.layers_landed, self.layers_ready
            staged = self._staged(first, stop)
            if staged is not None:
                local, remote, self._scatter = staged
            else:
                local, remote = kv_descriptors(
                    self._local, self._remote, self._pieces, (first, stop), self._heads
                )
            self.reads.append((first, stop, len(local)))
            self._reading = (first, stop)
            try:
                self._handle, state = self._transport.post(local, remote, "READ")
            except BaseException:
                self._unstage()
                raise
            if state not in ("DONE", "PROC"):
                self._retire()
                self._unstage()
                raise self._transport._failure(f"the NIXL READ failed (state {state})")

    def _staged(self, first: int, stop: int) -> tuple[Any, Any, RowScatter] | None:
        """A gather's READ of layers ``[first, stop)`` through the transport's staging buffer
        (the sender's shard blocks whole, then scattered into this side's wider blocks), if
        the transport has one that holds them, is free, and ``staging_cost`` says it pays
        against a descriptor per (layer, K|V, token) row; else None."""
        transport = self._transport
        staging = getattr(transport, "staging", None)
        if staging is None:
            return None
        plan = gather_rows(self._local, self._remote, (first, stop), self._heads, staging.base_ptr)
        if plan is None:
            return None
        local, remote, scatter = plan
        nbytes = len(self._local.ids) * scatter.rows * scatter.row_bytes
        rows_unstaged = len(self._local.ids) * scatter.rows
        if not transport.staging_cost.worth(rows_unstaged - len(local) + 1, nbytes):
            return None
        if not staging.acquire(RECEIVING, -(-nbytes // staging.block_bytes)):
            return None
        return local, remote, scatter

    def _unstage(self) -> None:
        """Gives the staging buffer back (the READ into it has ended or was never posted)."""
        if self._scatter is not None:
            self._scatter = None
            self._transport.staging.release(RECEIVING)

    def _retire(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._transport.retire(handle)

    def _reap(self) -> bool:
        """Whether the READ in flight (if any) has ended, landing its layers."""
        if self._handle is None:
            return True
        try:
            state = self._transport.agent.check_xfer_state(self._handle)
        except Exception as e:
            self._retire()
            raise self._transport._failure(f"the NIXL READ failed: {type(e).__name__}: {e}") from e
        if state == "PROC":
            return False
        self._retire()
        try:
            if state != "DONE":
                raise self._transport._failure(f"the NIXL READ failed (state {state})")
            if self._clock() >= self._deadline:
                raise self._late()  # the sender may have given up and reused its blocks
            self._take_announcements()  # the sender neither aborted nor died meanwhile
            if self._scatter is not None:  # the trusted rows, from the buffer to the blocks
                self._transport.staging.scatter_rows(self._local.ids, self._scatter)
        finally:
            self._unstage()
        self.layers_landed = self._reading[1]
        return True

    def done(self) -> bool:
        if self._read_done:
            return self._commit is None or self._commit.done()
        if self.read_complete:
            return True  # held: ``finish`` sends done
        self._take_announcements()
        while self._reap() and self.layers_landed < self.layers_ready:
            self.start()
        if self.layers_landed < self.num_layers:
            if self._clock() >= self._deadline:
                raise self._late()
            return False
        self._transport._check_sender(self.request_id)
        self.read_complete = True
        if self._hold_done:
            return True
        return self.finish()

    def finish(self) -> bool:
        """Tells the sender its blocks were read (after every layer landed); then the request
        is ready, or once the sender commits."""
        if not self._read_done:
            self._transport._check_sender(self.request_id)
            self._transport.send_control({"kind": "done", "request_id": self.request_id})
            self._read_done = True
        return self._commit is None or self._commit.done()

    def cancel(self) -> None:
        """Ends the READ in flight (cancelled, or waited for): called before the blocks are
        returned on a failure."""
        self._retire()
        self._unstage()

    def synchronize(self) -> None:
        pass
