//! Target sequences' page tables (`SeqPages`) and the whole-step calls over them
//! (`plan_forward`, `accept_rows`, `free_all`). The rules are the core's
//! (`blockdraft_core::pages`, `blockdraft_core::pages_step`); this module converts arguments,
//! locks, and maps errors.
//!
//! A whole-step call checks every sequence and then changes them, so it holds all of its
//! sequences' locks at once (taken in address order, so two calls over overlapping sequences
//! cannot deadlock) and only then a pool lock, one at a time: the same "sequence, then pool"
//! order as every single-sequence call. The locks are held with the GIL released.

use std::collections::HashSet;
use std::sync::{Arc, MutexGuard};

use blockdraft_core as core;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyString};

use crate::convert::{is_repeat, optional, owner_arg, positive, py_bool, size_arg};
use crate::errors::{lock, CoreError, CoreResult, InvalidStateError};
use crate::shared::Shared;
use crate::step::{prefixed, strict_i64};
use crate::PyBlockPool;

/// A sequence and the pool it draws from.
type PagesShared = Shared<core::SeqPages>;

/// One target sequence's K/V pages (all taken at creation) and its committed and pending
/// token counts. See `blockdraft/_core.pyi`.
#[pyclass(name = "SeqPages", module = "blockdraft._core", frozen)]
pub(crate) struct PySeqPages {
    shared: Arc<PagesShared>,
}

impl PySeqPages {
    fn read<T>(&self, f: impl FnOnce(&core::SeqPages) -> T) -> PyResult<T> {
        let guard = self.shared.lock()?;
        Ok(f(&guard))
    }
}

#[pymethods]
impl PySeqPages {
    #[new]
    // `owner=None` only so that negative ints are reported as `ValueError`; Python sees (and
    // the stub declares) the default 0.
    #[pyo3(signature = (pool, capacity, owner=None), text_signature = "(pool, capacity, owner=0)")]
    fn py_new(
        py: Python<'_>,
        pool: &Bound<'_, PyBlockPool>,
        capacity: &Bound<'_, PyAny>,
        owner: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let capacity = positive(size_arg(capacity, "capacity")?, "capacity")?;
        let owner = optional(owner).map_or(Ok(0), owner_arg)?;
        let pool = Arc::clone(&pool.get().pool);
        let seq = py.detach(|| {
            let mut guard = lock(&pool, "pool")?;
            core::SeqPages::new(&mut guard, capacity, owner).map_err(CoreError)
        })?;
        Ok(Self {
            shared: Arc::new(PagesShared::new(seq, pool)),
        })
    }

    #[getter]
    fn owner(&self) -> PyResult<u64> {
        self.read(core::SeqPages::owner)
    }
    #[getter]
    fn capacity(&self) -> PyResult<usize> {
        self.read(core::SeqPages::capacity)
    }
    #[getter]
    fn page_size(&self) -> PyResult<usize> {
        self.read(core::SeqPages::page_size)
    }
    #[getter]
    fn length(&self) -> PyResult<usize> {
        self.read(core::SeqPages::length)
    }
    #[getter]
    fn pending(&self) -> PyResult<usize> {
        self.read(core::SeqPages::pending)
    }
    #[getter]
    fn pages(&self) -> PyResult<Vec<usize>> {
        self.read(|s| s.pages().to_vec())
    }
    #[getter]
    fn num_pages(&self) -> PyResult<usize> {
        self.read(core::SeqPages::num_pages)
    }
    #[getter]
    fn freed(&self) -> PyResult<bool> {
        self.read(core::SeqPages::freed)
    }

    #[pyo3(signature = (pos))]
    fn slot(&self, pos: &Bound<'_, PyAny>) -> PyResult<usize> {
        let pos = size_arg(pos, "pos")?;
        self.read(|s| s.slot(pos))?.map_err(|e| prefixed(e, "slot"))
    }

