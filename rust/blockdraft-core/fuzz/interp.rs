//! Operation-sequence interpreter shared by the `cargo fuzz` target (`fuzz_targets/ops.rs`) and
//! the corpus replay test (`blockdraft-core/tests/fuzz_corpus.rs`, run by plain `cargo test`).
//!
//! A byte string is read as a program: each operation takes an opcode byte and a few argument
//! bytes (missing bytes read as 0, so every input is a valid program). Operations drive one pool
//! shared by up to `MAX_STATES` context states plus raw allocations, against a reference model of
//! plain vectors. Refused operations must change nothing (the pool and the state compare equal
//! to their clones); after every operation the crate's invariants 1-3 (`blockdraft_core` docs)
//! are checked, and at the end every state is freed and the pool must be exactly full
//! (invariants 6-7). Any violation panics, which is what the fuzzer reports.

use blockdraft_core::{
    batch_decline_reason, ctx_window, propose_batch_max, split_bands, AppendPlan, BlockPool,
    ContextState, Error, PrecomputePlan,
};

const MAX_STATES: usize = 6;

/// What one program did (the replay test reports the totals).
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub ops: u64,
    pub checks: u64,
}

struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn done(&self) -> bool {
        self.at >= self.data.len()
    }

    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    fn small(&mut self, below: usize) -> usize {
        usize::from(self.u8()) % below.max(1)
    }

    /// A boundary-heavy 64-bit value: 0, 1, small, huge, or arbitrary bytes.
    fn wide(&mut self) -> u64 {
        match self.u8() % 6 {
            0 => 0,
            1 => 1,
            2 => u64::from(self.u8()),
            3 => u64::MAX - u64::from(self.u8()),
            4 => 1 << (self.u8() % 64),
            _ => (0..8).fold(0, |acc, _| (acc << 8) | u64::from(self.u8())),
        }
    }
}

/// One state with the model of what it must hold.
struct Slot {
    st: ContextState,
    positions: Vec<i64>,
    committed: usize,
    plan: Option<PrecomputePlan>,
    /// Whether the outstanding plan was made for an older version (it can only be aborted).
    stale: bool,
    drafted: usize,
    freed: bool,
}

struct World {
    pool: BlockPool,
    /// A second pool with another page size: every state must refuse it.
    other: BlockPool,
    slots: Vec<Slot>,
    raw: Vec<Vec<usize>>,
    stats: Stats,
}

fn expect_err<T: std::fmt::Debug>(r: blockdraft_core::Result<T>, what: &str) -> Error {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) => e,
    }
}

