"""Block-level KV transfer between pools in different processes (disaggregated serving).

A :class:`KvSender` moves one request's blocks out of its pool into the pool of a
:class:`KvReceiver`, which allocates its own block ids (a ``HybridTables`` request: every
group's pages); the protocol (``protocol.py``) refuses a layout or spec mismatch before
anything moves, and a failed or interrupted transfer leaves both pools
consistent. Bytes travel through a :class:`Transport`: :class:`NcclTransport` (NCCL
point-to-point through CuPy, one process per GPU; needs CuPy with NCCL) or, for tests, the
in-process ``kvpool.transfer.testing.fake_transport_pair``. Over NIXL a request can also move
layer by layer while the sender computes it (``send(..., layers_ready=)``), and between
tensor-parallel groups of different sizes (:class:`KvGatherReceiver`,
:class:`KvSplitSender`, ``tp=(rank, size)``). Design notes: ``transfer.md``.
"""

from kvpool._core import TransferError
from kvpool.transfer.nccl import NcclTransport  # CuPy's NCCL binding loads when it connects
from kvpool.transfer.pieces import AUTO, GROUPED, MODES, STAGED, plan_pieces
from kvpool.transfer.protocol import (
    KvReceiver,
    KvSender,
    Transfer,
    layout_fingerprint,
    layout_mismatch,
    spec_fingerprint,
    spec_mismatch,
    wait_all,
)
from kvpool.transfer.tp_legs import KvGatherReceiver, KvSplitSender
from kvpool.transfer.transport import PeerGone, Transport

__all__ = [
    "AUTO",
    "GROUPED",
    "MODES",
    "STAGED",
    "KvGatherReceiver",
    "KvReceiver",
    "KvSender",
    "KvSplitSender",
    "NcclTransport",
    "PeerGone",
    "Transfer",
    "TransferError",
    "Transport",
    "layout_fingerprint",
    "layout_mismatch",
    "plan_pieces",
    "spec_fingerprint",
    "spec_mismatch",
    "wait_all",
]
