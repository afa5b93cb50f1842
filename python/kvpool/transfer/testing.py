"""An in-process transport over host memory, for tests of the transfer protocol (kvpool's own
and a user's): `fake_transport_pair()` gives two connected endpoints, optionally failing after
a number of sends to test recovery. Not a transport to serve with.

Two knobs let a test play an adversarial peer in one thread: ``clock`` (the clock data calls
compare their deadline with; a test advances a fake one instead of sleeping) and
``on_idle(end)``, called whenever a receive finds nothing queued, so the test's peer can act
then (send a piece, stay silent and move the clock past the deadline, or close the link).
"""

from __future__ import annotations

import ctypes
import json
import queue
import threading
import time
from collections.abc import Callable

from kvpool.transfer.transport import PeerGone, Transport


class _Link:
    """The shared state of a fake transport pair: one control and one data queue per
    direction, and whether the link is closed (a peer gone)."""

    def __init__(self) -> None:
        self.control: tuple[queue.Queue[dict], queue.Queue[dict]] = (queue.Queue(), queue.Queue())
        self.data: tuple[queue.Queue[bytes], queue.Queue[bytes]] = (queue.Queue(), queue.Queue())
        self.closed = threading.Event()


class FakeTransport(Transport):
    """One end of an in-process transport over host memory, for tests of the protocol.

    ``fail_after_sends=k``: the k+1-th data send of this end closes the link instead (the
    process "dies" mid-transfer), so the peer sees PeerGone.
    """

    def __init__(
        self,
        link: _Link,
        side: int,
        fail_after_sends: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._link, self._side = link, side
        self._fail_after = fail_after_sends
        self.clock = clock
        self.on_idle: Callable[[FakeTransport], None] | None = None
        self.num_sends = 0
        self.num_data_calls = 0

    def send_control(self, message: dict) -> None:
        if self._link.closed.is_set():
            raise PeerGone("the link is closed")
        # Through JSON, as on a real control channel: the peer gets a copy, in JSON's types.
        self._link.control[1 - self._side].put(json.loads(json.dumps(message)))

    def recv_control(self, timeout: float | None) -> dict:
        q = self._link.control[self._side]
        step = 0.01
        waited = 0.0
        while True:
            try:
                return q.get(timeout=step)
            except queue.Empty:
                if self._link.closed.is_set():
                    raise PeerGone("the peer closed the link") from None
                waited += step
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"no control message within {timeout} s") from None

    def peer_alive(self) -> bool:
        return not self._link.closed.is_set()

    def send(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        if self._fail_after is not None and self.num_sends >= self._fail_after:
            self._link.closed.set()
            raise PeerGone("injected failure: this end died during the transfer")
        if self._link.closed.is_set():
            raise PeerGone("the link is closed")
        self.num_sends += 1
        self.num_data_calls += 1
        self._link.data[1 - self._side].put(ctypes.string_at(ptr, nbytes))

    def recv(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        self.num_data_calls += 1
        q = self._link.data[self._side]
        while True:
            if self.on_idle is not None and q.empty():
                self.on_idle(self)
            try:
                payload = q.get(timeout=0 if self.on_idle is not None else 0.01)
                break
            except queue.Empty:
                if self._link.closed.is_set():
                    raise PeerGone("the peer died during the transfer") from None
                if deadline is not None and self.clock() >= deadline:
                    raise TimeoutError("the peer sent nothing before the deadline") from None
        if len(payload) != nbytes:
            raise ValueError(f"a send of {len(payload)} bytes met a receive of {nbytes}")
        ctypes.memmove(ptr, payload, nbytes)

    def abort(self) -> None:
        self._link.closed.set()

    def close(self) -> None:
        self._link.closed.set()


def fake_transport_pair(
    fail_after_sends: int | None = None, clock: Callable[[], float] = time.monotonic
) -> tuple[FakeTransport, FakeTransport]:
    """Two connected fake ends (sender side first); see FakeTransport for the knobs
    (``fail_after_sends`` applies to the first end, ``clock`` to both)."""
    link = _Link()
    return FakeTransport(link, 0, fail_after_sends, clock), FakeTransport(link, 1, clock=clock)
