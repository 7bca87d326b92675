//! Argument conversion: Python ints and lists into the core's types, with `TypeError` /
//! `ValueError` messages that name the argument (never `OverflowError`).

use std::collections::HashSet;
use std::sync::Arc;

use blockdraft_core as core;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyInt;

use crate::errors::CoreError;

/// A non-negative Python int as `usize`: `TypeError` for non-ints, `ValueError` naming the
/// argument for negative or too large values (never `OverflowError`).
pub(crate) fn size_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    match obj.extract::<usize>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() => {
            if obj.lt(0)? {
                Err(PyValueError::new_err(format!(
                    "{name} must be non-negative, got {obj}"
                )))
            } else {
                Err(PyValueError::new_err(format!("{name} is too large: {obj}")))
            }
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            obj.get_type().name()?
        ))),
    }
}

/// Like [`size_arg`] but a value beyond `usize` saturates (used for budgets).
pub(crate) fn saturating_size_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    match size_arg(obj, name) {
        Err(e) if obj.is_instance_of::<PyInt>() && !obj.lt(0)? => {
            drop(e);
            Ok(usize::MAX)
        }
        r => r,
    }
}

/// A Python int as `i64`: `TypeError` for non-ints, `ValueError` naming the argument when out
/// of range.
pub(crate) fn i64_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() => Err(PyValueError::new_err(format!(
            "{name} is out of the 64-bit range: {obj}"
        ))),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{name} must be an int, got {}",
            obj.get_type().name()?
        ))),
    }
}

/// A sequence of ints as `Vec<i64>` (a `str` or non-sequence is a `TypeError`).
pub(crate) fn i64_list_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a list of ints, got str"
        )));
    }
    let items = obj.try_iter().map_err(|_| {
        let ty = obj.get_type();
        let ty = ty.name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        PyTypeError::new_err(format!("{name} must be a list of ints, got {ty}"))
    })?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, item) in items.enumerate() {
        let item = item?;
        // The fast path formats nothing; the element's name is built only for an error.
        match item.extract::<i64>() {
            Ok(v) => out.push(v),
            Err(_) => out.push(i64_arg(&item, &format!("{name}[{i}]"))?),
        }
    }
    Ok(out)
}

pub(crate) fn optional<'a, 'py>(
    obj: Option<&'a Bound<'py, PyAny>>,
) -> Option<&'a Bound<'py, PyAny>> {
    obj.filter(|o| !o.is_none())
}

/// A proposer id: a non-negative int of at most 64 bits.
pub(crate) fn owner_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    u64::try_from(size_arg(obj, "owner")?).map_err(|_| PyValueError::new_err("owner is too large"))
}

pub(crate) fn cap_arg(cap: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match optional(cap) {
        Some(c) => size_arg(c, "cap"),
        None => Ok(core::read_ctx_cap().map_err(CoreError)?),
    }
}

pub(crate) fn positive(v: usize, name: &'static str) -> PyResult<usize> {
    if v == 0 {
        Err(PyValueError::new_err(format!("{name} must be >= 1, got 0")))
    } else {
        Ok(v)
    }
}

pub(crate) fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

/// Calls with fewer items than this find a repeat by scanning the ones before each (cheaper
/// than hashing for a handful, e.g. the one state of `propose`); wider ones hash.
const SCAN_BELOW: usize = 16;

/// Whether `next` is already among `earlier` (by identity). `seen` holds a set of `earlier`
/// once the call is wide enough to hash; pass the same `seen` for every item of one call.
pub(crate) fn is_repeat<T>(
    earlier: &[Arc<T>],
    seen: &mut Option<HashSet<*const T>>,
    next: &Arc<T>,
) -> bool {
    if earlier.len() < SCAN_BELOW {
        earlier.iter().any(|o| Arc::ptr_eq(o, next))
    } else {
        let set = seen.get_or_insert_with(|| earlier.iter().map(Arc::as_ptr).collect());
        !set.insert(Arc::as_ptr(next))
    }
}
