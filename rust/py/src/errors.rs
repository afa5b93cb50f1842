//! The Python exception hierarchy, declared once, and the one conversion from core errors.
//! `kvpool/__init__.py` re-exports every class here.

use kvpool_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(kvpool._core, KvError, PyException, "Base class of every kvpool error.");
create_exception!(kvpool._core, OutOfBlocksError, KvError, "Too few free blocks (and a growable pool could not grow); attributes `requested`, `free`, `num_blocks`, `max_num_blocks` (None for fixed pools).");
create_exception!(kvpool._core, HostTierFullError, OutOfBlocksError, "The host tier has too few free blocks for a swap-out (nothing moved); attributes `requested`, `free`, `num_blocks`.");
create_exception!(kvpool._core, WrongTierError, KvError, "A request is not on the tier the operation moves it from (swapping out a request already swapped out, say); attribute `tier`: where it is.");
create_exception!(
    kvpool._core,
    OutOfMemoryError,
    KvError,
    "The slab itself could not be allocated."
);
create_exception!(
    kvpool._core,
    DoubleFreeError,
    KvError,
    "A block was freed that is not allocated."
);
create_exception!(
    kvpool._core,
    InvalidBlockError,
    KvError,
    "A block id that is not an id of this pool."
);
create_exception!(
    kvpool._core,
    UnknownRequestError,
    KvError,
    "A request id that is not in the block tables."
);
create_exception!(
    kvpool._core,
    DuplicateRequestError,
    KvError,
    "A request id that is already in the block tables."
);
create_exception!(
    kvpool._core,
    CapacityError,
    KvError,
    "A fixed capacity (max_seqs, max_blocks_per_seq) would be exceeded."
);
create_exception!(
    kvpool._core,
    CacheInUseError,
    KvError,
    "A prefix-cache reset while cached blocks are still referenced; attribute `in_use` (how many)."
);
create_exception!(kvpool._core, LayoutError, KvError, "An invalid KvLayout.");
create_exception!(
    kvpool._core,
    InvalidArgumentError,
    KvError,
    "An argument out of its valid range."
);
create_exception!(kvpool._core, CudaUnavailableError, KvError, "No CUDA driver or no such device.");
create_exception!(kvpool._core, CudaError, KvError, "The CUDA driver reported an error.");
create_exception!(kvpool._core, TransferError, KvError, "A KV transfer between pools was refused (layout mismatch, too few free blocks on the receiver) or failed (peer gone, timeout, transport error); both pools are consistent afterwards (the receiver's blocks freed, the sender's still owned).");
create_exception!(kvpool._core, KvSystemError, KvError, "The operating system refused a call for another reason than lack of memory (an mprotect of a growable host pool, say); attribute `errno`.");

/// Carries a [`CoreError`] to Python (a newtype: neither `CoreError` nor `PyErr` is ours).
pub struct PyKvError(pub CoreError);

impl From<CoreError> for PyKvError {
    fn from(e: CoreError) -> Self {
        PyKvError(e)
    }
}

impl From<PyKvError> for PyErr {
    fn from(PyKvError(e): PyKvError) -> PyErr {
        let message = e.to_string();
        match e {
            CoreError::OutOfBlocks { requested, free, num_blocks } => Python::attach(|py| {
                let err = OutOfBlocksError::new_err(message);
                let value = err.value(py);
                // Setting attributes on a fresh exception object cannot fail short of OOM;
                // the message already carries the numbers if it does.
                let _ = value.setattr("requested", requested);
                let _ = value.setattr("free", free);
                let _ = value.setattr("num_blocks", num_blocks);
                let _ = value.setattr("max_num_blocks", py.None());
                err
            }),
            // A growable pool that could not grow: the same error, naming the maximum too.
            CoreError::CannotGrow { requested, free, num_blocks, max_num_blocks, .. } => {
                Python::attach(|py| {
                    let err = OutOfBlocksError::new_err(message);
                    let value = err.value(py);
                    let _ = value.setattr("requested", requested);
                    let _ = value.setattr("free", free);
                    let _ = value.setattr("num_blocks", num_blocks);
                    let _ = value.setattr("max_num_blocks", max_num_blocks);
                    err
                })
            }
            CoreError::HostTierFull { requested, free, num_blocks } => Python::attach(|py| {
                let err = HostTierFullError::new_err(message);
                let value = err.value(py);
                let _ = value.setattr("requested", requested);
                let _ = value.setattr("free", free);
                let _ = value.setattr("num_blocks", num_blocks);
                let _ = value.setattr("max_num_blocks", py.None());
                err
            }),
            CoreError::WrongTier { tier, .. } => Python::attach(|py| {
                let err = WrongTierError::new_err(message);
                let _ = err.value(py).setattr("tier", tier);
                err
            }),
            CoreError::OutOfMemory { .. } => OutOfMemoryError::new_err(message),
            CoreError::DoubleFree { .. } => DoubleFreeError::new_err(message),
            CoreError::InvalidBlock { .. } => InvalidBlockError::new_err(message),
            CoreError::UnknownRequest { .. } => UnknownRequestError::new_err(message),
            CoreError::DuplicateRequest { .. } => DuplicateRequestError::new_err(message),
            CoreError::CapacityExceeded { .. } => CapacityError::new_err(message),
            CoreError::CacheInUse { in_use } => Python::attach(|py| {
                let err = CacheInUseError::new_err(message);
                let _ = err.value(py).setattr("in_use", in_use);
                err
            }),
            CoreError::InvalidLayout(_) => LayoutError::new_err(message),
            CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
            CoreError::CudaUnavailable(_) => CudaUnavailableError::new_err(message),
            CoreError::Cuda(_) => CudaError::new_err(message),
            CoreError::System { errno, .. } => Python::attach(|py| {
                let err = KvSystemError::new_err(message);
                let _ = err.value(py).setattr("errno", errno);
                err
            }),
        }
    }
}

/// `OutOfBlocksError` for a request of more blocks than any count (an int beyond 64 bits):
/// the message and `requested` are the caller's int itself, not a clamped value.
pub fn out_of_blocks_beyond_any_count(
    py: Python<'_>,
    requested: &Py<PyAny>,
    free: usize,
    num_blocks: usize,
    max_num_blocks: Option<usize>,
) -> PyErr {
    let shown = requested.bind(py).str().map(|s| s.to_string()).unwrap_or_default();
    let err = OutOfBlocksError::new_err(format!(
        "out of blocks: requested {shown}, but only {free} of {num_blocks} are free (a request past 2**63 - 1 blocks can never be met)"
    ));
    let value = err.value(py);
    let _ = value.setattr("requested", requested);
    let _ = value.setattr("free", free);
    let _ = value.setattr("num_blocks", num_blocks);
    let _ = value.setattr("max_num_blocks", max_num_blocks);
    err
}

pub type KvResult<T> = Result<T, PyKvError>;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvError", py.get_type::<KvError>())?;
    m.add("OutOfBlocksError", py.get_type::<OutOfBlocksError>())?;
    m.add("HostTierFullError", py.get_type::<HostTierFullError>())?;
    m.add("WrongTierError", py.get_type::<WrongTierError>())?;
    m.add("OutOfMemoryError", py.get_type::<OutOfMemoryError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("DuplicateRequestError", py.get_type::<DuplicateRequestError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("CacheInUseError", py.get_type::<CacheInUseError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("CudaUnavailableError", py.get_type::<CudaUnavailableError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("KvSystemError", py.get_type::<KvSystemError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    Ok(())
}
