"""Boundary fuzz of the Python bindings with hypothesis, and panics across the boundary.

Every entry point of ``blockdraft._core`` gets arguments from the edges: huge and negative
integers (beyond 64 bits too), NaN and infinite floats, empty and mixed lists, ``None``,
strings, bools. Each call must either succeed with a sane result or raise one of the documented
types (``TypeError``, ``ValueError``, a ``BlockdraftError``); never ``OverflowError``,
``SystemError`` or a Rust panic (``PanicException``, a ``BaseException``). After every call the
pool and the state still satisfy their invariants and nothing leaked.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blockdraft import BlockdraftError, BlockPool, InvalidStateError, _core, ctx_ceiling, ctx_window
from blockdraft.core import ContextState, batch_decline_reason, propose_batch_max, split_bands

from support.scorecard import score

ALLOWED = (TypeError, ValueError, BlockdraftError)

ints = st.one_of(
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**64)]),
)
floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(ints, floats, st.none(), st.booleans(), st.text(max_size=3))
int_lists = st.lists(ints, max_size=6)
lists = st.one_of(int_lists, st.lists(scalars, max_size=4), st.just([]), st.just([float("nan")]))
anything = st.one_of(scalars, lists)


def call(fn: Any, *args: Any) -> tuple[bool, Any]:
    """(ok, result-or-exception); anything outside the documented types fails the test."""
    score.bad_inputs += 1
    try:
        out = fn(*args)
    except ALLOWED as exc:
        assert not isinstance(exc, OverflowError), f"{fn.__name__}{args!r}: {exc!r}"
        assert str(exc), f"{fn.__name__}{args!r} raised {type(exc).__name__} without a message"
        score.clear_errors += 1
        return False, exc
    # A call that succeeded was not a bad input after all.
    score.bad_inputs -= 1
    return True, out


@given(m=anything, g=anything, b=anything, c=anything)
def test_window_functions(m: Any, g: Any, b: Any, c: Any) -> None:
    ok, w = call(ctx_window, m, g, b, c)
    if ok:
        assert isinstance(w, int) and 1 <= w <= m
        if isinstance(c, int) and c > 0:
            assert w <= c
    ok, w = call(ctx_ceiling, m, c)
    if ok:
        assert isinstance(w, int) and 1 <= w <= m


@given(batched=anything, width=anything, max_batch=anything, n=anything, a=anything, b=anything)
def test_batch_policy(batched: Any, width: Any, max_batch: Any, n: Any, a: Any, b: Any) -> None:
    ok, got = call(propose_batch_max, batched, width, max_batch)
    if ok:
        assert isinstance(got, int) and got >= 1
    ok, reason = call(batch_decline_reason, n, max_batch, batched, a, b)
    if ok:
        assert reason is None or isinstance(reason, str)


@given(tokens=lists, n=anything, block=anything, mask=anything, cap=anything)
def test_split_bands(tokens: Any, n: Any, block: Any, mask: Any, cap: Any) -> None:
    ok, bands = call(split_bands, tokens, n, block, mask, cap)
    if ok and bands is not None:
        assert len(bands) == n
        assert all(len(band) <= block for band in bands)


@given(num_pages=anything, page_size=anything)
def test_pool_constructor(num_pages: Any, page_size: Any) -> None:
    # Keep real pools small: the bookkeeping of a valid huge pool is really allocated.
    if isinstance(num_pages, int) and not isinstance(num_pages, bool) and 10_000 < num_pages < 2**36:
        num_pages = -num_pages
    ok, pool = call(BlockPool, num_pages, page_size)
    if ok:
        assert pool.num_free == pool.num_pages == num_pages and pool.page_size == page_size


@given(ops=st.lists(st.tuples(st.integers(0, 7), anything, anything), min_size=1, max_size=25))
def test_pool_and_state_methods(ops: list[tuple[int, Any, Any]]) -> None:
    pool = BlockPool(12, 4)
    state = ContextState(pool, 10, owner=3)
    held: list[list[int]] = []
    plan = None
    for op, x, y in ops:
        if op == 0:
            ok, got = call(pool.alloc, x)
            if ok:
                held.append(got)
        elif op == 1:
            ok, _ = call(pool.free, x)
            if ok:
                # Only ids this test holds can be freed; forget them.
                freed = set(x)
                held = [[b for b in h if b not in freed] for h in held]
        elif op == 2:
            ok, got = call(pool.is_allocated, x)
            if ok:
                assert isinstance(got, bool)
        elif op == 3:
            ok, ap = call(state.plan_append, x)
            if ok:
                state.apply_append(ap)
        elif op == 4:
            call(state.note_propose, x, y)
        elif op == 5:
            call(state.after_verify, x)
        elif op == 6:
            if plan is None:
                ok, plan = call(state.plan_precompute)
                if not ok:
                    plan = None
            else:
                state.abort_precompute(plan)
                plan = None
        else:
            call(ContextState, pool, x, y)
        pool.check_invariants()
        state.check_invariants()
        score.invariant_checks += 2
        score.operations += 1
    state.free()
    for h in held:
        pool.free(h)
    assert pool.num_free == pool.num_pages
    score.sequences += 1


@given(position=st.one_of(floats, st.integers(-(2**70), 2**70)), n=st.one_of(floats, ints))
def test_note_propose_edges(position: Any, n: Any) -> None:
    pool = BlockPool(2, 2)
    state = ContextState(pool, 4)
    ok, _ = call(state.note_propose, position, n)
    if ok:
        assert isinstance(position, int) and state.seq_len == position + 1
    elif isinstance(position, float) and math.isnan(position):
        assert state.seq_len == 0 and not state.prefill_done


def test_rust_panic_surfaces_as_python_exception() -> None:
    with pytest.raises(BaseException) as info:
        _core._panic_for_tests()
    # pyo3's PanicException derives from BaseException, so `except Exception` does not hide it.
    assert type(info.value).__name__ == "PanicException"
    assert not isinstance(info.value, Exception)
    assert "_panic_for_tests" in str(info.value)
    # The interpreter and the extension are fine afterwards.
    pool = BlockPool(3, 2)
    assert pool.alloc(2) == [0, 1]


def test_panic_under_the_pool_lock_poisons_only_that_pool() -> None:
    pool = BlockPool(4, 2)
    state = ContextState(pool, 4)
    state.apply_append(state.plan_append([0, 1, 2]))
    with pytest.raises(BaseException) as info:
        _core._panic_for_tests(pool)
    assert type(info.value).__name__ == "PanicException"
    # Every later use of the poisoned pool is a typed error, never a second panic or a hang.
    for use in (lambda: pool.alloc(1), pool.check_invariants, state.plan_precompute, state.free):
        score.bad_inputs += 1
        with pytest.raises(InvalidStateError, match="poisoned"):
            use()
        score.clear_errors += 1
    other = BlockPool(2, 2)
    assert other.alloc(2) == [0, 1]
