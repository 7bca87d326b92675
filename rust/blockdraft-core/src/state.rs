//! Bookkeeping of one sequence's drafter context: which rows it keeps and at which positions,
//! how many of them have K/V in the paged cache, and which pool pages hold that K/V.
//!
//! Every change goes through a two-phase plan: `plan_*` computes what the caller (who owns the
//! tensors) must do without changing the state, and the state changes only once the caller
//! reports success. Each change bumps `version`; a plan made for an older version is refused.
//!
//! Invariant (3 of the crate docs): `0 <= ctx_committed <= ctx_len <= window`, positions
//! strictly increasing, and `page_table.len() == ceil(ctx_committed / page_size)`.
//!
//! A slide drops the oldest rows and leaves `slide_room` rows free beyond the commit's (see
//! [`ContextState::plan_append`]): a slide forces the next precompute to recompute every kept
//! row, so freeing more than the commit needs lets that one recompute serve many steps.

use crate::error::{Error, Result};
use crate::pool::BlockPool;

/// Move source rows `[src_start, src_start + keep)` to `[0, keep)` before appending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidePlan {
    pub src_start: usize,
    pub keep: usize,
}

/// The accumulator work of one append: the optional slide, then the new rows at
/// `[dst_start, dst_start + positions.len())`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendPlan {
    state_id: u64,
    version: u64,
    pub slide: Option<SlidePlan>,
    pub dst_start: usize,
    pub positions: Vec<i64>,
}

impl AppendPlan {
    #[must_use]
    pub fn n_rows(&self) -> usize {
        self.positions.len()
    }

    /// The state version this plan was made for.
    #[must_use]
    pub fn version(&self) -> u64 {
        self.version
    }
}

/// K/V work for rows `[row_start, row_end)`; `slots[i]` belongs to row `row_start + i`.
///
/// The plan is a description only: its `new_pages` are held by the state as "pending" until
/// the plan is confirmed (they join the page table) or aborted (they go back to the pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrecomputePlan {
    state_id: u64,
    plan_id: u64,
    version: u64,
    pub row_start: usize,
    pub row_end: usize,
    pub new_pages: Vec<usize>,
    pub slots: Vec<usize>,
    pub positions: Vec<i64>,
}

impl PrecomputePlan {
    /// The state version this plan was made for.
    #[must_use]
    pub fn version(&self) -> u64 {
        self.version
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Pending {
    plan_id: u64,
    pages: Vec<usize>,
}

/// The first adjacent pair `(a, b)` with `a >= b`, if any.
fn first_unordered(xs: &[i64]) -> Option<(i64, i64)> {
    xs.windows(2).find_map(|w| match *w {
        [a, b] if a >= b => Some((a, b)),
        _ => None,
    })
}

/// One sequence's context bookkeeping: its window, context rows, page table and the
/// proposal/verify counters of the proposer (no device memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextState {
    id: u64,
    owner: u64,
    window: usize,
    slide_room: usize,
    page_size: usize,
    ctx_positions: Vec<i64>,
    ctx_committed: usize,
    page_table: Vec<usize>,
    seq_len: usize,
    prefill_done: bool,
    last_num_drafted: usize,
    last_num_accepted: usize,
    skip_next_decode_append: bool,
    ctx_count_drafter: usize,
    max_ctx_count_drafter: usize,
    freed: bool,
    version: u64,
    /// Slides since the state was made or freed: each one replaced the page table.
    slides: u64,
    next_plan_id: u64,
    pending: Option<Pending>,
}

impl ContextState {
    /// A fresh, empty state of `window` rows drawing pages from `pool`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `window` is 0.
    pub fn new(pool: &mut BlockPool, window: usize, owner: u64) -> Result<Self> {
        if window == 0 {
            return Err(Error::invalid_argument("window", "must be >= 1, got 0"));
        }
        Ok(Self::empty(
            pool.issue_state_id(),
            owner,
            (window, 0),
            pool.page_size(),
        ))
    }

    /// The same state with `slide_room` rows left free by every slide (0, the default of
    /// [`Self::new`], slides by exactly the rows a commit needs). Only a fresh state takes it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `slide_room >= window` (a slide would keep no row even
    /// for a one-row commit) or the state is not fresh.
    pub fn with_slide_room(mut self, slide_room: usize) -> Result<Self> {
        if slide_room >= self.window {
            return Err(Error::invalid_argument(
                "slide_room",
                format!(
                    "must be below the window of {} rows, got {slide_room}",
                    self.window
                ),
            ));
        }
        if self.version != 0 {
            return Err(Error::invalid_argument(
                "slide_room",
                "is set on a fresh state only",
            ));
        }
        self.slide_room = slide_room;
        Ok(self)
    }

