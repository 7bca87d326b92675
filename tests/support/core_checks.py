"""Snapshots and invariant checks for the Rust core, shared by the suite.

``world_snapshot`` captures everything observable about a pool and a set of states, so a test can
assert that a declined or failed operation changed nothing (invariant 5) by comparing two
snapshots. ``check_world`` asserts invariants 1-3 and counts every check into the scorecard.
The numbers are those of the core's invariants (``rust/blockdraft-core/src/lib.rs``).
``pages_snapshot`` and ``check_pages_world`` are the same for target sequences (``SeqPages``).

    before = world_snapshot(pool, states)
    with expect_clear_error(PoolExhaustedError):
        st.plan_precompute()
    assert world_snapshot(pool, states) == before
    check_world(pool, live_states, extra_held=raw_pages)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import blockdraft

from support.scorecard import score

# Every observable attribute of a ContextState, in a fixed order.
STATE_FIELDS: tuple[str, ...] = (
    "owner",
    "window",
    "ctx_len",
    "ctx_committed",
    "ctx_positions",
    "page_table",
    "num_pages",
    "seq_len",
    "prefill_done",
    "last_num_drafted",
    "last_num_accepted",
    "skip_next_decode_append",
    "ctx_count_drafter",
    "max_ctx_count_drafter",
    "freed",
    "version",
)

# Values of a state straight from ``ContextState(pool, window)`` (and again after ``free``).
FRESH_VALUES: dict[str, Any] = {
    "ctx_len": 0,
    "ctx_committed": 0,
    "ctx_positions": [],
    "page_table": [],
    "num_pages": 0,
    "seq_len": 0,
    "prefill_done": False,
    "last_num_drafted": 0,
    "last_num_accepted": 0,
    "skip_next_decode_append": False,
    "ctx_count_drafter": 0,
    "max_ctx_count_drafter": 0,
}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def state_snapshot(st: blockdraft.core.ContextState) -> tuple[Any, ...]:
    return tuple(
        tuple(v) if isinstance(v := getattr(st, name), list) else v for name in STATE_FIELDS
    )


def pool_snapshot(pool: blockdraft.BlockPool) -> tuple[Any, ...]:
    """Sizes, counters and the allocation bitmap (O(num_pages): keep test pools small)."""
    return (
        pool.num_pages,
        pool.page_size,
        pool.num_free,
        pool.num_used,
        tuple(pool.is_allocated(b) for b in range(pool.num_pages)),
    )


def world_snapshot(
    pool: blockdraft.BlockPool, states: Iterable[blockdraft.core.ContextState] = ()
) -> tuple[Any, ...]:
    return (pool_snapshot(pool), tuple(state_snapshot(st) for st in states))


def assert_fresh(st: blockdraft.core.ContextState) -> None:
    """Invariant 6: every counter equals its value in a fresh state."""
    for name, want in FRESH_VALUES.items():
        got = getattr(st, name)
        assert got == want, f"{name} = {got!r} after free, fresh value is {want!r}"
    score.invariant_checks += 1


def check_state(st: blockdraft.core.ContextState, page_size: int) -> None:
    """Invariant 3 for one live state, from Python and from the core's own check."""
    positions = st.ctx_positions
    table = st.page_table
    assert 0 <= st.ctx_committed <= st.ctx_len <= st.window, (
        st.ctx_committed,
        st.ctx_len,
        st.window,
    )
    assert len(positions) == st.ctx_len
    assert all(p >= 0 for p in positions)
    assert all(a < b for a, b in zip(positions, positions[1:])), positions
    assert len(table) == st.num_pages == ceil_div(st.ctx_committed, page_size), (
        table,
        st.ctx_committed,
        page_size,
    )
    st.check_invariants()
    score.invariant_checks += 2


def check_world(
    pool: blockdraft.BlockPool,
    live: Sequence[blockdraft.core.ContextState],
    extra_held: Iterable[int] = (),
) -> None:
    """Invariants 1-3: conservation, no page held twice or held while free, per-state shape.

    ``extra_held`` lists pages the test holds outside any state (raw ``pool.alloc`` results,
    pages of outstanding precompute plans).
    """
    pool.check_invariants()
    held: list[int] = list(extra_held)
    for st in live:
        assert not st.freed
        check_state(st, pool.page_size)
        held.extend(st.page_table)
    assert pool.num_free + pool.num_used == pool.num_pages
    assert pool.num_free + len(held) == pool.num_pages, (pool.num_free, len(held))
    assert len(set(held)) == len(held), f"a page is held twice: {sorted(held)}"
    assert all(0 <= b < pool.num_pages and pool.is_allocated(b) for b in held)
    score.invariant_checks += 4


# Every observable attribute of a SeqPages, in a fixed order.
SEQ_FIELDS: tuple[str, ...] = (
    "owner",
    "capacity",
    "page_size",
    "length",
    "pending",
    "pages",
    "num_pages",
    "freed",
)


def seq_snapshot(seq: blockdraft.core.SeqPages) -> tuple[Any, ...]:
    return tuple(
        tuple(v) if isinstance(v := getattr(seq, name), list) else v for name in SEQ_FIELDS
    )


def pages_snapshot(
    pool: blockdraft.BlockPool, seqs: Iterable[blockdraft.core.SeqPages] = ()
) -> tuple[Any, ...]:
    return (pool_snapshot(pool), tuple(seq_snapshot(s) for s in seqs))


def assert_seq_freed(seq: blockdraft.core.SeqPages) -> None:
    """A freed sequence holds nothing and counts nothing (its capacity and owner stay)."""
    assert seq.freed
    assert (seq.pages, seq.num_pages, seq.length, seq.pending) == ([], 0, 0, 0), seq
    seq.check_invariants()
    score.invariant_checks += 2


def check_seq(seq: blockdraft.core.SeqPages, page_size: int) -> None:
    """The shape of one live sequence: all its pages, distinct, and the counts in capacity."""
    assert not seq.freed
    pages = seq.pages
    assert len(pages) == seq.num_pages == ceil_div(seq.capacity, page_size), (
        pages,
        seq.capacity,
        page_size,
    )
    assert len(set(pages)) == len(pages), f"a page is held twice: {pages}"
    assert 0 <= seq.length and 0 <= seq.pending and seq.length + seq.pending <= seq.capacity
    assert seq.page_size == page_size
    seq.check_invariants()
    score.invariant_checks += 2


def check_pages_world(
    pool: blockdraft.BlockPool,
    live: Sequence[blockdraft.core.SeqPages],
    extra_held: Iterable[int] = (),
) -> None:
    """Invariants 1 and 2 with target sequences: conservation, no page held twice or while free;
    and every live sequence's shape."""
    pool.check_invariants()
    held: list[int] = list(extra_held)
    for seq in live:
        check_seq(seq, pool.page_size)
        held.extend(seq.pages)
    assert pool.num_free + len(held) == pool.num_pages, (pool.num_free, len(held))
    assert len(set(held)) == len(held), f"a page is held twice: {sorted(held)}"
    assert all(0 <= b < pool.num_pages and pool.is_allocated(b) for b in held)
    score.invariant_checks += 3