    #[pyo3(signature = (k))]
    fn accept(&self, k: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = size_arg(k, "k")?;
        self.shared
            .lock()?
            .accept(k)
            .map_err(|e| prefixed(e, "accept"))
    }

    /// With `owner`, a sequence of another owner is refused before anything changes (checked on
    /// a freed sequence too, which is then still a no-op).
    #[pyo3(signature = (owner=None))]
    fn free(&self, py: Python<'_>, owner: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let owner = optional(owner).map(|o| owner_arg(o)).transpose()?;
        py.detach(|| {
            self.shared.with(|s, p| {
                if let Some(o) = owner {
                    s.ensure_owner(o)?;
                }
                s.free(p)
            })
        })
        .map_err(|CoreError(e)| prefixed(e, "free"))
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.shared.with(|s, p| s.check_invariants(p)))?)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.read(|s| {
            format!(
                "SeqPages(capacity={}, length={}, pending={}, pages={}, freed={})",
                s.capacity(),
                s.length(),
                s.pending(),
                s.num_pages(),
                py_bool(s.freed())
            )
        })
    }
}

/// The sequences of one call: each a `SeqPages`, none twice.
fn seqs_arg(seqs: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Arc<PagesShared>>> {
    let mut out: Vec<Arc<PagesShared>> = Vec::with_capacity(seqs.len().unwrap_or(0));
    let mut seen: Option<HashSet<*const PagesShared>> = None;
    for (i, item) in seqs.try_iter()?.enumerate() {
        let item = item?;
        let Ok(seq) = item.cast::<PySeqPages>() else {
            return Err(InvalidStateError::new_err(format!(
                "{what}: sequence {i}: not a target sequence (a {}, not a SeqPages)",
                item.get_type().name()?
            )));
        };
        let shared = Arc::clone(&seq.get().shared);
        if is_repeat(&out, &mut seen, &shared) {
            return Err(PyValueError::new_err(format!(
                "{what}: sequence {i}: the same sequence appears twice"
            )));
        }
        out.push(shared);
    }
    Ok(out)
}

/// A sequence of ints (`bool` refused), one per sequence of the call; element errors name the
/// sequence.
fn counts_arg(obj: &Bound<'_, PyAny>, what: &str, name: &str) -> PyResult<Vec<i64>> {
    let not_a_list = || {
        let ty = obj.get_type();
        let ty = ty.name().map_or_else(|_| "?".to_owned(), |n| n.to_string());
        PyTypeError::new_err(format!("{what}: {name} must be a list of ints, got {ty}"))
    };
    if obj.is_instance_of::<PyString>() {
        return Err(not_a_list());
    }
    let items = obj.try_iter().map_err(|_| not_a_list())?;
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for (i, item) in items.enumerate() {
        let item = item?;
        // The fast path formats nothing; the element's name is built only for an error.
        match item.extract::<i64>() {
            Ok(v) if !item.is_instance_of::<PyBool>() => out.push(v),
            _ => out.push(strict_i64(&item, &format!("{what}: sequence {i}: {name}"))?),
        }
    }
    Ok(out)
}

/// Lock every sequence (in address order) and run `f` on them, in the call's order.
fn with_all<T>(
    shared: &[Arc<PagesShared>],
    f: impl FnOnce(&mut [&mut core::SeqPages]) -> core::Result<T>,
) -> CoreResult<T> {
    let mut order: Vec<usize> = (0..shared.len()).collect();
    order.sort_unstable_by_key(|&i| Arc::as_ptr(&shared[i]) as usize);
    let mut guards: Vec<Option<MutexGuard<'_, core::SeqPages>>> =
        std::iter::repeat_with(|| None).take(shared.len()).collect();
    for i in order {
        guards[i] = Some(shared[i].lock()?);
    }
    let mut seqs: Vec<&mut core::SeqPages> =
        guards.iter_mut().flatten().map(|g| &mut **g).collect();
    Ok(f(&mut seqs)?)
}

/// What one forward over many sequences writes and reads (from :func:`plan_forward`); plain
/// data.
#[pyclass(name = "ForwardPlan", module = "blockdraft._core", frozen)]
struct PyForwardPlan {
    inner: core::ForwardPlan,
}

#[pymethods]
impl PyForwardPlan {
    #[getter]
    fn n_rows(&self) -> usize {
        self.inner.n_rows()
    }
    #[getter]
    fn positions(&self) -> Vec<usize> {
        self.inner.positions.clone()
    }
    #[getter]
    fn slots(&self) -> Vec<usize> {
        self.inner.slots.clone()
    }
    #[getter]
    fn q_starts(&self) -> Vec<usize> {
        self.inner.q_starts.clone()
    }
    #[getter]
    fn kv_lens(&self) -> Vec<usize> {
        self.inner.kv_lens.clone()
    }
    #[getter]
    fn max_rows(&self) -> usize {
        self.inner.max_rows
    }
    #[getter]
    fn max_pages(&self) -> usize {
        self.inner.max_pages
    }

    #[pyo3(signature = (width))]
    fn page_table(&self, width: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let width = size_arg(width, "width")?;
        self.inner
            .page_table(width)
            .map_err(|e| prefixed(e, "page_table"))
    }

    /// The page table written straight into `out` (see the stub), without a Python list; with
    /// `pad` false only each row's pages are written.
    #[pyo3(signature = (out, width, pad=true))]
    fn fill(&self, out: &Bound<'_, PyAny>, width: &Bound<'_, PyAny>, pad: bool) -> PyResult<()> {
        let width = size_arg(width, "width")?;
        let n = self.inner.n_seqs();
        let (ptr, len) = int32_host(out, n, width)?;
        let fill = |buf: &mut [i32]| {
            if pad {
                self.inner.fill_page_table(buf, width)
            } else {
                self.inner.fill_page_table_pages(buf, width)
            }
        };
        if len == 0 {
            return fill(&mut []).map_err(|e| prefixed(e, "fill"));
        }
        // SAFETY: `int32_host` checked that `out` is a plain `torch.Tensor` on the CPU, strided,
        // contiguous, of dtype int32 and shape [n, width], so its `len` elements lie back to
        // back from `ptr`, which is non-null and aligned for i32. `out` is borrowed for the
        // whole call and the GIL is held throughout, so no Python code can resize or free the
        // tensor while the slice lives; the slice ends with this call. A caller must not have
        // an asynchronous device copy out of the tensor in flight (the same rule as for any
        // in-place write to it).
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr as *mut i32, len) };
        fill(buf).map_err(|e| prefixed(e, "fill"))
    }

    fn __repr__(&self) -> String {
        format!(
            "ForwardPlan(n_seqs={}, n_rows={}, max_rows={}, max_pages={})",
            self.inner.n_seqs(),
            self.inner.n_rows(),
            self.inner.max_rows,
            self.inner.max_pages
        )
    }
}

