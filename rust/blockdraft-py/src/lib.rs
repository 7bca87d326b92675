//! `blockdraft._core`: thin `PyO3` bindings of `blockdraft-core`.
//!
//! Argument conversion, error mapping and locking live here; every decision is made by the
//! core. The pool is shared as `Arc<Mutex<BlockPool>>` between the Python `BlockPool` and every
//! `ContextState` made from it. Lock order is always state, then pool; no lock is ever held
//! while waiting for the GIL (work under a lock runs with the GIL released or touches no
//! Python object), so the GIL and these locks cannot deadlock.

#![warn(clippy::pedantic)]

mod step;

use std::sync::{Arc, Mutex, MutexGuard};

use blockdraft_core as core;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyInt, PyTuple, PyType};

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
    "The shared block pool cannot satisfy an allocation; nothing was changed."
);
create_exception!(
    blockdraft._core,
    InvalidStateError,
    BlockdraftError,
    "A state or plan was used out of its lifecycle (freed, foreign, stale, or bad blocks)."
);
create_exception!(
    blockdraft._core,
    CheckpointError,
    BlockdraftError,
    "A drafter checkpoint is missing, unreadable or inconsistent."
);

/// `ConfigError(BlockdraftError, ValueError)`: `create_exception!` allows one base only, so the
/// class is built with `type()` at module init and kept here for raising.
static CONFIG_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn make_config_error(py: Python<'_>) -> PyResult<Py<PyType>> {
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
struct CoreError(core::Error);

impl From<core::Error> for CoreError {
    fn from(e: core::Error) -> Self {
        Self(e)
    }
}

impl From<CoreError> for PyErr {
    fn from(CoreError(e): CoreError) -> Self {
        use core::Error as E;
        let msg = e.to_string();
        match e {
            E::PoolExhausted { .. } => PoolExhaustedError::new_err(msg),
            E::BlockOutOfRange { .. }
            | E::BlockNotAllocated { .. }
            | E::DuplicateBlock { .. }
            | E::Freed
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
            E::Checkpoint(_) => CheckpointError::new_err(msg),
        }
    }
}

type CoreResult<T> = Result<T, CoreError>;

/// Lock, turning a poisoned lock (a panic under it) into an error instead of a second panic.
fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> CoreResult<MutexGuard<'a, T>> {
    m.lock().map_err(|_| {
        CoreError(core::Error::Invariant(format!(
            "the {what} lock was poisoned by an earlier panic; its contents cannot be trusted"
        )))
    })
}

