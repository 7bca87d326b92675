//! Whole-step entry points: one call does a step's bookkeeping for every sequence of a batch
//! (the checks, the plans, the confirms, the graph metadata), instead of a dozen Python-to-Rust
//! calls per sequence. The decisions stay in the core (`blockdraft_core::step` and the state's
//! plans); this module converts arguments, takes each state's lock in turn (state, then pool,
//! as everywhere; never two states at once) and maps errors.
//!
//! Locks are taken with the GIL held: the work under them touches no Python object and never
//! waits for the GIL, so a thread holding a state lock always finishes without it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use blockdraft_core as core;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};

use crate::convert::{i64_arg, i64_list_arg, is_repeat};
use crate::errors::{lock, with_message, CoreError, InvalidStateError, PoolExhaustedError};
use crate::{PyContextState, PyPrecomputePlan, StateShared};

/// `obj` as an int (`bool` refused), named `name` in errors.
pub(crate) fn strict_i64(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, not bool"
        )));
    }
    i64_arg(obj, name)
}

/// The states of one call: each a `ContextState` of proposer `owner`, none twice.
fn states_arg(
    states: &Bound<'_, PyAny>,
    owner: u64,
    what: &str,
) -> PyResult<Vec<Arc<StateShared>>> {
    let mut out: Vec<Arc<StateShared>> = Vec::with_capacity(states.len().unwrap_or(0));
    let mut seen: Option<HashSet<*const StateShared>> = None;
    for item in states.try_iter()? {
        let item = item?;
        let Ok(ctx) = item.cast::<PyContextState>() else {
            return Err(InvalidStateError::new_err(format!(
                "{what}: not a DFlash proposer state ({})",
                item.get_type().name()?
            )));
        };
        let shared = Arc::clone(&ctx.get().shared);
        shared
            .lock()?
            .ensure_owner(owner)
            .map_err(|e| map_err(e, what))?;
        if is_repeat(&out, &mut seen, &shared) {
            return Err(PyValueError::new_err(format!(
                "{what}: the same state appears twice"
            )));
        }
        out.push(shared);
    }
    Ok(out)
}

/// A lifecycle error of `what` in the proposer's words.
fn freed_err(what: &str) -> PyErr {
    InvalidStateError::new_err(format!("{what}: the state was freed"))
}

/// A core error of the call `what`: lifecycle errors of a state name the call ("propose: the
/// state was freed", "free: the state belongs to another proposer (owner 2, expected 1)"), and
/// so does every error of one sequence of a whole-step call.
pub(crate) fn map_err(e: core::Error, what: &str) -> PyErr {
    match e {
        core::Error::Freed => freed_err(what),
        e @ (core::Error::ForeignOwner { .. }
        | core::Error::ForeignSequence { .. }
        | core::Error::NoContext) => InvalidStateError::new_err(format!("{what}: {e}")),
        e @ core::Error::InSequence { .. } => prefixed(e, what),
        e => CoreError(e).into(),
    }
}

/// Any core error with `prefix` (the call, and the sequence for [`core::Error::InSequence`])
/// in front of its message: "forward: sequence 2: the state was freed".
pub(crate) fn prefixed(e: core::Error, prefix: &str) -> PyErr {
    match e {
        core::Error::InSequence { index, source } => {
            prefixed(*source, &format!("{prefix}: sequence {index}"))
        }
        core::Error::Freed => freed_err(prefix),
        e => with_message(&e, format!("{prefix}: {e}")),
    }
}

fn same_len(name: &str, got: usize, n: usize) -> PyResult<()> {
    if got == n {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "{n} states but {got} {name}"
        )))
    }
}

