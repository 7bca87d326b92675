//! One steady-state step over many sequences: the anchor rules of a proposal, and the metadata
//! matrix the graph path reads (`python/blockdraft/proposer/graphs.py`, `docs/design/graph-path.md`).
//!
//! The graph path replays a CUDA graph per batch-size bucket; per call only a small `i64`
//! matrix changes. [`GraphMeta`] writes it from the states' plans and keeps a mirror of which
//! state each row describes, so a row's page table is rewritten only when the row changes
//! hands or the table changed in a way the plans do not explain (a slide, an aborted plan).
//!
//! Layout of the matrix (`rows x cols`, row-major, `cols = 3 + width + 3 * B`, where `B` is the
//! drafter's `block_size`):
//!
//! | columns | what |
//! | --- | --- |
//! | 0 | context rows with K/V (the plan's `row_end`) |
//! | 1 | anchor token |
//! | 2 | anchor position |
//! | `3 .. 3 + width` | page table, zero padded |
//! | next `B` | positions of the staged context rows |
//! | next `B` | slots of the staged context rows ([`PAD_SLOT`](crate::PAD_SLOT) = unused) |
//! | next `B` | where each staged row is read from: `base + row * stride` (0 without a base) |
//!
//! Staged row `j` of a call (the `j`-th context row whose K/V the graph stores) sits at matrix
//! row `j / B`, entry `j % B`; rows past the call's sequences have no context. The source column
//! lets the replayed graph gather the staged rows itself: the caller gives each sequence's
//! accumulator base address and the row stride in bytes (opaque numbers here).

use crate::error::{Error, Result};
use crate::state::{ContextState, PrecomputePlan};
use crate::PAD_SLOT;

/// Anchor positions must leave room for the block's `position + block_size` in an `i64` tensor.
pub const MAX_ANCHOR_POSITION: i64 = 1 << 62;