/// The data pointer and element count of `out` after checking that it is a contiguous CPU
/// int32 `torch.Tensor` of shape `[n, width]` (`TypeError` for anything but a tensor,
/// `ValueError` for another dtype, layout, device, shape or layout in memory).
fn int32_host(out: &Bound<'_, PyAny>, n: usize, width: usize) -> PyResult<(usize, usize)> {
    let py = out.py();
    let torch = py.import("torch")?;
    // The exact class: a subclass may carry no real storage behind `data_ptr`.
    if !out.get_type().is(&torch.getattr("Tensor")?) {
        return Err(PyTypeError::new_err(format!(
            "fill: out must be a torch.Tensor, got {}",
            out.get_type().name()?
        )));
    }
    let dtype = out.getattr("dtype")?;
    let device: String = out.getattr("device")?.getattr("type")?.extract()?;
    let shape: Vec<usize> = out.getattr("shape")?.extract()?;
    let strided = out.getattr("layout")?.eq(torch.getattr("strided")?)?;
    let int32 = dtype.eq(torch.getattr("int32")?)?;
    let contiguous = strided && out.call_method0("is_contiguous")?.extract::<bool>()?;
    let dtype = dtype.str()?;
    let refuse = |why: &str| {
        PyValueError::new_err(format!(
            "fill: out must be a contiguous CPU int32 tensor [{n}, {width}], got {dtype} \
             {shape:?} on {device}{why}"
        ))
    };
    if !int32 || device != "cpu" || shape != [n, width] {
        return Err(refuse(""));
    }
    if !contiguous {
        return Err(refuse(" (not contiguous)"));
    }
    let len = n * width;
    // Asked only of a checked CPU tensor (other devices' pointers mean nothing here).
    let ptr: usize = out.call_method0("data_ptr")?.extract()?;
    if len > 0 && (ptr == 0 || ptr % std::mem::align_of::<i32>() != 0) {
        return Err(refuse(&format!(
            " (data at {ptr:#x}, not aligned for int32)"
        )));
    }
    Ok((ptr, len))
}

