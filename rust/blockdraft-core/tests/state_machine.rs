//! Stateful property test: random operation sequences over one pool shared by several context
//! states (plus raw allocations), run against the core and against a reference model made of
//! plain `Vec`s and counters. The crate's invariants 1–7 (`blockdraft_core` docs) are checked
//! after every step. States draw random slide levers (the fraction of the window a slide
//! leaves free), so invariant 4 and the slide policy are checked over many of them.

use std::collections::HashSet;

use blockdraft_core::{slide_room, BlockPool, ContextState, Error, PrecomputePlan};
use proptest::prelude::*;

const MAX_STATES: usize = 5;

#[derive(Debug, Clone)]
enum Op {
    /// A state of `window` rows whose slides leave `per_mille / 1000` of it free.
    NewState {
        window: usize,
        per_mille: u16,
    },
    /// Raw allocation of `n` pages by someone other than a state.
    Alloc {
        n: usize,
    },
    FreeRaw {
        pick: usize,
    },
    /// A free that must be refused: 0 = duplicate, 1 = not allocated, 2 = out of range.
    BadFree {
        kind: u8,
        pick: usize,
    },
    /// Append `n` rows starting `gap` after the last position; `twice` re-applies the plan;
    /// `newest` plans with `plan_append_newest` (a commit longer than the window).
    Append {
        st: usize,
        n: usize,
        gap: i64,
        twice: bool,
        newest: bool,
    },
    /// An append that must be refused: 0 = empty, 1 = negative, 2 = unordered, 3 = not after
    /// the last position, 4 = more rows than the window.
    BadAppend {
        st: usize,
        kind: u8,
    },
    /// Plan a precompute; 0 = confirm, 1 = abort, 2 = leave it outstanding.
    Precompute {
        st: usize,
        then: u8,
    },
    /// Resolve an outstanding plan: confirm (may be stale) or abort.
    Resolve {
        st: usize,
        confirm: bool,
    },
    Propose {
        st: usize,
        drafted: usize,
        accepted: usize,
    },
    Free {
        st: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let st = 0..MAX_STATES;
    prop_oneof![
        1 => (1usize..12, prop_oneof![Just(0u16), 0u16..1000])
            .prop_map(|(window, per_mille)| Op::NewState { window, per_mille }),
        1 => (0usize..6).prop_map(|n| Op::Alloc { n }),
        1 => any::<usize>().prop_map(|pick| Op::FreeRaw { pick }),
        1 => (0u8..3, any::<usize>()).prop_map(|(kind, pick)| Op::BadFree { kind, pick }),
        6 => (st.clone(), 1usize..8, 0i64..3, prop::bool::weighted(0.1), any::<bool>())
            .prop_map(|(st, n, gap, twice, newest)| Op::Append { st, n, gap, twice, newest }),
        1 => (st.clone(), 0u8..5).prop_map(|(st, kind)| Op::BadAppend { st, kind }),
        4 => (st.clone(), 0u8..3).prop_map(|(st, then)| Op::Precompute { st, then }),
        1 => (st.clone(), any::<bool>()).prop_map(|(st, confirm)| Op::Resolve { st, confirm }),
        1 => (st.clone(), 0usize..8, 0usize..8)
            .prop_map(|(st, drafted, accepted)| Op::Propose { st, drafted, accepted }),
        1 => st.prop_map(|st| Op::Free { st }),
    ]
}

/// The reference model of one state: rows by position, and page counts only.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Model {
    window: usize,
    /// Rows a slide leaves free beyond its commit's.
    room: usize,
    /// Rows of the commit that last slid and rows committed since (`None` before any slide).
    last_slide: Option<(usize, usize)>,
    positions: Vec<i64>,
    committed: usize,
    pages: usize,
    /// Pages taken by the outstanding plan and the version it was made at.
    pending: Option<(usize, u64)>,
    version: u64,
    freed: bool,
    seq_len: usize,
    last_drafted: usize,
    last_accepted: usize,
}

impl Model {
    fn new(window: usize, room: usize) -> Self {
        Self {
            window,
            room,
            last_slide: None,
            positions: Vec::new(),
            committed: 0,
            pages: 0,
            pending: None,
            version: 0,
            freed: false,
            seq_len: 0,
            last_drafted: 0,
            last_accepted: 0,
        }
    }

    fn held(&self) -> usize {
        self.pages + self.pending.map_or(0, |p| p.0)
    }
}

struct Harness {
    pool: BlockPool,
    states: Vec<(ContextState, Model, Option<PrecomputePlan>)>,
    raw: Vec<Vec<usize>>,
    model_free: usize,
    checks: usize,
}