impl World {
    fn new(num_pages: usize, page_size: usize) -> Self {
        Self {
            pool: BlockPool::new(num_pages, page_size).expect("valid pool"),
            other: BlockPool::new(3, page_size + 1).expect("valid pool"),
            slots: Vec::new(),
            raw: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn page_size(&self) -> usize {
        self.pool.page_size()
    }

    /// Run `f` on slot `i`, which must refuse; the pool and the state must be unchanged.
    fn refused<T: std::fmt::Debug>(
        &mut self,
        i: usize,
        what: &str,
        f: impl FnOnce(&mut ContextState, &mut BlockPool) -> blockdraft_core::Result<T>,
    ) -> Error {
        let (pool0, st0) = (self.pool.clone(), self.slots[i].st.clone());
        let e = expect_err(f(&mut self.slots[i].st, &mut self.pool), what);
        assert_eq!(self.pool, pool0, "{what}: a refused call changed the pool");
        assert_eq!(
            self.slots[i].st, st0,
            "{what}: a refused call changed the state"
        );
        self.stats.checks += 2;
        e
    }

    fn next_positions(&self, i: usize, n: usize, gap: i64) -> Vec<i64> {
        let start = self.slots[i].positions.last().map_or(gap, |&p| p + 1 + gap);
        (0..n).map(|k| start + k as i64).collect()
    }

    fn append(&mut self, i: usize, n: usize, gap: i64) {
        let positions = self.next_positions(i, n, gap);
        let window = self.slots[i].st.window();
        if self.slots[i].freed {
            let e = self.refused(i, "append after free", |s, _| s.plan_append(&positions));
            assert!(matches!(e, Error::Freed), "{e:?}");
            return;
        }
        if n == 0 || n > window {
            let e = self.refused(i, "bad append size", |s, _| s.plan_append(&positions));
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        name: "positions",
                        ..
                    }
                ),
                "{e:?}"
            );
            return;
        }
        let plan = self.slots[i]
            .st
            .plan_append(&positions)
            .expect("valid append");
        let slot = &mut self.slots[i];
        let len = slot.positions.len();
        if len + n > window {
            let keep = (window - slot.st.slide_room()).saturating_sub(n);
            let slide = plan.slide.expect("an overflowing append slides");
            assert_eq!((slide.src_start, slide.keep), (len - keep, keep));
            assert_eq!(plan.dst_start, keep);
        } else {
            assert!(plan.slide.is_none());
            assert_eq!(plan.dst_start, len);
        }
        let free_before = self.pool.num_free();
        let table = slot.st.page_table().len();
        slot.st
            .apply_append(&mut self.pool, &plan)
            .expect("fresh plan applies");
        if let Some(slide) = plan.slide {
            // Invariant 4: the newest rows stay, in order, with their positions; K/V is dropped.
            slot.positions.drain(..slide.src_start);
            slot.committed = 0;
            assert_eq!(
                self.pool.num_free(),
                free_before + table,
                "a slide returns the table"
            );
        }
        slot.positions.extend_from_slice(&positions);
        if slot.plan.is_some() {
            slot.stale = true;
        }
        // Re-applying the same plan is refused: it is now stale.
        let e = self.refused(i, "re-applied append plan", |s, p| s.apply_append(p, &plan));
        assert!(matches!(e, Error::StalePlan { .. }), "{e:?}");
    }

    fn bad_append(&mut self, i: usize, kind: usize) {
        let last = self.slots[i].positions.last().copied();
        let positions: Vec<i64> = match kind {
            0 => vec![],
            1 => vec![-1 - i64::from(u8::try_from(i).unwrap_or(0))],
            2 => vec![last.map_or(10, |p| p + 10), last.map_or(5, |p| p + 5)],
            _ => match last {
                Some(p) => vec![p],
                None => vec![3, 3],
            },
        };
        let e = self.refused(i, "bad append", |s, _| s.plan_append(&positions));
        assert!(
            matches!(e, Error::InvalidArgument { .. } | Error::Freed),
            "{e:?}"
        );
    }

    fn precompute(&mut self, i: usize, then: usize) {
        let ps = self.page_size();
        let slot = &self.slots[i];
        if slot.freed {
            let e = self.refused(i, "precompute after free", |s, p| s.plan_precompute(p));
            assert!(matches!(e, Error::Freed), "{e:?}");
            return;
        }
        if slot.plan.is_some() {
            let e = self.refused(i, "second plan", |s, p| s.plan_precompute(p));
            assert!(matches!(e, Error::PlanOutstanding), "{e:?}");
            return;
        }
        let len = slot.positions.len();
        let need = len.div_ceil(ps) - slot.st.page_table().len();
        if need > self.pool.num_free() {
            let e = self.refused(i, "precompute on a dry pool", |s, p| s.plan_precompute(p));
            assert!(matches!(e, Error::PoolExhausted { .. }), "{e:?}");
            return;
        }
        let (pool0, st0, other0) = (
            self.pool.clone(),
            self.slots[i].st.clone(),
            self.other.clone(),
        );
        let e = expect_err(
            self.slots[i].st.plan_precompute(&mut self.other),
            "other pool",
        );
        assert!(matches!(e, Error::PoolMismatch { .. }), "{e:?}");
        assert_eq!(
            (&self.pool, &self.slots[i].st, &self.other),
            (&pool0, &st0, &other0)
        );
        let slot = &mut self.slots[i];
        let plan = slot
            .st
            .plan_precompute(&mut self.pool)
            .expect("pages are free");
        assert_eq!((plan.row_start, plan.row_end), (slot.committed, len));
        assert_eq!(plan.new_pages.len(), need);
        assert_eq!(plan.slots.len(), len - slot.committed);
        assert_eq!(plan.positions, slot.positions[slot.committed..]);
        for (k, &s) in plan.slots.iter().enumerate() {
            let row = plan.row_start + k;
            let idx = row / ps;
            let table = slot.st.page_table();
            let page = table
                .get(idx)
                .copied()
                .unwrap_or_else(|| plan.new_pages[idx - table.len()]);
            assert_eq!(s, page * ps + row % ps, "slot of row {row}");
        }
        slot.plan = Some(plan);
        slot.stale = false;
        self.stats.checks += 4;
        match then {
            0 => self.confirm(i),
            1 => self.abort(i),
            _ => {}
        }
    }

    fn confirm(&mut self, i: usize) {
        let Some(plan) = self.slots[i].plan.clone() else {
            return;
        };
        if self.slots[i].stale || self.slots[i].freed {
            let e = self.refused(i, "stale confirm", |s, _| s.confirm_precompute(&plan));
            assert!(
                matches!(
                    e,
                    Error::StalePlan { .. } | Error::Freed | Error::PlanResolved
                ),
                "{e:?}"
            );
            return;
        }
        let slot = &mut self.slots[i];
        slot.st
            .confirm_precompute(&plan)
            .expect("fresh plan confirms");
        slot.committed = plan.row_end;
        slot.plan = None;
        let e = self.refused(i, "confirm twice", |s, _| s.confirm_precompute(&plan));
        assert!(matches!(e, Error::PlanResolved), "{e:?}");
    }

    fn abort(&mut self, i: usize) {
        let Some(plan) = self.slots[i].plan.take() else {
            return;
        };
        let free = self.pool.num_free();
        let pending = if self.slots[i].freed {
            0
        } else {
            plan.new_pages.len()
        };
        self.slots[i]
            .st
            .abort_precompute(&mut self.pool, &plan)
            .expect("own plan aborts");
        assert_eq!(self.pool.num_free(), free + pending);
        // Aborting again does nothing.
        let (pool0, st0) = (self.pool.clone(), self.slots[i].st.clone());
        self.slots[i]
            .st
            .abort_precompute(&mut self.pool, &plan)
            .expect("resolved plan abort is a no-op");
        assert_eq!((&self.pool, &self.slots[i].st), (&pool0, &st0));
        self.stats.checks += 2;
    }

    fn propose(&mut self, i: usize, drafted: usize, accepted: usize) {
        if self.slots[i].freed {
            let e = self.refused(i, "propose after free", |s, _| s.note_propose(0, 1));
            assert!(matches!(e, Error::Freed), "{e:?}");
            return;
        }
        let position = self.slots[i].positions.last().map_or(0, |&p| p + 1);
        let slot = &mut self.slots[i];
        let pos = usize::try_from(position).expect("non-negative");
        slot.st.note_propose(pos, drafted).expect("live state");
        assert_eq!(slot.st.seq_len(), pos + 1);
        slot.drafted = drafted;
        if slot.plan.is_some() {
            slot.stale = true;
        }
        if accepted > drafted {
            let e = self.refused(i, "over-acceptance", |s, _| s.after_verify(accepted));
            assert!(
                matches!(
                    e,
                    Error::InvalidArgument {
                        name: "num_accepted",
                        ..
                    }
                ),
                "{e:?}"
            );
        } else {
            let slot = &mut self.slots[i];
            slot.st.after_verify(accepted).expect("valid acceptance");
            assert_eq!(slot.st.last_num_drafted(), 0);
            slot.drafted = 0;
        }
    }

    fn free(&mut self, i: usize) {
        let first = !self.slots[i].freed;
        let slot = &mut self.slots[i];
        let held = slot.st.page_table().len() + slot.st.pending_pages().len();
        let free = self.pool.num_free();
        assert_eq!(slot.st.free(&mut self.pool).expect("free"), first);
        assert_eq!(self.pool.num_free(), free + if first { held } else { 0 });
        assert!(!slot.st.free(&mut self.pool).expect("second free"));
        assert!(slot.st.page_table().is_empty() && slot.st.ctx_len() == 0);
        assert_eq!((slot.st.seq_len(), slot.st.last_num_drafted()), (0, 0));
        slot.freed = true;
        slot.positions.clear();
        slot.committed = 0;
        slot.stale = true;
        self.stats.checks += 4;
    }

    fn raw_alloc(&mut self, n: usize) {
        let free = self.pool.num_free();
        if n > free {
            let pool0 = self.pool.clone();
            let e = expect_err(self.pool.alloc(n), "raw alloc beyond free");
            assert!(matches!(e, Error::PoolExhausted { .. }), "{e:?}");
            assert_eq!(self.pool, pool0);
            return;
        }
        let got = self.pool.alloc(n).expect("enough free");
        assert_eq!(got.len(), n);
        self.raw.push(got);
    }

    fn raw_free(&mut self, pick: usize) {
        if self.raw.is_empty() {
            return;
        }
        let pages = self.raw.swap_remove(pick % self.raw.len());
        self.pool.free(&pages).expect("raw pages free");
    }

    fn bad_free(&mut self, kind: usize, pick: usize) {
        let n = self.pool.num_pages();
        let ids: Vec<usize> = match kind {
            0 => match self.raw.iter().find(|r| !r.is_empty()) {
                Some(r) => vec![r[0], r[0]],
                None => vec![n + pick],
            },
            1 => vec![n + pick],
            _ => match (0..n).find(|&b| !self.pool.is_allocated(b)) {
                Some(b) => vec![b],
                None => vec![usize::MAX - pick],
            },
        };
        let pool0 = self.pool.clone();
        let e = expect_err(self.pool.free(&ids), "bad free");
        assert!(
            matches!(
                e,
                Error::DuplicatePage { .. }
                    | Error::PageOutOfRange { .. }
                    | Error::PageNotAllocated { .. }
            ),
            "{e:?}"
        );
        assert_eq!(self.pool, pool0);
        self.stats.checks += 1;
    }

    fn foreign(&mut self, a: usize, b: usize) {
        if a == b {
            return;
        }
        if let Some(plan) = self.slots[a].plan.clone() {
            let e = self.refused(b, "foreign confirm", |s, _| s.confirm_precompute(&plan));
            assert!(matches!(e, Error::ForeignPlan), "{e:?}");
            let e = self.refused(b, "foreign abort", |s, p| s.abort_precompute(p, &plan));
            assert!(matches!(e, Error::ForeignPlan), "{e:?}");
        }
        if !self.slots[a].freed && !self.slots[b].freed {
            let positions = self.next_positions(a, 1, 0);
            let plan: AppendPlan = self.slots[a].st.plan_append(&positions).expect("valid");
            let e = self.refused(b, "foreign append", |s, p| s.apply_append(p, &plan));
            assert!(matches!(e, Error::ForeignPlan), "{e:?}");
        }
    }

    fn pure(&mut self, bytes: &mut Bytes<'_>) {
        let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let (m, g, b, c) = (bytes.wide(), bytes.wide(), bytes.wide(), bytes.wide());
        let budget = (b % 3 != 0).then_some(to_usize(b));
        match ctx_window(to_usize(m), to_usize(g), budget, to_usize(c)) {
            Ok(w) => {
                assert!(w >= 1 && w <= to_usize(m));
                if c != 0 {
                    assert!(w <= to_usize(c));
                }
            }
            Err(e) => assert!(m == 0 || g == 0, "{e:?}"),
        }
        #[allow(clippy::cast_possible_wrap)]
        let (n, mb) = (m as i64, g as i64);
        let width = propose_batch_max(b % 2 == 0, n, mb);
        assert!(width >= 1);
        let _ = batch_decline_reason(n, mb, c % 2 == 0, b as i64, n);
        let tokens: Vec<u32> = (0..bytes.small(40)).map(|k| k as u32).collect();
        let (n, block_size) = (bytes.small(6), bytes.small(9));
        let cap = match bytes.small(4) {
            0 => None,
            k => Some(k - 1),
        };
        match split_bands(&tokens, n, block_size, c % 2 == 1, cap) {
            Ok(Some(bands)) => {
                assert_eq!(bands.len(), n);
                assert!(tokens.len() >= n * block_size);
                for band in bands {
                    assert!(band.len() <= block_size && cap.is_none_or(|k| band.len() <= k));
                }
            }
            Ok(None) => assert!(tokens.len() < n * block_size),
            Err(_) => assert!(n == 0 || block_size == 0 || cap == Some(0)),
        }
    }

    /// Invariants 1-3 across the pool, every live state and the raw allocations.
    fn check(&mut self) {
        let ps = self.page_size();
        self.pool.check_invariants().expect("pool invariants");
        let mut held: Vec<usize> = self.raw.iter().flatten().copied().collect();
        for slot in &self.slots {
            let st = &slot.st;
            st.check_invariants(&self.pool).expect("state invariants");
            assert_eq!(st.freed(), slot.freed);
            assert_eq!(
                st.ctx_positions(),
                slot.positions.as_slice(),
                "positions vs model"
            );
            assert_eq!(st.ctx_committed(), slot.committed, "committed vs model");
            assert!(st.ctx_len() <= st.window());
            assert_eq!(st.page_table().len(), slot.committed.div_ceil(ps));
            held.extend_from_slice(st.page_table());
            held.extend_from_slice(st.pending_pages());
        }
        assert_eq!(
            self.pool.num_free() + held.len(),
            self.pool.num_pages(),
            "conservation"
        );
        let mut sorted = held.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), held.len(), "a page is held twice");
        assert!(held.iter().all(|&b| self.pool.is_allocated(b)));
        self.stats.checks += 5 + 5 * self.slots.len() as u64;
    }

    fn finish(mut self) -> Stats {
        for i in 0..self.slots.len() {
            self.free(i);
        }
        for pages in std::mem::take(&mut self.raw) {
            self.pool.free(&pages).expect("raw pages free");
        }
        self.pool.check_invariants().expect("pool invariants");
        assert_eq!(
            self.pool.num_free(),
            self.pool.num_pages(),
            "pool not full at the end"
        );
        self.stats.checks += 2;
        self.stats
    }
}

