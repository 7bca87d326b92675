"""Hypothesis state machine driving DFlashProposer (torch backend, tiny random pair, CPU).

Random interleavings of alloc, commit, propose, propose_batch, after_verify, free, double free
and use after free, with TESTING.md's invariants checked after every step: conservation of
pool pages, no page held twice, per-state row/position/page accounting, slides keep the
newest rows and leave the room of the run's slide lever (drawn per run), declined batches
change nothing, free resets everything.

Each step runs real tensors through the drafter, so this machine uses fewer examples than the
core's pure-bookkeeping machines (``ci``: 80 runs of up to 30 steps; ``thorough``: 400 x 60).
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from blockdraft import InvalidStateError, PoolExhaustedError
from blockdraft.core import slide_room
from blockdraft.levers import Levers
from blockdraft.proposer import DFlashProposer, DFlashState

from support.scorecard import expect_clear_error, score
from support.tinypair import K_H, tiny_drafter, tiny_target

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"
TARGET = tiny_target()
DRAFTER = tiny_drafter()


class ProposerMachine(RuleBasedStateMachine):
    live = Bundle("live")
    dead = Bundle("dead")

    def __init__(self) -> None:
        super().__init__()
        self.prop = DFlashProposer(
            DRAFTER, TARGET, max_seq_len=40, num_pages=12, page_size=4, max_batch=3, backend="torch"
        )
        self.states: list[DFlashState] = []
        self.next_pos: dict[int, int] = {}
        self.seed = 0
        score.sequences += 1

    @initialize(slide=st.sampled_from([0.0, 0.125, 0.3, 0.9]))
    def slide_lever(self, slide: float) -> None:
        """The run's proposer slides leaving ``slide`` of each window free."""
        self.prop = DFlashProposer(
            DRAFTER, TARGET, max_seq_len=40, num_pages=12, page_size=4, max_batch=3,
            backend="torch", levers=Levers(ctx_cap=self.prop.levers.ctx_cap, slide=slide),
        )

    def _rows(self, n: int) -> torch.Tensor:
        self.seed += 1
        return torch.randn(n, K_H, generator=torch.Generator().manual_seed(self.seed))

    @rule(target=live, budget=st.one_of(st.none(), st.integers(0, 30)))
    def alloc(self, budget: int | None) -> DFlashState:
        s = self.prop.alloc_state() if budget is None else self.prop.alloc_state_for(budget)
        assert s.acc is not None and bool((s.acc == 0).all())
        self.states.append(s)
        self.next_pos[id(s)] = 0
        score.operations += 1
        return s

    @rule(s=live, n=st.integers(1, 12), gap=st.integers(0, 3))
    def commit(self, s: DFlashState, n: int, gap: int) -> None:
        start = self.next_pos[id(s)] + gap
        data = self._rows(n)
        old_pos = s.ctx_positions
        self.prop.commit_ctx(s, data, range(start, start + n))
        self.next_pos[id(s)] = start + n
        kept = min(n, s.window)
        appended = old_pos + list(range(start, start + n))
        slid = len(appended) > s.window
        # A slide keeps the newest rows, leaving the lever's room free unless the commit's own
        # rows need it.
        if slid:
            assert s.ctx_len == max(s.window - slide_room(s.window, self.prop.levers.slide), kept)
        expect = appended[len(appended) - s.ctx_len :] if slid else appended
        assert s.ctx_positions == expect
        assert s.acc is not None and torch.equal(s.acc[s.ctx_len - kept : s.ctx_len], data[-kept:])
        if slid:
            assert s.ctx_committed == 0  # invariant 4
        score.operations += 1
        score.invariant_checks += 2

    @rule(data=st.data(), k=st.integers(1, 3), how=st.sampled_from(["now", "deferred", "deferred+propose"]))
    def commit_batch(self, data: st.DataObject, k: int, how: str) -> None:
        """``commit_ctx_batch`` over distinct live states (0..6 rows each), or ``committing``
        with nothing or a proposal of those states inside its block: each state ends as one
        ``commit_ctx`` of its rows would leave it."""
        pool = [s for s in self.states if not s.freed]
        picks = list({id(s): s for s in (data.draw(st.sampled_from(pool)) for _ in range(k))}
                     .values()) if pool else []
        counts = [data.draw(st.integers(0, 6)) for _ in picks]
        rows = self._rows(sum(counts))
        positions = []
        expect = []
        offset = 0
        for s, n in zip(picks, counts):
            start = self.next_pos[id(s)]
            positions.append(list(range(start, start + n)))
            appended = s.ctx_positions + positions[-1]
            expect.append((appended, rows[offset : offset + n][-min(n, s.window):] if n else None))
            offset += n
        if how == "now":
            self.prop.commit_ctx_batch(picks, rows, positions)
        else:
            with self.prop.committing(picks, rows, positions):
                ready = [s for s in picks if s.ctx_len > 0]
                if how == "deferred+propose" and ready:
                    # May decline (a full pool): the block still writes the rows.
                    self.prop.propose_on_device(ready, [1] * len(ready),
                                                [self.next_pos[id(s)] + len(p) for s, p in zip(picks, positions)
                                                 if s.ctx_len > 0], 1)
        for s, n, (appended, data_rows) in zip(picks, counts, expect):
            self.next_pos[id(s)] += n
            assert s.ctx_positions == appended[len(appended) - s.ctx_len :]
            if data_rows is not None:
                kept = data_rows.shape[0]
                assert s.acc is not None
                assert torch.equal(s.acc[s.ctx_len - kept : s.ctx_len], data_rows)
        score.operations += 1
        score.invariant_checks += len(picks)

    @rule(s=live, nd=st.integers(1, 3), tok=st.integers(0, 63))
    def propose(self, s: DFlashState, nd: int, tok: int) -> None:
        pos = self.next_pos[id(s)]
        before = self._snap()
        if s.ctx_len == 0:
            # the lifecycle is strict: context is committed before anything is proposed
            with expect_clear_error(InvalidStateError, "no committed context"):
                self.prop.propose(s, tok, pos, nd)
            assert self._snap() == before
            score.invariant_checks += 1
            return
        try:
            drafts = self.prop.propose(s, tok, pos, nd)
        except PoolExhaustedError:
            assert self._snap() == before  # invariant 5
            score.invariant_checks += 1
            return
        assert len(drafts) == nd and s.ctx_committed == s.ctx_len and s.last_num_drafted == nd
        score.operations += 1

    @rule(data=st.data(), nd=st.integers(1, 3), k=st.integers(0, 4))
    def propose_batch(self, data: st.DataObject, nd: int, k: int) -> None:
        pool = [s for s in self.states if not s.freed]
        if not pool:
            return
        picks = [data.draw(st.sampled_from(pool)) for _ in range(k)]
        before = self._snap()
        out = self.prop.propose_batch(picks, [1] * k, [self.next_pos[id(s)] for s in picks], nd)
        if out is None:
            assert self._snap() == before  # invariant 5
            score.invariant_checks += 1
        else:
            assert len(out) == k and all(len(d) == nd for d in out)
            assert len({id(s) for s in picks}) == k
        score.operations += 1

    @rule(s=live, frac=st.floats(0, 1))
    def after_verify(self, s: DFlashState, frac: float) -> None:
        acc = int(s.last_num_drafted * frac)
        self.prop.after_verify(s, acc)
        assert s.last_num_drafted == 0 and s.last_num_accepted == acc
        score.operations += 1

    @rule(data=st.data(), k=st.integers(1, 3))
    def after_verify_batch(self, data: st.DataObject, k: int) -> None:
        """Many verify records in one core call: as ``after_verify`` per state; a bad count
        (more than drafted) records the states before it and none after."""
        pool = [s for s in self.states if not s.freed]
        if len(pool) < k:
            return
        picks = data.draw(st.permutations(pool).map(lambda p: p[:k]))
        counts = [data.draw(st.integers(0, s.last_num_drafted + 1)) for s in picks]
        bad = next((i for i, (s, c) in enumerate(zip(picks, counts)) if c > s.last_num_drafted), None)
        drafted = [s.last_num_drafted for s in picks]
        if bad is None:
            self.prop.after_verify_batch(picks, counts)
        else:
            with pytest.raises(ValueError, match="num_accepted"):
                self.prop.after_verify_batch(picks, counts)
        for i, (s, c) in enumerate(zip(picks, counts)):
            if bad is None or i < bad:
                assert s.last_num_drafted == 0 and s.last_num_accepted == c
            else:
                assert s.last_num_drafted == drafted[i]
        score.operations += 1

    @rule(target=dead, s=consumes(live))
    def free(self, s: DFlashState) -> DFlashState:
        pages_before = self.prop.pool.num_free
        held = len(s.page_table)
        self.prop.free_state(s)
        assert self.prop.pool.num_free == pages_before + held  # invariant 6
        assert s.ctx_len == s.ctx_committed == s.seq_len == 0 and s.page_table == []
        assert s.acc is None and not s.prefill_done and s.last_num_drafted == 0
        score.operations += 1
        score.invariant_checks += 1
        return s

    @rule(s=dead)
    def double_free_and_use_after_free(self, s: DFlashState) -> None:
        free_before = self.prop.pool.num_free
        self.prop.free_state(s)
        assert self.prop.pool.num_free == free_before
        for call in (
            lambda: self.prop.propose(s, 1, 100, 1),
            lambda: self.prop.commit_ctx(s, self._rows(1), [100]),
        ):
            try:
                call()
            except InvalidStateError:
                score.bad_inputs += 1
                score.clear_errors += 1
            else:
                raise AssertionError("use after free was accepted")
        score.operations += 3

    def _snap(self) -> Any:
        return (
            self.prop.pool.num_free,
            [(s.ctx_len, s.ctx_committed, s.ctx_positions, s.page_table, s.last_num_drafted, s.seq_len)
             for s in self.states],
        )

    @invariant()
    def pool_conservation_and_states(self) -> None:
        pool = self.prop.pool
        pool.check_invariants()
        held: list[int] = []
        for s in self.states:
            if s.freed:
                assert s.page_table == []
                continue
            s.ctx.check_invariants()
            assert 0 <= s.ctx_committed <= s.ctx_len <= s.window
            pos = s.ctx_positions
            assert len(pos) == s.ctx_len and all(a < b for a, b in zip(pos, pos[1:]))
            assert len(s.page_table) == math.ceil(s.ctx_committed / pool.page_size)
            held += s.page_table
        assert len(held) == len(set(held))  # invariant 2
        assert all(pool.is_allocated(b) for b in held)
        assert pool.num_free + len(held) == pool.num_pages  # invariant 1
        score.invariant_checks += 5

    def teardown(self) -> None:
        for s in self.states:
            self.prop.free_state(s)
        assert self.prop.pool.num_free == self.prop.pool.num_pages  # invariant 7
        score.invariant_checks += 1


# TESTING.md's example counts (ci >= 300, thorough >= 10,000); the steps are shorter than the
# core machine's because every step runs real drafter tensors.
ProposerMachine.TestCase.settings = settings(
    settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci")),
    max_examples=10_000 if THOROUGH else 300,
    stateful_step_count=30,
)
TestProposerMachine = ProposerMachine.TestCase
