"""A hypothesis state machine over the core's public API, checked against a Python model.

Rules drive one BlockPool shared by many ContextStates plus raw allocations by an extra owner:
append rows (with slides over random slide rooms), precompute (confirm, abort or drop; exhaustion), propose/verify
counters, free, double free, use after free, stale and foreign plans. After every step the
core's invariants (numbered in ``rust/blockdraft-core/src/lib.rs``) hold (1-3 as ``@invariant``s,
4-6 inside the rules that can break them, 7 at teardown), and every declined or failed operation
is shown to change nothing by comparing a snapshot of the pool and of every state before and after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import event
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from blockdraft import BlockPool, InvalidStateError, PoolExhaustedError
from blockdraft.core import AppendPlan, ContextState, slide_room

from support.core_checks import assert_fresh, ceil_div, check_world, world_snapshot
from support.scorecard import expect_clear_error, score


@dataclass
class Model:
    """What a ContextState must look like, updated by the rules independently of the core."""

    window: int
    owner: int
    room: int = 0
    # (rows of the commit that last slid, rows committed since); None before any slide
    last_slide: tuple[int, int] | None = None
    positions: list[int] = field(default_factory=list)
    committed: int = 0
    seq_len: int = 0
    prefill_done: bool = False
    last_drafted: int = 0
    last_accepted: int = 0

    @property
    def next_position(self) -> int:
        return self.positions[-1] + 1 if self.positions else 0


class CoreMachine(RuleBasedStateMachine):
    live = Bundle("live")
    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.models: dict[int, Model] = {}
        self.live_states: list[ContextState] = []
        self.freed_states: list[ContextState] = []
        # A plan made just before each free, to replay after it (keyed by id of the freed state).
        self.pre_free_plans: dict[int, AppendPlan] = {}
        self.raw: list[list[int]] = []
        score.sequences += 1

    def snapshot(self) -> object:
        assert self.pool is not None
        return world_snapshot(self.pool, self.live_states + self.freed_states)

    def raw_held(self) -> list[int]:
        return [b for group in self.raw for b in group]

    def model(self, state: ContextState) -> Model:
        return self.models[id(state)]

    def positions_after(self, state: ContextState, n: int, data: st.DataObject) -> list[int]:
        first = self.model(state).next_position + data.draw(st.integers(0, 3), label="gap")
        steps = data.draw(st.lists(st.integers(1, 3), min_size=n - 1, max_size=n - 1), label="steps")
        out = [first]
        for s in steps:
            out.append(out[-1] + s)
        return out

    @initialize(num_pages=st.integers(1, 16), page_size=st.integers(1, 4))
    def make_pool(self, num_pages: int, page_size: int) -> None:
        self.pool = BlockPool(num_pages, page_size)
        score.operations += 1

    @rule(
        target=live,
        window=st.integers(1, 24),
        owner=st.integers(0, 3),
        fraction=st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)),
    )
    def new_state(self, window: int, owner: int, fraction: float) -> ContextState:
        assert self.pool is not None
        room = slide_room(window, fraction)
        assert room == min(int(window * fraction), window - 1)
        state = ContextState(self.pool, window, owner=owner, slide_room=room)
        assert state.slide_room == room
        self.models[id(state)] = Model(window, owner, room)
        self.live_states.append(state)
        score.operations += 1
        return state

    @rule(n=st.integers(0, 6))
    def raw_alloc(self, n: int) -> None:
        assert self.pool is not None
        score.operations += 1
        if n > self.pool.num_free:
            event("raw alloc: exhausted")
            before = self.snapshot()
            with expect_clear_error(PoolExhaustedError):
                self.pool.alloc(n)
            assert self.snapshot() == before
            return
        got = self.pool.alloc(n)
        assert len(got) == n
        self.raw.append(got)

    @rule(data=st.data())
    def raw_free(self, data: st.DataObject) -> None:
        assert self.pool is not None
        if not self.raw:
            return
        group = self.raw.pop(data.draw(st.integers(0, len(self.raw) - 1), label="group"))
        free_before = self.pool.num_free
        self.pool.free(group)
        score.operations += 1
        assert self.pool.num_free == free_before + len(group)

    @rule(state=live, data=st.data(), apply=st.integers(0, 4))
    def commit_rows(self, state: ContextState, data: st.DataObject, apply: int) -> None:
        assert self.pool is not None
        m = self.model(state)
        n = data.draw(st.integers(1, m.window), label="rows")
        new = self.positions_after(state, n, data)
        before = self.snapshot()
        plan = state.plan_append(new)
        score.operations += 1
        assert self.snapshot() == before, "plan_append changed something"
        ctx = m.positions
        assert plan.n_rows == n and plan.positions == new
        if len(ctx) + n <= m.window:
            assert plan.slide is None
            assert plan.dst_start == len(ctx)
        else:
            # The room is left free beyond the commit's rows; the commit's rows all stay.
            keep = max(0, m.window - m.room - n)
            event("commit: slide" if m.room == 0 else "commit: slide with room")
            assert plan.slide is not None
            assert (plan.slide.src_start, plan.slide.keep) == (len(ctx) - keep, keep)
            assert plan.dst_start == keep
        if apply == 0:
            return  # an unapplied plan is just dropped
        held = len(state.page_table)
        free_before = self.pool.num_free
        state.apply_append(plan)
        score.operations += 1
        if plan.slide is None:
            m.positions = ctx + new
            if m.last_slide is not None:
                m.last_slide = (m.last_slide[0], m.last_slide[1] + n)
        else:
            # The policy: no slide before the room the last one left (or what its commit left
            # of the window) has filled up.
            if m.last_slide is not None:
                last_n, since = m.last_slide
                assert since + n > min(m.room, m.window - last_n), (since, n, m.room, last_n)
            m.last_slide = (n, 0)
            # Invariant 4: the newest rows, in order, with their positions; K/V recomputed.
            kept = ctx[len(ctx) - plan.slide.keep :]
            m.positions = kept + new
            m.committed = 0
            assert state.ctx_positions[: plan.slide.keep] == kept
            assert state.ctx_committed == 0 and state.page_table == []
            assert self.pool.num_free == free_before + held
            assert state.ctx_len == max(m.window - m.room, n)
            score.invariant_checks += 1
        assert state.ctx_positions == m.positions
        assert state.ctx_len <= m.window

    @rule(
        state=live,
        kind=st.sampled_from(["empty", "negative", "unordered", "duplicate", "not_after_last", "too_many"]),
    )
    def commit_bad_rows(self, state: ContextState, kind: str) -> None:
        m = self.model(state)
        nxt = m.next_position
        if kind == "not_after_last":
            if not m.positions or len(m.positions) + 1 > m.window:
                return
            bad = [m.positions[-1]]
        else:
            bad = {
                "empty": [],
                "negative": [-1] if nxt == 0 else [nxt, -1],
                "unordered": [nxt + 1, nxt],
                "duplicate": [nxt, nxt],
                "too_many": list(range(nxt, nxt + m.window + 1)),
            }[kind]
        before = self.snapshot()
        with expect_clear_error(ValueError):
            state.plan_append(bad)
        score.operations += 1
        assert self.snapshot() == before

    @rule(state=live, outcome=st.sampled_from(["confirm", "confirm", "abort", "drop"]), again=st.booleans())
    def precompute(self, state: ContextState, outcome: str, again: bool) -> None:
        assert self.pool is not None
        m = self.model(state)
        ps = self.pool.page_size
        need = ceil_div(len(m.positions), ps) - len(state.page_table)
        before = self.snapshot()
        score.operations += 1
        if need > self.pool.num_free:
            event("precompute: exhausted")
            with expect_clear_error(PoolExhaustedError):
                state.plan_precompute()
            assert self.snapshot() == before
            return
        plan = state.plan_precompute()
        event(f"precompute: {outcome} {'with' if need else 'without'} new blocks")
        assert (plan.row_start, plan.row_end) == (m.committed, len(m.positions))
        assert len(plan.new_pages) == need and not plan.resolved
        assert self.pool.num_free == before[0][2] - need  # type: ignore[index]
        table = state.page_table + plan.new_pages
        assert plan.slots == [table[r // ps] * ps + r % ps for r in range(plan.row_start, plan.row_end)]
        assert plan.positions == m.positions[plan.row_start : plan.row_end]
        # Conservation holds with the plan's pages counted as held by the caller.
        check_world(self.pool, self.live_states, self.raw_held() + plan.new_pages)
        if again:
            mid = self.snapshot()
            with expect_clear_error(InvalidStateError):
                state.plan_precompute()
            assert self.snapshot() == mid
        if outcome == "confirm":
            state.confirm_precompute(plan)
            m.committed = len(m.positions)
            assert plan.resolved and state.page_table == table
            assert state.slot_mapping() == [table[r // ps] * ps + r % ps for r in range(m.committed)]
            after = self.snapshot()
            with expect_clear_error(InvalidStateError):
                state.confirm_precompute(plan)
            state.abort_precompute(plan)  # resolved: a no-op that must not return adopted blocks
            assert self.snapshot() == after
        elif outcome == "abort":
            state.abort_precompute(plan)
            assert plan.resolved
            assert self.snapshot() == before, "abort must restore pool and state"
        else:
            del plan  # refcount drop runs the plan's destructor, which aborts it
            assert self.snapshot() == before, "dropping an unresolved plan must abort it"
        score.operations += 1

    @rule(state=live, position=st.integers(0, 10_000), drafted=st.integers(0, 16), data=st.data())
    def propose_and_verify(self, state: ContextState, position: int, drafted: int, data: st.DataObject) -> None:
        m = self.model(state)
        state.note_propose(position, drafted)
        m.seq_len, m.last_drafted, m.prefill_done = position + 1, drafted, True
        score.operations += 1
        if data.draw(st.booleans(), label="over-accept"):
            # Drawn outside the error check: a draw can end the example (hypothesis runs out of
            # data), which must not count as a bad input without its clear error.
            excess = data.draw(st.integers(1, 5), label="excess")
            before = self.snapshot()
            with expect_clear_error(ValueError):
                state.after_verify(drafted + excess)
            assert self.snapshot() == before
        if data.draw(st.booleans(), label="verify"):
            accepted = data.draw(st.integers(0, drafted), label="accepted")
            state.after_verify(accepted)
            m.last_accepted, m.last_drafted = accepted, 0
            score.operations += 1

    @rule(state=live, via_precompute=st.booleans())
    def stale_plan(self, state: ContextState, via_precompute: bool) -> None:
        assert self.pool is not None
        m = self.model(state)
        old = state.plan_append([m.next_position])
        score.operations += 1
        if via_precompute:
            # Needs rows without K/V and the pages to hold them, or confirm changes nothing.
            need = ceil_div(len(m.positions), self.pool.page_size) - len(state.page_table)
            if m.committed == len(m.positions) or need > self.pool.num_free:
                return
            pre = state.plan_precompute()
            state.confirm_precompute(pre)
            m.committed = len(m.positions)
            event("stale plan: after confirm")
        else:
            newer = state.plan_append([m.next_position + 1])
            state.apply_append(newer)
            if newer.slide is not None:
                assert newer.slide.keep == max(0, m.window - m.room - 1)
                m.positions = m.positions[len(m.positions) - newer.slide.keep :]
                m.committed = 0
                m.last_slide = (1, 0)
            elif m.last_slide is not None:
                m.last_slide = (m.last_slide[0], m.last_slide[1] + 1)
            m.positions = m.positions + newer.positions
        score.operations += 2
        before = self.snapshot()
        with expect_clear_error(InvalidStateError):
            state.apply_append(old)
        assert self.snapshot() == before

    @rule(a=live, b=live)
    def foreign_plan(self, a: ContextState, b: ContextState) -> None:
        if a is b:
            return
        plan = a.plan_append([self.model(a).next_position])
        before = self.snapshot()
        with expect_clear_error(InvalidStateError):
            b.apply_append(plan)
        score.operations += 2
        assert self.snapshot() == before

    @rule(target=freed, state=consumes(live))
    def free(self, state: ContextState) -> ContextState:
        assert self.pool is not None
        m = self.model(state)
        self.pre_free_plans[id(state)] = state.plan_append([m.next_position])
        held = list(state.page_table)
        free_before = self.pool.num_free
        assert state.free() is True
        score.operations += 2
        # Invariant 6: every block back, every counter fresh, identity kept.
        assert state.freed
        assert self.pool.num_free == free_before + len(held)
        assert not any(self.pool.is_allocated(b) for b in held)
        assert (state.window, state.owner) == (m.window, m.owner)
        assert_fresh(state)
        self.live_states.remove(state)
        self.freed_states.append(state)
        del self.models[id(state)]
        return state

    @rule(state=freed)
    def double_free(self, state: ContextState) -> None:
        before = self.snapshot()
        assert state.free() is False
        score.operations += 1
        assert self.snapshot() == before
        assert_fresh(state)

    @rule(
        state=freed,
        op=st.sampled_from(["plan_append", "apply_old_plan", "plan_precompute", "note_propose", "after_verify"]),
    )
    def use_after_free(self, state: ContextState, op: str) -> None:
        before = self.snapshot()
        with expect_clear_error(InvalidStateError):
            if op == "plan_append":
                state.plan_append([0])
            elif op == "apply_old_plan":
                state.apply_append(self.pre_free_plans[id(state)])
            elif op == "plan_precompute":
                state.plan_precompute()
            elif op == "note_propose":
                state.note_propose(0, 1)
            else:
                state.after_verify(0)
        score.operations += 1
        assert self.snapshot() == before

    @invariant()
    def pool_and_states_consistent(self) -> None:
        if self.pool is None:
            return
        check_world(self.pool, self.live_states, self.raw_held())

    @invariant()
    def states_match_model(self) -> None:
        for state in self.live_states:
            m = self.model(state)
            assert state.ctx_positions == m.positions
            assert state.ctx_len == len(m.positions)
            assert state.ctx_committed == m.committed
            assert (state.window, state.owner, state.freed) == (m.window, m.owner, False)
            assert (state.seq_len, state.prefill_done) == (m.seq_len, m.prefill_done)
            assert (state.last_num_drafted, state.last_num_accepted) == (m.last_drafted, m.last_accepted)
            score.invariant_checks += 1
        for state in self.freed_states:
            assert state.freed and state.page_table == []
            score.invariant_checks += 1

    def teardown(self) -> None:
        if self.pool is None:
            return
        for state in self.live_states:
            assert state.free() is True
        for group in self.raw:
            self.pool.free(group)
        # Invariant 7: with every state freed the pool is exactly full again.
        assert self.pool.num_free == self.pool.num_pages and self.pool.num_used == 0
        assert not any(self.pool.is_allocated(b) for b in range(self.pool.num_pages))
        self.pool.check_invariants()
        for state in self.live_states + self.freed_states:
            assert_fresh(state)
        score.invariant_checks += 1


TestCoreMachine = CoreMachine.TestCase