    /// Every counter at its `alloc_state` value: the one definition of "fresh".
    /// `(window, slide_room)`: the state's fixed shape.
    fn empty(id: u64, owner: u64, (window, slide_room): (usize, usize), page_size: usize) -> Self {
        Self {
            id,
            owner,
            window,
            slide_room,
            page_size,
            ctx_positions: Vec::new(),
            ctx_committed: 0,
            page_table: Vec::new(),
            seq_len: 0,
            prefill_done: false,
            last_num_drafted: 0,
            last_num_accepted: 0,
            skip_next_decode_append: false,
            ctx_count_drafter: 0,
            max_ctx_count_drafter: 0,
            freed: false,
            version: 0,
            slides: 0,
            next_plan_id: 1,
            pending: None,
        }
    }

    #[must_use]
    pub fn id(&self) -> u64 {
        self.id
    }
    #[must_use]
    pub fn owner(&self) -> u64 {
        self.owner
    }
    #[must_use]
    pub fn window(&self) -> usize {
        self.window
    }
    /// Rows a slide leaves free beyond the rows of the commit that caused it.
    #[must_use]
    pub fn slide_room(&self) -> usize {
        self.slide_room
    }
    #[must_use]
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    #[must_use]
    pub fn ctx_len(&self) -> usize {
        self.ctx_positions.len()
    }
    #[must_use]
    pub fn ctx_committed(&self) -> usize {
        self.ctx_committed
    }
    #[must_use]
    pub fn ctx_positions(&self) -> &[i64] {
        &self.ctx_positions
    }
    /// Position of the newest context row (`None` while the context is empty).
    #[must_use]
    pub fn last_position(&self) -> Option<i64> {
        self.ctx_positions.last().copied()
    }
    #[must_use]
    pub fn page_table(&self) -> &[usize] {
        &self.page_table
    }
    #[must_use]
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
    #[must_use]
    pub fn prefill_done(&self) -> bool {
        self.prefill_done
    }
    #[must_use]
    pub fn last_num_drafted(&self) -> usize {
        self.last_num_drafted
    }
    #[must_use]
    pub fn last_num_accepted(&self) -> usize {
        self.last_num_accepted
    }
    #[must_use]
    pub fn skip_next_decode_append(&self) -> bool {
        self.skip_next_decode_append
    }
    /// Context rows the drafter attended to in its last confirmed precompute.
    #[must_use]
    pub fn ctx_count_drafter(&self) -> usize {
        self.ctx_count_drafter
    }
    /// High-water mark of [`Self::ctx_count_drafter`] since the state was made or freed.
    #[must_use]
    pub fn max_ctx_count_drafter(&self) -> usize {
        self.max_ctx_count_drafter
    }
    #[must_use]
    pub fn freed(&self) -> bool {
        self.freed
    }
    #[must_use]
    pub fn version(&self) -> u64 {
        self.version
    }
    /// Slides since the state was made or freed. Each one gave the whole page table back, so
    /// a table of the same length after a slide may hold other pages: whoever mirrors a table
    /// (the graph path's metadata) keys it by `(id, slides)`.
    #[must_use]
    pub fn slides(&self) -> u64 {
        self.slides
    }
    /// Pages held by an unresolved precompute plan (empty when none).
    #[must_use]
    pub fn pending_pages(&self) -> &[usize] {
        self.pending.as_ref().map_or(&[], |p| &p.pages)
    }

    /// Whether `plan` (made by this state) is still unresolved.
    #[must_use]
    pub fn is_pending(&self, plan: &PrecomputePlan) -> bool {
        plan.state_id == self.id
            && self
                .pending
                .as_ref()
                .is_some_and(|p| p.plan_id == plan.plan_id)
    }

    /// Whether the state belongs to the proposer `owner` (the id it was made with).
    ///
    /// # Errors
    /// [`Error::ForeignOwner`] naming both ids.
    pub fn ensure_owner(&self, owner: u64) -> Result<()> {
        if self.owner == owner {
            Ok(())
        } else {
            Err(Error::ForeignOwner {
                owner: self.owner,
                expected: owner,
            })
        }
    }

