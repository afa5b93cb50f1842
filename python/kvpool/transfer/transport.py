"""What the transfer protocol needs from a transport (an in-process one for tests: testing.py).

A transport joins two endpoints (one per process, each on its GPU) with two channels:

- a *control* channel of small messages (dicts of JSON values), in order, both ways: the
  offer, its acceptance or refusal. Its end-of-file is how a peer's death is noticed.
- a *data* channel that moves device buffers: ``send``/``recv`` of ``nbytes`` at a device
  address, queued on a CUDA stream (or done at once for host memory). Sends and receives
  are matched in order and by size, as NCCL point-to-point operations are.

``deadline`` (a time on the transfer's clock, ``time.monotonic`` unless the transport was made
with another) bounds a data call that completes on the host: a host transport raises
TimeoutError once it passes instead of waiting on a silent peer forever. A device transport
only queues the operation; the deadline of its transfer is enforced by ``Transfer.wait``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class PeerGone(Exception):
    """The other endpoint closed its control channel or died."""


class Transport:
    """The interface (see the module docstring). ``stream`` is a CUstream handle (int) for
    device buffers, None for host buffers."""

    def send_control(self, message: dict) -> None:
        raise NotImplementedError

    def recv_control(self, timeout: float | None) -> dict:
        """The next message; raises PeerGone (channel closed) or TimeoutError."""
        raise NotImplementedError

    def peer_alive(self) -> bool:
        """False once the control channel has reached end-of-file (the peer exited)."""
        raise NotImplementedError

    def send(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        raise NotImplementedError

    def recv(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Sends and receives issued inside are batched into one launch (NCCL's group)."""
        yield

    def abort(self) -> None:
        """Tear the data channel down so that queued operations end (after a failure); the
        transport is unusable afterwards."""

    def close(self) -> None:
        """Orderly shutdown (the peer sees end-of-file)."""
