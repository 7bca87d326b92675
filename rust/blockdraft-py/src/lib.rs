//! `blockdraft._core`: thin `PyO3` bindings of `blockdraft-core`.
//!
//! Argument conversion, error mapping and locking live here; every decision is made by the
//! core. The pool is shared as `Arc<Mutex<BlockPool>>` between the Python `BlockPool` and every
//! `ContextState` and `SeqPages` made from it. Lock order is always state, then pool (a
//! whole-step call over target sequences takes all of its sequences, in address order, then a
//! pool at a time: `pages`); no lock is ever held while waiting for the GIL (work under a lock
//! runs with the GIL released or touches no Python object), so the GIL and these locks cannot
//! deadlock.

#![warn(clippy::pedantic)]

mod convert;
mod errors;
mod pages;
mod shared;
mod step;

use std::sync::{Arc, Mutex};

use blockdraft_core as core;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyInt;

use shared::Shared;

use convert::{
    cap_arg, i64_arg, i64_list_arg, optional, owner_arg, positive, py_bool, saturating_size_arg,
    size_arg,
};
use errors::{
    lock, make_config_error, BlockdraftError, CheckpointError, CoreError, CoreResult,
    InvalidStateError, PoolExhaustedError, CONFIG_ERROR,
};

/// Rows of the per-sequence context accumulator: `ceiling = max_seq_len` if the cap is 0,
/// else `min(max_seq_len, cap)`; `window = min(ceiling, budget_tokens + block_size + 1)`
/// (saturating). `budget_tokens=None` means the ceiling; `cap=None` reads
/// `BLOCKDRAFT_DFLASH_CTX_CAP` (default 16384). Raises `ValueError` for a zero or negative size,
/// `ConfigError` for a bad environment value.
#[pyfunction]
#[pyo3(signature = (max_seq_len, block_size, budget_tokens=None, cap=None))]
fn ctx_window(
    max_seq_len: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    budget_tokens: Option<&Bound<'_, PyAny>>,
    cap: Option<&Bound<'_, PyAny>>,
) -> PyResult<usize> {
    let max_seq_len = positive(size_arg(max_seq_len, "max_seq_len")?, "max_seq_len")?;
    let block_size = positive(size_arg(block_size, "block_size")?, "block_size")?;
    let budget = optional(budget_tokens)
        .map(|b| saturating_size_arg(b, "budget_tokens"))
        .transpose()?;
    let cap = cap_arg(cap)?;
    Ok(core::ctx_window(max_seq_len, block_size, budget, cap).map_err(CoreError)?)
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

/// The slide fraction from `BLOCKDRAFT_DFLASH_SLIDE` (default 0.125). Raises `ConfigError`
/// when the value is not a fraction in `[0, 1)`.
#[pyfunction]
fn read_slide() -> PyResult<f64> {
    Ok(core::read_slide().map_err(CoreError)?)
}

/// Rows a slide of a `window`-row context leaves free: `floor(window * fraction)`, at most
/// `window - 1`; `fraction=None` reads `BLOCKDRAFT_DFLASH_SLIDE`. Raises `ValueError` (a
/// window below 1, a fraction outside `[0, 1)`) or `ConfigError`.
#[pyfunction]
#[pyo3(signature = (window, fraction=None))]
fn slide_room(window: &Bound<'_, PyAny>, fraction: Option<f64>) -> PyResult<usize> {
    let window = positive(size_arg(window, "window")?, "window")?;
    let fraction = match fraction {
        Some(f) => f,
        None => core::read_slide().map_err(CoreError)?,
    };
    Ok(core::slide_room(window, fraction).map_err(CoreError)?)
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

/// Split `n * block_size` output tokens into `n` bands of drafts: band i is
/// `tokens[i*block_size:(i+1)*block_size]`, without its row 0 (the anchor) when there is a mask
/// token, at most `draft_cap` drafts each. `None` when fewer than `n * block_size` tokens were
/// given. Raises `ValueError` for `n < 1`, `block_size < 1` or `draft_cap < 1`.
#[pyfunction]
#[pyo3(signature = (tokens, n, block_size, has_mask_token, draft_cap=None))]
fn split_bands(
    tokens: &Bound<'_, PyAny>,
    n: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    has_mask_token: bool,
    draft_cap: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<Vec<i64>>>> {
    let n = positive(size_arg(n, "n")?, "n")?;
    let block_size = positive(size_arg(block_size, "block_size")?, "block_size")?;
    let cap = optional(draft_cap)
        .map(|c| size_arg(c, "draft_cap").and_then(|c| positive(c, "draft_cap")))
        .transpose()?;
    let tokens = i64_list_arg(tokens, "tokens")?;
    Ok(core::split_bands(&tokens, n, block_size, has_mask_token, cap).map_err(CoreError)?)
}

type SharedPool = Arc<Mutex<core::BlockPool>>;

/// A fixed set of `num_pages` K/V pages of `page_size` tokens, shared by sequences
/// (thread-safe). See `blockdraft/_core.pyi` for every method.
#[pyclass(name = "BlockPool", module = "blockdraft._core", frozen)]
struct PyBlockPool {
    pool: SharedPool,
    num_pages: usize,
    page_size: usize,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_pages, page_size))]
    fn py_new(num_pages: &Bound<'_, PyAny>, page_size: &Bound<'_, PyAny>) -> PyResult<Self> {
        let num_pages = positive(size_arg(num_pages, "num_pages")?, "num_pages")?;
        let page_size = positive(size_arg(page_size, "page_size")?, "page_size")?;
        let pool = core::BlockPool::new(num_pages, page_size).map_err(CoreError)?;
        Ok(Self {
            pool: Arc::new(Mutex::new(pool)),
            num_pages,
            page_size,
        })
    }

    #[getter]
    fn num_pages(&self) -> usize {
        self.num_pages
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
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

    #[pyo3(signature = (pages))]
    fn free(&self, py: Python<'_>, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = i64_list_arg(pages, "pages").map_err(|e| {
            // An int beyond 64 bits is simply not a page of this pool, like -1 or 99.
            if e.is_instance_of::<PyValueError>(py) {
                InvalidStateError::new_err(format!(
                    "{} (the pool has {} pages)",
                    e.value(py),
                    self.num_pages
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
                        "page {b} is out of range (the pool has {} pages)",
                        self.num_pages
                    ))
                })
            })
            .collect::<PyResult<Vec<usize>>>()?;
        Ok(py.detach(|| lock(&self.pool, "pool")?.free(&ids).map_err(CoreError))?)
    }

    #[pyo3(signature = (page))]
    fn is_allocated(&self, page: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(b) = i64_arg(page, "page") else {
            // Out of the 64-bit range is out of the pool; non-ints still raise TypeError.
            return if page.is_instance_of::<PyInt>() {
                Ok(false)
            } else {
                i64_arg(page, "page").map(|_| false)
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
            "BlockPool(num_pages={}, page_size={}, num_free={free})",
            self.num_pages, self.page_size
        ))
    }
}