    /// Plan appending rows at `positions`; changes nothing.
    ///
    /// When the rows overflow the window the plan slides first: it keeps the newest
    /// `window - slide_room - n` rows (none when the commit alone needs more room), so after
    /// the append `ctx_len == max(window - slide_room, n)` and the next slide waits for at least
    /// `min(slide_room, window - n)` more rows. The commit's own rows are always all kept.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] for empty, negative or unordered positions,
    /// positions not after the last context position, or more rows than the window.
    pub fn plan_append(&self, positions: &[i64]) -> Result<AppendPlan> {
        self.check_positions(positions)?;
        let n = positions.len();
        if n > self.window {
            return Err(Error::invalid_argument(
                "positions",
                format!("{n} rows exceed the window of {} rows", self.window),
            ));
        }
        let len = self.ctx_len();
        let (slide, dst_start) = if len + n > self.window {
            // Keep the newest rows that leave room for all n new ones and `slide_room` more;
            // `keep < len` since `len + n > window >= window - slide_room`.
            let keep = (self.window - self.slide_room).saturating_sub(n);
            (
                Some(SlidePlan {
                    src_start: len - keep,
                    keep,
                }),
                keep,
            )
        } else {
            (None, len)
        };
        Ok(AppendPlan {
            state_id: self.id,
            version: self.version,
            slide,
            dst_start,
            positions: positions.to_vec(),
        })
    }

    /// The position rules of an append: live state, non-empty, non-negative, strictly
    /// increasing, after the last context position.
    fn check_positions(&self, positions: &[i64]) -> Result<()> {
        self.ensure_live()?;
        if positions.is_empty() {
            return Err(Error::invalid_argument("positions", "must not be empty"));
        }
        if let Some(&p) = positions.iter().find(|&&p| p < 0) {
            return Err(Error::invalid_argument(
                "positions",
                format!("must be non-negative, got {p}"),
            ));
        }
        if let Some((a, b)) = first_unordered(positions) {
            return Err(Error::invalid_argument(
                "positions",
                format!("must be strictly increasing, got {a} then {b}"),
            ));
        }
        if let Some(&last) = self.ctx_positions.last() {
            if positions[0] <= last {
                return Err(Error::invalid_argument(
                    "positions",
                    format!(
                        "must come after the last context position {last}, got {}",
                        positions[0]
                    ),
                ));
            }
        }
        Ok(())
    }

    /// [`Self::plan_append`] of the newest `window` of `positions` (all of them when they fit):
    /// a commit longer than the window keeps only the rows the window can hold. Returns the plan
    /// and how many leading positions were cut. The slide room never cuts a commit's rows:
    /// such a commit keeps exactly `window` rows, all its own.
    ///
    /// # Errors
    /// As [`Self::plan_append`] (the checks see every given position, cut or not).
    pub fn plan_append_newest(&self, positions: &[i64]) -> Result<(AppendPlan, usize)> {
        let skip = positions.len().saturating_sub(self.window);
        if skip > 0 {
            // The cut rows must still be valid positions: check them as one append would.
            self.check_positions(positions)?;
        }
        Ok((self.plan_append(&positions[skip..])?, skip))
    }

    /// Commit an append plan after the accumulator rows were written.
    ///
    /// A slide sets `ctx_committed = 0` and returns every page of the table to the pool: the
    /// kept rows move to new row indices, so their cached K/V no longer sits in the slots
    /// `row -> page_table[row / page_size]` says, and is recomputed by the next precompute.
    ///
    /// # Errors
    /// [`Error::Freed`], [`Error::ForeignPlan`], [`Error::StalePlan`], [`Error::PoolMismatch`];
    /// nothing changes.
    pub fn apply_append(&mut self, pool: &mut BlockPool, plan: &AppendPlan) -> Result<()> {
        self.ensure_live()?;
        self.ensure_pool(pool)?;
        if plan.state_id != self.id {
            return Err(Error::ForeignPlan);
        }
        if plan.version != self.version {
            return Err(Error::StalePlan {
                plan: plan.version,
                state: self.version,
            });
        }
        if let Some(slide) = plan.slide {
            pool.free(&self.page_table)?;
            self.page_table.clear();
            self.ctx_positions.drain(..slide.src_start);
            self.ctx_committed = 0;
            self.ctx_count_drafter = 0;
            self.slides += 1;
        }
        debug_assert_eq!(self.ctx_positions.len(), plan.dst_start);
        self.ctx_positions.extend_from_slice(&plan.positions);
        self.bump();
        Ok(())
    }