/// A non-negative Python int as `usize`: `TypeError` for non-ints, `ValueError` naming the
/// argument for negative or too large values (never `OverflowError`).
fn size_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
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
fn saturating_size_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
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
fn i64_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<i64> {
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
fn i64_list_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
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

fn optional<'a, 'py>(obj: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
    obj.filter(|o| !o.is_none())
}

fn cap_arg(cap: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    match optional(cap) {
        Some(c) => size_arg(c, "cap"),
        None => Ok(core::read_ctx_cap().map_err(CoreError)?),
    }
}

fn positive(v: usize, name: &'static str) -> PyResult<usize> {
    if v == 0 {
        Err(PyValueError::new_err(format!("{name} must be >= 1, got 0")))
    } else {
        Ok(v)
    }
}

/// Rows of the per-sequence context accumulator: `ceiling = max_seq_len` if the cap is 0,
/// else `min(max_seq_len, cap)`; `window = min(ceiling, budget_tokens + gamma + 1)`
/// (saturating). `budget_tokens=None` means the ceiling; `cap=None` reads
/// `BLOCKDRAFT_DFLASH_CTX_CAP` (default 16384). Raises `ValueError` for a zero or negative size,
/// `ConfigError` for a bad environment value.
#[pyfunction]
#[pyo3(signature = (max_seq_len, gamma, budget_tokens=None, cap=None))]
fn ctx_window(
    max_seq_len: &Bound<'_, PyAny>,
    gamma: &Bound<'_, PyAny>,
    budget_tokens: Option<&Bound<'_, PyAny>>,
    cap: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let max_seq_len = positive(size_arg(max_seq_len, "max_seq_len")?, "max_seq_len")?;
    let gamma = positive(size_arg(gamma, "gamma")?, "gamma")?;
    let budget = optional(budget_tokens)
        .map(|b| saturating_size_arg(b, "budget_tokens"))
        .transpose()?;
    let cap = cap_arg(cap)?;
    Ok(core::ctx_window(max_seq_len, gamma, budget, cap).map_err(CoreError)?)
}

/// `max_seq_len` if the cap is 0, else `min(max_seq_len, cap)`; `cap=None` reads the
/// environment. Raises `ValueError` (`max_seq_len < 1`, a negative cap) or `ConfigError`.
#[pyfunction]
#[pyo3(signature = (max_seq_len, cap=None))]
fn ctx_ceiling(max_seq_len: &Bound<'_, PyAny>, cap: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    let max_seq_len = positive(size_arg(max_seq_len, "max_seq_len")?, "max_seq_len")?;
    let cap = cap_arg(cap)?;
    Ok(core::ctx_ceiling(max_seq_len, cap).map_err(CoreError)?)
}

/// The cap from `BLOCKDRAFT_DFLASH_CTX_CAP` (default 16384, 0 = uncapped). Raises `ConfigError`
/// when the value is not a non-negative integer.
#[pyfunction]
fn read_ctx_cap() -> PyResult<usize> {
    Ok(core::read_ctx_cap().map_err(CoreError)?)
}

/// 1 without a batched path or when `width < 2`; else `min(width, max(max_batch, 1))`.
#[pyfunction]
#[pyo3(signature = (batched_path, width, max_batch))]
fn propose_batch_max(
    batched_path: bool,
    width: &Bound<'_, PyAny>,
    max_batch: &Bound<'_, PyAny>,
) -> PyResult<i64> {
    Ok(core::propose_batch_max(
        batched_path,
        i64_arg(width, "width")?,
        i64_arg(max_batch, "max_batch")?,
    ))
}

/// Why `propose_batch` must decline before doing any work, or `None` to proceed: `n < 2`,
/// `n > max_batch`, `num_positions != n`, `num_states != n`, or no batched path.
#[pyfunction]
#[pyo3(signature = (n, max_batch, batched_path, num_positions, num_states))]
fn batch_decline_reason(
    n: &Bound<'_, PyAny>,
    max_batch: &Bound<'_, PyAny>,
    batched_path: bool,
    num_positions: &Bound<'_, PyAny>,
    num_states: &Bound<'_, PyAny>,
) -> PyResult<Option<String>> {
    Ok(core::batch_decline_reason(
        i64_arg(n, "n")?,
        i64_arg(max_batch, "max_batch")?,
        batched_path,
        i64_arg(num_positions, "num_positions")?,
        i64_arg(num_states, "num_states")?,
    ))
}

/// Split `n * block` output tokens into `n` bands of drafts: band i is
/// `tokens[i*block:(i+1)*block]`, without its row 0 (the anchor) when there is a mask token,
/// at most `draft_cap` drafts each. `None` when fewer than `n * block` tokens were given.
/// Raises `ValueError` for `n < 1`, `block < 1` or `draft_cap < 1`.
#[pyfunction]
#[pyo3(signature = (tokens, n, block, has_mask_token, draft_cap=None))]
fn split_bands(
    tokens: &Bound<'_, PyAny>,
    n: &Bound<'_, PyAny>,
    block: &Bound<'_, PyAny>,
    has_mask_token: bool,
    draft_cap: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<Vec<i64>>>> {
    let n = positive(size_arg(n, "n")?, "n")?;
    let block = positive(size_arg(block, "block")?, "block")?;
    let cap = optional(draft_cap)
        .map(|c| size_arg(c, "draft_cap").and_then(|c| positive(c, "draft_cap")))
        .transpose()?;
    let tokens = i64_list_arg(tokens, "tokens")?;
    Ok(core::split_bands(&tokens, n, block, has_mask_token, cap).map_err(CoreError)?)
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

type SharedPool = Arc<Mutex<core::BlockPool>>;

/// A fixed set of `num_blocks` K/V blocks of `block_size` tokens, shared by sequences
/// (thread-safe). See `blockdraft/_core.pyi` for every method.
#[pyclass(name = "BlockPool", module = "blockdraft._core", frozen)]
struct PyBlockPool {
    pool: SharedPool,
    num_blocks: usize,
    block_size: usize,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size))]
    fn py_new(num_blocks: &Bound<'_, PyAny>, block_size: &Bound<'_, PyAny>) -> PyResult<Self> {
        let num_blocks = positive(size_arg(num_blocks, "num_blocks")?, "num_blocks")?;
        let block_size = positive(size_arg(block_size, "block_size")?, "block_size")?;
        let pool = core::BlockPool::new(num_blocks, block_size).map_err(CoreError)?;
        Ok(Self {
            pool: Arc::new(Mutex::new(pool)),
            num_blocks,
            block_size,
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn num_free(&self) -> PyResult<usize> {
        Ok(lock(&self.pool, "pool")?.num_free())
    }

    #[getter]
    fn num_used(&self) -> PyResult<usize> {
        Ok(lock(&self.pool, "pool")?.num_used())
    }

    #[pyo3(signature = (n))]
    fn alloc(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let n = size_arg(n, "n")?;
        Ok(py.detach(|| lock(&self.pool, "pool")?.alloc(n).map_err(CoreError))?)
    }

    #[pyo3(signature = (blocks))]
    fn free(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = i64_list_arg(blocks, "blocks").map_err(|e| {
            // An int beyond 64 bits is simply not a block of this pool, like -1 or 99.
            if e.is_instance_of::<PyValueError>(py) {
                InvalidStateError::new_err(format!(
                    "{} (the pool has {} blocks)",
                    e.value(py),
                    self.num_blocks
                ))
            } else {
                e
            }
        })?;
        let ids = ids
            .into_iter()
            .map(|b| {
                usize::try_from(b).map_err(|_| {
                    InvalidStateError::new_err(format!(
                        "block {b} is out of range (the pool has {} blocks)",
                        self.num_blocks
                    ))
                })
            })
            .collect::<PyResult<Vec<usize>>>()?;
        Ok(py.detach(|| lock(&self.pool, "pool")?.free(&ids).map_err(CoreError))?)
    }

    #[pyo3(signature = (block))]
    fn is_allocated(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(b) = i64_arg(block, "block") else {
            // Out of the 64-bit range is out of the pool; non-ints still raise TypeError.
            return if block.is_instance_of::<PyInt>() {
                Ok(false)
            } else {
                i64_arg(block, "block").map(|_| false)
            };
        };
        Ok(usize::try_from(b)
            .is_ok_and(|b| lock(&self.pool, "pool").is_ok_and(|p| p.is_allocated(b))))
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| {
            lock(&self.pool, "pool")?
                .check_invariants()
                .map_err(CoreError)
        })?)
    }

    fn __repr__(&self) -> PyResult<String> {
        let free = lock(&self.pool, "pool")?.num_free();
        Ok(format!(
            "BlockPool(num_blocks={}, block_size={}, num_free={free})",
            self.num_blocks, self.block_size
        ))
    }
}

/// A state and the pool it draws from; shared by the Python state and its plans.
struct StateShared {
    state: Mutex<core::ContextState>,
    pool: SharedPool,
}

impl StateShared {
    /// Run `f` on the locked state and pool (state first, then pool).
    fn with<T>(
        &self,
        f: impl FnOnce(&mut core::ContextState, &mut core::BlockPool) -> core::Result<T>,
    ) -> CoreResult<T> {
        let mut state = lock(&self.state, "state")?;
        let mut pool = lock(&self.pool, "pool")?;
        Ok(f(&mut state, &mut pool)?)
    }
}

impl Drop for StateShared {
    /// A state dropped without `free` still returns its blocks, so forgetting to free cannot
    /// leak pool capacity. Errors cannot be reported from a destructor and are ignored.
    fn drop(&mut self) {
        let _ = self.with(core::ContextState::free);
    }
}

/// What an append must do to the accumulator before writing new rows: move rows
/// `[src_start, src_start + keep)` to the front.
#[pyclass(name = "SlidePlan", module = "blockdraft._core", frozen)]
struct PySlidePlan {
    inner: core::SlidePlan,
}

#[pymethods]
impl PySlidePlan {
    #[getter]
    fn src_start(&self) -> usize {
        self.inner.src_start
    }

    #[getter]
    fn keep(&self) -> usize {
        self.inner.keep
    }

    fn __repr__(&self) -> String {
        format!(
            "SlidePlan(src_start={}, keep={})",
            self.inner.src_start, self.inner.keep
        )
    }
}

/// The accumulator work of one `ContextState.plan_append` call: the optional slide, then the
/// new rows at `[dst_start, dst_start + n_rows)`; commit it with `ContextState.apply_append`.
#[pyclass(name = "AppendPlan", module = "blockdraft._core", frozen)]
struct PyAppendPlan {
    inner: core::AppendPlan,
    owner: Arc<StateShared>,
}

#[pymethods]
impl PyAppendPlan {
    #[getter]
    fn slide(&self) -> Option<PySlidePlan> {
        self.inner.slide.map(|inner| PySlidePlan { inner })
    }

    #[getter]
    fn dst_start(&self) -> usize {
        self.inner.dst_start
    }

    #[getter]
    fn n_rows(&self) -> usize {
        self.inner.n_rows()
    }

    #[getter]
    fn positions(&self) -> Vec<i64> {
        self.inner.positions.clone()
    }

    fn __repr__(&self) -> String {
        format!(
            "AppendPlan(slide={}, dst_start={}, n_rows={})",
            self.inner.slide.map_or_else(
                || "None".to_owned(),
                |inner| PySlidePlan { inner }.__repr__()
            ),
            self.inner.dst_start,
            self.inner.n_rows()
        )
    }
}

/// K/V work for context rows `[row_start, row_end)` of one state: their positions, slots and
/// the blocks taken for them; resolve it with `confirm_precompute` or `abort_precompute`.
#[pyclass(name = "PrecomputePlan", module = "blockdraft._core", frozen)]
struct PyPrecomputePlan {
    inner: core::PrecomputePlan,
    owner: Arc<StateShared>,
}

impl Drop for PyPrecomputePlan {
    /// Dropping an unresolved plan aborts it, so its blocks cannot leak.
    fn drop(&mut self) {
        let inner = &self.inner;
        let _ = self.owner.with(|s, p| s.abort_precompute(p, inner));
    }
}

#[pymethods]
impl PyPrecomputePlan {
    #[getter]
    fn row_start(&self) -> usize {
        self.inner.row_start
    }

    #[getter]
    fn row_end(&self) -> usize {
        self.inner.row_end
    }

    #[getter]
    fn new_blocks(&self) -> Vec<usize> {
        self.inner.new_blocks.clone()
    }

    #[getter]
    fn slots(&self) -> Vec<usize> {
        self.inner.slots.clone()
    }

    #[getter]
    fn positions(&self) -> Vec<i64> {
        self.inner.positions.clone()
    }

    #[getter]
    fn resolved(&self) -> PyResult<bool> {
        Ok(!lock(&self.owner.state, "state")?.is_pending(&self.inner))
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!(
            "PrecomputePlan(row_start={}, row_end={}, new_blocks={:?}, resolved={})",
            self.inner.row_start,
            self.inner.row_end,
            self.inner.new_blocks,
            py_bool(self.resolved()?)
        ))
    }
}

