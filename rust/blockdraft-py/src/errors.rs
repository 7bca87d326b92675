//! The binding's exception classes and the one mapping from core errors onto them.

use std::sync::{Mutex, MutexGuard};

use blockdraft_core as core;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    blockdraft._core,
    BlockdraftError,
    PyException,
    "Base class of every error blockdraft raises on purpose."
);
create_exception!(
    blockdraft._core,
    PoolExhaustedError,
    BlockdraftError,
    "The shared page pool cannot satisfy an allocation; nothing was changed."
);
create_exception!(
    blockdraft._core,
    InvalidStateError,
    BlockdraftError,
    "A state or plan was used out of its lifecycle (freed, foreign, stale, or bad pages)."
);
// Raised by the Python loaders (`blockdraft.config`, `blockdraft.checkpoint`), never by the
// core; it lives here so that every blockdraft error shares the one base class.
create_exception!(
    blockdraft._core,
    CheckpointError,
    BlockdraftError,
    "A drafter checkpoint is missing, unreadable or inconsistent."
);

/// `ConfigError(BlockdraftError, ValueError)`: `create_exception!` allows one base only, so the
/// class is built with `type()` at module init and kept here for raising.
pub(crate) static CONFIG_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

pub(crate) fn make_config_error(py: Python<'_>) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(
        py,
        [
            py.get_type::<BlockdraftError>(),
            py.get_type::<PyValueError>(),
        ],
    )?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "blockdraft._core")?;
    ns.set_item(
        "__doc__",
        "A configuration value (for example an environment variable) cannot be used.",
    )?;
    let ty = py
        .get_type::<PyType>()
        .call1(("ConfigError", bases, ns))?
        .cast_into::<PyType>()?;
    Ok(ty.unbind())
}

/// The one mapping from core errors to Python exceptions.
pub(crate) struct CoreError(pub(crate) core::Error);

impl From<core::Error> for CoreError {
    fn from(e: core::Error) -> Self {
        Self(e)
    }
}

impl From<CoreError> for PyErr {
    fn from(CoreError(e): CoreError) -> Self {
        let msg = e.to_string();
        with_message(&e, msg)
    }
}

/// The exception class of `e` (the one mapping), carrying `msg`.
pub(crate) fn with_message(e: &core::Error, msg: String) -> PyErr {
    use core::Error as E;
    match e {
        E::InSequence { source, .. } => with_message(source, msg),
        E::PoolExhausted { .. } => PoolExhaustedError::new_err(msg),
        E::PageOutOfRange { .. }
        | E::PageNotAllocated { .. }
        | E::DuplicatePage { .. }
        | E::Freed
        | E::ForeignOwner { .. }
        | E::ForeignSequence { .. }
        | E::NoContext
        | E::ForeignPlan
        | E::StalePlan { .. }
        | E::PlanOutstanding
        | E::PlanResolved
        | E::PoolMismatch { .. }
        | E::Invariant(_) => InvalidStateError::new_err(msg),
        E::InvalidArgument { .. } => PyValueError::new_err(msg),
        E::Config(_) => Python::attach(|py| match CONFIG_ERROR.get(py) {
            Some(ty) => PyErr::from_type(ty.bind(py).clone(), msg),
            None => PyValueError::new_err(msg),
        }),
    }
}

pub(crate) type CoreResult<T> = Result<T, CoreError>;

/// Lock, turning a poisoned lock (a panic under it) into an error instead of a second panic.
pub(crate) fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> CoreResult<MutexGuard<'a, T>> {
    m.lock().map_err(|_| {
        CoreError(core::Error::Invariant(format!(
            "the {what} lock was poisoned by an earlier panic; its contents cannot be trusted"
        )))
    })
}
