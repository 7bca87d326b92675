"""BlockPool: all-or-nothing allocation, validated freeing, conservation (core invariants 1, 2, 5)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import blockdraft
from blockdraft import BlockPool, InvalidStateError, PoolExhaustedError

from support.core_checks import check_world, pool_snapshot
from support.scorecard import expect_clear_error, score


def test_fresh_pool_is_full() -> None:
    pool = BlockPool(7, 16)
    assert (pool.num_pages, pool.page_size) == (7, 16)
    assert (pool.num_free, pool.num_used) == (7, 0)
    assert not any(pool.is_allocated(b) for b in range(7))
    pool.check_invariants()


def test_alloc_returns_distinct_in_range_ids() -> None:
    pool = BlockPool(10, 4)
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert len(a) == 4 and len(b) == 6
    assert sorted(a + b) == list(range(10))
    assert all(pool.is_allocated(x) for x in a + b)
    assert (pool.num_free, pool.num_used) == (0, 10)
    check_world(pool, [], extra_held=a + b)


def test_alloc_zero_is_empty_and_changes_nothing() -> None:
    pool = BlockPool(3, 2)
    before = pool_snapshot(pool)
    assert pool.alloc(0) == []
    assert pool_snapshot(pool) == before


def test_alloc_more_than_free_changes_nothing() -> None:
    pool = BlockPool(5, 8)
    held = pool.alloc(3)
    before = pool_snapshot(pool)
    with expect_clear_error(PoolExhaustedError):
        pool.alloc(3)
    assert pool_snapshot(pool) == before
    # The two that are free are still usable: the failed call did not take them.
    rest = pool.alloc(2)
    assert sorted(held + rest) == list(range(5))


def test_is_allocated_out_of_range_is_false() -> None:
    pool = BlockPool(2, 1)
    pool.alloc(2)
    assert not pool.is_allocated(2)
    assert not pool.is_allocated(10**6)
    assert not pool.is_allocated(-1)


def test_free_then_realloc_round_trip() -> None:
    pool = BlockPool(4, 4)
    pages = pool.alloc(4)
    pool.free(pages[1:3])
    assert pool.num_free == 2
    assert not pool.is_allocated(pages[1]) and pool.is_allocated(pages[0])
    again = pool.alloc(2)
    assert sorted(again) == sorted(pages[1:3])
    pool.free(pages[:1] + again + pages[3:])
    assert pool.num_free == 4
    pool.check_invariants()


def test_free_empty_list_changes_nothing() -> None:
    pool = BlockPool(3, 4)
    pool.alloc(1)
    before = pool_snapshot(pool)
    pool.free([])
    assert pool_snapshot(pool) == before


@pytest.mark.parametrize("case", ["out of range", "not allocated", "listed twice", "negative id"])
def test_free_validates_everything_before_changing_anything(case: str) -> None:
    pool = BlockPool(6, 4)
    held = pool.alloc(3)
    free_id = next(b for b in range(6) if not pool.is_allocated(b))
    # A valid id first: a free that mutated before validating would release it.
    bad = {
        "out of range": [held[0], 99],
        "not allocated": [held[0], free_id],
        "listed twice": [held[0], held[1], held[0]],
        "negative id": [held[0], -1],
    }[case]
    before = pool_snapshot(pool)
    with expect_clear_error(InvalidStateError):
        pool.free(bad)
    assert pool_snapshot(pool) == before, case
    pool.check_invariants()


def test_double_free_across_calls_is_rejected() -> None:
    pool = BlockPool(3, 4)
    pages = pool.alloc(2)
    pool.free(pages[:1])
    before = pool_snapshot(pool)
    with expect_clear_error(InvalidStateError):
        pool.free(pages[:1])
    assert pool_snapshot(pool) == before


def test_exceptions_share_the_base() -> None:
    for exc in (
        blockdraft.PoolExhaustedError,
        blockdraft.InvalidStateError,
        blockdraft.CheckpointError,
        blockdraft.ConfigError,
    ):
        assert issubclass(exc, blockdraft.BlockdraftError)
    assert issubclass(blockdraft.ConfigError, ValueError)
    assert issubclass(blockdraft.BlockdraftError, Exception)


# A random program of allocations and frees (valid and invalid) against a Python model of the
# set of allocated ids.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 12)),
        st.tuples(st.just("free"), st.lists(st.integers(0, 40), max_size=5)),
        st.tuples(st.just("free_bad"), st.integers(-3, 40)),
    ),
    max_size=40,
)


@given(num_pages=st.integers(1, 24), page_size=st.integers(1, 64), ops=_ops)
def test_pool_matches_model(num_pages: int, page_size: int, ops: list[tuple[str, object]]) -> None:
    pool = BlockPool(num_pages, page_size)
    held: list[int] = []
    score.sequences += 1
    for kind, arg in ops:
        score.operations += 1
        before = pool_snapshot(pool)
        if kind == "alloc":
            assert isinstance(arg, int)
            if arg > pool.num_free:
                with pytest.raises(PoolExhaustedError):
                    pool.alloc(arg)
                assert pool_snapshot(pool) == before
            else:
                got = pool.alloc(arg)
                assert len(got) == arg
                assert not set(got) & set(held)
                held.extend(got)
        elif kind == "free":
            # Indices into what we hold, so frees are valid (duplicates removed).
            assert isinstance(arg, list)
            chosen = sorted({held[i % len(held)] for i in arg}) if held else []
            pool.free(chosen)
            held = [b for b in held if b not in chosen]
        else:
            assert isinstance(arg, int)
            if not (0 <= arg < num_pages) or arg not in held:
                with pytest.raises(InvalidStateError):
                    pool.free([arg])
                assert pool_snapshot(pool) == before
        check_world(pool, [], extra_held=held)
        assert {b for b in range(num_pages) if pool.is_allocated(b)} == set(held)
    pool.free(held)
    assert pool.num_free == num_pages