/// Check every state (live, with committed context) and anchor of a proposal over `states`
/// (owned by `owner`), then plan every sequence's context K/V. All or nothing: on any error no
/// plan stays outstanding. Returns the plans in order. Raises `InvalidStateError` (foreign,
/// freed, no context yet, not a state), `TypeError` / `ValueError` (a bad token or position, a
/// state given twice), `PoolExhaustedError`.
#[cfg(not(feature = "test-hooks"))]
#[pyfunction]
#[pyo3(signature = (what, states, tokens, positions, vocab, owner))]
fn plan_proposals(
    what: &str,
    states: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    vocab: usize,
    owner: u64,
) -> PyResult<Vec<PyPrecomputePlan>> {
    plan_all(what, states, tokens, positions, vocab, owner, None)
}

/// As without the `test-hooks` feature, plus `fail_at`, the fault point of
/// `blockdraft.faults.hits`: planning sequence `fail_at` raises `PoolExhaustedError` as if the
/// pool were empty there (the plans before it are given back).
#[cfg(feature = "test-hooks")]
#[pyfunction]
#[pyo3(signature = (what, states, tokens, positions, vocab, owner, fail_at=None))]
fn plan_proposals(
    what: &str,
    states: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    vocab: usize,
    owner: u64,
    fail_at: Option<usize>,
) -> PyResult<Vec<PyPrecomputePlan>> {
    plan_all(what, states, tokens, positions, vocab, owner, fail_at)
}

/// `plan_proposals`, with the fault point `fail_at` (always `None` without `test-hooks`).
fn plan_all(
    what: &str,
    states: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    vocab: usize,
    owner: u64,
    fail_at: Option<usize>,
) -> PyResult<Vec<PyPrecomputePlan>> {
    let shared = states_arg(states, owner, what)?;
    let n = shared.len();
    same_len("tokens", tokens.len()?, n)?;
    same_len("positions", positions.len()?, n)?;
    for (i, st) in shared.iter().enumerate() {
        let token = strict_i64(&tokens.get_item(i)?, "last_token")?;
        let position = strict_i64(&positions.get_item(i)?, "position")?;
        let guard = st.lock()?;
        core::check_proposal(&guard, token, position, vocab).map_err(|e| map_err(e, what))?;
    }
    // Dropping an unresolved plan aborts it: an error here gives back every earlier plan.
    let mut plans = Vec::with_capacity(n);
    for (i, st) in shared.into_iter().enumerate() {
        if fail_at == Some(i) {
            return Err(PoolExhaustedError::new_err(format!(
                "fault injection: pool_pages at sequence {i} of {n} (simulated pool exhaustion)"
            )));
        }
        let inner = st
            .with(core::ContextState::plan_precompute)
            .map_err(|CoreError(e)| map_err(e, what))?;
        plans.push(PyPrecomputePlan { inner, owner: st });
    }
    Ok(plans)
}

/// The drafts exist: confirm each plan (its K/V is stored) and record its proposal at
/// `positions[i]` with `counts[i]` drafts (an int: the same count for all). Stops at the first
/// error (a stale, foreign or resolved plan: `InvalidStateError`).
#[pyfunction]
#[pyo3(signature = (plans, positions, counts))]
fn confirm_proposals(
    plans: &Bound<'_, PyList>,
    positions: &Bound<'_, PyAny>,
    counts: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let n = plans.len();
    let same: Option<usize> = counts.extract().ok();
    same_len("positions", positions.len()?, n)?;
    if same.is_none() {
        same_len("counts", counts.len()?, n)?;
    }
    for (i, plan) in plans.iter().enumerate() {
        let plan = plan.cast_into::<PyPrecomputePlan>()?;
        let plan = plan.get();
        let position: usize = positions.get_item(i)?.extract()?;
        let count = match same {
            Some(c) => c,
            None => counts.get_item(i)?.extract()?,
        };
        plan.owner.with(|s, _| {
            s.confirm_precompute(&plan.inner)?;
            s.note_propose(position, count)
        })?;
    }
    Ok(())
}

