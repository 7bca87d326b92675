//! Stateful property test of target sequences: random operation sequences (create, forwards and
//! accepts over random subsets, free, double free, free of all, use after free, another owner's
//! sequences) over one pool, run against the core and a reference model of counters. After
//! every step: the pool's own check, conservation (free pages plus pages held by live
//! sequences equal the pool), no page held twice, every sequence's invariant, and the model.

use std::cell::RefCell;
use std::collections::HashSet;

use blockdraft_core::{accept_rows, free_all, plan_forward, BlockPool, Error, SeqPages};
use proptest::prelude::*;

const MAX_SEQS: usize = 6;
const OWNER: u64 = 1;
const OTHER: u64 = 2;

#[derive(Debug, Clone)]
enum Op {
    New {
        capacity: usize,
        foreign: bool,
    },
    /// A forward over the sequences whose bit is set in `mask`; `specs[i]` picks each one's
    /// row count (mostly valid, sometimes 0, negative or past the capacity).
    Forward {
        mask: u8,
        specs: [u8; MAX_SEQS],
    },
    /// Accepts over the sequences in `mask`; `specs[i]` picks each count (mostly valid).
    Accept {
        mask: u8,
        specs: [u8; MAX_SEQS],
    },
    /// Free one sequence: 0 = no owner given, 1 = its owner's call, 2 = the other owner's.
    Free {
        st: usize,
        who: u8,
    },
    FreeAll {
        mask: u8,
    },
    Slot {
        st: usize,
        pos: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let specs = prop::array::uniform6(any::<u8>());
    prop_oneof![
        2 => (1usize..14, prop::bool::weighted(0.2))
            .prop_map(|(capacity, foreign)| Op::New { capacity, foreign }),
        5 => (any::<u8>(), specs).prop_map(|(mask, specs)| Op::Forward { mask, specs }),
        4 => (any::<u8>(), specs).prop_map(|(mask, specs)| Op::Accept { mask, specs }),
        1 => (0..MAX_SEQS, 0u8..3).prop_map(|(st, who)| Op::Free { st, who }),
        1 => any::<u8>().prop_map(|mask| Op::FreeAll { mask }),
        1 => (0..MAX_SEQS, 0usize..16).prop_map(|(st, pos)| Op::Slot { st, pos }),
    ]
}

/// What a sequence must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Model {
    owner: u64,
    capacity: usize,
    /// The pages it took at creation (they never change while it lives).
    pages: Vec<usize>,
    length: usize,
    pending: usize,
    freed: bool,
}

/// Row count of a forward from a drawn byte: usually in `1..=room`, else 0, -1 or `room + 1`.
fn rows_from(spec: u8, m: &Model) -> i64 {
    let room = i64::try_from(m.capacity - m.length).unwrap();
    match spec {
        0..=199 => 1 + i64::from(spec) % room.max(1),
        200..=217 => 0,
        218..=235 => -1,
        _ => room + 1,
    }
}

/// Accept count from a drawn byte: usually in `0..=pending`, else `pending + 1` or -1.
fn count_from(spec: u8, m: &Model) -> i64 {
    let pending = i64::try_from(m.pending).unwrap();
    match spec {
        0..=219 => i64::from(spec) % (pending + 1),
        220..=237 => pending + 1,
        _ => -1,
    }
}

struct Harness {
    pool: RefCell<BlockPool>,
    seqs: Vec<(SeqPages, Model)>,
    model_free: usize,
}

impl Harness {
    fn new(num_pages: usize, page_size: usize) -> Self {
        Self {
            pool: RefCell::new(BlockPool::new(num_pages, page_size).unwrap()),
            seqs: Vec::new(),
            model_free: num_pages,
        }
    }

    fn picked(&self, mask: u8) -> Vec<usize> {
        (0..self.seqs.len())
            .filter(|&i| mask >> i & 1 == 1)
            .collect()
    }

    fn snapshot(&self) -> (Vec<SeqPages>, BlockPool) {
        (
            self.seqs.iter().map(|(s, _)| s.clone()).collect(),
            self.pool.borrow().clone(),
        )
    }

    /// The index (in the call) of the first sequence of another owner, else of the first one
    /// `bad` refuses.
    fn first_refused(
        &self,
        picked: &[usize],
        bad: impl Fn(usize, &Model) -> bool,
    ) -> Option<usize> {
        let models: Vec<&Model> = picked.iter().map(|&i| &self.seqs[i].1).collect();
        models
            .iter()
            .position(|m| m.owner != OWNER)
            .or_else(|| models.iter().enumerate().position(|(k, m)| bad(k, m)))
    }

    fn run(&mut self, op: &Op) {
        match *op {
            Op::New { capacity, foreign } => self.create(capacity, foreign),
            Op::Forward { mask, specs } => self.forward(mask, specs),
            Op::Accept { mask, specs } => self.accept(mask, specs),
            Op::Free { st, who } => self.free(st, who),
            Op::FreeAll { mask } => self.free_all(mask),
            Op::Slot { st, pos } => self.slot(st, pos),
        }
    }