/// Check every sequence (a `SeqPages` of `owner`, live, given once, `rows[i]` an int >= 1
/// within its capacity), then mark each one's rows pending; returns the forward's plan.
#[pyfunction]
#[pyo3(signature = (what, seqs, rows, owner))]
fn plan_forward(
    py: Python<'_>,
    what: &str,
    seqs: &Bound<'_, PyAny>,
    rows: &Bound<'_, PyAny>,
    owner: &Bound<'_, PyAny>,
) -> PyResult<PyForwardPlan> {
    let owner = owner_arg(owner)?;
    let shared = seqs_arg(seqs, what)?;
    let rows = counts_arg(rows, what, "rows")?;
    let inner = py
        .detach(|| with_all(&shared, |s| core::plan_forward(s, &rows, owner)))
        .map_err(|CoreError(e)| prefixed(e, what))?;
    Ok(PyForwardPlan { inner })
}

/// Check every sequence (a `SeqPages` of `owner`, live, given once, `0 <= counts[i] <=
/// pending`), then accept `counts[i]` rows of each.
#[pyfunction]
#[pyo3(signature = (what, seqs, counts, owner))]
fn accept_rows(
    py: Python<'_>,
    what: &str,
    seqs: &Bound<'_, PyAny>,
    counts: &Bound<'_, PyAny>,
    owner: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let owner = owner_arg(owner)?;
    let shared = seqs_arg(seqs, what)?;
    let counts = counts_arg(counts, what, "counts")?;
    py.detach(|| with_all(&shared, |s| core::accept_rows(s, &counts, owner)))
        .map_err(|CoreError(e)| prefixed(e, what))
}

/// Check that every sequence belongs to `owner`, then free each; returns how many were live.
#[pyfunction]
#[pyo3(signature = (what, seqs, owner))]
fn free_all(
    py: Python<'_>,
    what: &str,
    seqs: &Bound<'_, PyAny>,
    owner: &Bound<'_, PyAny>,
) -> PyResult<usize> {
    let owner = owner_arg(owner)?;
    let shared = seqs_arg(seqs, what)?;
    let pool_for = |i: usize| shared[i].lock_pool().map_err(|CoreError(e)| e);
    py.detach(|| with_all(&shared, |s| core::free_all(s, owner, pool_for)))
        .map_err(|CoreError(e)| prefixed(e, what))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySeqPages>()?;
    m.add_class::<PyForwardPlan>()?;
    m.add_function(wrap_pyfunction!(plan_forward, m)?)?;
    m.add_function(wrap_pyfunction!(accept_rows, m)?)?;
    m.add_function(wrap_pyfunction!(free_all, m)?)?;
    Ok(())
}
