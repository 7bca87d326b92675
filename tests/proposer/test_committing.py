"""``DFlashProposer.committing``: a batch commit whose accumulator writes wait for the end of a
``with`` block, so that a proposal inside it drafts from the new rows as they are. Against
``commit_ctx_batch`` followed by the same proposal: the same drafts, and after the block the
same accumulators, core state and pool, over rounds that draft inside the block, skip a
proposal (the next one then stages more than the last commit's rows, so the pending rows are
written before it reads), slide a window (written at once) and raise inside the block.

The Triton backend (the graph path's gather reads the staged rows by address) runs under the
interpreter here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft.kernels import triton_available
from blockdraft.proposer import DFlashProposer, DFlashState

from support.tinypair import K_H, make_proposer
from test_proposer import snapshot

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]

BUDGETS = [60, 60, 9]
"""One window per state; the last is small enough to slide within a few rounds."""


class Boom(Exception):
    pass


def _proposers(drafter: Any, target: Any, backend: str, graphs: str) -> list[tuple[DFlashProposer, list[DFlashState]]]:
    out = []
    for _ in range(2):
        prop = make_proposer(drafter, target, backend=backend, graphs=graphs, max_seq_len=200, num_pages=120)
        out.append((prop, [prop.alloc_state_for(b) for b in BUDGETS]))
    return out


def _same(a: tuple[DFlashProposer, list[DFlashState]], b: tuple[DFlashProposer, list[DFlashState]]) -> None:
    """Core state, pool and the accumulator rows the core describes."""
    sa, sb = snapshot(*a), snapshot(*b)
    assert sa[0] == sb[0]
    assert [x[:-1] for x in sa[1]] == [x[:-1] for x in sb[1]]
    for x, y in zip(a[1], b[1]):
        assert x.acc is not None and y.acc is not None
        assert torch.equal(x.acc[: x.ctx_len], y.acc[: y.ctx_len])


def _propose(prop: DFlashProposer, states: list[DFlashState], pos: list[int]) -> list[list[int]]:
    got = prop.propose_on_device(states, [5, 6, 7], pos, 3)
    assert got is not None
    out: list[list[int]] = got.tolist()
    return out


def _laid_out(rows: torch.Tensor, layout: str) -> torch.Tensor:
    """``rows`` as they are, or as a column band of a wider buffer (rows apart in memory: a
    request's one row is still read by address, several are not)."""
    if layout == "packed":
        return rows
    wide = torch.zeros(rows.shape[0], 3 * K_H)
    wide[:, K_H : 2 * K_H] = rows
    return wide[:, K_H : 2 * K_H]


@pytest.mark.parametrize("layout", ["packed", "strided"])
@pytest.mark.parametrize("graphs", ["static", "off"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_and_state_equal_a_commit_then_a_proposal(
    drafter: Any, target: Any, backend: str, graphs: str, layout: str
) -> None:
    now, later = _proposers(drafter, target, backend, graphs)
    gen = torch.Generator().manual_seed(5)
    pos = [0, 0, 0]
    # per round: rows per state, and what the round does besides committing
    # After the skipped proposal every plan stages two commits' rows, within a graph's B.
    rounds = [([7, 3, 4], "draft"), ([1, 2, 3], "draft"), ([1, 1, 1], "skip"), ([1, 2, 1], "draft"),
              ([1, 1, 1], "draft"),
              ([1, 1, 4], "draft"), ([2, 3, 1], "raise"), ([4, 1, 2], "draft"), ([1, 2, 1], "draft")]
    slid = False
    for counts, what in rounds:
        positions = [list(range(p, p + c)) for p, c in zip(pos, counts)]
        rows = _laid_out(torch.randn(sum(counts), K_H, generator=gen), layout)
        pos = [p + c for p, c in zip(pos, counts)]
        committed = later[1][2].ctx_committed
        now[0].commit_ctx_batch(now[1], rows, positions)
        expected = _propose(*now, pos) if what == "draft" else None
        if what == "raise":
            with pytest.raises(Boom), later[0].committing(later[1], rows, positions):
                raise Boom
        else:
            with later[0].committing(later[1], rows, positions):
                if what == "draft":
                    assert _propose(*later, pos) == expected
        slid = slid or later[1][2].ctx_committed < committed + counts[2]
        _same(now, later)
    assert slid, "the small window never slid: the rounds do not cover a sliding commit"
    for prop, states in (now, later):
        for s in states:
            prop.free_state(s)
        assert prop.pool.num_free == prop.pool.num_pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rows_are_written_when_the_block_ends(drafter: Any, target: Any, backend: str) -> None:
    prop = make_proposer(drafter, target, backend=backend, graphs="static")
    states = [prop.alloc_state_for(60) for _ in range(2)]
    rows = torch.randn(5, K_H, generator=torch.Generator().manual_seed(1))
    with prop.committing(states, rows, [[0, 1, 2], [0, 1]]):
        assert [s.ctx_len for s in states] == [3, 2]  # recorded at once
        assert all(s.acc is not None and not s.acc[:3].any() for s in states)  # not yet written
        assert prop.propose_on_device(states, [5, 6], [3, 2], 3) is not None
    assert states[0].acc is not None and states[1].acc is not None
    assert torch.equal(states[0].acc[:3], rows[:3]) and torch.equal(states[1].acc[:2], rows[3:])


def test_bad_input_records_nothing(drafter: Any, target: Any) -> None:
    prop = make_proposer(drafter, target, graphs="static")
    states = [prop.alloc_state_for(60) for _ in range(2)]
    before = snapshot(prop, states)
    rows = torch.randn(5, K_H)
    with pytest.raises(ValueError, match="5 rows but 4 positions"):
        prop.committing(states, rows, [[0, 1], [0, 1]])
    with pytest.raises(ValueError, match="position lists"):
        prop.committing(states, rows, [[0, 1, 2, 3, 4]])
    after = snapshot(prop, states)
    assert before[0] == after[0] and [x[:-1] for x in before[1]] == [x[:-1] for x in after[1]]