    fn create(&mut self, capacity: usize, foreign: bool) {
        if self.seqs.len() >= MAX_SEQS {
            return;
        }
        let owner = if foreign { OTHER } else { OWNER };
        let need = capacity.div_ceil(self.pool.borrow().page_size());
        let before = self.pool.borrow().clone();
        let made = SeqPages::new(&mut self.pool.borrow_mut(), capacity, owner);
        match made {
            Ok(seq) => {
                assert!(need <= self.model_free);
                assert_eq!(seq.num_pages(), need);
                self.model_free -= need;
                let m = Model {
                    owner,
                    capacity,
                    pages: seq.pages().to_vec(),
                    length: 0,
                    pending: 0,
                    freed: false,
                };
                self.seqs.push((seq, m));
            }
            Err(e) => {
                assert_eq!(
                    e,
                    Error::PoolExhausted {
                        requested: need,
                        free: self.model_free
                    }
                );
                assert_eq!(*self.pool.borrow(), before, "a refused creation took pages");
            }
        }
    }

    fn forward(&mut self, mask: u8, specs: [u8; MAX_SEQS]) {
        let picked = self.picked(mask);
        let rows: Vec<i64> = picked
            .iter()
            .zip(specs)
            .map(|(&i, s)| rows_from(s, &self.seqs[i].1))
            .collect();
        let refused = self.first_refused(&picked, |k, m| {
            m.freed || rows[k] < 1 || m.length + usize::try_from(rows[k]).unwrap() > m.capacity
        });
        let page_size = self.pool.borrow().page_size();
        let before = self.snapshot();
        let mut refs: Vec<&mut SeqPages> = self
            .seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| mask >> i & 1 == 1)
            .map(|(_, (s, _))| s)
            .collect();
        let res = plan_forward(&mut refs, &rows, OWNER);
        if let Some(at) = refused {
            assert!(
                matches!(res, Err(Error::InSequence { index, .. }) if index == at),
                "{res:?}, want sequence {at}"
            );
            assert_eq!(
                self.snapshot(),
                before,
                "a refused forward changed something"
            );
            return;
        }
        let plan = res.unwrap();
        let (mut positions, mut slots, mut q_starts, mut table) = (vec![], vec![], vec![0], vec![]);
        // A forward's table holds the pages of the tokens it reads: `length + rows` of them.
        let used = |m: &Model, r: i64| (m.length + usize::try_from(r).unwrap()).div_ceil(page_size);
        let width = picked
            .iter()
            .zip(&rows)
            .map(|(&i, &r)| used(&self.seqs[i].1, r))
            .max();
        for (&i, &r) in picked.iter().zip(&rows) {
            let m = &mut self.seqs[i].1;
            let in_use = used(m, r);
            let r = usize::try_from(r).unwrap();
            for p in m.length..m.length + r {
                positions.push(p);
                slots.push(m.pages[p / page_size] * page_size + p % page_size);
            }
            q_starts.push(positions.len());
            table.extend(&m.pages[..in_use]);
            table.resize(table.len() + width.unwrap() - in_use, 0);
            m.pending = r;
        }
        assert_eq!(plan.positions, positions);
        assert_eq!(plan.slots, slots);
        assert_eq!(plan.q_starts, q_starts);
        let kv: Vec<usize> = picked
            .iter()
            .map(|&i| self.seqs[i].1.length + self.seqs[i].1.pending)
            .collect();
        assert_eq!(plan.kv_lens, kv);
        assert_eq!(plan.max_pages, width.unwrap_or(0));
        let max_rows = rows.iter().map(|&r| usize::try_from(r).unwrap()).max();
        assert_eq!(plan.max_rows, max_rows.unwrap_or(0));
        assert_eq!(plan.page_table(plan.max_pages).unwrap(), table);
        // Slots never collide within one forward.
        assert_eq!(slots.iter().collect::<HashSet<_>>().len(), slots.len());
    }

    fn accept(&mut self, mask: u8, specs: [u8; MAX_SEQS]) {
        let picked = self.picked(mask);
        let counts: Vec<i64> = picked
            .iter()
            .zip(specs)
            .map(|(&i, s)| count_from(s, &self.seqs[i].1))
            .collect();
        let refused = self.first_refused(&picked, |k, m| {
            m.freed || counts[k] < 0 || usize::try_from(counts[k]).unwrap() > m.pending
        });
        let before = self.snapshot();
        let mut refs: Vec<&mut SeqPages> = self
            .seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| mask >> i & 1 == 1)
            .map(|(_, (s, _))| s)
            .collect();
        let res = accept_rows(&mut refs, &counts, OWNER);
        if let Some(at) = refused {
            assert!(
                matches!(res, Err(Error::InSequence { index, .. }) if index == at),
                "{res:?}, want sequence {at}"
            );
            assert_eq!(
                self.snapshot(),
                before,
                "a refused accept changed something"
            );
            return;
        }
        res.unwrap();
        for (&i, &k) in picked.iter().zip(&counts) {
            let m = &mut self.seqs[i].1;
            m.length += usize::try_from(k).unwrap();
            m.pending = 0;
        }
    }

    fn free(&mut self, st: usize, who: u8) {
        let Some((seq, m)) = self.seqs.get_mut(st) else {
            return;
        };
        let pool = &mut self.pool.borrow_mut();
        let owner = match who {
            0 => None,
            1 => Some(m.owner),
            _ => Some(if m.owner == OWNER { OTHER } else { OWNER }),
        };
        if let Some(o) = owner {
            if let Err(e) = seq.ensure_owner(o) {
                // The binding's `free(owner)`: refused before anything changes, freed or not.
                assert_eq!(who, 2, "{e}");
                return;
            }
        }
        let first = seq.free(pool).unwrap();
        assert_eq!(first, !m.freed, "free returns true exactly once");
        if first {
            self.model_free += m.pages.len();
            m.freed = true;
            m.pages.clear();
            m.length = 0;
            m.pending = 0;
        }
        // Twice equals once.
        let once = (seq.clone(), pool.clone());
        assert_eq!(seq.free(pool), Ok(false));
        assert_eq!((seq.clone(), pool.clone()), once);
    }

    fn free_all(&mut self, mask: u8) {
        let picked = self.picked(mask);
        let refused = self.first_refused(&picked, |_, _| false);
        let before = self.snapshot();
        let pool = &self.pool;
        let mut refs: Vec<&mut SeqPages> = self
            .seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| mask >> i & 1 == 1)
            .map(|(_, (s, _))| s)
            .collect();
        let res = free_all(&mut refs, OWNER, |_| Ok(pool.borrow_mut()));
        if let Some(at) = refused {
            assert!(
                matches!(&res, Err(Error::InSequence { index, source })
                    if *index == at && matches!(**source, Error::ForeignSequence { .. })),
                "{res:?}"
            );
            assert_eq!(
                self.snapshot(),
                before,
                "a refused free_all freed something"
            );
            return;
        }
        let live = picked.iter().filter(|&&i| !self.seqs[i].1.freed).count();
        assert_eq!(res, Ok(live));
        for &i in &picked {
            let m = &mut self.seqs[i].1;
            self.model_free += m.pages.len();
            m.freed = true;
            m.pages.clear();
            m.length = 0;
            m.pending = 0;
        }
    }

    fn slot(&self, st: usize, pos: usize) {
        let Some((seq, m)) = self.seqs.get(st) else {
            return;
        };
        let ps = self.pool.borrow().page_size();
        match seq.slot(pos) {
            Ok(slot) => {
                assert!(!m.freed && pos < m.capacity);
                assert_eq!(slot, m.pages[pos / ps] * ps + pos % ps);
            }
            Err(Error::Freed) => assert!(m.freed),
            Err(Error::InvalidArgument { name: "pos", .. }) => assert!(pos >= m.capacity),
            Err(e) => panic!("slot({pos}): {e}"),
        }
    }

    /// Conservation, no page twice, every sequence's invariant, and the model.
    fn check(&self) {
        let pool = self.pool.borrow();
        pool.check_invariants().unwrap();
        assert_eq!(pool.num_free(), self.model_free, "model free count");
        let mut held = HashSet::new();
        for (seq, m) in &self.seqs {
            seq.check_invariants(&pool).unwrap();
            for &b in seq.pages() {
                assert!(held.insert(b), "page {b} held twice");
                assert!(pool.is_allocated(b), "held page {b} is free");
            }
            assert_eq!(seq.pages(), m.pages.as_slice(), "the page table changed");
            assert_eq!(
                (seq.length(), seq.pending(), seq.freed()),
                (m.length, m.pending, m.freed)
            );
            let want = if m.freed {
                0
            } else {
                m.capacity.div_ceil(pool.page_size())
            };
            assert_eq!(seq.num_pages(), want);
            assert!(seq.length() + seq.pending() <= seq.capacity());
            assert_eq!((seq.capacity(), seq.owner()), (m.capacity, m.owner));
        }
        assert_eq!(
            pool.num_free() + held.len(),
            pool.num_pages(),
            "conservation"
        );
    }

    /// With every sequence freed the pool is full again.
    fn drain(&mut self) {
        let mut pool = self.pool.borrow_mut();
        for (seq, _) in &mut self.seqs {
            seq.free(&mut pool).unwrap();
        }
        assert_eq!(pool.num_free(), pool.num_pages());
        pool.check_invariants().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn sequences_match_the_model(
        num_pages in 1usize..24,
        page_size in 1usize..5,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness::new(num_pages, page_size);
        h.run(&Op::New { capacity: 3, foreign: false });
        h.check();
        for op in &ops {
            h.run(op);
            h.check();
        }
        h.drain();
    }
}