impl Harness {
    fn new(num_pages: usize, page_size: usize) -> Self {
        Self {
            pool: BlockPool::new(num_pages, page_size).unwrap(),
            states: Vec::new(),
            raw: Vec::new(),
            model_free: num_pages,
            checks: 0,
        }
    }

    fn page_size(&self) -> usize {
        self.pool.page_size()
    }

    fn run(&mut self, op: &Op) {
        match *op {
            Op::NewState { window, per_mille } => {
                if self.states.len() < MAX_STATES {
                    let room = slide_room(window, f64::from(per_mille) / 1000.0).unwrap();
                    assert!(room < window);
                    let st = ContextState::new(&mut self.pool, window, 1)
                        .and_then(|st| st.with_slide_room(room))
                        .unwrap();
                    assert_eq!(st.slide_room(), room);
                    self.states.push((st, Model::new(window, room), None));
                }
            }
            Op::Alloc { n } => {
                let before = self.pool.clone();
                match self.pool.alloc(n) {
                    Ok(pages) => {
                        assert!(n <= self.model_free);
                        assert_eq!(pages.len(), n);
                        self.model_free -= n;
                        self.raw.push(pages);
                    }
                    Err(e) => {
                        assert_eq!(
                            e,
                            Error::PoolExhausted {
                                requested: n,
                                free: self.model_free
                            }
                        );
                        assert!(n > self.model_free);
                        assert_eq!(
                            self.pool, before,
                            "invariant 5: failed alloc changed the pool"
                        );
                    }
                }
            }
            Op::FreeRaw { pick } => {
                if !self.raw.is_empty() {
                    let pages = self.raw.swap_remove(pick % self.raw.len());
                    self.pool.free(&pages).unwrap();
                    self.model_free += pages.len();
                }
            }
            Op::BadFree { kind, pick } => self.bad_free(kind, pick),
            Op::Append {
                st,
                n,
                gap,
                twice,
                newest,
            } => self.append(st, n, gap, twice, newest),
            Op::BadAppend { st, kind } => self.bad_append(st, kind),
            Op::Precompute { st, then } => self.precompute(st, then),
            Op::Resolve { st, confirm } => self.resolve(st, confirm),
            Op::Propose {
                st,
                drafted,
                accepted,
            } => self.propose(st, drafted, accepted),
            Op::Free { st } => self.free(st),
        }
    }