/// A state and the pool it draws from; shared by the Python state and its plans.
type StateShared = Shared<core::ContextState>;

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
/// the pages taken for them; resolve it with `confirm_precompute` or `abort_precompute`.
#[pyclass(name = "PrecomputePlan", module = "blockdraft._core", frozen)]
struct PyPrecomputePlan {
    inner: core::PrecomputePlan,
    owner: Arc<StateShared>,
}

impl Drop for PyPrecomputePlan {
    /// Dropping an unresolved plan aborts it, so its pages cannot leak.
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
    fn new_pages(&self) -> Vec<usize> {
        self.inner.new_pages.clone()
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
        Ok(!self.owner.lock()?.is_pending(&self.inner))
    }

    fn __repr__(&self) -> PyResult<String> {
        Ok(format!(
            "PrecomputePlan(row_start={}, row_end={}, new_pages={:?}, resolved={})",
            self.inner.row_start,
            self.inner.row_end,
            self.inner.new_pages,
            py_bool(self.resolved()?)
        ))
    }
}

/// Bookkeeping of one sequence's drafter context: window, counters, page table and the
/// two-phase plans. See `blockdraft/_core.pyi`.
#[pyclass(name = "ContextState", module = "blockdraft._core", frozen)]
struct PyContextState {
    shared: Arc<StateShared>,
}

