"""The core's whole-step entry points (``plan_proposals``, ``confirm_proposals``,
``abort_plans``, ``verify_all``, ``plan_appends`` / ``AppendBatch``, ``GraphMeta``) through the
binding: all-or-nothing planning, the argument and lifecycle errors a proposer relies on, and
the metadata matrix ``GraphMeta`` writes. (Their use by the proposer is covered by the proposer,
fault, fast-path and commit-batch tests; the matrix against a from-scratch rebuild over many
steps by the core's own unit tests.)"""

from __future__ import annotations

import pytest
import torch

from blockdraft import _core
from blockdraft._core import BlockPool, ContextState, InvalidStateError, PoolExhaustedError

from support.scorecard import expect_clear_error, score

OWNER = 7


def states_with_rows(pool: BlockPool, rows: list[int], window: int = 32) -> list[ContextState]:
    out = []
    for n in rows:
        st = ContextState(pool, window, OWNER)
        if n:
            st.apply_append(st.plan_append(list(range(n))))
        out.append(st)
    return out


def view(st: ContextState) -> tuple[object, ...]:
    return (st.ctx_positions, st.ctx_committed, st.page_table, st.seq_len, st.last_num_drafted,
            st.version)


def test_plan_proposals_is_all_or_nothing_when_the_pool_runs_out() -> None:
    # pages of 4: the states need 2, 2 and 3 pages; 6 free -> the third fails
    pool = BlockPool(6, 4)
    states = states_with_rows(pool, [8, 5, 9])
    before = [view(s) for s in states]
    with expect_clear_error(PoolExhaustedError, "exhausted"):
        _core.plan_proposals("propose_batch", states, [1, 2, 3], [8, 5, 9], 64, OWNER)
    assert pool.num_free == 6 and [view(s) for s in states] == before
    # without the third, both plans are made, confirmed and noted together
    plans = _core.plan_proposals("propose_batch", states[:2], [1, 2], [8, 5], 64, OWNER)
    assert [p.row_end for p in plans] == [8, 5] and pool.num_free == 2
    _core.confirm_proposals(plans, [8, 5], [3, 2])
    assert [s.ctx_committed for s in states[:2]] == [8, 5]
    assert [(s.seq_len, s.last_num_drafted) for s in states[:2]] == [(9, 3), (6, 2)]
    assert all(p.resolved for p in plans)
    _core.abort_plans(plans)  # resolved plans are ignored
    assert pool.num_free == 2
    score.invariant_checks += 1


def test_plan_proposals_fault_point_gives_back_the_earlier_plans() -> None:
    pool = BlockPool(16, 4)
    states = states_with_rows(pool, [3, 3, 3])
    with expect_clear_error(PoolExhaustedError, "fault injection"):
        _core.plan_proposals("propose_batch", states, [1, 1, 1], [3, 3, 3], 64, OWNER, fail_at=2)
    assert pool.num_free == 16
    plans = _core.plan_proposals("propose_batch", states, [1, 1, 1], [3, 3, 3], 64, OWNER)
    _core.abort_plans(plans)
    assert pool.num_free == 16 and not any(s.page_table for s in states)


def test_plan_proposals_bad_anchors_and_states_change_nothing() -> None:
    pool = BlockPool(16, 4)
    other = ContextState(pool, 8, OWNER + 1)
    freed = ContextState(pool, 8, OWNER)
    freed.free()
    a, b = states_with_rows(pool, [3, 2])
    cases = [
        (TypeError, ("last_token", "bool"), [a], [True], [3]),
        (TypeError, ("position",), [a], [1], [3.0]),
        (ValueError, ("last_token",), [a], [64], [3]),
        (ValueError, ("last_token",), [a], [-1], [3]),
        (ValueError, ("position",), [a], [1], [2]),  # not after the context (last is 2)
        (ValueError, ("position",), [a], [1], [2**62]),
        (ValueError, ("position", "64-bit"), [a], [1], [2**63]),
        (ValueError, ("twice",), [a, a], [1, 1], [3, 3]),
        (ValueError, ("positions",), [a, b], [1, 1], [3]),
        (InvalidStateError, ("another proposer",), [a, other], [1, 1], [3, 0]),
        (InvalidStateError, ("freed",), [b, freed], [1, 1], [2, 0]),
        (InvalidStateError, ("not a DFlash",), [a, "state"], [1, 1], [3, 0]),
    ]
    for exc, words, sts, toks, poss in cases:
        before = [view(s) for s in (a, b)]
        with expect_clear_error(exc, *words):
            _core.plan_proposals("propose", sts, toks, poss, 64, OWNER)
        assert [view(s) for s in (a, b)] == before and pool.num_free == 16, words


