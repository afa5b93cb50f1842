"""NixlTransport: the data phase through NIXL (UCX inside: RDMA, shared memory, TCP), the
control channel the TCP connection of the NCCL transport (nccl.py: same rendezvous, same
framed JSON messages, end-of-file as a dead peer).

NIXL is one-sided, so this transport does not pair sends with receives as the Transport
interface does; it is ``one_sided`` and the protocol (protocol.py) asks it instead to
``read_blocks`` (receiver) and ``serve_blocks`` (sender):

- at connect, each side registers its pool's slab once and sends a ``nixl_hello`` control
  message: its agent's metadata, the slab's base address and size in blocks. Each side adds
  the other's agent.
- the offer and the accept carry the block-id lists as for any transport; the receiver then
  READs the sender's blocks into its own, one descriptor per run of blocks contiguous on both
  sides (pieces.py's grouped pieces: a fresh pool's request is one descriptor), and tells the
  sender ``{"kind": "done"}``; the sender's transfer completes on that message.
- a request whose blocks are scattered may move through each side's staging buffer instead,
  as one descriptor (nixl_staging.py): the sender gathers it before its offer and says
  ``staged_at``; a receiver whose own blocks are scattered READs into its buffer and scatters.

Why the receiver pulls (READ) rather than the sender pushing (WRITE): the side whose blocks
are written must own the completion. With WRITE, a receiver that gives up at its deadline
frees blocks that a late write may still land in after they were reused; with READ, the
receiver ends its own transfer before freeing, and a sender that never hears ``done`` keeps
its blocks (nothing is corrupted, they were only read).

Two more data phases are polled instead (nixl_layers.py): layer by layer (``read_layers``: the
receiver READs each range of layers the sender announces) and head ranges of a
tensor-parallel shard (regions.py, tp_legs.py); both wait for messages with ``poll_message``,
never blocking, so the caller computes or decodes meanwhile.

Host pools register their slab as DRAM, CUDA pools as VRAM with the pool's device id
(``nixl_memory``): every descriptor row then carries that device id, the local rows this
pool's, the remote rows the peer's (from its hello), so one READ may join a CUDA pool and a host
pool too. A CUDA sender's KV must be written before the receiver reads it: a one-sided send
synchronizes the sending stream before the offer goes out (``settle_source``). Growable
pools are refused at connect (``refuse_growable``: the registration would not follow a
growth). ``load_nixl()`` imports the ``nixl`` module (the ``nixl`` meta package) or
the ``nixl_cu13`` / ``nixl_cu12`` one that the wheels of those names install.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool._core import Pool, TransferError
from kvpool.kernels._launch import cupy_stream, stream_handle
from kvpool.transfer.movers import Done
from kvpool.transfer.nccl import NcclTransport, rendezvous_control
from kvpool.transfer.nixl_layers import AwaitMessage, LayeredRead
from kvpool.transfer.nixl_staging import (
    RECEIVING,
    StagingBuffer,
    StagingCost,
    runs,
    staging_blocks,
)
from kvpool.transfer.pieces import GROUPED, plan_pieces
from kvpool.transfer.regions import Side
from kvpool.transfer.transport import PeerGone, Transport

_POLL_S = 0.0002
_SPIN_S = 0.002
# How long the sender waits on the control connection between looks at its deadline's clock
# (an injected clock in tests: a short wait keeps them fast).
_SERVE_POLL_S = 0.05
# How long tearing down a transfer waits for a READ that NIXL cannot cancel to end.
_CANCEL_WAIT_S = 5.0
# UCX's switch for cuda_ipc GET, which a READ is. Its default, ``auto``, turns GET off unless UCX
# sees NVLink, and a READ into GPU memory then falls back to a GET emulated through host memory
# over TCP (on one H200: 0.4 GB/s; bench/results/README.md has the two runs side by side). A
# CUDA pool's agent asks for GET (``y``) unless the variable is set: a user who set it keeps
# theirs. UCX reads it when the agent is made, so it is set before.
CUDA_IPC_GET = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def enable_cuda_ipc_get(mem_type: str) -> None:
    """Before a ``mem_type`` agent is made: for VRAM, ``CUDA_IPC_GET=y`` unless set already."""
    if mem_type == "VRAM":
        os.environ.setdefault(CUDA_IPC_GET, "y")


def load_nixl() -> Any:
    """The NIXL Python module; raises ImportError (naming the wheels) if none is installed."""
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise ImportError("NIXL is not installed: pip install 'kvpool[nixl]' (nixl-cu13)")


def nixl_memory(pool: Pool) -> tuple[str, int]:
    """NIXL's memory type and device id of ``pool``'s slab: ``("DRAM", 0)`` for a host pool,
    ``("VRAM", n)`` for a pool on ``cuda:n``. TransferError for any other device."""
    device = str(pool.device)
    if device == "host":
        return "DRAM", 0
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return "VRAM", int(device[5:]) if ":" in device else 0
    raise TransferError(
        f"NixlTransport moves host and CUDA pools only (NIXL DRAM and VRAM), not {device!r}"
    )


def refuse_growable(pool: Pool) -> None:
    """TransferError if ``pool`` is growable (host or CUDA). NIXL registers a pool's memory
    once, at connect, as ``num_blocks * block_bytes`` from ``base_ptr``: blocks a later growth
    maps lie outside that registration (NIXL then refuses the READ mid-transfer,
    ``NIXL_ERR_NOT_FOUND``, after the receiver has allocated), and a shrink unmaps memory that
    is still registered. Not done instead: registering the whole reservation (its unmapped
    part is ``PROT_NONE`` on the host and has no physical memory on CUDA: nothing an RDMA
    registration can pin), or registering each growth's chunks (the peer must then be sent
    the new registration's metadata before it may READ them, a second exchange per growth)."""
    if getattr(pool, "growable", False):
        raise TransferError(
            "NixlTransport does not move growable pools: NIXL registers a pool's memory once "
            f"at connect ({pool.num_blocks} blocks here), so blocks a later growth maps would "
            "lie outside the registration and a shrink would unmap registered memory; give "
            "the transport a fixed-size pool (Pool(layout, num_blocks))"
        )