    /// Plan K/V for rows `[ctx_committed, ctx_len)` and take the pages they need from `pool`.
    ///
    /// A plan with no rows takes no pages; it still has to be confirmed or aborted.
    ///
    /// # Errors
    /// [`Error::Freed`], [`Error::PlanOutstanding`], [`Error::PoolMismatch`],
    /// [`Error::PoolExhausted`]; nothing changes.
    pub fn plan_precompute(&mut self, pool: &mut BlockPool) -> Result<PrecomputePlan> {
        self.ensure_live()?;
        self.ensure_pool(pool)?;
        if self.pending.is_some() {
            return Err(Error::PlanOutstanding);
        }
        let row_end = self.ctx_len();
        // Under the invariant `ctx_committed <= ctx_len` this clamp is a no-op; it keeps a plan
        // well-formed (`row_start <= row_end`) even if the invariant were ever broken.
        let row_start = self.ctx_committed.min(row_end);
        let ps = self.page_size;
        let need = row_end.div_ceil(ps).saturating_sub(self.page_table.len());
        let new_pages = pool.alloc(need)?;
        let held = self.page_table.len();
        let slots = (row_start..row_end)
            .map(|r| {
                let idx = r / ps;
                let page = if idx < held {
                    self.page_table[idx]
                } else {
                    new_pages[idx - held]
                };
                page * ps + r % ps
            })
            .collect();
        let plan_id = self.next_plan_id;
        self.next_plan_id += 1;
        self.pending = Some(Pending {
            plan_id,
            pages: new_pages.clone(),
        });
        Ok(PrecomputePlan {
            state_id: self.id,
            plan_id,
            version: self.version,
            row_start,
            row_end,
            new_pages,
            slots,
            positions: self.ctx_positions[row_start..row_end].to_vec(),
        })
    }

    /// The plan's K/V is written: adopt its pages and set `ctx_committed = row_end`.
    ///
    /// # Errors
    /// [`Error::ForeignPlan`], [`Error::Freed`], [`Error::PlanResolved`],
    /// [`Error::StalePlan`]; nothing changes.
    pub fn confirm_precompute(&mut self, plan: &PrecomputePlan) -> Result<()> {
        if plan.state_id != self.id {
            return Err(Error::ForeignPlan);
        }
        self.ensure_live()?;
        if !self.is_pending(plan) {
            return Err(Error::PlanResolved);
        }
        if plan.version != self.version {
            return Err(Error::StalePlan {
                plan: plan.version,
                state: self.version,
            });
        }
        let Some(pending) = self.pending.take() else {
            return Err(Error::PlanResolved);
        };
        self.page_table.extend_from_slice(&pending.pages);
        self.ctx_committed = plan.row_end;
        self.ctx_count_drafter = plan.row_end;
        self.max_ctx_count_drafter = self.max_ctx_count_drafter.max(plan.row_end);
        self.bump();
        Ok(())
    }

    /// Give the plan's pages back; the state is as before `plan_precompute`. A plan that is
    /// already resolved (or whose state was freed) is ignored.
    ///
    /// # Errors
    /// [`Error::ForeignPlan`], [`Error::PoolMismatch`]; nothing changes.
    pub fn abort_precompute(&mut self, pool: &mut BlockPool, plan: &PrecomputePlan) -> Result<()> {
        if plan.state_id != self.id {
            return Err(Error::ForeignPlan);
        }
        self.ensure_pool(pool)?;
        match &self.pending {
            Some(p) if self.is_pending(plan) => pool.free(&p.pages)?,
            _ => return Ok(()),
        }
        self.pending = None;
        Ok(())
    }

    /// Paged-cache slot of each committed row `[0, ctx_committed)`.
    #[must_use]
    pub fn slot_mapping(&self) -> Vec<usize> {
        let ps = self.page_size;
        (0..self.ctx_committed)
            .map(|r| self.page_table[r / ps] * ps + r % ps)
            .collect()
    }

    /// Record a proposal at `position` that drafted `num_drafted` tokens.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] when `position + 1` overflows.
    pub fn note_propose(&mut self, position: usize, num_drafted: usize) -> Result<()> {
        self.ensure_live()?;
        let seq_len = position
            .checked_add(1)
            .ok_or_else(|| Error::invalid_argument("position", "too large"))?;
        self.seq_len = seq_len;
        self.last_num_drafted = num_drafted;
        self.prefill_done = true;
        self.bump();
        Ok(())
    }

