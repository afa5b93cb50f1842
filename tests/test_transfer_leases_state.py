"""Transfer leases under every fault at every step: a Hypothesis state machine drives a sender
and a receiver over host pools and the fake transport (a fresh pair per transfer, one lease
book per pool shared by all of them), interleaving transfers that succeed, a sender that dies
after k pieces, a sender silent after k pieces (the fake clock passes the deadline), a
malformed offer, a receiver gone before answering, aborts and passed deadlines of transfers
whose leases are still live, and frees. After every step, on both pools,
free + evictable + used + in_flight == total with every live lease covering exactly its
request's blocks (LeaseBook.check_invariants), and the model's requests are the tables'."""

from __future__ import annotations

import threading

import kvpool
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvpool.transfer import STAGED, KvReceiver, KvSender, TransferError, layout_fingerprint
from kvpool.transfer.leases import LeaseBook
from kvpool.transfer.protocol import PROTOCOL_VERSION
from kvpool.transfer.testing import fake_transport_pair

LAYOUT = kvpool.KvLayout(2, 1, 16, 4)
TIMEOUT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TransferLeases(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.src_pool = kvpool.Pool(LAYOUT, 48, device="host")
        self.dst_pool = kvpool.Pool(LAYOUT, 24, device="host")
        self.src = kvpool.BlockTables(self.src_pool, 16, 16)
        self.dst = kvpool.BlockTables(self.dst_pool, 16, 16)
        self.src_leases, self.dst_leases = LeaseBook(self.src), LeaseBook(self.dst)
        self.endpoints: list = []
        self.pending: list = []  # (send transfer, recv transfer, payload) with live leases
        self.next_rid = 0
        self.src_model: set[int] = set()
        self.dst_model: dict[int, list[np.ndarray]] = {}

    def _pair(self, fail_after_sends=None):
        a, b = fake_transport_pair(fail_after_sends, clock=self.clock)
        kw = dict(timeout_s=TIMEOUT_S, clock=self.clock)
        sender = KvSender(
            self.src,
            a,
            mode=STAGED,
            chunk_bytes=2 * self.src_pool.block_bytes,
            leases=self.src_leases,
            **kw,
        )
        receiver = KvReceiver(self.dst, b, leases=self.dst_leases, **kw)
        self.endpoints += [sender, receiver]
        return a, b, sender, receiver

    # -- what differs between uniform and hybrid tables (test_transfer_hybrid_leases.py) --
    def _payload(self, rid):
        """The request's bytes on the sender, as ``_received`` reads them on the receiver."""
        return [np.array(v[self.src.blocks(rid)]) for v in (self.src_pool.k_view(0),)]

    def _received(self, rid):
        return [np.array(self.dst_pool.k_view(0)[self.dst.blocks(rid)])]

    def _make(self, rid, num_tokens, grow):
        """Adds request ``rid`` to the sender and writes its blocks (KvError if no room)."""
        self.src.add(rid, num_tokens)
        view = self.src_pool.k_view(0)
        ids = self.src.blocks(rid)
        view[ids] = np.arange(view[ids].size, dtype=np.float32).reshape(view[ids].shape) + rid

    def _offer(self, rid, malformed):
        """A hand-played sender's offer of ``rid`` (its first id past int32 if malformed) and
        its number of blocks."""
        ids = [int(x) for x in self.src.blocks(rid)]
        offer = {
            "kind": "offer",
            "version": PROTOCOL_VERSION,
            "request_id": rid,
            "num_tokens": self.src.num_tokens(rid),
            "layout": layout_fingerprint(LAYOUT),
            "src_ids": [2**31, *ids[1:]] if malformed else ids,
            "mode": STAGED,
            "chunk_blocks": 2,
        }
        return offer, len(ids)

    def _held(self, tables):
        return set(tables.request_ids())

    @rule(num_tokens=st.integers(1, 24), grow=st.integers(0, 12))
    def add_request(self, num_tokens, grow):
        rid = self.next_rid
        self.next_rid += 1
        try:
            self._make(rid, num_tokens, grow)
        except kvpool.KvError:  # out of blocks or of sequences
            return
        self.src_model.add(rid)

    def _idle_request(self, data):
        leased = {lease.request_id for lease in self.src_leases.live()}
        # A request the sender kept after an abort but the receiver already holds would be
        # refused as a duplicate: offer only requests neither in flight nor delivered.
        idle = sorted(self.src_model - leased - set(self.dst_model))
        return data.draw(st.sampled_from(idle)) if idle else None

    @precondition(lambda self: self.src_model)
    @rule(data=st.data(), dies_after=st.none() | st.integers(0, 4))
    def transfer(self, data, dies_after):
        """A real sender (in a thread, joined) against the real receiver; the sender's
        process dies after ``dies_after`` data sends if given."""
        rid = self._idle_request(data)
        if rid is None:
            return
        payload = self._payload(rid)
        a, b, sender, receiver = self._pair(dies_after)
        out: dict = {}

        def send():
            try:
                out["send"] = sender.send(rid)
            except TransferError as e:
                out["send_error"] = e

        th = threading.Thread(target=send)
        th.start()
        try:
            out["recv"] = receiver.recv(timeout=5)
        except TransferError as e:
            out["recv_error"] = e
        th.join()
        if "recv" in out and "send" in out:
            self.pending.append((out["send"], out["recv"], payload))
        else:  # refused or failed: the sender keeps the request, the receiver has nothing
            assert "send" not in out or out["send"].state == "in_flight"
            if "send" in out:  # the receiver failed after the sender queued everything
                out["send"].abort()
            assert rid in self.src and rid not in self.dst

    @precondition(lambda self: self.src_model)
    @rule(data=st.data(), pieces=st.integers(0, 3), malformed=st.booleans())
    def scripted_sender(self, data, pieces, malformed):
        """A hand-played sender: a malformed offer (src ids out of int32), or a good offer and
        ``pieces`` staged pieces, then silence while the clock runs past the deadline."""
        rid = self._idle_request(data)
        if rid is None:
            return
        a, b, _, receiver = self._pair()
        offer, num_ids = self._offer(rid, malformed)
        for _ in range(min(pieces, -(-num_ids // 2) - 1)):  # never the last piece
            payload = np.zeros(2 * self.src_pool.block_bytes, np.uint8)
            a.send(payload.ctypes.data, payload.nbytes, None)
        a.send_control(offer)
        b.on_idle = lambda end: setattr(self.clock, "now", self.clock.now + 1.0)
        try:
            t = receiver.recv(timeout=1)
        except TransferError:
            assert rid not in self.dst
            return
        raise AssertionError(f"a silent or malformed sender's transfer completed: {t.state}")

    @precondition(lambda self: self.src_model)
    @rule(data=st.data())
    def receiver_gone(self, data):
        rid = self._idle_request(data)
        if rid is None:
            return
        a, b, sender, _ = self._pair()
        b.close()
        try:
            sender.send(rid)
        except TransferError:
            return
        raise AssertionError("a send to a closed receiver succeeded")

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def complete(self, data):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        send_t, recv_t, payload = self.pending.pop(i)
        recv_t.wait()
        send_t.wait()  # frees the sender's blocks
        rid = recv_t.request_id
        self.src_model.discard(rid)
        self.dst_model[rid] = payload
        for got, want in zip(self._received(rid), payload, strict=True):
            np.testing.assert_array_equal(got, want)

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), which=st.sampled_from(["send", "recv", "both"]))
    def abort(self, data, which):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        send_t, recv_t, payload = self.pending.pop(i)
        if which in ("send", "both"):
            send_t.abort()
        if which in ("recv", "both"):
            recv_t.abort()
        # The other side's data had landed (host transfers complete inside recv/send), so
        # polling it completes it: an abort only gives up the side it is called on.
        if which == "send":
            recv_t.wait()
            self.dst_model[recv_t.request_id] = payload
        else:
            assert recv_t.request_id not in self.dst  # freed
        if which == "recv":
            send_t.wait()  # frees the sender's blocks
            self.src_model.discard(send_t.request_id)
        else:
            assert send_t.request_id in self.src  # kept

    @precondition(lambda self: self.pending)
    @rule()
    def deadline_passes(self):
        self.clock.now += TIMEOUT_S + 1
        for endpoint in self.endpoints:
            endpoint.reap_expired()
        # Host transfers have completed their data already: reaping completes them instead.
        for send_t, recv_t, payload in self.pending:
            assert send_t.state == recv_t.state == "done"
            self.src_model.discard(send_t.request_id)
            self.dst_model[recv_t.request_id] = payload
        self.pending.clear()

    @precondition(lambda self: self.dst_model)
    @rule(data=st.data())
    def free_received(self, data):
        rid = data.draw(st.sampled_from(sorted(self.dst_model)))
        self.dst.free(rid)
        del self.dst_model[rid]

    @invariant()
    def leases_and_pools_agree(self):
        self.src_leases.check_invariants()
        self.dst_leases.check_invariants()
        live_dst = {lease.request_id for lease in self.dst_leases.live()}
        assert self._held(self.src) == self.src_model
        assert self._held(self.dst) == set(self.dst_model) | live_dst
        assert live_dst == {r.request_id for _, r, _ in self.pending}
        assert self.src_leases.in_flight == sum(len(s.lease.block_ids) for s, _, _ in self.pending)


TransferLeases.TestCase.settings = settings(max_examples=30, stateful_step_count=25)
TestTransferLeases = TransferLeases.TestCase