def run_descriptors(
    base: int, block_bytes: int, ids: np.ndarray, pieces: list, device: int = 0
) -> np.ndarray:
    """NIXL's Nx3 descriptor array ``(address, bytes, device)``, one row per piece."""
    rows = np.zeros((len(pieces), 3), np.uint64)
    for row, (start, count) in enumerate(pieces):
        rows[row] = (base + int(ids[start]) * block_bytes, count * block_bytes, device)
    return rows


def on_device(rows: np.ndarray, device: int) -> np.ndarray:
    """``rows`` (Nx3 descriptors) with every row's device id set to ``device``: a copy, the
    caller's array is left alone."""
    rows = np.array(rows, np.uint64, copy=True).reshape(-1, 3)
    rows[:, 2] = device
    return rows


def settle_source(pool: Pool, stream: Any = None) -> None:
    """Before a one-sided offer of ``pool``'s blocks: waits for the work queued on ``stream``
    (the pool's stream by default) on a CUDA pool, so that the receiver's READ, which no
    stream of this process orders, sees the KV written. Nothing to do for a host pool."""
    if nixl_memory(pool)[0] != "VRAM":
        return
    import cupy

    stream = pool.stream if stream is None else stream
    handle = stream if isinstance(stream, int) else stream_handle(stream)
    with cupy.cuda.Device(nixl_memory(pool)[1]):
        cupy_stream(handle).synchronize()


