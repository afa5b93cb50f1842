"""What the package's top levels export: kvpool's names (no type a user only receives, every
exception it exported before), and kvpool.transfer without its test transport."""

from __future__ import annotations

import kvpool
import kvpool.transfer
from kvpool.transfer.testing import FakeTransport, fake_transport_pair

RECEIVED_ONLY = {"AddResult", "SlabView", "DeviceArray", "CudaStream"}
EXCEPTIONS = {
    "KvError",
    "OutOfBlocksError",
    "HostTierFullError",
    "WrongTierError",
    "OutOfMemoryError",
    "DoubleFreeError",
    "InvalidBlockError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "CapacityError",
    "CacheInUseError",
    "LayoutError",
    "InvalidArgumentError",
    "CudaUnavailableError",
    "CudaError",
    "KvSystemError",
    "TransferError",
}


def test_kvpool_exports_no_type_a_user_only_receives():
    assert not RECEIVED_ONLY & set(kvpool.__all__)
    assert all(hasattr(kvpool._core, name) for name in RECEIVED_ONLY)  # still there, typed
    assert {"Pool", "BlockTables", "KvLayout", "HostTier", "PoolGroup"} <= set(kvpool.__all__)
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kvpool.__all__)
    assert {"KvGroup", "ModelKvSpec", "HybridTables", "HybridHostTier"} <= set(kvpool.__all__)


def test_kvpool_exports_every_exception():
    assert set(kvpool.__all__) >= EXCEPTIONS
    assert all(issubclass(getattr(kvpool, name), kvpool.KvError) for name in EXCEPTIONS)


def test_transfer_exports_no_test_fake():
    assert not {n for n in kvpool.transfer.__all__ if "fake" in n.lower()}
    assert set(kvpool.transfer.__all__) <= set(dir(kvpool.transfer))
    a, b = fake_transport_pair()
    assert isinstance(a, FakeTransport) and isinstance(b, FakeTransport)
