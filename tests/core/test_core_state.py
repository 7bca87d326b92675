"""ContextState: append and slide plans, precompute plans and slots, counters, free (core invariants 3-6)."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockdraft import BlockPool, InvalidStateError, PoolExhaustedError
from blockdraft.core import AppendPlan, ContextState, PrecomputePlan

from support.core_checks import assert_fresh, ceil_div, check_world, state_snapshot, world_snapshot
from support.scorecard import expect_clear_error, score


def append(state: ContextState, positions: list[int]) -> AppendPlan:
    plan = state.plan_append(positions)
    state.apply_append(plan)
    return plan


def precompute(state: ContextState) -> PrecomputePlan:
    plan = state.plan_precompute()
    state.confirm_precompute(plan)
    return plan


def test_fresh_state() -> None:
    pool = BlockPool(4, 8)
    state = ContextState(pool, 32, owner=7)
    assert state.window == 32 and state.owner == 7 and not state.freed
    assert_fresh(state)
    assert ContextState(pool, 1).owner == 0
    check_world(pool, [state])


def test_append_without_slide() -> None:
    state = ContextState(BlockPool(4, 8), 10)
    plan = state.plan_append([3, 4, 9])
    assert plan.slide is None
    assert (plan.dst_start, plan.n_rows, plan.positions) == (0, 3, [3, 4, 9])
    assert state.ctx_len == 0, "plan_append must not change the state"
    state.apply_append(plan)
    assert state.ctx_positions == [3, 4, 9] and state.ctx_len == 3
    plan = state.plan_append([10, 11])
    assert plan.slide is None and plan.dst_start == 3
    state.apply_append(plan)
    assert state.ctx_positions == [3, 4, 9, 10, 11]


def test_append_filling_the_window_exactly_does_not_slide() -> None:
    state = ContextState(BlockPool(4, 8), 5)
    append(state, [0, 1, 2])
    plan = state.plan_append([3, 4])
    assert plan.slide is None and plan.dst_start == 3


def test_slide_keeps_the_newest_rows_and_resets_committed() -> None:
    pool = BlockPool(8, 2)
    state = ContextState(pool, 6)
    append(state, [10, 11, 12, 13, 14])
    precompute(state)
    assert state.ctx_committed == 5 and len(state.page_table) == 3
    plan = state.plan_append([20, 21, 22])
    assert plan.slide is not None
    # keep = window - new rows = 3, the newest ones: source rows [2, 5).
    assert (plan.slide.src_start, plan.slide.keep) == (2, 3)
    assert (plan.dst_start, plan.n_rows) == (3, 3)
    assert pool.num_free == 5, "planning a slide must not release pages"
    state.apply_append(plan)
    assert state.ctx_positions == [12, 13, 14, 20, 21, 22]
    assert state.ctx_committed == 0
    assert state.page_table == [] and pool.num_free == 8
    check_world(pool, [state])


def test_slide_by_a_full_window_keeps_nothing() -> None:
    state = ContextState(BlockPool(4, 4), 4)
    append(state, [0, 1, 2])
    plan = state.plan_append([5, 6, 7, 8])
    assert plan.slide is not None and plan.slide.keep == 0 and plan.dst_start == 0
    state.apply_append(plan)
    assert state.ctx_positions == [5, 6, 7, 8]


def test_precompute_plan_slots_and_positions() -> None:
    pool = BlockPool(6, 4)
    state = ContextState(pool, 64)
    append(state, list(range(100, 106)))
    plan = state.plan_precompute()
    assert (plan.row_start, plan.row_end) == (0, 6)
    assert len(plan.new_pages) == 2 and not plan.resolved
    assert pool.num_free == 4 and all(pool.is_allocated(b) for b in plan.new_pages)
    table = plan.new_pages
    assert plan.slots == [table[r // 4] * 4 + r % 4 for r in range(6)]
    assert plan.positions == list(range(100, 106))
    assert state.ctx_committed == 0 and state.page_table == [], "not applied before confirm"
    state.confirm_precompute(plan)
    assert plan.resolved
    assert state.ctx_committed == 6 and state.page_table == table
    assert state.slot_mapping() == plan.slots

    # The next rows continue in the half-used last block before taking a new one.
    append(state, [106, 107, 108])
    plan = state.plan_precompute()
    assert (plan.row_start, plan.row_end) == (6, 9) and len(plan.new_pages) == 1
    full = table + plan.new_pages
    assert plan.slots == [full[r // 4] * 4 + r % 4 for r in range(6, 9)]
    state.confirm_precompute(plan)
    assert state.slot_mapping() == [full[r // 4] * 4 + r % 4 for r in range(9)]
    check_world(pool, [state])


def test_empty_precompute_takes_nothing() -> None:
    pool = BlockPool(2, 4)
    state = ContextState(pool, 8)
    plan = state.plan_precompute()
    assert (plan.row_start, plan.row_end, plan.new_pages, plan.slots) == (0, 0, [], [])
    assert pool.num_free == 2
    state.confirm_precompute(plan)
    assert state.ctx_committed == 0


def test_abort_restores_everything() -> None:
    pool = BlockPool(6, 2)
    state = ContextState(pool, 16)
    append(state, [0, 1, 2])
    precompute(state)
    append(state, [3, 4, 5, 6])
    before = world_snapshot(pool, [state])
    plan = state.plan_precompute()
    assert pool.num_free < before[0][2]
    state.abort_precompute(plan)
    assert plan.resolved
    assert world_snapshot(pool, [state]) == before
    state.abort_precompute(plan)  # a resolved plan: does nothing
    assert world_snapshot(pool, [state]) == before
    with expect_clear_error(InvalidStateError):
        state.confirm_precompute(plan)
    assert world_snapshot(pool, [state]) == before


def test_confirm_twice_is_rejected() -> None:
    pool = BlockPool(4, 2)
    state = ContextState(pool, 8)
    append(state, [0, 1, 2])
    plan = precompute(state)
    before = world_snapshot(pool, [state])
    with expect_clear_error(InvalidStateError):
        state.confirm_precompute(plan)
    state.abort_precompute(plan)  # resolved by the confirm: must not return adopted blocks
    assert world_snapshot(pool, [state]) == before


def test_exhausted_precompute_changes_nothing() -> None:
    pool = BlockPool(3, 2)
    other = pool.alloc(2)
    state = ContextState(pool, 16)
    append(state, [0, 1, 2, 3, 4])
    before = world_snapshot(pool, [state])
    with expect_clear_error(PoolExhaustedError):
        state.plan_precompute()
    assert world_snapshot(pool, [state]) == before
    pool.free(other)
    precompute(state)
    assert state.ctx_committed == 5


def test_second_outstanding_plan_is_rejected() -> None:
    pool = BlockPool(8, 2)
    state = ContextState(pool, 16)
    append(state, [0, 1, 2])
    plan = state.plan_precompute()
    before = world_snapshot(pool, [state])
    with expect_clear_error(InvalidStateError):
        state.plan_precompute()
    assert world_snapshot(pool, [state]) == before
    state.abort_precompute(plan)
    precompute(state)


def test_dropping_an_unresolved_plan_returns_its_pages() -> None:
    pool = BlockPool(5, 2)
    state = ContextState(pool, 16)
    append(state, [0, 1, 2])
    before = world_snapshot(pool, [state])
    plan = state.plan_precompute()
    assert pool.num_free == 3
    del plan
    gc.collect()
    assert world_snapshot(pool, [state]) == before
    # The dropped plan no longer counts as outstanding.
    precompute(state)
    assert state.ctx_committed == 3
    check_world(pool, [state])


def test_dropping_a_confirmed_plan_keeps_the_pages() -> None:
    pool = BlockPool(5, 2)
    state = ContextState(pool, 16)
    append(state, [0, 1, 2])
    precompute(state)  # the plan is dropped right here
    gc.collect()
    assert pool.num_free == 3 and len(state.page_table) == 2
    check_world(pool, [state])


def test_note_propose_and_after_verify() -> None:
    state = ContextState(BlockPool(2, 2), 8)
    state.note_propose(41, 7)
    assert (state.seq_len, state.last_num_drafted, state.prefill_done) == (42, 7, True)
    state.after_verify(5)
    assert (state.last_num_accepted, state.last_num_drafted) == (5, 0)
    state.note_propose(47, 3)
    before = state_snapshot(state)
    with expect_clear_error(ValueError, "num_accepted"):
        state.after_verify(4)
    assert state_snapshot(state) == before
    state.after_verify(3)
    assert state.last_num_accepted == 3


def test_version_increases_on_changes_only() -> None:
    pool = BlockPool(4, 2)
    state = ContextState(pool, 8)
    v0 = state.version
    plan = state.plan_append([0, 1, 2])
    assert state.version == v0, "planning is not a change"
    state.apply_append(plan)
    v1 = state.version
    assert v1 > v0
    precompute(state)
    assert state.version > v1


def test_free_returns_pages_and_resets_counters() -> None:
    pool = BlockPool(6, 2)
    state = ContextState(pool, 8, owner=3)
    append(state, [0, 1, 2, 3, 4])
    precompute(state)
    state.note_propose(4, 2)
    assert pool.num_free == 3
    assert state.free() is True
    assert state.freed and pool.num_free == 6
    assert (state.window, state.owner) == (8, 3)
    assert_fresh(state)
    before = world_snapshot(pool, [state])
    assert state.free() is False
    assert world_snapshot(pool, [state]) == before


def test_stale_append_plan_is_rejected() -> None:
    pool = BlockPool(4, 2)
    state = ContextState(pool, 8)
    old = state.plan_append([0, 1])
    newer = state.plan_append([0, 1, 2])
    state.apply_append(newer)
    before = world_snapshot(pool, [state])
    with expect_clear_error(InvalidStateError):
        state.apply_append(old)
    assert world_snapshot(pool, [state]) == before
    # Applying the same plan twice is stale too.
    with expect_clear_error(InvalidStateError):
        state.apply_append(newer)
    assert world_snapshot(pool, [state]) == before


def test_foreign_plans_are_rejected() -> None:
    pool = BlockPool(8, 2)
    a = ContextState(pool, 8)
    b = ContextState(pool, 8)
    a_plan = a.plan_append([0, 1, 2])
    before = world_snapshot(pool, [a, b])
    with expect_clear_error(InvalidStateError):
        b.apply_append(a_plan)
    assert world_snapshot(pool, [a, b]) == before
    a.apply_append(a_plan)
    b.apply_append(b.plan_append([5]))
    a_pre = a.plan_precompute()
    before = world_snapshot(pool, [a, b])
    with expect_clear_error(InvalidStateError):
        b.confirm_precompute(a_pre)
    assert world_snapshot(pool, [a, b]) == before
    a.confirm_precompute(a_pre)
    check_world(pool, [a, b])


def ref_append(
    ctx: list[int], window: int, new: list[int], room: int = 0
) -> tuple[int | None, int, list[int]]:
    """(slide src_start or None, dst_start, positions after) of appending ``new`` to ``ctx``
    in a window whose slides leave ``room`` rows free beyond the new ones."""
    if len(ctx) + len(new) <= window:
        return None, len(ctx), ctx + new
    keep = max(0, window - room - len(new))
    return len(ctx) - keep, keep, ctx[len(ctx) - keep :] + new


@given(
    window=st.integers(1, 24),
    room=st.integers(0, 23),
    page_size=st.integers(1, 5),
    steps=st.lists(
        st.tuples(st.integers(1, 24), st.integers(0, 3), st.booleans()), min_size=1, max_size=30
    ),
)
def test_appends_and_slides_match_reference(
    window: int, room: int, page_size: int, steps: list[tuple[int, int, bool]]
) -> None:
    """Random appends (gaps between positions, overflowing windows) in windows with random
    slide rooms, precompute in between."""
    room = min(room, window - 1)
    pool = BlockPool(ceil_div(window, page_size), page_size)
    state = ContextState(pool, window, slide_room=room)
    score.sequences += 1
    next_pos = 0
    for n, gap, commit in steps:
        n = min(n, window)
        new = list(range(next_pos + gap, next_pos + gap + n))
        next_pos = new[-1] + 1
        src, dst, after = ref_append(state.ctx_positions, window, new, room)
        old_committed = state.ctx_committed
        plan = state.plan_append(new)
        assert plan.dst_start == dst and plan.n_rows == n and plan.positions == new
        if src is None:
            assert plan.slide is None
        else:
            assert plan.slide is not None
            assert (plan.slide.src_start, plan.slide.keep) == (src, dst)
        state.apply_append(plan)
        score.operations += 2
        assert state.ctx_positions == after
        assert state.ctx_committed == (0 if src is not None else old_committed)
        if commit:
            pre = state.plan_precompute()
            assert (pre.row_start, pre.row_end) == (state.ctx_committed, state.ctx_len)
            assert pre.positions == after[pre.row_start :]
            state.confirm_precompute(pre)
            score.operations += 2
            assert state.slot_mapping() == [
                state.page_table[r // page_size] * page_size + r % page_size
                for r in range(state.ctx_len)
            ]
        check_world(pool, [state])
    state.free()
    assert pool.num_free == pool.num_pages


def test_slide_room_out_of_range_is_refused_and_changes_nothing() -> None:
    pool = BlockPool(4, 4)
    before = world_snapshot(pool, [])
    for bad in (4, 5):
        with expect_clear_error(ValueError, "slide_room"):
            ContextState(pool, 4, slide_room=bad)
    with expect_clear_error(ValueError, "slide_room"):
        ContextState(pool, 4, slide_room=-1)
    with pytest.raises(TypeError):
        ContextState(pool, 4, slide_room=1.5)  # type: ignore[arg-type]
    assert world_snapshot(pool, []) == before
    assert ContextState(pool, 4, slide_room=3).slide_room == 3


def test_last_position_tracks_the_newest_row_through_slides() -> None:
    pool = BlockPool(8, 4)
    state = ContextState(pool, 4)
    assert state.last_position is None
    for positions in ([2, 5], [6], [7, 9, 11]):  # the last append slides the window
        plan = state.plan_append(positions)
        state.apply_append(plan)
        assert state.last_position == state.ctx_positions[-1] == positions[-1]
    state.free()
    assert state.last_position is None