/// Bookkeeping of one sequence's drafter context (the seed's `DflashProposerState`): window,
/// counters, block table and the two-phase plans. See `blockdraft/_core.pyi`.
#[pyclass(name = "ContextState", module = "blockdraft._core", frozen)]
struct PyContextState {
    shared: Arc<StateShared>,
}

impl PyContextState {
    fn read<T>(&self, f: impl FnOnce(&core::ContextState) -> T) -> PyResult<T> {
        let guard = lock(&self.shared.state, "state")?;
        Ok(f(&guard))
    }

    fn check_owner(&self, other: &Arc<StateShared>) -> CoreResult<()> {
        if Arc::ptr_eq(&self.shared, other) {
            Ok(())
        } else {
            Err(CoreError(core::Error::ForeignPlan))
        }
    }
}

#[pymethods]
impl PyContextState {
    #[new]
    // `owner=None` in the Rust signature only so that negative ints can be reported as
    // `ValueError`; Python sees (and the stub declares) the default 0.
    #[pyo3(signature = (pool, window, owner=None), text_signature = "(pool, window, owner=0)")]
    fn py_new(
        pool: &Bound<'_, PyBlockPool>,
        window: &Bound<'_, PyAny>,
        owner: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let window = positive(size_arg(window, "window")?, "window")?;
        let owner = match optional(owner) {
            Some(o) => u64::try_from(size_arg(o, "owner")?)
                .map_err(|_| PyValueError::new_err("owner is too large"))?,
            None => 0,
        };
        let pool = Arc::clone(&pool.get().pool);
        let state = {
            let mut guard = lock(&pool, "pool")?;
            core::ContextState::new(&mut guard, window, owner).map_err(CoreError)?
        };
        Ok(Self {
            shared: Arc::new(StateShared {
                state: Mutex::new(state),
                pool,
            }),
        })
    }

