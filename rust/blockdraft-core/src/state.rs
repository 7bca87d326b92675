//! Bookkeeping of one sequence's drafter context: which rows it keeps and at which positions,
//! how many of them have K/V in the paged cache, and which pool blocks hold that K/V.
//!
//! Every change goes through a two-phase plan: `plan_*` computes what the caller (who owns the
//! tensors) must do without changing the state, and the state changes only once the caller
//! reports success. Each change bumps `version`; a plan made for an older version is refused.
//!
//! Invariant (TESTING.md 3): `0 <= ctx_committed <= ctx_len <= window`, positions strictly
//! increasing, and `block_table.len() == ceil(ctx_committed / block_size)`.

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
/// The plan is a description only: its `new_blocks` are held by the state as "pending" until
/// the plan is confirmed (they join the block table) or aborted (they go back to the pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrecomputePlan {
    state_id: u64,
    plan_id: u64,
    version: u64,
    pub row_start: usize,
    pub row_end: usize,
    pub new_blocks: Vec<usize>,
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
    blocks: Vec<usize>,
}

/// The first adjacent pair `(a, b)` with `a >= b`, if any.
fn first_unordered(xs: &[i64]) -> Option<(i64, i64)> {
    xs.windows(2).find_map(|w| match *w {
        [a, b] if a >= b => Some((a, b)),
        _ => None,
    })
}

/// One sequence's context bookkeeping (the seed's `DflashProposerState`, minus device memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextState {
    id: u64,
    owner: u64,
    window: usize,
    block_size: usize,
    ctx_positions: Vec<i64>,
    ctx_committed: usize,
    block_table: Vec<usize>,
    seq_len: usize,
    prefill_done: bool,
    last_num_drafted: usize,
    last_num_accepted: usize,
    skip_next_decode_append: bool,
    ctx_count_drafter: usize,
    max_ctx_count_drafter: usize,
    freed: bool,
    version: u64,
    next_plan_id: u64,
    pending: Option<Pending>,
}