/// Interpret `data` as an operation sequence; panics on any invariant violation.
pub fn run(data: &[u8]) -> Stats {
    let mut bytes = Bytes { data, at: 0 };
    let num_pages = 1 + bytes.small(40);
    let page_size = 1 + bytes.small(8);
    let mut world = World::new(num_pages, page_size);
    while !bytes.done() {
        let op = bytes.small(16);
        let count = world.slots.len();
        let pick = bytes.small(MAX_STATES);
        let i = if count == 0 { 0 } else { pick % count };
        match op {
            0 | 1 if count < MAX_STATES => {
                let window = 1 + bytes.small(24);
                // A slide room below the window (any of them), as the proposer's lever gives.
                let room = bytes.small(window);
                let st = ContextState::new(&mut world.pool, window, 7)
                    .and_then(|st| st.with_slide_room(room))
                    .expect("window >= 1, room < window");
                world.slots.push(Slot {
                    st,
                    positions: Vec::new(),
                    committed: 0,
                    plan: None,
                    stale: false,
                    drafted: 0,
                    freed: false,
                });
            }
            _ if count == 0 => {
                let n = bytes.small(8);
                world.raw_alloc(n);
            }
            0..=3 => {
                let window = world.slots[i].st.window();
                let n = bytes.small(window + 2);
                let gap = i64::from(bytes.u8() % 4);
                world.append(i, n, gap);
            }
            4 => {
                let kind = bytes.small(4);
                world.bad_append(i, kind);
            }
            5 | 6 => {
                let then = bytes.small(3);
                world.precompute(i, then);
            }
            7 => world.confirm(i),
            8 => world.abort(i),
            9 => {
                let (d, a) = (bytes.small(16), bytes.small(18));
                world.propose(i, d, a);
            }
            10 => world.free(i),
            11 => {
                let n = bytes.small(8);
                world.raw_alloc(n);
            }
            12 => {
                let p = bytes.small(8);
                world.raw_free(p);
            }
            13 => {
                let (k, p) = (bytes.small(3), bytes.small(8));
                world.bad_free(k, p);
            }
            14 => {
                let b = bytes.small(MAX_STATES) % count;
                world.foreign(i, b);
            }
            _ => world.pure(&mut bytes),
        }
        world.stats.ops += 1;
        world.check();
    }
    world.finish()
}