    #[getter]
    fn owner(&self) -> PyResult<u64> {
        self.read(core::ContextState::owner)
    }
    #[getter]
    fn window(&self) -> PyResult<usize> {
        self.read(core::ContextState::window)
    }
    #[getter]
    fn ctx_len(&self) -> PyResult<usize> {
        self.read(core::ContextState::ctx_len)
    }
    #[getter]
    fn ctx_committed(&self) -> PyResult<usize> {
        self.read(core::ContextState::ctx_committed)
    }
    #[getter]
    fn ctx_positions(&self) -> PyResult<Vec<i64>> {
        self.read(|s| s.ctx_positions().to_vec())
    }
    #[getter]
    fn last_position(&self) -> PyResult<Option<i64>> {
        self.read(core::ContextState::last_position)
    }
    #[getter]
    fn block_table(&self) -> PyResult<Vec<usize>> {
        self.read(|s| s.block_table().to_vec())
    }
    #[getter]
    fn num_blocks(&self) -> PyResult<usize> {
        self.read(|s| s.block_table().len())
    }
    #[getter]
    fn seq_len(&self) -> PyResult<usize> {
        self.read(core::ContextState::seq_len)
    }
    #[getter]
    fn prefill_done(&self) -> PyResult<bool> {
        self.read(core::ContextState::prefill_done)
    }
    #[getter]
    fn last_num_drafted(&self) -> PyResult<usize> {
        self.read(core::ContextState::last_num_drafted)
    }
    #[getter]
    fn last_num_accepted(&self) -> PyResult<usize> {
        self.read(core::ContextState::last_num_accepted)
    }
    #[getter]
    fn skip_next_decode_append(&self) -> PyResult<bool> {
        self.read(core::ContextState::skip_next_decode_append)
    }
    #[getter]
    fn ctx_count_drafter(&self) -> PyResult<usize> {
        self.read(core::ContextState::ctx_count_drafter)
    }
    #[getter]
    fn max_ctx_count_drafter(&self) -> PyResult<usize> {
        self.read(core::ContextState::max_ctx_count_drafter)
    }
    #[getter]
    fn freed(&self) -> PyResult<bool> {
        self.read(core::ContextState::freed)
    }
    #[getter]
    fn version(&self) -> PyResult<u64> {
        self.read(core::ContextState::version)
    }