/// Give back every plan's pages (a resolved plan is ignored).
#[pyfunction]
#[pyo3(signature = (plans))]
fn abort_plans(plans: &Bound<'_, PyList>) -> PyResult<()> {
    for plan in plans.iter() {
        let plan = plan.cast_into::<PyPrecomputePlan>()?;
        let plan = plan.get();
        plan.owner.with(|s, p| s.abort_precompute(p, &plan.inner))?;
    }
    Ok(())
}

/// Record a verify for every state: `accepted[i]` of its last proposal's drafts.
/// Raises as `ContextState.after_verify`; stops at the first error.
#[pyfunction]
#[pyo3(signature = (what, states, accepted, owner))]
fn verify_all(
    what: &str,
    states: &Bound<'_, PyAny>,
    accepted: &Bound<'_, PyAny>,
    owner: u64,
) -> PyResult<()> {
    let shared = states_arg(states, owner, what)?;
    same_len("accepted counts", accepted.len()?, shared.len())?;
    let counts = i64_list_arg(accepted, "num_accepted")?;
    for (st, count) in shared.iter().zip(counts) {
        let count = usize::try_from(count).map_err(|_| {
            PyValueError::new_err(format!("num_accepted must be >= 0, got {count}"))
        })?;
        st.lock()?
            .after_verify(count)
            .map_err(|e| map_err(e, what))?;
    }
    Ok(())
}

/// One state's share of an `AppendBatch`.
struct Append {
    shared: Arc<StateShared>,
    plan: core::AppendPlan,
    /// The index of its state in the call.
    index: usize,
    /// Its first kept row in the call's rows.
    src_start: usize,
}

/// The accumulator work of one commit over many states (`plan_appends`): per state the rows
/// it keeps, where they come from and go, and the slides to do first; `apply` records it all.
#[pyclass(name = "AppendBatch", module = "blockdraft._core", frozen)]
struct PyAppendBatch {
    /// One entry per state that gets rows, in the states' order.
    appends: Vec<Append>,
    n_rows: usize,
}

#[pymethods]
impl PyAppendBatch {
    /// Rows given in all (cut ones included).
    #[getter]
    fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Per state with rows (an entry), in the call's order: `(index of the state in the call,
    /// its first kept row in the call's rows, its first accumulator row to write, rows kept)`.
    #[getter]
    fn entries(&self) -> Vec<(usize, usize, usize, usize)> {
        self.appends
            .iter()
            .map(|a| (a.index, a.src_start, a.plan.dst_start, a.plan.n_rows()))
            .collect()
    }

    /// Rows kept in all.
    #[getter]
    fn kept(&self) -> usize {
        self.appends.iter().map(|a| a.plan.n_rows()).sum()
    }

    /// `(entry, src_start, keep)` of each slide to do before writing the rows.
    #[getter]
    fn slides<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.appends
            .iter()
            .enumerate()
            .filter_map(|(e, a)| a.plan.slide.map(|s| (e, s.src_start, s.keep)))
            .map(|t| PyTuple::new(py, [t.0, t.1, t.2]))
            .collect()
    }

    /// The row map of the accumulator kernel: per kept row (in order) its entry, then per kept
    /// row its destination row.
    fn row_map(&self) -> Vec<usize> {
        let kept = self.kept();
        let mut out = Vec::with_capacity(2 * kept);
        for (e, a) in self.appends.iter().enumerate() {
            out.extend(std::iter::repeat_n(e, a.plan.n_rows()));
        }
        for a in &self.appends {
            out.extend(a.plan.dst_start..a.plan.dst_start + a.plan.n_rows());
        }
        out
    }

    /// The rows are written: record every append (stops at the first error: a stale plan).
    fn apply(&self) -> PyResult<()> {
        for a in &self.appends {
            a.shared.with(|s, p| s.apply_append(p, &a.plan))?;
        }
        Ok(())
    }
}

