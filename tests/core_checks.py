"""Snapshots and TESTING.md invariants for the Rust core, shared by the suite.

``world_snapshot`` captures everything observable about a pool and a set of states, so a test can
assert that a declined or failed operation changed nothing (invariant 5) by comparing two
snapshots. ``check_world`` asserts invariants 1-3 and counts every check into the scorecard.

    before = world_snapshot(pool, states)
    with expect_clear_error(PoolExhaustedError):
        st.plan_precompute()
    assert world_snapshot(pool, states) == before
    check_world(pool, live_states, extra_held=raw_blocks)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import blockdraft
from scorecard import score

# Every observable attribute of a ContextState, in a fixed order.
STATE_FIELDS: tuple[str, ...] = (
    "owner",
    "window",
    "ctx_len",
    "ctx_committed",
    "ctx_positions",
    "block_table",
    "num_blocks",
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
    "block_table": [],
    "num_blocks": 0,
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


def state_snapshot(st: blockdraft.ContextState) -> tuple[Any, ...]:
    return tuple(
        tuple(v) if isinstance(v := getattr(st, name), list) else v for name in STATE_FIELDS
    )


def pool_snapshot(pool: blockdraft.BlockPool) -> tuple[Any, ...]:
    """Sizes, counters and the allocation bitmap (O(num_blocks): keep test pools small)."""
    return (
        pool.num_blocks,
        pool.block_size,
        pool.num_free,
        pool.num_used,
        tuple(pool.is_allocated(b) for b in range(pool.num_blocks)),
    )


def world_snapshot(
    pool: blockdraft.BlockPool, states: Iterable[blockdraft.ContextState] = ()
) -> tuple[Any, ...]:
    return (pool_snapshot(pool), tuple(state_snapshot(st) for st in states))


def assert_fresh(st: blockdraft.ContextState) -> None:
    """Invariant 6: every counter equals its value in a fresh state."""
    for name, want in FRESH_VALUES.items():
        got = getattr(st, name)
        assert got == want, f"{name} = {got!r} after free, fresh value is {want!r}"
    score.invariant_checks += 1


def check_state(st: blockdraft.ContextState, block_size: int) -> None:
    """Invariant 3 for one live state, from Python and from the core's own check."""
    positions = st.ctx_positions
    table = st.block_table
    assert 0 <= st.ctx_committed <= st.ctx_len <= st.window, (
        st.ctx_committed,
        st.ctx_len,
        st.window,
    )
    assert len(positions) == st.ctx_len
    assert all(p >= 0 for p in positions)
    assert all(a < b for a, b in zip(positions, positions[1:])), positions
    assert len(table) == st.num_blocks == ceil_div(st.ctx_committed, block_size), (
        table,
        st.ctx_committed,
        block_size,
    )
    st.check_invariants()
    score.invariant_checks += 2


def check_world(
    pool: blockdraft.BlockPool,
    live: Sequence[blockdraft.ContextState],
    extra_held: Iterable[int] = (),
) -> None:
    """Invariants 1-3: conservation, no block held twice or held while free, per-state shape.

    ``extra_held`` lists blocks the test holds outside any state (raw ``pool.alloc`` results,
    blocks of outstanding precompute plans).
    """
    pool.check_invariants()
    held: list[int] = list(extra_held)
    for st in live:
        assert not st.freed
        check_state(st, pool.block_size)
        held.extend(st.block_table)
    assert pool.num_free + pool.num_used == pool.num_blocks
    assert pool.num_free + len(held) == pool.num_blocks, (pool.num_free, len(held))
    assert len(set(held)) == len(held), f"a block is held twice: {sorted(held)}"
    assert all(0 <= b < pool.num_blocks and pool.is_allocated(b) for b in held)
    score.invariant_checks += 4