    #[pyo3(signature = (positions))]
    fn plan_append(&self, py: Python<'_>, positions: &Bound<'_, PyAny>) -> PyResult<PyAppendPlan> {
        let positions = i64_list_arg(positions, "positions")?;
        let inner = py.detach(|| {
            lock(&self.shared.state, "state")?
                .plan_append(&positions)
                .map_err(CoreError)
        })?;
        Ok(PyAppendPlan {
            inner,
            owner: Arc::clone(&self.shared),
        })
    }

    #[pyo3(signature = (plan))]
    fn apply_append(&self, py: Python<'_>, plan: &Bound<'_, PyAppendPlan>) -> PyResult<()> {
        let plan = plan.get();
        self.check_owner(&plan.owner)?;
        Ok(py.detach(|| self.shared.with(|s, p| s.apply_append(p, &plan.inner)))?)
    }

    fn plan_precompute(&self, py: Python<'_>) -> PyResult<PyPrecomputePlan> {
        let inner = py.detach(|| self.shared.with(core::ContextState::plan_precompute))?;
        Ok(PyPrecomputePlan {
            inner,
            owner: Arc::clone(&self.shared),
        })
    }

    #[pyo3(signature = (plan))]
    fn confirm_precompute(
        &self,
        py: Python<'_>,
        plan: &Bound<'_, PyPrecomputePlan>,
    ) -> PyResult<()> {
        let plan = plan.get();
        self.check_owner(&plan.owner)?;
        Ok(py.detach(|| self.shared.with(|s, _| s.confirm_precompute(&plan.inner)))?)
    }