    fn bad_free(&mut self, kind: u8, pick: usize) {
        let held: Vec<usize> = self.raw.iter().flatten().copied().collect();
        let pages = match kind {
            0 if !held.is_empty() => {
                let b = held[pick % held.len()];
                vec![b, b]
            }
            1 => match (0..self.pool.num_pages()).find(|&b| !self.pool.is_allocated(b)) {
                // A valid id first, so a pool that mutated before validating would show it.
                Some(free) => held.iter().take(1).copied().chain([free]).collect(),
                None => return,
            },
            _ => vec![self.pool.num_pages() + pick % 3],
        };
        let before = self.pool.clone();
        let err = self.pool.free(&pages).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicatePage { .. }
                    | Error::PageNotAllocated { .. }
                    | Error::PageOutOfRange { .. }
            ),
            "{err}"
        );
        assert_eq!(self.pool, before, "a refused free changed the pool");
    }

    fn append(&mut self, i: usize, n: usize, gap: i64, twice: bool, newest: bool) {
        let Some((st, m, _)) = self.states.get_mut(i) else {
            return;
        };
        let start = m.positions.last().map_or(gap, |&p| p + 1 + gap);
        let positions: Vec<i64> = (0..n as i64).map(|k| start + k).collect();
        let planned = if newest {
            st.plan_append_newest(&positions)
        } else {
            st.plan_append(&positions).map(|p| (p, 0))
        };
        if m.freed {
            assert_eq!(planned, Err(Error::Freed));
            return;
        }
        if n > m.window && !newest {
            assert!(matches!(planned, Err(Error::InvalidArgument { .. })));
            return;
        }
        let (plan, skip) = planned.unwrap();
        // A commit longer than the window keeps exactly its newest `window` rows.
        assert_eq!(skip, n.saturating_sub(m.window));
        let positions = &positions[skip..];
        assert_eq!(plan.positions, positions);
        let n = positions.len();
        st.apply_append(&mut self.pool, &plan).unwrap();
        let len = m.positions.len();
        if len + n > m.window {
            let keep = (m.window - m.room).saturating_sub(n);
            let slide = plan.slide.expect("overflowing append must slide");
            assert_eq!((slide.src_start, slide.keep), (len - keep, keep));
            // The policy: a slide follows the last one only after the room it left (or what the
            // last commit left of the window) has filled up.
            if let Some((last_n, since)) = m.last_slide {
                assert!(
                    since + n > m.room.min(m.window - last_n),
                    "slid again after {since} + {n} rows (room {}, last commit {last_n})",
                    m.room
                );
            }
            m.last_slide = Some((n, 0));
            // Invariant 4: the newest rows, in order, with their positions; nothing committed;
            // every page back in the pool.
            m.positions.drain(..len - keep);
            m.committed = 0;
            self.model_free += m.pages;
            m.pages = 0;
            assert_eq!(st.ctx_len(), (m.window - m.room).max(n));
            assert!(st.page_table().is_empty());
        } else {
            assert_eq!(plan.slide, None);
            if let Some((_, since)) = &mut m.last_slide {
                *since += n;
            }
        }
        assert_eq!(plan.dst_start, m.positions.len());
        m.positions.extend_from_slice(positions);
        m.version += 1;
        if twice {
            let before = st.clone();
            assert!(matches!(
                st.apply_append(&mut self.pool, &plan),
                Err(Error::StalePlan { .. })
            ));
            assert_eq!(*st, before);
        }
    }

    fn bad_append(&mut self, i: usize, kind: u8) {
        let Some((st, m, _)) = self.states.get(i) else {
            return;
        };
        let last = m.positions.last().copied();
        let next = last.map_or(0, |p| p + 1);
        let positions: Vec<i64> = match kind {
            0 => vec![],
            1 => vec![-1 - next],
            2 => vec![next + 1, next],
            3 => match last {
                Some(p) => vec![p],
                None => return,
            },
            _ => (0..=m.window as i64).map(|k| next + k).collect(),
        };
        let before = st.clone();
        let err = st.plan_append(&positions).unwrap_err();
        if m.freed {
            assert_eq!(err, Error::Freed);
        } else {
            assert!(
                matches!(
                    err,
                    Error::InvalidArgument {
                        name: "positions",
                        ..
                    }
                ),
                "{err}"
            );
        }
        assert_eq!(*st, before);
    }

    fn precompute(&mut self, i: usize, then: u8) {
        let ps = self.page_size();
        let Some((st, m, out)) = self.states.get_mut(i) else {
            return;
        };
        let pool_before = self.pool.clone();
        let st_before = st.clone();
        let res = st.plan_precompute(&mut self.pool);
        if m.freed {
            assert_eq!(res, Err(Error::Freed));
            return;
        }
        if m.pending.is_some() {
            assert_eq!(res, Err(Error::PlanOutstanding));
            return;
        }
        let len = m.positions.len();
        let need = len.div_ceil(ps) - m.pages;
        if need > self.model_free {
            assert!(matches!(res, Err(Error::PoolExhausted { .. })));
            assert_eq!(self.pool, pool_before, "invariant 5: pool changed");
            assert_eq!(*st, st_before, "invariant 5: state changed");
            return;
        }
        let plan = res.unwrap();
        assert_eq!((plan.row_start, plan.row_end), (m.committed, len));
        assert_eq!(plan.new_pages.len(), need);
        assert_eq!(plan.positions, m.positions[m.committed..]);
        // Every row gets its own slot, inside a page the state holds or just took.
        let mut owned: HashSet<usize> = st.page_table().iter().copied().collect();
        owned.extend(&plan.new_pages);
        let mut slots: HashSet<usize> = st.slot_mapping().into_iter().collect();
        for (k, &s) in plan.slots.iter().enumerate() {
            assert!(
                owned.contains(&(s / ps)),
                "slot {s} outside the state's pages"
            );
            assert_eq!(s % ps, (plan.row_start + k) % ps, "slot offset");
            assert!(slots.insert(s), "slot {s} used twice");
        }
        self.model_free -= need;
        m.pending = Some((need, m.version));
        match then {
            0 => {
                st.confirm_precompute(&plan).unwrap();
                Self::model_confirm(m, len);
            }
            1 => {
                st.abort_precompute(&mut self.pool, &plan).unwrap();
                assert_eq!(*st.page_table(), *st_before.page_table());
                assert_eq!(st.ctx_committed(), st_before.ctx_committed());
                self.model_free += need;
                m.pending = None;
            }
            _ => *out = Some(plan),
        }
    }

    fn model_confirm(m: &mut Model, row_end: usize) {
        let (need, _) = m.pending.take().unwrap();
        m.pages += need;
        m.committed = row_end;
        m.version += 1;
    }

    fn resolve(&mut self, i: usize, confirm: bool) {
        let Some((st, m, out)) = self.states.get_mut(i) else {
            return;
        };
        let Some(plan) = out.take() else {
            return;
        };
        if confirm {
            let res = st.confirm_precompute(&plan);
            match m.pending {
                _ if m.freed => assert_eq!(res, Err(Error::Freed)),
                Some((_, v)) if v == m.version => {
                    res.unwrap();
                    Self::model_confirm(m, plan.row_end);
                    return;
                }
                Some(_) => assert!(matches!(res, Err(Error::StalePlan { .. }))),
                None => assert_eq!(res, Err(Error::PlanResolved)),
            }
        }
        // A refused confirm leaves the plan outstanding; abort it (a no-op after free).
        st.abort_precompute(&mut self.pool, &plan).unwrap();
        if let Some((need, _)) = m.pending.take() {
            self.model_free += need;
        }
        assert!(!st.is_pending(&plan));
    }

    fn propose(&mut self, i: usize, drafted: usize, accepted: usize) {
        let Some((st, m, _)) = self.states.get_mut(i) else {
            return;
        };
        let position = m
            .positions
            .last()
            .map_or(0, |&p| usize::try_from(p).unwrap());
        let res = st.note_propose(position, drafted);
        if m.freed {
            assert_eq!(res, Err(Error::Freed));
            return;
        }
        res.unwrap();
        m.seq_len = position + 1;
        m.last_drafted = drafted;
        m.version += 1;
        let before = st.clone();
        let res = st.after_verify(accepted);
        if accepted > drafted {
            assert!(matches!(res, Err(Error::InvalidArgument { .. })));
            assert_eq!(*st, before);
        } else {
            res.unwrap();
            m.last_accepted = accepted;
            m.last_drafted = 0;
            m.version += 1;
        }
    }

    fn free(&mut self, i: usize) {
        let Some((st, m, _)) = self.states.get_mut(i) else {
            return;
        };
        let first = st.free(&mut self.pool).unwrap();
        assert_eq!(first, !m.freed);
        if first {
            self.model_free += m.held();
            let (window, room) = (m.window, m.room);
            *m = Model {
                freed: true,
                version: m.version + 1,
                ..Model::new(window, room)
            };
        }
        // Invariant 6: twice == once.
        let once = st.clone();
        assert_eq!(st.free(&mut self.pool), Ok(false));
        assert_eq!(*st, once);
    }

    /// Invariants 1–3 (and 6 for freed states) against the pool and the model.
    fn check(&mut self) {
        self.checks += 1;
        self.pool.check_invariants().unwrap();
        assert_eq!(self.pool.num_free(), self.model_free, "model free count");
        let mut held: HashSet<usize> = HashSet::new();
        let mut total = 0;
        let lists = self
            .states
            .iter()
            .flat_map(|(st, _, _)| [st.page_table(), st.pending_pages()])
            .chain(self.raw.iter().map(Vec::as_slice));
        for list in lists {
            for &b in list {
                total += 1;
                assert!(held.insert(b), "invariant 2: page {b} held twice");
                assert!(
                    self.pool.is_allocated(b),
                    "invariant 2: held page {b} is free"
                );
            }
        }
        // Invariant 1: conservation.
        assert_eq!(self.pool.num_free() + total, self.pool.num_pages());
        let ps = self.page_size();
        for (st, m, _) in &self.states {
            st.check_invariants(&self.pool).unwrap();
            assert_eq!(st.ctx_positions(), m.positions.as_slice());
            assert!(st.ctx_len() <= st.window(), "the window is never exceeded");
            assert_eq!((st.window(), st.slide_room()), (m.window, m.room));
            assert_eq!(st.ctx_committed(), m.committed);
            assert_eq!(st.page_table().len(), m.pages);
            assert_eq!(m.pages, m.committed.div_ceil(ps), "invariant 3");
            assert_eq!(st.pending_pages().len(), m.pending.map_or(0, |p| p.0));
            assert_eq!(st.version(), m.version);
            assert_eq!(st.freed(), m.freed);
            assert_eq!(
                (st.seq_len(), st.last_num_drafted(), st.last_num_accepted()),
                (m.seq_len, m.last_drafted, m.last_accepted)
            );
            assert_eq!(st.prefill_done(), !m.freed && m.seq_len > 0);
        }
    }

    /// Invariant 7: once every state and raw allocation is freed, the pool is full again.
    fn drain(&mut self) {
        for (st, _, plan) in &mut self.states {
            drop(plan.take());
            st.free(&mut self.pool).unwrap();
        }
        for pages in self.raw.drain(..) {
            self.pool.free(&pages).unwrap();
        }
        assert_eq!(self.pool.num_free(), self.pool.num_pages());
        self.pool.check_invariants().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pool_and_states_match_the_model(
        num_pages in 1usize..24,
        page_size in 1usize..5,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness::new(num_pages, page_size);
        h.run(&Op::NewState { window: 6, per_mille: 0 });
        h.run(&Op::NewState { window: 11, per_mille: 250 });
        h.check();
        for op in &ops {
            h.run(op);
            h.check();
        }
        prop_assert_eq!(h.checks, ops.len() + 1);
        h.drain();
    }
}