impl ContextState {
    /// A fresh, empty state of `window` rows drawing blocks from `pool`.
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
            window,
            pool.block_size(),
        ))
    }

    /// Every counter at its `alloc_state` value: the one definition of "fresh".
    fn empty(id: u64, owner: u64, window: usize, block_size: usize) -> Self {
        Self {
            id,
            owner,
            window,
            block_size,
            ctx_positions: Vec::new(),
            ctx_committed: 0,
            block_table: Vec::new(),
            seq_len: 0,
            prefill_done: false,
            last_num_drafted: 0,
            last_num_accepted: 0,
            skip_next_decode_append: false,
            ctx_count_drafter: 0,
            max_ctx_count_drafter: 0,
            freed: false,
            version: 0,
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
    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block_size
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
    pub fn block_table(&self) -> &[usize] {
        &self.block_table
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
    /// Blocks held by an unresolved precompute plan (empty when none).
    #[must_use]
    pub fn pending_blocks(&self) -> &[usize] {
        self.pending.as_ref().map_or(&[], |p| &p.blocks)
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

    /// Plan appending rows at `positions`; changes nothing.
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
            // Keep the newest rows that leave room for all n new ones.
            let keep = self.window - n;
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
    /// and how many leading positions were cut.
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
    /// A slide sets `ctx_committed = 0` and returns every block of the table to the pool: the
    /// kept rows move to new row indices, so their cached K/V no longer sits in the slots
    /// `row -> block_table[row / block_size]` says, and is recomputed by the next precompute.
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
            pool.free(&self.block_table)?;
            self.block_table.clear();
            self.ctx_positions.drain(..slide.src_start);
            self.ctx_committed = 0;
            self.ctx_count_drafter = 0;
        }
        debug_assert_eq!(self.ctx_positions.len(), plan.dst_start);
        self.ctx_positions.extend_from_slice(&plan.positions);
        self.bump();
        Ok(())
    }

    /// Plan K/V for rows `[ctx_committed, ctx_len)` and take the blocks they need from `pool`.
    ///
    /// A plan with no rows takes no blocks; it still has to be confirmed or aborted.
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
        // The seed clamps here; under the invariant this is a no-op, kept as a guard.
        let row_start = self.ctx_committed.min(row_end);
        let bs = self.block_size;
        let need = row_end.div_ceil(bs).saturating_sub(self.block_table.len());
        let new_blocks = pool.alloc(need)?;
        let held = self.block_table.len();
        let slots = (row_start..row_end)
            .map(|r| {
                let idx = r / bs;
                let block = if idx < held {
                    self.block_table[idx]
                } else {
                    new_blocks[idx - held]
                };
                block * bs + r % bs
            })
            .collect();
        let plan_id = self.next_plan_id;
        self.next_plan_id += 1;
        self.pending = Some(Pending {
            plan_id,
            blocks: new_blocks.clone(),
        });
        Ok(PrecomputePlan {
            state_id: self.id,
            plan_id,
            version: self.version,
            row_start,
            row_end,
            new_blocks,
            slots,
            positions: self.ctx_positions[row_start..row_end].to_vec(),
        })
    }

    /// The plan's K/V is written: adopt its blocks and set `ctx_committed = row_end`.
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
        self.block_table.extend_from_slice(&pending.blocks);
        self.ctx_committed = plan.row_end;
        self.ctx_count_drafter = plan.row_end;
        self.max_ctx_count_drafter = self.max_ctx_count_drafter.max(plan.row_end);
        self.bump();
        Ok(())
    }

    /// Give the plan's blocks back; the state is as before `plan_precompute`. A plan that is
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
            Some(p) if self.is_pending(plan) => pool.free(&p.blocks)?,
            _ => return Ok(()),
        }
        self.pending = None;
        Ok(())
    }

    /// Paged-cache slot of each committed row `[0, ctx_committed)`.
    #[must_use]
    pub fn slot_mapping(&self) -> Vec<usize> {
        let bs = self.block_size;
        (0..self.ctx_committed)
            .map(|r| self.block_table[r / bs] * bs + r % bs)
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

    /// Return every block (table and pending plan) and reset every counter to its fresh value.
    /// Returns `Ok(false)` and does nothing when already freed.
    ///
    /// # Errors
    /// [`Error::PoolMismatch`], or a pool error if the state holds a block the pool does not
    /// consider allocated (a broken invariant); nothing changes.
    pub fn free(&mut self, pool: &mut BlockPool) -> Result<bool> {
        if self.freed {
            return Ok(false);
        }
        self.ensure_pool(pool)?;
        let mut all = self.block_table.clone();
        all.extend_from_slice(self.pending_blocks());
        pool.free(&all)?;
        self.block_table = Vec::new();
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
        self.freed = true;
        self.bump();
        Ok(true)
    }

    /// Verify TESTING.md invariant 3 and that every held block is allocated in `pool`.
    ///
    /// # Errors
    /// [`Error::Invariant`] describing the first violation found.
    pub fn check_invariants(&self, pool: &BlockPool) -> Result<()> {
        let bad = |m: String| Err(Error::Invariant(m));
        let len = self.ctx_len();
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
        let want = self.ctx_committed.div_ceil(self.block_size);
        if self.block_table.len() != want {
            return bad(format!(
                "{} blocks held for {} committed rows of block size {} (want {want})",
                self.block_table.len(),
                self.ctx_committed,
                self.block_size
            ));
        }
        let held: Vec<usize> = self
            .block_table
            .iter()
            .chain(self.pending_blocks())
            .copied()
            .collect();
        for (i, &b) in held.iter().enumerate() {
            if !pool.is_allocated(b) {
                return bad(format!("held block {b} is not allocated in the pool"));
            }
            if held[..i].contains(&b) {
                return bad(format!("block {b} is held twice by one state"));
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
            ..Self::empty(self.id, self.owner, self.window, self.block_size)
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
        if pool.block_size() == self.block_size {
            Ok(())
        } else {
            Err(Error::PoolMismatch {
                expected: self.block_size,
                actual: pool.block_size(),
            })
        }
    }

    fn bump(&mut self) {
        self.version += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The observable bookkeeping of a state (everything but internal id counters).
    fn view(s: &ContextState) -> (Vec<i64>, usize, Vec<usize>, Vec<usize>, u64, bool) {
        (
            s.ctx_positions().to_vec(),
            s.ctx_committed(),
            s.block_table().to_vec(),
            s.pending_blocks().to_vec(),
            s.version(),
            s.freed(),
        )
    }

    fn setup(num_blocks: usize, block_size: usize, window: usize) -> (BlockPool, ContextState) {
        let mut pool = BlockPool::new(num_blocks, block_size).unwrap();
        let st = ContextState::new(&mut pool, window, 7).unwrap();
        (pool, st)
    }

    fn append(st: &mut ContextState, pool: &mut BlockPool, positions: &[i64]) -> AppendPlan {
        let plan = st.plan_append(positions).unwrap();
        st.apply_append(pool, &plan).unwrap();
        plan
    }

    fn precompute(st: &mut ContextState, pool: &mut BlockPool) -> PrecomputePlan {
        let plan = st.plan_precompute(pool).unwrap();
        st.confirm_precompute(&plan).unwrap();
        plan
    }

    #[test]
    fn fresh_state() {
        let (_, st) = setup(4, 4, 16);
        assert_eq!(
            (st.window(), st.owner(), st.ctx_len(), st.ctx_committed()),
            (16, 7, 0, 0)
        );
        assert!(st.block_table().is_empty() && !st.freed() && !st.prefill_done());
        let mut pool = BlockPool::new(1, 1).unwrap();
        assert!(matches!(
            ContextState::new(&mut pool, 0, 0),
            Err(Error::InvalidArgument { name: "window", .. })
        ));
    }

    #[test]
    fn bad_appends_change_nothing() {
        let (mut pool, mut st) = setup(8, 4, 4);
        append(&mut st, &mut pool, &[5, 6]);
        let before = st.clone();
        for bad in [
            &[][..],
            &[-1],
            &[8, 8],
            &[9, 8],
            &[6],
            &[3, 7],
            &[7, 8, 9, 10, 11],
        ] {
            let err = st.plan_append(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidArgument {
                        name: "positions",
                        ..
                    }
                ),
                "{bad:?}: {err}"
            );
        }
        assert_eq!(st, before);
    }

    #[test]
    fn append_then_slide_keeps_newest_rows() {
        let (mut pool, mut st) = setup(8, 2, 5);
        let plan = append(&mut st, &mut pool, &[0, 1, 2]);
        assert_eq!((plan.slide, plan.dst_start, plan.n_rows()), (None, 0, 3));
        precompute(&mut st, &mut pool);
        assert_eq!((st.ctx_committed(), st.block_table().len()), (3, 2));
        assert_eq!(pool.num_used(), 2);

        let plan = append(&mut st, &mut pool, &[10, 11, 12]);
        assert_eq!(
            plan.slide,
            Some(SlidePlan {
                src_start: 1,
                keep: 2
            })
        );
        assert_eq!(plan.dst_start, 2);
        assert_eq!(st.ctx_positions(), &[1, 2, 10, 11, 12]);
        assert_eq!(st.ctx_committed(), 0);
        assert!(st.block_table().is_empty(), "a slide returns every block");
        assert_eq!(pool.num_used(), 0);
        st.check_invariants(&pool).unwrap();

        // A full-window append keeps nothing.
        let plan = append(&mut st, &mut pool, &[20, 21, 22, 23, 24]);
        assert_eq!(
            plan.slide,
            Some(SlidePlan {
                src_start: 5,
                keep: 0
            })
        );
        assert_eq!(st.ctx_positions(), &[20, 21, 22, 23, 24]);
    }

    #[test]
    fn precompute_slots_fill_the_last_block_then_new_ones() {
        let (mut pool, mut st) = setup(8, 4, 32);
        append(&mut st, &mut pool, &[0, 1, 2]);
        let p = precompute(&mut st, &mut pool);
        assert_eq!(
            (p.row_start, p.row_end, p.new_blocks.clone()),
            (0, 3, vec![0])
        );
        assert_eq!(p.slots, vec![0, 1, 2]);
        pool.alloc(1).unwrap(); // someone else takes block 1
        append(&mut st, &mut pool, &[3, 4, 5, 6, 7, 8]);
        let p = st.plan_precompute(&mut pool).unwrap();
        assert_eq!((p.row_start, p.row_end), (3, 9));
        assert_eq!(p.new_blocks, vec![2, 3]);
        assert_eq!(p.slots, vec![3, 8, 9, 10, 11, 12]);
        assert_eq!(p.positions, vec![3, 4, 5, 6, 7, 8]);
        st.confirm_precompute(&p).unwrap();
        assert_eq!(st.slot_mapping(), vec![0, 1, 2, 3, 8, 9, 10, 11, 12]);
        assert_eq!((st.ctx_count_drafter(), st.max_ctx_count_drafter()), (9, 9));
        st.check_invariants(&pool).unwrap();

        // Nothing new: an empty plan that takes no blocks.
        let p = st.plan_precompute(&mut pool).unwrap();
        assert_eq!((p.row_start, p.row_end), (9, 9));
        assert!(p.new_blocks.is_empty() && p.slots.is_empty());
        st.confirm_precompute(&p).unwrap();
    }

    #[test]
    fn abort_and_exhaustion_leave_the_state_as_it_was() {
        let (mut pool, mut st) = setup(2, 2, 8);
        append(&mut st, &mut pool, &[0, 1, 2, 3, 4]);
        let before = view(&st);
        assert!(matches!(
            st.plan_precompute(&mut pool),
            Err(Error::PoolExhausted {
                requested: 3,
                free: 2
            })
        ));
        assert_eq!(view(&st), before);
        assert_eq!(pool.num_free(), 2);

        let (mut pool, mut st) = setup(4, 2, 8);
        append(&mut st, &mut pool, &[0, 1, 2]);
        let before = view(&st);
        let p = st.plan_precompute(&mut pool).unwrap();
        assert_eq!(pool.num_used(), 2);
        assert!(st.is_pending(&p));
        st.abort_precompute(&mut pool, &p).unwrap();
        assert_eq!(view(&st), before);
        assert_eq!(pool.num_used(), 0);
        // Aborting twice is a no-op; confirming a resolved plan is refused.
        st.abort_precompute(&mut pool, &p).unwrap();
        assert_eq!(st.confirm_precompute(&p), Err(Error::PlanResolved));
    }

    #[test]
    fn one_outstanding_plan_and_stale_plans() {
        let (mut pool, mut st) = setup(8, 2, 8);
        append(&mut st, &mut pool, &[0, 1]);
        let p = st.plan_precompute(&mut pool).unwrap();
        assert_eq!(st.plan_precompute(&mut pool), Err(Error::PlanOutstanding));
        // An append moves the version on: the outstanding plan can no longer be confirmed.
        append(&mut st, &mut pool, &[2]);
        assert!(matches!(
            st.confirm_precompute(&p),
            Err(Error::StalePlan { .. })
        ));
        st.abort_precompute(&mut pool, &p).unwrap();
        assert_eq!(pool.num_used(), 0);

        let a = st.plan_append(&[3]).unwrap();
        let b = st.plan_append(&[4]).unwrap();
        st.apply_append(&mut pool, &a).unwrap();
        let before = st.clone();
        assert!(matches!(
            st.apply_append(&mut pool, &b),
            Err(Error::StalePlan { .. })
        ));
        assert!(matches!(
            st.apply_append(&mut pool, &a),
            Err(Error::StalePlan { .. })
        ));
        assert_eq!(st, before);
    }

    #[test]
    fn foreign_plans_and_pools_are_refused() {
        let mut pool = BlockPool::new(8, 2).unwrap();
        let mut a = ContextState::new(&mut pool, 8, 1).unwrap();
        let mut b = ContextState::new(&mut pool, 8, 1).unwrap();
        let plan = a.plan_append(&[0]).unwrap();
        assert_eq!(b.apply_append(&mut pool, &plan), Err(Error::ForeignPlan));
        a.apply_append(&mut pool, &plan).unwrap();
        let p = a.plan_precompute(&mut pool).unwrap();
        assert_eq!(b.confirm_precompute(&p), Err(Error::ForeignPlan));
        assert_eq!(b.abort_precompute(&mut pool, &p), Err(Error::ForeignPlan));
        a.confirm_precompute(&p).unwrap();
        let mut other = BlockPool::new(8, 3).unwrap();
        assert!(matches!(
            a.plan_precompute(&mut other),
            Err(Error::PoolMismatch {
                expected: 2,
                actual: 3
            })
        ));
    }

    #[test]
    fn free_is_idempotent_and_returns_pending_blocks() {
        let (mut pool, mut st) = setup(8, 2, 8);
        append(&mut st, &mut pool, &[0, 1, 2]);
        precompute(&mut st, &mut pool);
        append(&mut st, &mut pool, &[3, 4, 5]);
        let p = st.plan_precompute(&mut pool).unwrap();
        st.note_propose(5, 3).unwrap();
        assert_eq!(pool.num_used(), 3);
        assert_eq!(st.free(&mut pool), Ok(true));
        assert_eq!(pool.num_used(), 0);
        let once = st.clone();
        assert_eq!(st.free(&mut pool), Ok(false));
        assert_eq!(st, once, "a second free does nothing");
        assert!(!st.is_pending(&p));
        st.abort_precompute(&mut pool, &p).unwrap();
        assert_eq!(pool.num_used(), 0);
        assert_eq!(
            (st.ctx_len(), st.seq_len(), st.last_num_drafted()),
            (0, 0, 0)
        );
        assert!(!st.prefill_done());
        st.check_invariants(&pool).unwrap();
        assert_eq!(st.plan_append(&[0]), Err(Error::Freed));
        assert_eq!(st.plan_precompute(&mut pool), Err(Error::Freed));
        assert_eq!(st.note_propose(1, 1), Err(Error::Freed));
        assert_eq!(st.after_verify(0), Err(Error::Freed));
    }

    #[test]
    fn propose_and_verify_counters() {
        let (_, mut st) = setup(1, 1, 8);
        st.note_propose(9, 4).unwrap();
        assert_eq!((st.seq_len(), st.last_num_drafted()), (10, 4));
        assert!(st.prefill_done());
        assert!(matches!(
            st.after_verify(5),
            Err(Error::InvalidArgument {
                name: "num_accepted",
                ..
            })
        ));
        st.after_verify(3).unwrap();
        assert_eq!((st.last_num_accepted(), st.last_num_drafted()), (3, 0));
        assert!(st.note_propose(usize::MAX, 1).is_err());
    }

    #[test]
    fn check_invariants_detects_corruption() {
        let (mut pool, mut st) = setup(8, 2, 8);
        append(&mut st, &mut pool, &[0, 1, 2]);
        precompute(&mut st, &mut pool);
        st.check_invariants(&pool).unwrap();

        let mut s = st.clone();
        s.block_table.pop();
        assert!(matches!(
            s.check_invariants(&pool),
            Err(Error::Invariant(_))
        ));
        let mut s = st.clone();
        s.ctx_committed = 4;
        assert!(matches!(
            s.check_invariants(&pool),
            Err(Error::Invariant(_))
        ));
        let mut s = st.clone();
        s.ctx_positions[1] = 0;
        assert!(matches!(
            s.check_invariants(&pool),
            Err(Error::Invariant(_))
        ));
        let mut s = st.clone();
        s.block_table[1] = s.block_table[0];
        assert!(matches!(
            s.check_invariants(&pool),
            Err(Error::Invariant(_))
        ));
        let mut p = pool.clone();
        p.free(st.block_table()).unwrap();
        assert!(matches!(st.check_invariants(&p), Err(Error::Invariant(_))));
        let mut s = st.clone();
        s.free(&mut pool).unwrap();
        s.seq_len = 3;
        assert!(matches!(
            s.check_invariants(&pool),
            Err(Error::Invariant(_))
        ));
    }
}
