//! Unit tests of `ContextState` and its plans (private fields are corrupted on purpose to
//! test `check_invariants`).

use super::*;

/// The observable bookkeeping of a state (everything but internal id counters).
fn view(s: &ContextState) -> (Vec<i64>, usize, Vec<usize>, Vec<usize>, u64, bool) {
    (
        s.ctx_positions().to_vec(),
        s.ctx_committed(),
        s.page_table().to_vec(),
        s.pending_pages().to_vec(),
        s.version(),
        s.freed(),
    )
}

fn setup(num_pages: usize, page_size: usize, window: usize) -> (BlockPool, ContextState) {
    let mut pool = BlockPool::new(num_pages, page_size).unwrap();
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
    assert!(st.page_table().is_empty() && !st.freed() && !st.prefill_done());
    let mut pool = BlockPool::new(1, 1).unwrap();
    assert!(matches!(
        ContextState::new(&mut pool, 0, 0),
        Err(Error::InvalidArgument { name: "window", .. })
    ));
}

#[test]
fn owner_check_names_both_ids() {
    let (mut pool, mut st) = setup(4, 4, 16);
    assert_eq!(st.ensure_owner(7), Ok(()));
    let err = st.ensure_owner(8).unwrap_err();
    assert_eq!(
        err,
        Error::ForeignOwner {
            owner: 7,
            expected: 8
        }
    );
    assert!(err.to_string().contains("another proposer"), "{err}");
    st.free(&mut pool).unwrap();
    assert_eq!(st.ensure_owner(7), Ok(()), "a freed state keeps its owner");
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
    assert_eq!((st.ctx_committed(), st.page_table().len()), (3, 2));
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
    assert!(st.page_table().is_empty(), "a slide returns every page");
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
fn slide_room_leaves_free_rows_for_later_commits() {
    let mut pool = BlockPool::new(8, 2).unwrap();
    let mut st = ContextState::new(&mut pool, 8, 7)
        .unwrap()
        .with_slide_room(3)
        .unwrap();
    assert_eq!(st.slide_room(), 3);
    append(&mut st, &mut pool, &[0, 1, 2, 3, 4, 5, 6]);
    precompute(&mut st, &mut pool);
    // 7 + 2 rows overflow 8: keep 8 - 3 - 2 = 3 newest rows, then the 2 new ones.
    let plan = append(&mut st, &mut pool, &[7, 8]);
    assert_eq!(
        plan.slide,
        Some(SlidePlan {
            src_start: 4,
            keep: 3
        })
    );
    assert_eq!(plan.dst_start, 3);
    assert_eq!(st.ctx_positions(), &[4, 5, 6, 7, 8]);
    assert_eq!((st.ctx_committed(), pool.num_used()), (0, 0));
    // The room takes three more rows before the next slide.
    for p in 9..12 {
        assert_eq!(append(&mut st, &mut pool, &[p]).slide, None);
    }
    assert!(append(&mut st, &mut pool, &[12]).slide.is_some());
    assert_eq!(st.ctx_positions(), &[8, 9, 10, 11, 12]);
    st.check_invariants(&pool).unwrap();
}

#[test]
fn slide_room_never_cuts_the_commit() {
    let mut pool = BlockPool::new(8, 2).unwrap();
    let mut st = ContextState::new(&mut pool, 6, 7)
        .unwrap()
        .with_slide_room(4)
        .unwrap();
    append(&mut st, &mut pool, &[0, 1, 2, 3]);
    // 4 + 3 > 6 and 6 - 4 < 3: nothing old is kept, all 3 new rows are.
    let plan = append(&mut st, &mut pool, &[4, 5, 6]);
    assert_eq!(plan.slide.map(|s| s.keep), Some(0));
    assert_eq!(st.ctx_positions(), &[4, 5, 6]);
    // A commit longer than the window keeps exactly its newest `window` rows.
    let (plan, skip) = st
        .plan_append_newest(&[7, 8, 9, 10, 11, 12, 13, 14])
        .unwrap();
    assert_eq!((skip, plan.slide.map(|s| s.keep)), (2, Some(0)));
    st.apply_append(&mut pool, &plan).unwrap();
    assert_eq!(st.ctx_positions(), &[9, 10, 11, 12, 13, 14]);
    st.check_invariants(&pool).unwrap();
}

#[test]
fn slide_room_must_be_below_the_window_and_set_fresh() {
    let (mut pool, st) = setup(4, 4, 8);
    assert!(matches!(
        st.clone().with_slide_room(8),
        Err(Error::InvalidArgument {
            name: "slide_room",
            ..
        })
    ));
    let mut st = st.with_slide_room(7).unwrap();
    append(&mut st, &mut pool, &[0]);
    assert!(
        st.with_slide_room(1).is_err(),
        "only a fresh state takes a room"
    );
}

#[test]
fn freed_state_keeps_its_slide_room() {
    let mut pool = BlockPool::new(4, 2).unwrap();
    let mut st = ContextState::new(&mut pool, 6, 7)
        .unwrap()
        .with_slide_room(2)
        .unwrap();
    append(&mut st, &mut pool, &[0, 1, 2]);
    st.free(&mut pool).unwrap();
    assert_eq!(st.slide_room(), 2);
    st.check_invariants(&pool).unwrap();
}

#[test]
fn precompute_slots_fill_the_last_page_then_new_ones() {
    let (mut pool, mut st) = setup(8, 4, 32);
    append(&mut st, &mut pool, &[0, 1, 2]);
    let p = precompute(&mut st, &mut pool);
    assert_eq!(
        (p.row_start, p.row_end, p.new_pages.clone()),
        (0, 3, vec![0])
    );
    assert_eq!(p.slots, vec![0, 1, 2]);
    pool.alloc(1).unwrap(); // someone else takes page 1
    append(&mut st, &mut pool, &[3, 4, 5, 6, 7, 8]);
    let p = st.plan_precompute(&mut pool).unwrap();
    assert_eq!((p.row_start, p.row_end), (3, 9));
    assert_eq!(p.new_pages, vec![2, 3]);
    assert_eq!(p.slots, vec![3, 8, 9, 10, 11, 12]);
    assert_eq!(p.positions, vec![3, 4, 5, 6, 7, 8]);
    st.confirm_precompute(&p).unwrap();
    assert_eq!(st.slot_mapping(), vec![0, 1, 2, 3, 8, 9, 10, 11, 12]);
    assert_eq!((st.ctx_count_drafter(), st.max_ctx_count_drafter()), (9, 9));
    st.check_invariants(&pool).unwrap();

    // Nothing new: an empty plan that takes no pages.
    let p = st.plan_precompute(&mut pool).unwrap();
    assert_eq!((p.row_start, p.row_end), (9, 9));
    assert!(p.new_pages.is_empty() && p.slots.is_empty());
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
fn free_is_idempotent_and_returns_pending_pages() {
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
    s.page_table.pop();
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
    s.page_table[1] = s.page_table[0];
    assert!(matches!(
        s.check_invariants(&pool),
        Err(Error::Invariant(_))
    ));
    let mut p = pool.clone();
    p.free(st.page_table()).unwrap();
    assert!(matches!(st.check_invariants(&p), Err(Error::Invariant(_))));
    let mut s = st.clone();
    s.free(&mut pool).unwrap();
    s.seq_len = 3;
    assert!(matches!(
        s.check_invariants(&pool),
        Err(Error::Invariant(_))
    ));
}
