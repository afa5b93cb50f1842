"""NcclTransport: the data channel is NCCL point-to-point (CuPy's binding), the control channel a
TCP connection that also carries NCCL's unique id at rendezvous.

Rendezvous: rank 0 listens, rank 1 connects. ``rendezvous`` is either ``"tcp://host:port"``
(rank 0 binds it; works across machines) or a file path: rank 0 binds an ephemeral port on
``host`` and writes ``{"host", "port"}`` into the file (atomically), rank 1 waits for the file.
Rank 0 then sends the NCCL unique id over the connection and both create the communicator.
NVLink multicast (NVLS) is turned off for the communicator unless the environment already
says otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpool._core import CudaUnavailableError
from kvpool.transfer.transport import PeerGone, Transport

_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def load_nccl() -> Any:
    """CuPy's NCCL module; when CuPy did not find libnccl itself, the one of the
    ``nvidia-nccl-cu*`` wheel (what PyTorch uses) is loaded first."""
    from cupy.cuda import nccl

    if getattr(nccl, "available", hasattr(nccl, "NcclCommunicator")):
        return nccl
    spec = importlib.util.find_spec("nvidia.nccl")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder, "lib", "libnccl.so.2")
        if path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            nccl = importlib.reload(nccl)
            break
    if not getattr(nccl, "available", hasattr(nccl, "NcclCommunicator")):
        raise CudaUnavailableError(
            "CuPy's NCCL binding is unavailable (no libnccl.so.2 found); "
            "install nvidia-nccl-cu12 or -cu13 matching CuPy"
        )
    return nccl


def _send_frame(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise PeerGone("the peer closed the control connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, timeout: float | None) -> dict:
    if timeout is not None:
        ready, _, _ = select.select([sock], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no control message within {timeout} s")
    sock.settimeout(None)  # a frame that started arrives whole
    (length,) = struct.unpack("!I", _recv_exact(sock, 4))
    return json.loads(_recv_exact(sock, length))


def _listen_address(rendezvous: str, host: str) -> tuple[str, int]:
    if rendezvous.startswith("tcp://"):
        h, _, p = rendezvous[len("tcp://") :].rpartition(":")
        return h, int(p)
    return host, 0


def _wait_for_file(path: Path, deadline: float) -> tuple[str, int]:
    while True:
        try:
            info = json.loads(path.read_text())
            return info["host"], int(info["port"])
        except (FileNotFoundError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rendezvous file {path} from rank 0") from None
            time.sleep(0.05)


def rendezvous_control(
    rank: int,
    rendezvous: str | os.PathLike,
    unique_id: Any,
    *,
    host: str = "127.0.0.1",
    timeout: float = 120.0,
) -> tuple[socket.socket, list]:
    """The control connection of a pair, and the id rank 0 made with ``unique_id()`` and sent
    over it (see the module docstring for ``rendezvous``)."""
    rendezvous = str(rendezvous)
    deadline = time.monotonic() + timeout
    if rank == 0:
        uid = unique_id()
        server = socket.create_server(_listen_address(rendezvous, host))
        try:
            if not rendezvous.startswith("tcp://"):
                bound_host, port = server.getsockname()[:2]
                tmp = Path(rendezvous + ".tmp")
                tmp.write_text(json.dumps({"host": bound_host, "port": port}))
                tmp.replace(rendezvous)
            server.settimeout(timeout)
            sock, _ = server.accept()
        finally:
            server.close()
        _send_frame(sock, {"nccl_id": uid})
    else:
        address = (
            _listen_address(rendezvous, host)
            if rendezvous.startswith("tcp://")
            else _wait_for_file(Path(rendezvous), deadline)
        )
        while True:
            try:
                sock = socket.create_connection(address, timeout=timeout)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        uid = _recv_frame(sock, timeout)["nccl_id"]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, uid


class NcclTransport(Transport):
    """A two-rank NCCL communicator with a TCP control channel; make one with connect()."""

    def __init__(
        self, nccl: Any, comm: Any, sock: socket.socket, rank: int, device_id: int
    ) -> None:
        self._nccl, self.comm, self._sock = nccl, comm, sock
        self.rank, self.peer, self.device_id = rank, 1 - rank, device_id
        self._dtype = getattr(nccl, "NCCL_UINT8", getattr(nccl, "NCCL_CHAR", 0))
        self._dead = False

    @classmethod
    def connect(
        cls,
        rank: int,
        rendezvous: str | os.PathLike,
        device_id: int,
        *,
        host: str = "127.0.0.1",
        timeout: float = 120.0,
    ) -> NcclTransport:
        """Joins the two processes (blocks until both have called it)."""
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank!r}")
        import cupy

        for key, value in _MULTICAST_OFF.items():
            os.environ.setdefault(key, value)
        nccl = load_nccl()

        def unique_id() -> list:
            with cupy.cuda.Device(device_id):
                return list(nccl.get_unique_id())

        sock, uid = rendezvous_control(rank, rendezvous, unique_id, host=host, timeout=timeout)
        with cupy.cuda.Device(device_id):
            try:  # CuPy 14 takes the id as bytes, CuPy 13 as the tuple get_unique_id gave
                comm = nccl.NcclCommunicator(2, bytes(b & 0xFF for b in uid), rank)
            except TypeError:
                comm = nccl.NcclCommunicator(2, tuple(uid), rank)
        return cls(nccl, comm, sock, rank, device_id)

    def _check_open(self) -> None:
        if self._sock.fileno() < 0:
            raise PeerGone("this transport was aborted or closed")

    def send_control(self, message: dict) -> None:
        self._check_open()
        try:
            _send_frame(self._sock, message)
        except OSError as e:
            raise PeerGone(f"the control connection failed: {e}") from e

    def recv_control(self, timeout: float | None) -> dict:
        self._check_open()
        try:
            return _recv_frame(self._sock, timeout)
        except TimeoutError:  # an OSError too, but the peer may still answer
            raise
        except OSError as e:
            raise PeerGone(f"the control connection failed: {e}") from e

    def peer_alive(self) -> bool:
        if self._dead:
            return False
        try:
            ready, _, _ = select.select([self._sock], [], [], 0)
            if ready and not self._sock.recv(1, socket.MSG_PEEK):
                self._dead = True  # end-of-file: the peer closed or exited
        except OSError:
            self._dead = True
        return not self._dead

    # The deadline is not needed here: NCCL only queues the operation on the stream, and the
    # transfer's deadline is enforced by Transfer.wait (which aborts the communicator).
    def send(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        self.comm.send(ptr, nbytes, self._dtype, self.peer, stream or 0)

    def recv(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        self.comm.recv(ptr, nbytes, self._dtype, self.peer, stream or 0)

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def abort(self) -> None:
        """ncclCommAbort: queued NCCL kernels end; the communicator is gone."""
        if self.comm is not None:
            self.comm.abort()
            self.comm = None
        self._dead = True
        self._sock.close()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
        self._sock.close()