    #[pyo3(signature = (plan))]
    fn abort_precompute(&self, py: Python<'_>, plan: &Bound<'_, PyPrecomputePlan>) -> PyResult<()> {
        let plan = plan.get();
        self.check_owner(&plan.owner)?;
        Ok(py.detach(|| self.shared.with(|s, p| s.abort_precompute(p, &plan.inner)))?)
    }

    fn slot_mapping(&self) -> PyResult<Vec<usize>> {
        self.read(core::ContextState::slot_mapping)
    }

    #[pyo3(signature = (position, num_drafted))]
    fn note_propose(
        &self,
        position: &Bound<'_, PyAny>,
        num_drafted: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let position = size_arg(position, "position")?;
        let num_drafted = size_arg(num_drafted, "num_drafted")?;
        Ok(lock(&self.shared.state, "state")?
            .note_propose(position, num_drafted)
            .map_err(CoreError)?)
    }

    #[pyo3(signature = (num_accepted))]
    fn after_verify(&self, num_accepted: &Bound<'_, PyAny>) -> PyResult<()> {
        let num_accepted = size_arg(num_accepted, "num_accepted")?;
        Ok(lock(&self.shared.state, "state")?
            .after_verify(num_accepted)
            .map_err(CoreError)?)
    }

    fn free(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(py.detach(|| self.shared.with(core::ContextState::free))?)
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.shared.with(|s, p| s.check_invariants(p)))?)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.read(|s| {
            format!(
                "ContextState(window={}, ctx_len={}, ctx_committed={}, blocks={}, freed={})",
                s.window(),
                s.ctx_len(),
                s.ctx_committed(),
                s.block_table().len(),
                py_bool(s.freed())
            )
        })
    }
}

/// Panic inside the extension: the test that a Rust panic reaches Python as an exception
/// (pyo3's `PanicException`) and never aborts the interpreter. With `pool`, the panic happens
/// while that pool's lock is held, so the test can check that a poisoned lock turns every later
/// call into `InvalidStateError`. For tests only; it never returns.
#[pyfunction]
#[pyo3(name = "_panic_for_tests", signature = (pool=None))]
fn panic_for_tests(py: Python<'_>, pool: Option<&Bound<'_, PyBlockPool>>) {
    let Some(pool) = pool else {
        panic!("blockdraft._core._panic_for_tests");
    };
    let shared = Arc::clone(&pool.get().pool);
    py.detach(move || {
        let _guard = shared.lock();
        panic!("blockdraft._core._panic_for_tests (pool lock held)");
    });
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ENV_CTX_CAP", core::ENV_CTX_CAP)?;
    m.add("DEFAULT_CTX_CAP", core::DEFAULT_CTX_CAP)?;
    m.add("PAD_SLOT", core::PAD_SLOT)?;

    m.add("BlockdraftError", py.get_type::<BlockdraftError>())?;
    m.add("PoolExhaustedError", py.get_type::<PoolExhaustedError>())?;
    m.add("InvalidStateError", py.get_type::<InvalidStateError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    let config_error = CONFIG_ERROR.get_or_try_init(py, || make_config_error(py))?;
    m.add("ConfigError", config_error.bind(py))?;

    m.add_class::<PyBlockPool>()?;
    m.add_class::<PySlidePlan>()?;
    m.add_class::<PyAppendPlan>()?;
    m.add_class::<PyPrecomputePlan>()?;
    m.add_class::<PyContextState>()?;

    m.add_function(wrap_pyfunction!(ctx_window, m)?)?;
    m.add_function(wrap_pyfunction!(ctx_ceiling, m)?)?;
    m.add_function(wrap_pyfunction!(read_ctx_cap, m)?)?;
    m.add_function(wrap_pyfunction!(propose_batch_max, m)?)?;
    m.add_function(wrap_pyfunction!(batch_decline_reason, m)?)?;
    m.add_function(wrap_pyfunction!(split_bands, m)?)?;
    m.add_function(wrap_pyfunction!(panic_for_tests, m)?)?;
    step::register(m)?;
    Ok(())
}