    /// Record a verification that accepted `num_accepted` of the last proposal's drafts.
    ///
    /// # Errors
    /// [`Error::Freed`]; [`Error::InvalidArgument`] when `num_accepted > last_num_drafted`.
    pub fn after_verify(&mut self, num_accepted: usize) -> Result<()> {
        self.ensure_live()?;
        if num_accepted > self.last_num_drafted {
            return Err(Error::invalid_argument(
                "num_accepted",
                format!(
                    "{num_accepted} exceeds the {} drafts of the last proposal",
                    self.last_num_drafted
                ),
            ));
        }
        self.last_num_accepted = num_accepted;
        self.last_num_drafted = 0;
        self.bump();
        Ok(())
    }

    /// Return every page (table and pending plan) and reset every counter to its fresh value.
    /// Returns `Ok(false)` and does nothing when already freed.
    ///
    /// # Errors
    /// [`Error::PoolMismatch`], or a pool error if the state holds a page the pool does not
    /// consider allocated (a broken invariant); nothing changes.
    pub fn free(&mut self, pool: &mut BlockPool) -> Result<bool> {
        if self.freed {
            return Ok(false);
        }
        self.ensure_pool(pool)?;
        let mut all = self.page_table.clone();
        all.extend_from_slice(self.pending_pages());
        pool.free(&all)?;
        self.page_table = Vec::new();
        self.pending = None;
        self.ctx_positions = Vec::new();
        self.ctx_committed = 0;
        self.seq_len = 0;
        self.prefill_done = false;
        self.last_num_drafted = 0;
        self.last_num_accepted = 0;
        self.skip_next_decode_append = false;
        self.ctx_count_drafter = 0;
        self.max_ctx_count_drafter = 0;
        self.slides = 0;
        self.freed = true;
        self.bump();
        Ok(true)
    }

    /// Verify invariant 3 (crate docs), that no page is held twice, that every held page is
    /// allocated in `pool`, and that a freed state equals a fresh one.
    ///
    /// # Errors
    /// [`Error::Invariant`] describing the first violation found.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<()> {
        let bad = |m: String| Err(Error::Invariant(m));
        let len = self.ctx_len();
        if self.slide_room >= self.window {
            return bad(format!(
                "slide room {} not below the window {}",
                self.slide_room, self.window
            ));
        }
        if self.ctx_committed > len || len > self.window {
            return bad(format!(
                "need ctx_committed {} <= ctx_len {len} <= window {}",
                self.ctx_committed, self.window
            ));
        }
        if let Some((a, b)) = first_unordered(&self.ctx_positions) {
            return bad(format!("positions not increasing: {a} then {b}"));
        }
        if self.ctx_positions.first().is_some_and(|&p| p < 0) {
            return bad("negative context position".into());
        }
        let want = self.ctx_committed.div_ceil(self.page_size);
        if self.page_table.len() != want {
            return bad(format!(
                "{} pages held for {} committed rows of page size {} (want {want})",
                self.page_table.len(),
                self.ctx_committed,
                self.page_size
            ));
        }
        let held: Vec<usize> = self
            .page_table
            .iter()
            .chain(self.pending_pages())
            .copied()
            .collect();
        for (i, &b) in held.iter().enumerate() {
            if !pool.is_allocated(b) {
                return bad(format!("held page {b} is not allocated in the pool"));
            }
            if held[..i].contains(&b) {
                return bad(format!("page {b} is held twice by one state"));
            }
        }
        if self.freed && (len != 0 || !held.is_empty() || *self != self.fresh_like()) {
            return bad("a freed state has non-fresh counters".into());
        }
        Ok(())
    }

    /// What a fresh state with this identity looks like after `free` (for the freed check).
    fn fresh_like(&self) -> Self {
        Self {
            freed: true,
            version: self.version,
            next_plan_id: self.next_plan_id,
            ..Self::empty(
                self.id,
                self.owner,
                (self.window, self.slide_room),
                self.page_size,
            )
        }
    }

    fn ensure_live(&self) -> Result<()> {
        if self.freed {
            Err(Error::Freed)
        } else {
            Ok(())
        }
    }

    fn ensure_pool(&self, pool: &BlockPool) -> Result<()> {
        if pool.page_size() == self.page_size {
            Ok(())
        } else {
            Err(Error::PoolMismatch {
                expected: self.page_size,
                actual: pool.page_size(),
            })
        }
    }

    fn bump(&mut self) {
        self.version += 1;
    }
}

#[cfg(test)]
mod tests;
