"""Every exception kvpool raises, in one module (`kvpool` re-exports them all).

The convention: an argument of the wrong type (a float, str, None or bool where an int is
expected, a non-iterable where a sequence is) raises Python's `TypeError`, naming the argument
and the type received; a value of the right type that is out of range, unknown, or refused by
the pool's state or resources raises a subclass of `KvError`. A call that raises changes
nothing. Bools are refused where an int is expected although `bool` subclasses `int`: `True`
as a count or an id is a mistake, not a 1. NumPy integer scalars and any object with
`__index__` are ints.

The classes are defined by the extension module (whose raises they are) under this module's
name, so an instance pickles and unpickles to the same class with its message and attributes
(`OutOfBlocksError.requested`, ...).
"""

from kvpool._core import (
    CacheInUseError,
    CapacityError,
    CudaError,
    CudaUnavailableError,
    DoubleFreeError,
    DuplicateRequestError,
    HostTierFullError,
    InvalidArgumentError,
    InvalidBlockError,
    KvError,
    KvSystemError,
    LayoutError,
    OutOfBlocksError,
    OutOfMemoryError,
    TransferError,
    UnknownRequestError,
    WrongTierError,
)

__all__ = [
    "CacheInUseError",
    "CapacityError",
    "CudaError",
    "CudaUnavailableError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "HostTierFullError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "KvError",
    "KvSystemError",
    "LayoutError",
    "OutOfBlocksError",
    "OutOfMemoryError",
    "TransferError",
    "UnknownRequestError",
    "WrongTierError",
]