class NixlTransport(Transport):
    """Two processes' pools (host or CUDA) joined by NIXL; make one with ``connect``."""

    one_sided = True

    def __init__(
        self, control: NcclTransport, nixl: Any, agent: Any, pool: Pool, hello: dict
    ) -> None:
        self._control, self._nixl, self.agent, self.pool = control, nixl, agent, pool
        self.block_bytes = pool.block_bytes
        self.remote_name = hello["agent"]
        self.remote_base = int(hello["base_ptr"])
        self.remote_num_blocks = int(hello["num_blocks"])
        self.remote_block_bytes = int(hello["block_bytes"])
        self.mem_type, self.device_id = nixl_memory(pool)
        self.remote_mem_type, self.remote_device_id = hello["mem_type"], int(hello["device_id"])
        self.descriptor_counts: list[int] = []  # per transfer this side initiated
        self._notes: list[dict] = []  # control messages read while waiting for "done"
        self._registration: Any = None  # the slab's NIXL registration, released at teardown
        # Each side's staging buffer (nixl_staging.py), none where it holds no block.
        self.staging: StagingBuffer | None = None
        self.staging_cost = StagingCost()  # when a request is staged (settable)
        self.remote_staging_base = int(hello.get("staging_base", 0))
        self.remote_staging_blocks = int(hello.get("staging_blocks", 0))

    @classmethod
    def connect(
        cls,
        rank: int,
        rendezvous: str | os.PathLike,
        pool: Pool,
        *,
        host: str = "127.0.0.1",
        timeout: float = 120.0,
        staging_bytes: int | None = None,
    ) -> NixlTransport:
        """Joins the two processes (blocks until both have called it); registers the pool's
        slab with NIXL once for the transport's life, and a staging buffer of up to
        ``staging_bytes`` (None: 256 MiB on a CUDA pool, none on a host pool; 0: none) through
        which a request of scattered blocks moves as one descriptor (nixl_staging.py)."""
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank!r}")
        refuse_growable(pool)  # before NIXL is loaded or the rendezvous touched
        mem_type, device_id = nixl_memory(pool)  # refuses a device NIXL is not given here
        num_staging = staging_blocks(pool, staging_bytes, mem_type)
        nixl = load_nixl()
        sock, _ = rendezvous_control(rank, rendezvous, lambda: [], host=host, timeout=timeout)
        control = NcclTransport(None, None, sock, rank, 0)  # its control channel only
        name = f"kvpool-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        enable_cuda_ipc_get(mem_type)
        agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
        nbytes = pool.num_blocks * pool.block_bytes
        registration = agent.register_memory([(pool.base_ptr, nbytes, device_id, "")], mem_type)
        staging: StagingBuffer | None = None
        try:
            # Registered before the agent's metadata is taken for the hello: the peer's READs
            # of it need its key in that metadata.
            if num_staging:
                staging = StagingBuffer(pool, num_staging, agent, mem_type, device_id)
            return cls._greet(control, nixl, agent, registration, staging, name, pool, timeout)
        except BaseException:
            # No hello in time, the peer gone, a malformed hello: the caller gets no transport
            # to close, so the registrations and the socket go here (the agent with the error).
            if staging is not None:
                staging.close()
            with contextlib.suppress(Exception):
                agent.deregister_memory(registration)
            control.close()
            raise

    @classmethod
    def _greet(
        cls,
        control: NcclTransport,
        nixl: Any,
        agent: Any,
        registration: Any,
        staging: StagingBuffer | None,
        name: str,
        pool: Pool,
        timeout: float,
    ) -> NixlTransport:
        """``connect``'s exchange of hellos once ``agent`` registered the slab: the transport,
        or an exception (``connect`` then releases the registration)."""
        mem_type, device_id = nixl_memory(pool)
        control.send_control(
            {
                "kind": "nixl_hello",
                "agent": name,
                "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
                "base_ptr": pool.base_ptr,
                "num_blocks": pool.num_blocks,
                "block_bytes": pool.block_bytes,
                "mem_type": mem_type,
                "device_id": device_id,
                "staging_base": 0 if staging is None else staging.base_ptr,
                "staging_blocks": 0 if staging is None else staging.num_blocks,
            }
        )
        hello = control.recv_control(timeout)
        # The peer's blocks may be of other bytes (a TP shard of another size): each offer's
        # layout is checked against them (``source_ids_problem``).
        if (
            hello.get("kind") != "nixl_hello"
            or not isinstance(hello.get("block_bytes"), int)
            or hello.get("mem_type") not in ("DRAM", "VRAM")
            or not isinstance(hello.get("device_id"), int)
            or not all(
                isinstance(hello.get(key), int) and hello[key] >= 0
                for key in ("staging_base", "staging_blocks")
            )
        ):
            raise TransferError(f"the peer's NIXL hello is not one: {hello}")
        agent.add_remote_agent(base64.b64decode(hello["metadata"]))
        transport = cls(control, nixl, agent, pool, hello)
        transport._registration, transport.staging = registration, staging
        return transport

    # -- control channel (the NCCL transport's) ------------------------------------------
    def send_control(self, message: dict) -> None:
        self._control.send_control(message)

    def recv_control(self, timeout: float | None) -> dict:
        if self._notes:
            return self._notes.pop(0)
        return self._control.recv_control(timeout)

    def peer_alive(self) -> bool:
        return self._control.peer_alive()

    # -- one-sided data phase ---------------------------------------------------------------
    def source_ids_problem(
        self,
        src_ids: np.ndarray,
        block_bytes: int | None = None,
        staged_at: int | None = None,
    ) -> str | None:
        """Why an offer's source ids (of blocks of ``block_bytes``, this pool's by default;
        packed at block ``staged_at`` of the sender's staging buffer if given) cannot be read
        from the sender's registered memory (checked by the receiver before it allocates
        anything), or None."""
        block_bytes = self.block_bytes if block_bytes is None else block_bytes
        if block_bytes != self.remote_block_bytes:
            return (
                f"the offer's blocks are of {block_bytes} bytes; the sender's pool registered "
                f"blocks of {self.remote_block_bytes}"
            )
        if len(src_ids) and int(src_ids.max()) >= self.remote_num_blocks:
            return (
                f"the offer's source ids reach block {int(src_ids.max())}; the sender's pool "
                f"has {self.remote_num_blocks}"
            )
        if staged_at is not None and staged_at + len(src_ids) > self.remote_staging_blocks:
            return (
                f"the offer's {len(src_ids)} blocks staged at block {staged_at} lie outside "
                f"the sender's staging buffer of {self.remote_staging_blocks} blocks"
            )
        return None

    # -- staging (nixl_staging.py) ----------------------------------------------------------
    def worth_staging(self, ids: np.ndarray) -> bool:
        """Whether moving ``ids`` through a staging buffer beats a descriptor per run
        (``staging_cost``)."""
        return self.staging_cost.worth(runs(ids), len(ids) * self.block_bytes)

    def stage_source(self, request_id: int, ids: np.ndarray) -> dict:
        """Sender, before the offer (its KV written): gathers a request worth staging into
        this side's buffer if that holds it and is free, and returns the offer's fields
        (``{"staged_at": 0}``), or ``{}``: the request then moves run by run. ``unstage``
        gives the buffer back once this side's transfer has ended."""
        staging = self.staging
        if staging is None or not self.worth_staging(ids):
            return {}
        if not staging.acquire(request_id, len(ids)):
            return {}
        try:
            staging.gather(ids)
        except BaseException:
            staging.release(request_id)
            raise
        return {"staged_at": 0}

    def unstage(self, request_id: int) -> None:
        """Sender: gives this side's buffer back if ``request_id`` holds it."""
        if self.staging is not None:
            self.staging.release(request_id)

    def _read_rows(
        self, src_ids: np.ndarray, dst_ids: np.ndarray, pieces: list, staged_at: int | None
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """The READ's local and remote descriptor rows, and whether it lands in this side's
        staging buffer (held by the caller, to be scattered into ``dst_ids``)."""
        bb, n = self.block_bytes, len(dst_ids)
        if staged_at is None:
            source_one_region = runs(src_ids) == 1
            remote_base, remote_ids = self.remote_base, src_ids
        else:  # the sender packed the request: consecutive blocks of its buffer
            source_one_region = True
            remote_base = self.remote_staging_base
            remote_ids = np.arange(staged_at, staged_at + n, dtype=np.int32)
            pieces = plan_pieces(GROUPED, remote_ids, dst_ids, n)
        staging = self.staging
        if (
            source_one_region
            and staging is not None
            and self.worth_staging(dst_ids)
            and staging.acquire(RECEIVING, n)
        ):
            rows = run_descriptors(remote_base, bb, remote_ids, [(0, n)])
            local = np.array([[staging.base_ptr, n * bb, 0]], np.uint64)
            return local, rows, True
        local = run_descriptors(self.pool.base_ptr, bb, dst_ids, pieces)
        return local, run_descriptors(remote_base, bb, remote_ids, pieces), False

    def read_blocks(
        self,
        request_id: int,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        pieces: list,
        deadline: float,
        clock: Callable[[], float] = time.monotonic,
        staged_at: int | None = None,
    ) -> Done:
        """Receiver: READs the sender's ``src_ids`` (or, ``staged_at`` given, the request the
        sender packed in its staging buffer) into this pool's ``dst_ids`` (one descriptor per
        piece, or one into this side's staging buffer scattered after), then tells the sender.
        Raises TimeoutError if the READ is not seen complete before ``deadline``, PeerGone if
        NIXL reports an error, the sender gave the transfer up or its process died: in every
        such case the bytes that landed are not trusted (the sender may have released its
        blocks)."""
        problem = self.source_ids_problem(src_ids, staged_at=staged_at)
        if problem is not None:
            raise TransferError(problem)
        local, remote, scatter = self._read_rows(src_ids, dst_ids, pieces, staged_at)
        try:
            self.descriptor_counts.append(len(local))
            if len(local):
                self.move(local, remote, "READ", deadline, clock, request_id)
            # The READ is complete; it is good only if the sender still held its blocks (or
            # its staging buffer) all along.
            self._check_sender(request_id)
            if scatter:
                assert self.staging is not None
                self.staging.scatter(dst_ids)
        finally:
            if scatter:
                assert self.staging is not None
                self.staging.release(RECEIVING)
        self.send_control({"kind": "done", "request_id": request_id})
        return Done()

    def poll_message(
        self, request_id: int, kinds: tuple[str, ...], peer: str = "the peer"
    ) -> dict | None:
        """The next control message about ``request_id`` of one of ``kinds``, read without
        waiting, or None. Raises PeerGone if the peer (``peer`` names it in the error) gave
        ``request_id`` up (an ``abort``) or its control connection reached end-of-file; other
        messages are kept for ``recv_control``."""
        for index, message in enumerate(self._notes):
            if message.get("request_id") == request_id and message.get("kind") in (
                *kinds,
                "abort",
            ):
                del self._notes[index]
                return self._mine(message, peer)
        while True:
            try:
                message = self._control.recv_control(0)
            except TimeoutError:
                break
            except PeerGone as e:
                raise PeerGone(f"{peer}'s process died or closed the connection: {e}") from e
            if message.get("request_id") == request_id and message.get("kind") in (
                *kinds,
                "abort",
            ):
                return self._mine(message, peer)
            self._notes.append(message)
        if not self._control.peer_alive():
            raise PeerGone(f"{peer}'s process died or closed the connection")
        return None

    @staticmethod
    def _mine(message: dict, peer: str) -> dict:
        if message.get("kind") == "abort":
            raise PeerGone(f"{peer} gave the transfer up: {message.get('reason')}")
        return message

    def xfer_descs(self, local: np.ndarray, remote: np.ndarray) -> tuple[Any, Any]:
        """NIXL's descriptor lists of Nx3 rows of this pool (``local``) and the peer's
        (``remote``), each row given its side's device id and memory type."""
        return (
            self.agent.get_xfer_descs(on_device(local, self.device_id), self.mem_type),
            self.agent.get_xfer_descs(
                on_device(remote, self.remote_device_id), self.remote_mem_type
            ),
        )

    def post(self, local: np.ndarray, remote: np.ndarray, op: str) -> tuple[Any, str]:
        """Posts one NIXL transfer of descriptor arrays (Nx3); its handle and first state.
        PeerGone (naming a dead peer where that is why) if NIXL refuses it."""
        agent = self.agent
        try:
            handle = agent.initialize_xfer(op, *self.xfer_descs(local, remote), self.remote_name)
        except Exception as e:  # NIXL's errors (nixlRemoteDisconnectError...) are Exceptions
            raise self._failure(f"NIXL could not prepare the {op}: {type(e).__name__}: {e}") from e
        try:
            return handle, agent.transfer(handle)
        except Exception as e:
            self.retire(handle)
            raise self._failure(f"the NIXL {op} failed: {type(e).__name__}: {e}") from e

    def retire(self, handle: Any) -> None:
        """Releases a transfer's handle; one still in progress is cancelled, or if NIXL cannot
        cancel it, waited for (at most ``_CANCEL_WAIT_S``): its bytes must not land in blocks
        after they were returned to the pool."""
        give_up_at = time.perf_counter() + _CANCEL_WAIT_S
        while True:
            try:
                self.agent.release_xfer_handle(handle)
                return
            except Exception:
                pass  # still active and not cancellable: wait for it to end
            try:
                if self.agent.check_xfer_state(handle) == "PROC":
                    if time.perf_counter() > give_up_at:
                        return  # NIXL keeps it: the agent's teardown ends it
                    time.sleep(_POLL_S)
                    continue
            except Exception:
                pass
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass  # a failed transfer's handle: NIXL has already given it up
            return

    def read_layers(
        self,
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
    ) -> LayeredRead:
        """Receiver: the completion of a READ of the request's layers as the sender announces
        them (``layers_ready`` now; ``layers_ready`` messages later), KV heads ``heads`` of the
        model; see ``LayeredRead``. Nothing is posted until it is first polled (``start``)."""
        problem = self.source_ids_problem(remote.ids, remote.layout.block_bytes)
        if problem is not None:
            raise TransferError(problem)
        return LayeredRead(
            self,
            request_id,
            local,
            remote,
            pieces,
            heads,
            layers_ready,
            commit,
            deadline,
            clock,
            hold_done,
        )

    def await_message(
        self,
        request_id: int,
        kind: str,
        deadline: float,
        clock: Callable[[], float],
        late: str,
        peer: str = "the receiver",
    ) -> AwaitMessage:
        """The completion of waiting for the peer's ``kind`` message about ``request_id``
        (``late``: what TimeoutError says past ``deadline``), polled without blocking."""
        return AwaitMessage(self, request_id, kind, deadline, clock, late, peer)

    def _check_sender(self, request_id: int | None) -> None:
        """Raises PeerGone if the peer has told this side to give ``request_id`` up or its
        control connection reached end-of-file; other messages are kept for
        ``recv_control``. Never waits."""
        if request_id is None:
            return
        while True:
            try:
                message = self._control.recv_control(0)
            except TimeoutError:
                break
            except PeerGone as e:
                raise PeerGone(f"the peer's process died or closed the connection: {e}") from e
            if message.get("kind") == "abort" and message.get("request_id") == request_id:
                raise PeerGone(f"the peer gave the transfer up: {message.get('reason')}")
            self._notes.append(message)
        if not self._control.peer_alive():
            raise PeerGone("the peer's process died or closed the connection")

    def _failure(self, what: str) -> PeerGone:
        """A NIXL error, said with its likely cause: a peer whose control connection is at
        end-of-file has died (NIXL then reports a disconnected agent or a failed transfer)."""
        if not self._control.peer_alive():
            return PeerGone(f"the peer's process died or closed the connection ({what})")
        return PeerGone(what)

    def move(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        op: str,
        deadline: float,
        clock: Callable[[], float] = time.monotonic,
        request_id: int | None = None,
    ) -> None:
        """One NIXL transfer of descriptor arrays (Nx3) between this pool and the peer's.
        Raises TimeoutError unless it is seen complete before ``deadline`` (also when it
        completed at once but the clock is already past it: the lease has ended), PeerGone
        when NIXL fails or, with ``request_id``, the peer aborts it or dies meanwhile."""
        agent = self.agent
        try:
            handle = agent.initialize_xfer(op, *self.xfer_descs(local, remote), self.remote_name)
        except Exception as e:  # NIXL's errors (nixlRemoteDisconnectError...) are Exceptions
            raise self._failure(f"NIXL could not prepare the {op}: {type(e).__name__}: {e}") from e
        try:
            try:
                state = agent.transfer(handle)
                spin_until = time.perf_counter() + _SPIN_S
                while state == "PROC":
                    if clock() >= deadline:
                        break
                    self._check_sender(request_id)
                    state = agent.check_xfer_state(handle)
                    # Spin first: a sleep, even a short one, gives the core away for longer
                    # than a small READ takes on a busy machine.
                    if state == "PROC" and time.perf_counter() > spin_until:
                        time.sleep(_POLL_S)
            except PeerGone:
                raise
            except Exception as e:
                raise self._failure(f"the NIXL {op} failed: {type(e).__name__}: {e}") from e
            if state not in ("DONE", "PROC"):
                raise self._failure(f"the NIXL {op} failed (state {state})")
            if state == "PROC" or clock() >= deadline:
                raise TimeoutError(f"the NIXL {op} was not complete before the deadline")
        finally:
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                pass  # a failed transfer's handle: NIXL has already given it up

    def serve_blocks(
        self, request_id: int, deadline: float, clock: Callable[[], float] = time.monotonic
    ) -> Done:
        """Sender: waits until the receiver says it has read the request's blocks. Raises
        TimeoutError past ``deadline``, PeerGone on the receiver's abort or death."""
        while True:
            left = deadline - clock()
            if left <= 0:
                raise TimeoutError("the receiver did not finish reading before the deadline")
            try:
                message = self._control.recv_control(min(left, _SERVE_POLL_S))
            except TimeoutError:
                continue
            except PeerGone as e:
                raise PeerGone(f"the receiver's process died or closed the connection: {e}") from e
            kind = message.get("kind")
            if message.get("request_id") == request_id and kind == "done":
                return Done()
            if message.get("request_id") == request_id and kind == "abort":
                raise PeerGone(f"the receiver gave the transfer up: {message.get('reason')}")
            self._notes.append(message)  # a later offer's answer: kept for recv_control

    def send(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        raise TransferError("NixlTransport is one-sided: the protocol calls read_blocks")

    def recv(
        self, ptr: int, nbytes: int, stream: int | None, deadline: float | None = None
    ) -> None:
        raise TransferError("NixlTransport is one-sided: the protocol calls read_blocks")

    def _release_registration(self) -> None:
        if self.staging is not None:
            self.staging.close()
        registration, self._registration = self._registration, None
        if registration is not None:
            try:
                self.agent.deregister_memory(registration)
            except Exception:
                pass  # teardown after a failure: the agent may already be unusable

    def abort(self) -> None:
        self._control.abort()  # closes the control connection: the peer sees end-of-file
        self._release_registration()

    def close(self) -> None:
        self._control.close()
        self._release_registration()