def test_plan_proposals_refuses_a_state_without_context() -> None:
    # the lifecycle is alloc -> commit context -> propose: a fresh state anywhere in the call
    # refuses the whole call before any plan takes pages
    pool = BlockPool(16, 4)
    a, fresh = states_with_rows(pool, [5, 0])
    before = [view(s) for s in (a, fresh)]
    for sts, toks, poss in (([fresh], [1], [0]), ([a, fresh], [1, 1], [5, 0])):
        with expect_clear_error(InvalidStateError, "^propose_batch: ", "no committed context",
                                "commit_ctx before propose"):
            _core.plan_proposals("propose_batch", sts, toks, poss, 64, OWNER)
        assert [view(s) for s in (a, fresh)] == before and pool.num_free == 16
    # once it has context it proposes
    fresh.apply_append(fresh.plan_append([0]))
    plans = _core.plan_proposals("propose_batch", [a, fresh], [1, 1], [5, 1], 64, OWNER)
    assert [p.row_end for p in plans] == [5, 1]
    _core.abort_plans(plans)


def test_verify_all_records_in_order_and_stops_at_the_first_bad_count() -> None:
    pool = BlockPool(16, 4)
    states = states_with_rows(pool, [2, 2, 2])
    for s in states:
        s.note_propose(5, 3)
    _core.verify_all("after_verify_batch", states, [1, 3, 0], OWNER)
    assert [(s.last_num_accepted, s.last_num_drafted) for s in states] == [(1, 0), (3, 0), (0, 0)]
    for s in states:
        s.note_propose(6, 2)
    with expect_clear_error(ValueError, "num_accepted"):
        _core.verify_all("after_verify_batch", states, [2, 4, 1], OWNER)
    assert [s.last_num_drafted for s in states] == [0, 2, 2]  # the first one was recorded
    with expect_clear_error(ValueError, "accepted counts"):
        _core.verify_all("after_verify_batch", states, [0, 0], OWNER)
    with expect_clear_error(ValueError, "num_accepted", ">= 0"):
        _core.verify_all("after_verify_batch", states[1:], [-1, 0], OWNER)


def test_verify_all_one_state_and_repeats_in_wide_calls() -> None:
    pool = BlockPool(40, 1)
    states = states_with_rows(pool, [1] * 20)
    for s in states:
        s.note_propose(5, 2)
    # one state: the shape after_verify takes through the core
    _core.verify_all("after_verify", states[:1], [2], OWNER)
    assert (states[0].last_num_accepted, states[0].last_num_drafted) == (2, 0)
    # a repeat is found among the first few states and far into a wide call alike
    for at in (1, 15, 16, 18):
        call = states[1:]
        call[at] = call[0]
        with expect_clear_error(ValueError, "the same state appears twice"):
            _core.verify_all("after_verify_batch", call, [0] * len(call), OWNER)
        assert all(s.last_num_drafted == 2 for s in states[1:]), at  # nothing recorded
    _core.verify_all("after_verify_batch", states[1:], [1] * 19, OWNER)
    assert all(s.last_num_accepted == 1 for s in states[1:])


def test_free_with_owner_refuses_another_proposers_state() -> None:
    pool = BlockPool(8, 4)
    (st,) = states_with_rows(pool, [5])
    st.confirm_precompute(st.plan_precompute())
    before = (view(st), pool.num_free)
    words = ("^free: ", "another proposer", "owner 7", "expected 8")
    with expect_clear_error(InvalidStateError, *words):
        st.free(OWNER + 1)
    assert (view(st), pool.num_free) == before and not st.freed
    with expect_clear_error(ValueError, "owner"):
        st.free(-1)
    assert st.free(owner=OWNER) is True and pool.num_free == 8
    assert st.free(OWNER) is False  # idempotent
    with expect_clear_error(InvalidStateError, "another proposer"):
        st.free(OWNER + 1)  # the owner is checked on a freed state too
    assert st.free() is False  # no owner: no check


