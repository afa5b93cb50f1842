"""The NCCL transport's control channel without NCCL: rendezvous through a file, the unique id
handed from rank 0 to rank 1, framed messages both ways, timeouts, and a closed peer seen as
gone (what a receiver relies on when the sender's process dies)."""

from __future__ import annotations

import threading

import pytest
from kvpool.transfer import PeerGone
from kvpool.transfer.nccl import NcclTransport, _listen_address, rendezvous_control


def _pair(tmp_path):
    path = tmp_path / "rendezvous.json"
    out: dict = {}

    def rank1():
        out[1] = rendezvous_control(1, path, lambda: pytest.fail("rank 1 makes no id"), timeout=10)

    th = threading.Thread(target=rank1)
    th.start()
    out[0] = rendezvous_control(0, path, lambda: [7, -3, 120], timeout=10)
    th.join()
    # Control-only transports: no communicator (the data methods are not used here).
    return [NcclTransport(None, None, out[r][0], r, 0) for r in (0, 1)], out


def test_rank_1_gets_rank_0s_id_and_messages_flow_both_ways(tmp_path):
    (t0, t1), out = _pair(tmp_path)
    assert out[0][1] == out[1][1] == [7, -3, 120]
    t0.send_control({"kind": "offer", "src_ids": list(range(5000))})
    assert t1.recv_control(5)["src_ids"] == list(range(5000))
    t1.send_control({"kind": "accept"})
    assert t0.recv_control(5) == {"kind": "accept"}
    assert t0.peer_alive() and t1.peer_alive()
    t0._sock.close()
    t1._sock.close()


def test_a_pending_message_is_not_mistaken_for_a_dead_peer(tmp_path):
    (t0, t1), _ = _pair(tmp_path)
    t0.send_control({"n": 1})
    assert t1.peer_alive()
    assert t1.recv_control(5) == {"n": 1}
    t0._sock.close()
    t1._sock.close()


def test_a_closed_peer_is_gone_and_a_silent_one_times_out(tmp_path):
    (t0, t1), _ = _pair(tmp_path)
    with pytest.raises(TimeoutError):
        t1.recv_control(0.05)
    t0._sock.close()  # what the OS does when the sender's process exits
    assert not t1.peer_alive()
    with pytest.raises(PeerGone):
        t1.recv_control(5)
    t1._sock.close()
    with pytest.raises(PeerGone, match="closed"):
        t1.send_control({"after": "close"})


def test_tcp_rendezvous_addresses_parse():
    assert _listen_address("tcp://10.0.0.5:29500", "127.0.0.1") == ("10.0.0.5", 29500)
    assert _listen_address("/tmp/r.json", "127.0.0.1") == ("127.0.0.1", 0)


def test_a_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank"):
        NcclTransport.connect(2, "/nonexistent", 0)
