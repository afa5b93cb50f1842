//! The Python exception hierarchy, declared once, and the one conversion from core errors.
//! Python code imports the classes from `kvpool.exceptions` (re-exported by `kvpool`).
//!
//! The convention every binding call follows: an argument of the wrong type (a float, str,
//! None or bool where an int is expected; a non-iterable where a sequence is) raises Python's
//! `TypeError`, naming the argument and the type received; a value of the right type that is
//! out of range, unknown or refused by the pool's state raises a `KvError` subclass.

use kvpool_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

/// Declares every exception class (named `kvpool.exceptions.<Name>`, so an instance pickles
/// by the public path) and [`register`], which adds each to the module: the one list of the
/// hierarchy. `kvpool/exceptions.py` re-exports the classes and `_core.pyi` types them;
/// tests/test_exceptions.py checks both against the classes registered here.
macro_rules! exceptions {
    ($($name:ident($base:ty): $doc:literal;)*) => {
        $(create_exception!(kvpool.exceptions, $name, $base, $doc);)*

        pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            $(m.add(stringify!($name), py.get_type::<$name>())?;)*
            Ok(())
        }
    };
}

exceptions! {
    KvError(PyException): "Base class of every kvpool error.";
    OutOfBlocksError(KvError): "Too few free blocks (and a growable pool could not grow); attributes `requested`, `free`, `num_blocks`, `max_num_blocks` (None for fixed pools).";
    HostTierFullError(OutOfBlocksError): "The host tier has too few free blocks for a swap-out (nothing moved); attributes `requested`, `free`, `num_blocks`.";
    WrongTierError(KvError): "A request is not on the tier the operation moves it from (swapping out a request already swapped out, say); attribute `tier`: where it is.";
    OutOfMemoryError(KvError): "Memory could not be allocated (the slab, or a buffer sized by the caller's arguments); nothing changed.";
    DoubleFreeError(KvError): "A block was freed that is not allocated.";
    InvalidBlockError(KvError): "A block id that is not an id of this pool.";
    UnknownRequestError(KvError): "A request id that is not in the block tables.";
    DuplicateRequestError(KvError): "A request id that is already in the block tables.";
    CapacityError(KvError): "A fixed capacity (max_seqs, max_blocks_per_seq) would be exceeded.";
    CacheInUseError(KvError): "A prefix-cache reset while cached blocks are still referenced; attribute `in_use` (how many).";
    LayoutError(KvError): "An invalid KvLayout.";
    InvalidArgumentError(KvError): "An argument of the right type whose value is out of its valid range (a wrong type is a TypeError).";
    CudaUnavailableError(KvError): "No CUDA driver or no such device.";
    CudaError(KvError): "The CUDA driver reported an error.";
    TransferError(KvError): "A KV transfer between pools was refused (layout mismatch, too few free blocks on the receiver) or failed (peer gone, timeout, transport error); both pools are consistent afterwards (the receiver's blocks freed, the sender's still owned).";
    KvSystemError(KvError): "The operating system refused a call for another reason than lack of memory (an mprotect of a growable host pool, say); attribute `errno`.";
}

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
    requested: &Py<pyo3::types::PyInt>,
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

/// The error of a binding call: a core error, or a Python exception raised while reading the
/// arguments (a `TypeError` for a wrong type, or whatever the caller's own objects raised).
pub enum BindingError {
    Core(CoreError),
    Python(PyErr),
}

impl From<CoreError> for BindingError {
    fn from(e: CoreError) -> Self {
        BindingError::Core(e)
    }
}

impl From<PyKvError> for BindingError {
    fn from(PyKvError(e): PyKvError) -> Self {
        BindingError::Core(e)
    }
}

impl From<PyErr> for BindingError {
    fn from(e: PyErr) -> Self {
        BindingError::Python(e)
    }
}

impl From<BindingError> for PyErr {
    fn from(e: BindingError) -> PyErr {
        match e {
            BindingError::Core(e) => PyKvError(e).into(),
            BindingError::Python(e) => e,
        }
    }
}

pub type KvResult<T> = Result<T, BindingError>;