def test_plan_appends_cuts_to_the_window_and_maps_rows() -> None:
    pool = BlockPool(16, 4)
    a, b, c = states_with_rows(pool, [0, 3, 5], window=6)
    # a: 8 rows into a window of 6 -> the newest 6; b: 2 rows, fits; c: 2 rows, slides 1 out
    batch = _core.plan_appends("commit_ctx_batch", [a, b, c], [list(range(8)), [3, 4], [9, 11]],
                               OWNER)
    index, src_starts, dst_starts, counts = (list(c) for c in zip(*batch.entries))
    assert batch.n_rows == 12 and batch.kept == 10 and index == [0, 1, 2]
    assert src_starts == [2, 8, 10] and dst_starts == [0, 3, 4]
    assert counts == [6, 2, 2] and batch.slides == [(2, 1, 4)]
    assert batch.row_map() == [0] * 6 + [1, 1, 2, 2] + list(range(6)) + [3, 4, 4, 5]
    assert a.ctx_len == 0  # planning changes nothing
    batch.apply()
    assert a.ctx_positions == list(range(2, 8)) and b.ctx_positions == [0, 1, 2, 3, 4]
    assert c.ctx_positions == [1, 2, 3, 4, 9, 11]
    with expect_clear_error(InvalidStateError, "stale"):
        batch.apply()
    # empty lists are skipped; bad positions anywhere refuse the whole batch
    batch = _core.plan_appends("commit_ctx_batch", [a, b], [[], [5]], OWNER)
    assert [e[0] for e in batch.entries] == [1] and batch.n_rows == 1
    with expect_clear_error(TypeError, "positions must be ints"):
        _core.plan_appends("commit_ctx_batch", [a, b], [[8], [5.0]], OWNER)
    with expect_clear_error(ValueError, "positions", "after the last"):
        _core.plan_appends("commit_ctx_batch", [a, b], [[8], [4]], OWNER)


def test_graph_meta_writes_the_call() -> None:
    width, block_size, mask = 4, 3, 99
    table_col, pc, sc, src, cols = _core.GraphMeta.layout(width, block_size)
    assert (table_col, pc, sc, src, cols) == (3, 3 + width, 3 + width + block_size,
                                              3 + width + 2 * block_size, 3 + width + 3 * block_size)
    pool = BlockPool(16, 2)
    a, b = states_with_rows(pool, [3, 2])
    host = torch.full((3, cols), 5, dtype=torch.int64)
    meta = _core.GraphMeta(host, width, block_size, mask, 10)
    assert host[:, 1].tolist() == [mask] * 3 and (host[:, sc:src] == -1).all()
    plans = _core.plan_proposals("propose_batch", [a, b], [7, 8], [3, 2], 64, OWNER)
    got = meta.fill(plans, [7, 8], [3, 2], [1000, 2000])
    assert got == (5, [], []) and meta.staged == 5  # with bases the graph gathers the rows
    # without bases: the rows to copy are listed and the source column stays 0
    host2 = torch.zeros((3, cols), dtype=torch.int64)
    assert _core.GraphMeta(host2, width, block_size, mask, 10).fill(plans, [7, 8], [3, 2]) == (
        5, [], [(0, 0, 3), (1, 0, 2)])
    assert not host2[:, src:].any() and torch.equal(host2[:, :src], host[:, :src])
    assert host[:2, :3].tolist() == [[3, 7, 3], [2, 8, 2]] and host[2, :3].tolist() == [0, mask, 0]
    assert host[0, 3:5].tolist() == plans[0].new_pages and host[1, 3:4].tolist() == plans[1].new_pages
    # staged rows: a's 3 rows fill meta row 0; b's 2 rows start meta row 1
    assert host[0, pc:sc].tolist() == [0, 1, 2] and host[1, pc : pc + 2].tolist() == [0, 1]
    assert host[0, sc:src].tolist() == plans[0].slots
    assert host[1, sc:src].tolist() == plans[1].slots + [-1]
    assert host[0, src:].tolist() == [1000, 1010, 1020] and host[1, src : src + 2].tolist() == [2000, 2010]
    _core.confirm_proposals(plans, [3, 2], 2)
    # a call with one sequence and nothing new to stage clears what the last one left
    plans = _core.plan_proposals("propose", [b], [8], [3], 64, OWNER)
    assert meta.fill(plans, [8], [3]) == (0, [], [])
    assert host[1, :3].tolist() == [0, mask, 0] and (host[:2, sc:src] == -1).all()
    _core.abort_plans(plans)
    with expect_clear_error(ValueError, "exceed"):
        meta.fill(_core.plan_proposals("x", [a, b], [1, 1], [3, 3], 64, OWNER) * 2, [1] * 4, [3] * 4)
    for bad in (torch.zeros((3, cols)), torch.zeros((3, cols + 1), dtype=torch.int64),
                torch.zeros(cols, dtype=torch.int64), torch.zeros((cols, 3), dtype=torch.int64).t()):
        with expect_clear_error(ValueError, "host"):
            _core.GraphMeta(bad, width, block_size, mask, 10)
    with pytest.raises(ValueError, match="rows"):
        _core.GraphMeta(torch.zeros((0, cols), dtype=torch.int64), width, block_size, mask, 10)