/// Plan a commit of `positions[i]` (ints; may be empty) to each of `states`. A state given
/// more rows than its window keeps only the newest. Changes nothing. Raises `InvalidStateError`
/// (foreign, freed, not a state), `TypeError` / `ValueError` (positions that are not ints, or
/// negative, unordered, not after the context; a state given twice).
#[pyfunction]
#[pyo3(signature = (what, states, positions, owner))]
fn plan_appends(
    what: &str,
    states: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    owner: u64,
) -> PyResult<PyAppendBatch> {
    let shared = states_arg(states, owner, what)?;
    same_len("position lists", positions.len()?, shared.len())?;
    let mut batch = PyAppendBatch {
        appends: Vec::with_capacity(shared.len()),
        n_rows: 0,
    };
    let py = positions.py();
    for (i, st) in shared.into_iter().enumerate() {
        let pos = i64_list_arg(&positions.get_item(i)?, "positions").map_err(|e| {
            if e.is_instance_of::<PyTypeError>(py) {
                PyTypeError::new_err(format!(
                    "positions must be ints (a float position is never rounded): {}",
                    e.value(py)
                ))
            } else {
                e
            }
        })?;
        if pos.is_empty() {
            if st.lock()?.freed() {
                return Err(freed_err(what));
            }
            continue;
        }
        let (plan, skip) = st
            .lock()?
            .plan_append_newest(&pos)
            .map_err(|e| map_err(e, what))?;
        batch.appends.push(Append {
            shared: st,
            plan,
            index: i,
            src_start: batch.n_rows + skip,
        });
        batch.n_rows += pos.len();
    }
    Ok(batch)
}

/// The graph path's metadata writer over a host tensor (see `blockdraft_core::step`): per
/// call, every sequence's scalars, page table and staged context rows, with a mirror of what
/// each row holds so unchanged tables are not rewritten.
#[pyclass(name = "GraphMeta", module = "blockdraft._core", frozen)]
struct PyGraphMeta {
    /// The tensor written through `ptr`: held so it outlives this object.
    _host: Py<PyAny>,
    ptr: usize,
    len: usize,
    meta: Mutex<core::GraphMeta>,
}

impl PyGraphMeta {
    /// The host tensor's elements.
    ///
    /// The slice is valid for as long as `self` lives: `self` holds the tensor, which was
    /// checked at construction to be a contiguous CPU `int64` tensor of exactly `len`
    /// elements at `ptr`, and every caller holds the GIL, so no Python code touches the tensor
    /// while the slice is in use. Callers make one slice at a time: `py_new` before the object
    /// exists, `fill` under the `meta` lock. (Resizing the tensor from Python would break
    /// this; the tensor is private to the graph runner.)
    #[allow(clippy::mut_from_ref)]
    fn buf(&self, _py: Python<'_>) -> &mut [i64] {
        // SAFETY: see the method's documentation; `ptr` is aligned for i64 (a torch int64
        // tensor's storage) and `len` elements long.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut i64, self.len) }
    }
}

#[pymethods]
impl PyGraphMeta {
    /// `host`: a contiguous CPU int64 tensor `[rows, layout(width, block_size)[4]]` (written in
    /// place from now on: ``init`` runs at once); `stride`: bytes between two rows of a source.
    #[new]
    #[pyo3(signature = (host, width, block_size, mask_id, stride=0))]
    fn py_new(
        py: Python<'_>,
        host: &Bound<'_, PyAny>,
        width: usize,
        block_size: usize,
        mask_id: i64,
        stride: i64,
    ) -> PyResult<Self> {
        let shape: Vec<usize> = host.getattr("shape")?.extract()?;
        let device: String = host.getattr("device")?.getattr("type")?.extract()?;
        let elem: usize = host.call_method0("element_size")?.extract()?;
        let is_float: bool = host.call_method0("is_floating_point")?.extract()?;
        let contiguous: bool = host.call_method0("is_contiguous")?.extract()?;
        let [rows, cols] = shape[..] else {
            return Err(PyValueError::new_err(format!(
                "host must be 2-D, got {shape:?}"
            )));
        };
        let meta =
            core::GraphMeta::new(rows, width, block_size, mask_id, stride).map_err(CoreError)?;
        if device != "cpu" || elem != 8 || is_float || !contiguous || cols != meta.cols() {
            return Err(PyValueError::new_err(format!(
                "host must be a contiguous CPU int64 tensor [rows, {}], got {shape:?} on {device}",
                meta.cols()
            )));
        }
        let ptr: usize = host.call_method0("data_ptr")?.extract()?;
        let this = Self {
            _host: host.clone().unbind(),
            ptr,
            len: rows * cols,
            meta: Mutex::new(meta),
        };
        let buf = this.buf(py);
        lock(&this.meta, "graph metadata")?.init(buf);
        Ok(this)
    }