impl PyContextState {
    fn read<T>(&self, f: impl FnOnce(&core::ContextState) -> T) -> PyResult<T> {
        let guard = self.shared.lock()?;
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
    #[pyo3(
        signature = (pool, window, owner=None, slide_room=None),
        text_signature = "(pool, window, owner=0, slide_room=0)"
    )]
    fn py_new(
        pool: &Bound<'_, PyBlockPool>,
        window: &Bound<'_, PyAny>,
        owner: Option<&Bound<'_, PyAny>>,
        slide_room: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let window = positive(size_arg(window, "window")?, "window")?;
        let owner = optional(owner).map_or(Ok(0), owner_arg)?;
        let room = optional(slide_room).map_or(Ok(0), |r| size_arg(r, "slide_room"))?;
        let pool = Arc::clone(&pool.get().pool);
        let state = {
            let mut guard = lock(&pool, "pool")?;
            // The room is checked before a state id is issued: a refused call changes nothing.
            if room >= window {
                return Err(PyValueError::new_err(format!(
                    "slide_room must be below the window of {window} rows, got {room}"
                )));
            }
            core::ContextState::new(&mut guard, window, owner)
                .and_then(|st| st.with_slide_room(room))
                .map_err(CoreError)?
        };
        Ok(Self {
            shared: Arc::new(StateShared::new(state, pool)),
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
    fn slide_room(&self) -> PyResult<usize> {
        self.read(core::ContextState::slide_room)
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
    fn page_table(&self) -> PyResult<Vec<usize>> {
        self.read(|s| s.page_table().to_vec())
    }
    #[getter]
    fn num_pages(&self) -> PyResult<usize> {
        self.read(|s| s.page_table().len())
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
            self.shared
                .lock()?
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
        Ok(self
            .shared
            .lock()?
            .note_propose(position, num_drafted)
            .map_err(CoreError)?)
    }

    #[pyo3(signature = (num_accepted))]
    fn after_verify(&self, num_accepted: &Bound<'_, PyAny>) -> PyResult<()> {
        let num_accepted = size_arg(num_accepted, "num_accepted")?;
        Ok(self
            .shared
            .lock()?
            .after_verify(num_accepted)
            .map_err(CoreError)?)
    }

    /// With `owner`, a state of another proposer is refused before anything changes (the
    /// owner is checked even on a freed state, which is then still a no-op).
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
        .map_err(|CoreError(e)| step::map_err(e, "free"))
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(py.detach(|| self.shared.with(|s, p| s.check_invariants(p)))?)
    }

    fn __repr__(&self) -> PyResult<String> {
        self.read(|s| {
            format!(
                "ContextState(window={}, ctx_len={}, ctx_committed={}, pages={}, freed={})",
                s.window(),
                s.ctx_len(),
                s.ctx_committed(),
                s.page_table().len(),
                py_bool(s.freed())
            )
        })
    }
}

/// Panic inside the extension: the test that a Rust panic reaches Python as an exception
/// (pyo3's `PanicException`) and never aborts the interpreter. With `pool`, the panic happens
/// while that pool's lock is held, so the test can check that a poisoned lock turns every later
/// call into `InvalidStateError`. Built only with the `test-hooks` feature; it never returns.
#[cfg(feature = "test-hooks")]
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
    m.add("ENV_SLIDE", core::ENV_SLIDE)?;
    m.add("DEFAULT_SLIDE", core::DEFAULT_SLIDE)?;
    m.add("PAD_SLOT", core::PAD_SLOT)?;
    m.add("TEST_HOOKS", cfg!(feature = "test-hooks"))?;

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
    m.add_function(wrap_pyfunction!(read_slide, m)?)?;
    m.add_function(wrap_pyfunction!(slide_room, m)?)?;
    m.add_function(wrap_pyfunction!(propose_batch_max, m)?)?;
    m.add_function(wrap_pyfunction!(batch_decline_reason, m)?)?;
    m.add_function(wrap_pyfunction!(split_bands, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(panic_for_tests, m)?)?;
    step::register(m)?;
    pages::register(m)?;
    Ok(())
}