/// The rules of a proposal's anchor on a live state: `0 <= token < vocab`,
/// `0 <= position < 2**62`, and `position` after the state's last context position.
///
/// # Errors
/// [`Error::Freed`]; [`Error::InvalidArgument`] naming `last_token` or `position`.
pub fn check_anchor(state: &ContextState, token: i64, position: i64, vocab: usize) -> Result<()> {
    if state.freed() {
        return Err(Error::Freed);
    }
    if token < 0 || usize::try_from(token).is_ok_and(|t| t >= vocab) {
        return Err(Error::invalid_argument(
            "last_token",
            format!("{token} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    if position < 0 {
        return Err(Error::invalid_argument(
            "position",
            format!("must be >= 0, got {position}"),
        ));
    }
    if position >= MAX_ANCHOR_POSITION {
        return Err(Error::invalid_argument(
            "position",
            format!("must be < 2**62, got {position}"),
        ));
    }
    if let Some(last) = state.last_position() {
        if position <= last {
            return Err(Error::invalid_argument(
                "position",
                format!("{position} is not after the last context position {last}"),
            ));
        }
    }
    Ok(())
}

/// The rules of a proposal on a state: live, with committed context (the lifecycle is
/// alloc, commit context, propose), and an anchor [`check_anchor`] accepts.
///
/// # Errors
/// [`Error::Freed`]; [`Error::NoContext`] while the context is empty; as [`check_anchor`].
pub fn check_proposal(state: &ContextState, token: i64, position: i64, vocab: usize) -> Result<()> {
    if state.freed() {
        return Err(Error::Freed);
    }
    if state.ctx_len() == 0 {
        return Err(Error::NoContext);
    }
    check_anchor(state, token, position, vocab)
}

/// The columns of the metadata matrix for tables of `width` entries and blocks of `block_size`
/// rows (see the module docs): the one description of the layout, which the Python side reads
/// through the binding instead of spelling it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    pub width: usize,
    pub block_size: usize,
}

impl MetaLayout {
    /// The page table's first column (after the three scalars).
    pub const TABLE_COL: usize = 3;

    #[must_use]
    pub fn pos_col(self) -> usize {
        Self::TABLE_COL + self.width
    }
    #[must_use]
    pub fn slot_col(self) -> usize {
        self.pos_col() + self.block_size
    }
    #[must_use]
    pub fn src_col(self) -> usize {
        self.slot_col() + self.block_size
    }
    #[must_use]
    pub fn cols(self) -> usize {
        self.src_col() + self.block_size
    }
}

/// What one filled call asks of the caller besides replaying.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Filled {
    /// Context rows staged in the matrix (their K/V is stored inside the graph).
    pub staged: usize,
    /// Sequences whose plan has more than `block_size` rows: the caller stores their K/V first.
    pub eager: Vec<usize>,
    /// `(sequence, row_start, row_end)` of each staged plan, in staging order, for a call
    /// without source bases: the caller copies these accumulator rows into the staging
    /// buffer, back to back. (With bases the graph gathers them; the list stays empty.)
    pub staged_rows: Vec<(usize, usize, usize)>,
}

/// The metadata writer of one bucket (see the module docs for the layout).
#[derive(Debug, Clone)]
pub struct GraphMeta {
    rows: usize,
    layout: MetaLayout,
    mask_id: i64,
    /// Bytes between two rows of a source (see the module docs).
    stride: i64,
    /// Per row: the `(id, slides)` of the state it mirrors and how many of its pages the row
    /// holds.
    owners: Vec<Option<((u64, u64), usize)>>,
    /// Staged rows of the last call (their slots are reset by the next one).
    staged: usize,
    /// Per sequence of the call in progress: `(row_end, token, position)`.
    scalars: Vec<[i64; 3]>,
    /// Positions and slots of the call's staged rows, in order.
    staged_pos: Vec<i64>,
    staged_slot: Vec<i64>,
    staged_src: Vec<i64>,
    filled: Filled,
}

/// A page table too wide for the graphs: the caller takes the plain path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooWide;

impl GraphMeta {
    /// A writer for `rows` sequences with page tables of up to `width` entries and blocks of
    /// `block_size` drafter rows; rows without a sequence carry `mask_id` as their anchor;
    /// source rows lie `stride` bytes apart.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `rows`, `width` or `block_size` is 0.
    pub fn new(
        rows: usize,
        width: usize,
        block_size: usize,
        mask_id: i64,
        stride: i64,
    ) -> Result<Self> {
        for (name, v) in [("rows", rows), ("width", width), ("block_size", block_size)] {
            if v == 0 {
                return Err(Error::invalid_argument(name, "must be >= 1, got 0"));
            }
        }
        Ok(Self {
            rows,
            layout: MetaLayout { width, block_size },
            mask_id,
            stride,
            owners: vec![None; rows],
            staged: 0,
            scalars: Vec::with_capacity(rows),
            staged_pos: Vec::with_capacity(rows * block_size),
            staged_slot: Vec::with_capacity(rows * block_size),
            staged_src: Vec::with_capacity(rows * block_size),
            filled: Filled::default(),
        })
    }

    #[must_use]
    pub fn rows(&self) -> usize {
        self.rows
    }
    #[must_use]
    pub fn layout(&self) -> MetaLayout {
        self.layout
    }
    #[must_use]
    pub fn cols(&self) -> usize {
        self.layout.cols()
    }
    /// Staged rows of the last filled call.
    #[must_use]
    pub fn staged(&self) -> usize {
        self.staged
    }

    /// The matrix of a writer that has filled nothing: no context, mask anchors, every slot
    /// unused. Forgets every row's owner.
    ///
    /// # Panics
    /// When `buf` is not `rows * cols` long.
    pub fn init(&mut self, buf: &mut [i64]) {
        let cols = self.cols();
        assert_eq!(
            buf.len(),
            self.rows * cols,
            "the metadata buffer has the wrong size"
        );
        let (slot_col, block_size) = (self.layout.slot_col(), self.layout.block_size);
        for row in buf.chunks_exact_mut(cols) {
            row.fill(0);
            row[1] = self.mask_id;
            row[slot_col..slot_col + block_size].fill(PAD_SLOT);
        }
        self.owners.fill(None);
        self.staged = 0;
    }

    /// Start a call (before the first [`Self::row`]).
    pub fn begin(&mut self) {
        self.scalars.clear();
        self.staged_pos.clear();
        self.staged_slot.clear();
        self.staged_src.clear();
        self.filled = Filled::default();
    }

    /// The call's next sequence (0, 1, ... in order): the state `key` (its id and its
    /// [`slides`](crate::ContextState::slides): a slide replaces the table) with its committed
    /// `table`, its outstanding `plan`, its anchor `(token, position)`, and the `base` its
    /// staged rows are read from (row `r` at `base + r * stride`; `None`: 0 in the column).
    ///
    /// # Errors
    /// [`TooWide`] when the table with the plan's new pages exceeds `width`: the call must take
    /// the plain path (the row's mirror is dropped; nothing else changed that matters, since
    /// the scalars and staged entries are written by [`Self::finish`] only).
    ///
    /// # Panics
    /// When the call already has `rows` sequences or `buf` has the wrong size.
    pub fn row(
        &mut self,
        buf: &mut [i64],
        key: (u64, u64),
        table: &[usize],
        plan: &PrecomputePlan,
        (token, position): (i64, i64),
        base: Option<i64>,
    ) -> Result<(), TooWide> {
        let cols = self.cols();
        assert_eq!(
            buf.len(),
            self.rows * cols,
            "the metadata buffer has the wrong size"
        );
        let seq = self.scalars.len();
        assert!(seq < self.rows, "more sequences than rows");
        let row = &mut buf[seq * cols..(seq + 1) * cols];
        let (table_col, width, block_size) = (
            MetaLayout::TABLE_COL,
            self.layout.width,
            self.layout.block_size,
        );
        let mut held = match self.owners[seq] {
            Some((owner, len)) if owner == key && len == table.len() => len,
            _ => {
                if table.len() > width {
                    self.owners[seq] = None;
                    return Err(TooWide);
                }
                for (dst, &b) in row[table_col..table_col + table.len()]
                    .iter_mut()
                    .zip(table)
                {
                    *dst = as_i64(b);
                }
                table.len()
            }
        };
        let new = &plan.new_pages;
        if held + new.len() > width {
            self.owners[seq] = None;
            return Err(TooWide);
        }
        let at = table_col + held;
        for (dst, &b) in row[at..at + new.len()].iter_mut().zip(new) {
            *dst = as_i64(b);
        }
        // The mirror describes the table once the plan is confirmed; an aborted plan shows up
        // next call as a length mismatch and the row is rewritten from the state.
        held += new.len();
        self.owners[seq] = Some((key, held));
        self.scalars.push([as_i64(plan.row_end), token, position]);
        let count = plan.row_end - plan.row_start;
        if count > block_size {
            self.filled.eager.push(seq);
        } else if count > 0 {
            self.staged_pos.extend_from_slice(&plan.positions);
            self.staged_slot
                .extend(plan.slots.iter().map(|&s| as_i64(s)));
            let stride = self.stride;
            self.staged_src.extend(
                (plan.row_start..plan.row_end)
                    .map(|r| base.map_or(0, |b| b.wrapping_add(as_i64(r).wrapping_mul(stride)))),
            );
            if base.is_none() {
                self.filled
                    .staged_rows
                    .push((seq, plan.row_start, plan.row_end));
            }
        }
        Ok(())
    }

    /// End the call: write every sequence's scalars and the staged entries, clear the rows
    /// past the call's sequences and the staged entries the last call left beyond this one's.
    ///
    /// # Panics
    /// When `buf` has the wrong size.
    pub fn finish(&mut self, buf: &mut [i64]) -> &Filled {
        let cols = self.cols();
        assert_eq!(
            buf.len(),
            self.rows * cols,
            "the metadata buffer has the wrong size"
        );
        let layout = self.layout;
        let (block_size, pos_col, slot_col, src_col) = (
            layout.block_size,
            layout.pos_col(),
            layout.slot_col(),
            layout.src_col(),
        );
        for (row, scalars) in buf.chunks_exact_mut(cols).zip(&self.scalars) {
            row[..3].copy_from_slice(scalars);
        }
        for seq in self.scalars.len()..self.rows {
            let row = &mut buf[seq * cols..(seq + 1) * cols];
            if self.owners[seq].is_some() || row[0] != 0 {
                row[..3].copy_from_slice(&[0, self.mask_id, 0]);
                self.owners[seq] = None;
            }
        }
        let staged = self.staged_pos.len();
        let used = staged.div_ceil(block_size);
        for (r, row) in buf.chunks_exact_mut(cols).take(used).enumerate() {
            for entry in 0..block_size {
                let k = r * block_size + entry;
                if k < staged {
                    row[pos_col + entry] = self.staged_pos[k];
                    row[slot_col + entry] = self.staged_slot[k];
                    row[src_col + entry] = self.staged_src[k];
                } else {
                    row[slot_col + entry] = PAD_SLOT;
                }
            }
        }
        // Rows that held the last call's staged entries beyond this call's: unused again.
        for row in buf
            .chunks_exact_mut(cols)
            .take(self.staged.div_ceil(block_size))
            .skip(used)
        {
            row[slot_col..slot_col + block_size].fill(PAD_SLOT);
        }
        self.staged = staged;
        self.filled.staged = staged;
        &self.filled
    }
}

/// Page ids and row counts come from a pool of at most `isize::MAX` entries.
fn as_i64(v: usize) -> i64 {
    i64::try_from(v).expect("a count beyond i64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::BlockPool;

    /// The matrix the layout describes, built from scratch: what every fill must equal on the
    /// columns the graph reads.
    fn rebuild(meta: &GraphMeta, calls: &[(Vec<usize>, PrecomputePlan, i64, i64)]) -> Vec<i64> {
        let cols = meta.cols();
        let mut buf = vec![0i64; meta.rows * cols];
        let mut staged = Vec::new();
        for (i, (table, plan, tok, pos)) in calls.iter().enumerate() {
            let row = &mut buf[i * cols..(i + 1) * cols];
            row[0] = as_i64(plan.row_end);
            row[1] = *tok;
            row[2] = *pos;
            for (k, b) in table.iter().chain(&plan.new_pages).enumerate() {
                row[MetaLayout::TABLE_COL + k] = as_i64(*b);
            }
            let count = plan.row_end - plan.row_start;
            if count > 0 && count <= meta.layout.block_size {
                let base = base_of(i);
                staged.extend(
                    plan.positions
                        .iter()
                        .zip(&plan.slots)
                        .zip(plan.row_start..)
                        .map(|((&p, &s), r)| (p, s, base + as_i64(r) * STRIDE)),
                );
            }
        }
        for row in buf.chunks_exact_mut(cols).skip(calls.len()) {
            row[1] = meta.mask_id;
        }
        for (k, (p, s, src)) in staged.iter().enumerate() {
            let (r, e) = (k / meta.layout.block_size, k % meta.layout.block_size);
            buf[r * cols + meta.layout.pos_col() + e] = *p;
            buf[r * cols + meta.layout.slot_col() + e] = as_i64(*s);
            buf[r * cols + meta.layout.src_col() + e] = *src;
        }
        for k in staged.len()..meta.rows * meta.layout.block_size {
            let (r, e) = (k / meta.layout.block_size, k % meta.layout.block_size);
            buf[r * cols + meta.layout.slot_col() + e] = PAD_SLOT;
        }
        buf
    }

    const STRIDE: i64 = 48;

    /// Sequence `i`'s (made-up) source base address.
    fn base_of(i: usize) -> i64 {
        (1 << 40) + as_i64(i) * (1 << 20)
    }

    /// The columns the graph reads: scalars, the table up to its length, every slot, and the
    /// positions and sources of staged entries (others are never read: their slot is
    /// `PAD_SLOT`).
    fn read_view(meta: &GraphMeta, buf: &[i64], tables: &[usize]) -> Vec<i64> {
        let cols = meta.cols();
        let mut out = Vec::new();
        for (i, row) in buf.chunks_exact(cols).enumerate() {
            out.extend_from_slice(&row[..3]);
            let len = tables.get(i).copied().unwrap_or(0);
            out.extend_from_slice(&row[MetaLayout::TABLE_COL..MetaLayout::TABLE_COL + len]);
            for e in 0..meta.layout.block_size {
                let slot = row[meta.layout.slot_col() + e];
                out.push(slot);
                if slot != PAD_SLOT {
                    out.push(row[meta.layout.pos_col() + e]);
                    out.push(row[meta.layout.src_col() + e]);
                }
            }
        }
        out
    }

    #[test]
    fn anchor_rules() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut st = ContextState::new(&mut pool, 16, 0).unwrap();
        assert!(check_anchor(&st, 0, 0, 10).is_ok());
        let plan = st.plan_append(&[3, 5]).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        for (tok, pos, name) in [
            (-1, 6, "last_token"),
            (10, 6, "last_token"),
            (1, -1, "position"),
            (1, 5, "position"),
            (1, MAX_ANCHOR_POSITION, "position"),
        ] {
            match check_anchor(&st, tok, pos, 10) {
                Err(Error::InvalidArgument { name: got, .. }) => assert_eq!(got, name),
                other => panic!("({tok}, {pos}): {other:?}"),
            }
        }
        assert!(check_anchor(&st, 9, 6, 10).is_ok());
        st.free(&mut pool).unwrap();
        assert_eq!(check_anchor(&st, 1, 6, 10), Err(Error::Freed));
    }

    #[test]
    fn a_proposal_needs_committed_context() {
        let mut pool = BlockPool::new(8, 4).unwrap();
        let mut st = ContextState::new(&mut pool, 16, 0).unwrap();
        let err = check_proposal(&st, 1, 0, 10).unwrap_err();
        assert_eq!(err, Error::NoContext);
        assert_eq!(
            err.to_string(),
            "the state has no committed context (commit_ctx before propose)"
        );
        let plan = st.plan_append(&[3]).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        assert!(check_proposal(&st, 1, 4, 10).is_ok());
        // the anchor rules still apply once there is context
        assert!(matches!(
            check_proposal(&st, 1, 3, 10),
            Err(Error::InvalidArgument {
                name: "position",
                ..
            })
        ));
        st.free(&mut pool).unwrap();
        // freed comes first: a freed state has no context either
        assert_eq!(check_proposal(&st, 1, 4, 10), Err(Error::Freed));
    }

    #[test]
    fn fills_equal_a_rebuild_over_steps() {
        // Three sequences on pages of 4 rows, steps of 1..=block_size rows, one slide; the bucket
        // has 4 rows, so one stays empty.
        let (page, block_size, width) = (4, 3, 8);
        let mut pool = BlockPool::new(64, page).unwrap();
        let mut states: Vec<ContextState> = (0..3)
            .map(|_| ContextState::new(&mut pool, 20, 0).unwrap())
            .collect();
        let mut next = [0i64; 3];
        let mut meta = GraphMeta::new(4, width, block_size, 99, STRIDE).unwrap();
        let mut buf = vec![7i64; 4 * meta.cols()];
        meta.init(&mut buf);
        for step in 0..12usize {
            let mut calls = Vec::new();
            let mut plans = Vec::new();
            let n = if step % 4 == 3 { 2 } else { 3 };
            for (i, st) in states.iter_mut().enumerate().take(n) {
                let rows = if step == 0 {
                    5 + i
                } else {
                    1 + (step + i) % block_size
                };
                let pos: Vec<i64> = (next[i]..next[i] + as_i64(rows)).collect();
                next[i] += as_i64(rows) + 1;
                let (plan, _) = st.plan_append_newest(&pos).unwrap();
                st.apply_append(&mut pool, &plan).unwrap();
                let pre = st.plan_precompute(&mut pool).unwrap();
                calls.push((st.page_table().to_vec(), pre.clone(), as_i64(i), next[i]));
                plans.push(pre);
            }
            meta.begin();
            for (i, (table, plan, tok, pos)) in calls.iter().enumerate() {
                meta.row(
                    &mut buf,
                    (states[i].id(), states[i].slides()),
                    table,
                    plan,
                    (*tok, *pos),
                    Some(base_of(i)),
                )
                .unwrap();
            }
            let filled = meta.finish(&mut buf).clone();
            let tables: Vec<usize> = calls
                .iter()
                .map(|(t, p, ..)| t.len() + p.new_pages.len())
                .collect();
            assert_eq!(
                read_view(&meta, &buf, &tables),
                read_view(&meta, &rebuild(&meta, &calls), &tables),
                "step {step}"
            );
            let expect_eager: Vec<usize> = calls
                .iter()
                .enumerate()
                .filter(|(_, (_, p, ..))| p.row_end - p.row_start > block_size)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(filled.eager, expect_eager);
            // with source bases the graph gathers the rows: no copy list for the caller
            assert!(filled.staged_rows.is_empty());
            // Confirm all but (on odd steps) the last, which is aborted: its row must be
            // rewritten from the state next time.
            for (i, plan) in plans.iter().enumerate() {
                if step % 2 == 1 && i + 1 == plans.len() {
                    states[i].abort_precompute(&mut pool, plan).unwrap();
                } else {
                    states[i].confirm_precompute(plan).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_slide_between_calls_rewrites_the_row_even_at_the_same_table_length() {
        // The state's row mirrors 2 pages; it then slides and its kept rows are recomputed
        // without this matrix (another bucket's call) into 2 other pages.
        let mut pool = BlockPool::new(16, 4).unwrap();
        let mut st = ContextState::new(&mut pool, 8, 0)
            .unwrap()
            .with_slide_room(2)
            .unwrap();
        let mut meta = GraphMeta::new(1, 4, 3, 0, STRIDE).unwrap();
        let mut buf = vec![0i64; meta.cols()];
        meta.init(&mut buf);
        let fill =
            |meta: &mut GraphMeta, buf: &mut [i64], st: &ContextState, pre: &PrecomputePlan| {
                meta.begin();
                meta.row(
                    buf,
                    (st.id(), st.slides()),
                    st.page_table(),
                    pre,
                    (1, 9),
                    None,
                )
                .unwrap();
                meta.finish(buf);
            };
        let plan = st.plan_append(&(0..8).collect::<Vec<_>>()).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        let pre = st.plan_precompute(&mut pool).unwrap();
        fill(&mut meta, &mut buf, &st, &pre);
        st.confirm_precompute(&pre).unwrap();
        let old = st.page_table().to_vec();
        let plan = st.plan_append(&[8]).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        assert_eq!((st.slides(), st.ctx_len()), (1, 6));
        let held = pool.alloc(2).unwrap(); // the freed pages: the recompute takes others
        let pre = st.plan_precompute(&mut pool).unwrap();
        st.confirm_precompute(&pre).unwrap();
        assert_eq!(st.page_table().len(), old.len());
        assert!(st.page_table().iter().all(|p| !old.contains(p)));
        let plan = st.plan_append(&[9]).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        let pre = st.plan_precompute(&mut pool).unwrap();
        assert!(pre.new_pages.is_empty());
        fill(&mut meta, &mut buf, &st, &pre);
        let col = MetaLayout::TABLE_COL;
        let row: Vec<i64> = buf[col..col + 2].to_vec();
        let want: Vec<i64> = st.page_table().iter().map(|&p| as_i64(p)).collect();
        assert_eq!(row, want);
        pool.free(&held).unwrap();
    }

    #[test]
    fn too_wide_tables_are_refused() {
        let mut pool = BlockPool::new(16, 2).unwrap();
        let mut st = ContextState::new(&mut pool, 32, 0).unwrap();
        let plan = st.plan_append(&[0, 1, 2, 3, 4]).unwrap();
        st.apply_append(&mut pool, &plan).unwrap();
        let pre = st.plan_precompute(&mut pool).unwrap();
        let mut meta = GraphMeta::new(1, 2, 4, 0, 8).unwrap();
        let mut buf = vec![0i64; meta.cols()];
        meta.init(&mut buf);
        meta.begin();
        assert_eq!(
            meta.row(&mut buf, (st.id(), 0), &[], &pre, (1, 5), None),
            Err(TooWide)
        );
        assert!(GraphMeta::new(0, 1, 1, 0, 8).is_err());
    }
}