    /// The matrix's columns for tables of `width` entries and blocks of `block_size` rows:
    /// `(table_col, pos_col, slot_col, src_col, cols)` (the layout is the core's).
    #[staticmethod]
    fn layout(width: usize, block_size: usize) -> (usize, usize, usize, usize, usize) {
        let l = core::MetaLayout { width, block_size };
        (
            core::MetaLayout::TABLE_COL,
            l.pos_col(),
            l.slot_col(),
            l.src_col(),
            l.cols(),
        )
    }

    /// Staged rows of the last filled call.
    #[getter]
    fn staged(&self) -> PyResult<usize> {
        Ok(lock(&self.meta, "graph metadata")?.staged())
    }

    /// Write one call: the outstanding `plans` of the call's sequences (from `plan_proposals`)
    /// and their anchors; with `bases`, each sequence's source base address (the source
    /// column then says where each staged row is read from, and `staged_rows` is empty).
    /// Returns `(staged, eager, staged_rows)`: the staged row count, the
    /// sequences whose plans are too long to stage (their K/V is the caller's to store first),
    /// and `(sequence, row_start, row_end)` of each staged plan in order; or `None` when a
    /// table is wider than the graphs (the call takes the plain path).
    #[allow(clippy::type_complexity, clippy::needless_pass_by_value)]
    #[pyo3(signature = (plans, tokens, positions, bases=None))]
    fn fill(
        &self,
        py: Python<'_>,
        plans: &Bound<'_, PyList>,
        tokens: Vec<i64>,
        positions: Vec<i64>,
        bases: Option<Vec<i64>>,
    ) -> PyResult<Option<(usize, Vec<usize>, Vec<(usize, usize, usize)>)>> {
        let n = plans.len();
        same_len("tokens", tokens.len(), n)?;
        same_len("positions", positions.len(), n)?;
        if let Some(b) = &bases {
            same_len("bases", b.len(), n)?;
        }
        let mut meta = lock(&self.meta, "graph metadata")?;
        if n > meta.rows() {
            return Err(PyValueError::new_err(format!(
                "{n} sequences exceed the bucket's {} rows",
                meta.rows()
            )));
        }
        let buf = self.buf(py);
        meta.begin();
        for (i, plan) in plans.iter().enumerate() {
            let plan = plan.cast_into::<PyPrecomputePlan>()?;
            let plan = plan.get();
            let state = plan.owner.lock()?;
            if meta
                .row(
                    buf,
                    (state.id(), state.slides()),
                    state.page_table(),
                    &plan.inner,
                    (tokens[i], positions[i]),
                    bases.as_ref().map(|b| b[i]),
                )
                .is_err()
            {
                return Ok(None);
            }
        }
        let filled = meta.finish(buf);
        Ok(Some((
            filled.staged,
            filled.eager.clone(),
            filled.staged_rows.clone(),
        )))
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAppendBatch>()?;
    m.add_class::<PyGraphMeta>()?;
    m.add_function(wrap_pyfunction!(plan_proposals, m)?)?;
    m.add_function(wrap_pyfunction!(confirm_proposals, m)?)?;
    m.add_function(wrap_pyfunction!(abort_plans, m)?)?;
    m.add_function(wrap_pyfunction!(verify_all, m)?)?;
    m.add_function(wrap_pyfunction!(plan_appends, m)?)?;
    Ok(())
}
