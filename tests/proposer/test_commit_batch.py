"""``DFlashProposer.commit_ctx_batch``: many sequences' rows in one call, the same result as one
``commit_ctx`` per sequence (accumulators, core state, drafts), all or nothing on bad input.

The Triton backend (one accumulator-kernel launch for the batch) runs under the interpreter
here and on the GPU in ``tests/gpu``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft import InvalidStateError
from blockdraft.kernels import triton_available
from blockdraft.proposer import DFlashProposer, DFlashState

from support.scorecard import expect_clear_error
from support.tinypair import K_H, make_proposer
from test_proposer import snapshot

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]


def _pair(drafter: Any, target: Any, backend: str, budgets: list[int]) -> tuple[
        DFlashProposer, list[DFlashState], DFlashProposer, list[DFlashState]]:
    """Two identical proposers with one state per budget each (budgets set the windows)."""
    out: list[Any] = []
    for _ in range(2):
        prop = make_proposer(drafter, target, backend=backend, max_seq_len=400, num_pages=200)
        out += [prop, [prop.alloc_state_for(b) for b in budgets]]
    return out[0], out[1], out[2], out[3]


def _accs_equal(a: list[DFlashState], b: list[DFlashState]) -> bool:
    # rows [0, ctx_len) are what the core describes; the rest is scratch
    return all(
        x.ctx_len == y.ctx_len and x.acc is not None and y.acc is not None
        and torch.equal(x.acc[: x.ctx_len], y.acc[: y.ctx_len])
        for x, y in zip(a, b)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_batch_commit_equals_one_commit_per_sequence(
    drafter: Any, target: Any, backend: str, data: st.DataObject
) -> None:
    """Random windows and row counts per round (0 rows, more than the window: slides and the
    newest-rows cut), several rounds: accumulators and core state match the sequential
    commits after every round, and so do the drafts after the last."""
    budgets = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4), label="budgets")
    batch, b_states, single, s_states = _pair(drafter, target, backend, budgets)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    next_pos = [0] * len(budgets)
    for _ in range(data.draw(st.integers(1, 4), label="rounds")):
        counts = data.draw(st.lists(st.integers(0, 60), min_size=len(budgets),
                                    max_size=len(budgets)), label="counts")
        positions = []
        for i, c in enumerate(counts):
            positions.append(list(range(next_pos[i], next_pos[i] + c)))
            next_pos[i] += c
        rows = torch.randn(sum(counts), K_H, generator=gen)
        batch.commit_ctx_batch(b_states, rows, positions)
        offset = 0
        for state, pos in zip(s_states, positions):
            if pos:
                single.commit_ctx(state, rows[offset : offset + len(pos)], pos)
            offset += len(pos)
        # core state (lengths, positions, tables, counters) and the pool, then the rows
        assert [x[:-1] for x in snapshot(batch, b_states)[1]] == [
            x[:-1] for x in snapshot(single, s_states)[1]]
        assert batch.pool.num_free == single.pool.num_free
        assert _accs_equal(b_states, s_states)
    live = [i for i, s in enumerate(b_states) if s.ctx_len > 0]
    for i in live:
        a = batch.propose(b_states[i], 3, next_pos[i], 2)
        b = single.propose(s_states[i], 3, next_pos[i], 2)
        assert a == b
    assert batch.pool.num_free == single.pool.num_free
    for prop, states in ((batch, b_states), (single, s_states)):
        for s in states:
            prop.free_state(s)
        assert prop.pool.num_free == prop.pool.num_pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_commit_then_graph_path_drafts(drafter: Any, target: Any, backend: str) -> None:
    """The graph path stages the rows of a batch commit (no kept view) like those of single
    commits: the same drafts as the plain path after each."""
    results = []
    for graphs, batched in (("off", False), ("static", True), ("static", False)):
        prop = make_proposer(drafter, target, backend=backend, graphs=graphs)
        states = [prop.alloc_state_for(60) for _ in range(3)]
        gen = torch.Generator().manual_seed(3)
        pos = [0, 0, 0]
        out = []
        for step in range(5):
            counts = [5 + step, 1, 2] if step == 0 else [1 + (step + i) % 3 for i in range(3)]
            positions = [list(range(pos[i], pos[i] + c)) for i, c in enumerate(counts)]
            rows = torch.randn(sum(counts), K_H, generator=gen)
            if batched:
                prop.commit_ctx_batch(states, rows, positions)
            else:
                offset = 0
                for s, p in zip(states, positions):
                    prop.commit_ctx(s, rows[offset : offset + len(p)], p)
                    offset += len(p)
            for i, c in enumerate(counts):
                pos[i] += c
            got = prop.propose_batch(states, [7, 8, 9], pos, 3)
            assert got is not None
            out.append(got)
            for s in states:
                prop.after_verify(s, 0)
        results.append(out)
        for s in states:
            prop.free_state(s)
    assert results[0] == results[1] == results[2]


def test_batch_commit_rejects_bad_input_and_changes_nothing(drafter: Any, target: Any) -> None:
    prop = make_proposer(drafter, target)
    states = [prop.alloc_state_for(30) for _ in range(3)]
    prop.commit_ctx_batch(states, torch.randn(6, K_H), [[0, 1], [0, 1, 2], [5]])
    before = snapshot(prop, states)
    good = [[2], [3], [6]]
    rows = torch.randn(3, K_H)
    bad_calls: list[tuple[type[BaseException], tuple[str, ...], Any]] = [
        (ValueError, ("twice",), lambda: prop.commit_ctx_batch(
            [states[0], states[0], states[1]], rows, good)),
        (ValueError, ("position lists",), lambda: prop.commit_ctx_batch(states, rows, good[:2])),
        (ValueError, ("rows", "positions"), lambda: prop.commit_ctx_batch(
            states, torch.randn(4, K_H), good)),
        (ValueError, ("position",), lambda: prop.commit_ctx_batch(
            states, rows, [[2], [1], [6]])),  # state 1 goes backwards: nothing is committed
        (TypeError, ("ints",), lambda: prop.commit_ctx_batch(states, rows, [[2], [3.0], [6]])),
        (TypeError, ("torch.Tensor",), lambda: prop.commit_ctx_batch(states, [[0.0]], good)),
        (ValueError, ("k*H",), lambda: prop.commit_ctx_batch(
            states, torch.randn(3, K_H + 1), good)),
        (InvalidStateError, ("DFlash",), lambda: prop.commit_ctx_batch(
            [states[0], object(), states[2]], rows, good)),  # type: ignore[list-item]
    ]
    for exc, words, call in bad_calls:
        with expect_clear_error(exc, *words):
            call()
        after = snapshot(prop, states)
        assert after[0] == before[0]
        assert [x[:-1] for x in after[1]] == [x[:-1] for x in before[1]]
        assert all(torch.equal(x[-1], y[-1]) for x, y in zip(after[1], before[1]))
    other = make_proposer(drafter, target)
    foreign = other.alloc_state()
    with expect_clear_error(InvalidStateError, "another proposer"):
        prop.commit_ctx_batch([states[0], foreign], torch.randn(2, K_H), [[2], [0]])
    prop.free_state(states[2])
    with expect_clear_error(InvalidStateError, "freed"):
        prop.commit_ctx_batch(states, rows, good)
    # an empty batch, and states given no rows, are no-ops
    prop.commit_ctx_batch([], torch.randn(0, K_H), [])
    prop.commit_ctx_batch(states[:2], torch.randn(0, K_H), [[], []])
    assert [x[:-1] for x in snapshot(prop, states[:2])[1]] == [x[:-1] for x in before[1][:2]]
    for s in states[:2]:
        prop.free_state(s)
    other.free_state(foreign)
    assert prop.pool.num_free == prop.pool.num_pages


@pytest.mark.skipif(not triton_available(), reason="Triton is not importable here")
def test_triton_batch_commit_is_one_kernel_launch(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's few rows per sequence (up to B, none cut) go in with one accumulator-kernel
    call; a batch with a cut (more rows than a window) or with more than B rows per sequence
    (a prefill) takes the per-sequence copies. Same rows either way."""
    calls: list[int] = []

    def counting(rows: Any, table: Any) -> None:
        calls.append(int(table.numel() - 2 * rows.shape[0]))  # the accumulators' addresses
        real(rows, table)

    batch, b_states, single, s_states = _pair(drafter, target, "triton", [20, 20, 5])
    writer = batch.writer
    real = writer.ops.acc_append
    assert real is not None
    monkeypatch.setattr(writer, "ops", dataclasses.replace(writer.ops, acc_append=counting))
    rows = torch.randn(15, K_H, generator=torch.Generator().manual_seed(1))
    # B = 4: 7 rows for 2 sequences (one launch); 12 rows > window 5 + B + 1 = 10 (a cut);
    # 11 rows for 2 sequences > 2 x B (copies)
    for k, counts in enumerate(([3, 0, 4], [2, 1, 12], [5, 0, 6])):
        positions = [list(range(30 * k, 30 * k + c)) for c in counts]
        batch.commit_ctx_batch(b_states, rows[: sum(counts)], positions)
        offset = 0
        for state, pos in zip(s_states, positions):
            if pos:
                single.commit_ctx(state, rows[offset : offset + len(pos)], pos)
            offset += len(pos)
        assert _accs_equal(b_states, s_states)
    assert calls == [2]
    # The last commit (6 rows onto a full window of 10) slid, leaving its room of 1 free.
    assert (b_states[2].window, b_states[2].ctx.slide_room, b_states[2].ctx_len) == (10, 1, 9)


def test_positions_as_any_iterable_of_ints(drafter: Any, target: Any) -> None:
    """Positions may be a list, tuple, range, int tensor or any iterable of ints; a
    non-iterable is a clear ``TypeError``."""
    prop = make_proposer(drafter, target, max_seq_len=64, num_pages=32)
    st = prop.alloc_state_for(30)
    rows = torch.randn(8, K_H, generator=torch.Generator().manual_seed(3))
    prop.commit_ctx(st, rows[:2], (0, 1))
    prop.commit_ctx(st, rows[2:4], torch.tensor([2, 3]))
    prop.commit_ctx(st, rows[4:6], (p for p in (4, 5)))
    prop.commit_ctx_batch([st], rows[6:8], [iter([6, 7])])
    assert st.ctx_positions == list(range(8))
    with expect_clear_error(TypeError, "positions"):
        prop.commit_ctx(st, rows[:1], 8)  # type: ignore[arg-type]
    assert st.ctx_len == 8
