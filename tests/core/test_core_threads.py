"""One BlockPool shared by many threads (the core releases the GIL in alloc/free).

Threads start together on a ``threading.Barrier`` and hammer the pool with raw allocations,
ContextState lifecycles and target sequences (``SeqPages``: creation, forwards, accepts,
``free_all``, and whole-step calls over sequences shared by every thread, in different orders).
A shared ownership set (updated before a free and after an alloc, so it never reports a false
double grant) catches a page handed to two owners at once; at the end the pool is exactly full
and consistent.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from blockdraft import BlockPool, PoolExhaustedError
from blockdraft.core import ContextState, SeqPages, accept_rows, free_all, plan_forward

from support.core_checks import check_pages_world, check_world
from support.scorecard import score

N_THREADS = 8


@pytest.fixture(autouse=True)
def eager_thread_switching() -> Iterator[None]:
    """Switch threads every few bytecodes, so they interleave between core calls too."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


class Ownership:
    """Pages currently granted to some owner, across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def grant(self, pages: list[int]) -> None:
        with self._lock:
            again = self._held.intersection(pages)
            assert not again, f"pages {sorted(again)} granted to two owners"
            assert len(set(pages)) == len(pages), f"one grant lists a page twice: {pages}"
            self._held.update(pages)

    def release(self, pages: list[int]) -> None:
        with self._lock:
            assert self._held.issuperset(pages)
            self._held.difference_update(pages)

    def empty(self) -> bool:
        with self._lock:
            return not self._held


@dataclass
class Tally:
    operations: int = 0
    sequences: int = 0
    exhausted: int = 0


def run_threads(worker: Callable[[int, threading.Barrier, Tally], None]) -> list[Tally]:
    barrier = threading.Barrier(N_THREADS)
    tallies = [Tally() for _ in range(N_THREADS)]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            worker(i, barrier, tallies[i])
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"pool-worker-{i}") for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), f"{t.name} hung"
    if errors:
        raise errors[0]
    for tally in tallies:
        score.operations += tally.operations
        score.sequences += tally.sequences
    return tallies


def test_shared_pool_raw_alloc_and_state_lifecycles() -> None:
    pool = BlockPool(48, 4)
    owned = Ownership()

    def worker(i: int, barrier: threading.Barrier, tally: Tally) -> None:
        rng = random.Random(1000 + i)
        mine: list[list[int]] = []
        barrier.wait()
        for _ in range(1500):
            tally.operations += 1
            action = rng.random()
            if action < 0.45:
                try:
                    got = pool.alloc(rng.randint(0, 5))
                except PoolExhaustedError:
                    tally.exhausted += 1
                    continue
                owned.grant(got)
                mine.append(got)
            elif action < 0.8:
                if mine:
                    group = mine.pop(rng.randrange(len(mine)))
                    owned.release(group)
                    pool.free(group)
            else:
                tally.sequences += 1
                state_lifecycle(pool, owned, rng, tally)
        for group in mine:
            owned.release(group)
            pool.free(group)
            tally.operations += 1

    tallies = run_threads(worker)
    assert owned.empty()
    assert pool.num_free == pool.num_pages
    check_world(pool, [])
    # The pool is small enough that contention really ran it dry at times.
    assert sum(t.exhausted for t in tallies) > 0


def state_lifecycle(pool: BlockPool, owned: Ownership, rng: random.Random, tally: Tally) -> None:
    window = rng.randint(1, 24)
    state = ContextState(pool, window)
    pos = 0
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, window)
        plan = state.plan_append(list(range(pos, pos + n)))
        pos += n + rng.randint(0, 2)
        if plan.slide is not None:
            owned.release(state.page_table)  # the slide hands them back inside apply_append
        state.apply_append(plan)
        tally.operations += 2
        try:
            pre = state.plan_precompute()
        except PoolExhaustedError:
            tally.exhausted += 1
            continue
        owned.grant(pre.new_pages)
        if rng.random() < 0.2:
            owned.release(pre.new_pages)
            state.abort_precompute(pre)
        else:
            state.confirm_precompute(pre)
        tally.operations += 2
    owned.release(state.page_table)
    assert state.free() is True
    tally.operations += 1


def test_threads_each_own_a_state_on_a_shared_pool() -> None:
    page_size = 2
    pool = BlockPool(40, page_size)
    states = [ContextState(pool, 10 + 2 * i, owner=i) for i in range(N_THREADS)]

    def worker(i: int, barrier: threading.Barrier, tally: Tally) -> None:
        rng = random.Random(2000 + i)
        state = states[i]
        expected: list[int] = []
        committed = 0
        barrier.wait()
        tally.sequences += 1
        for step in range(400):
            n = rng.randint(1, 4)
            new = list(range(3 * step, 3 * step + min(n, 3)))
            plan = state.plan_append(new)
            state.apply_append(plan)
            if plan.slide is not None:
                expected = expected[len(expected) - plan.slide.keep :]
                committed = 0
            expected += new
            tally.operations += 2
            try:
                pre = state.plan_precompute()
                state.confirm_precompute(pre)
                committed = len(expected)
                tally.operations += 2
            except PoolExhaustedError:
                tally.exhausted += 1
            # Only this thread touches this state: it must match exactly, whatever the others do.
            assert state.ctx_positions == expected
            assert state.ctx_committed == committed
            assert len(state.page_table) == -(-committed // page_size)
            state.check_invariants()
        assert state.free() is True

    run_threads(worker)
    assert pool.num_free == pool.num_pages
    check_world(pool, [])
    assert all(s.freed for s in states)


def test_threads_run_target_sequences_on_a_shared_pool() -> None:
    pool = BlockPool(48, 4)
    owned = Ownership()
    # Sequences every thread forwards and accepts, each call in its own order: whole-step calls
    # over overlapping sequences must neither deadlock nor lose a count.
    shared = [SeqPages(pool, 8, owner=99) for _ in range(4)]
    for seq in shared:
        owned.grant(seq.pages)

    def worker(i: int, barrier: threading.Barrier, tally: Tally) -> None:
        rng = random.Random(3000 + i)
        mine: list[SeqPages] = []
        barrier.wait()
        tally.sequences += 1
        for _ in range(600):
            tally.operations += 1
            action = rng.random()
            if action < 0.3:
                try:
                    seq = SeqPages(pool, rng.randint(1, 20), owner=i)
                except PoolExhaustedError:
                    tally.exhausted += 1
                    continue
                owned.grant(seq.pages)
                mine.append(seq)
            elif action < 0.6 and mine:
                call = rng.sample(mine, rng.randint(1, len(mine)))
                rows = [rng.randint(1, s.capacity - s.length) if s.length < s.capacity else 0
                        for s in call]
                call = [s for s, r in zip(call, rows) if r]
                rows = [r for r in rows if r]
                plan = plan_forward("forward", call, rows, i)
                assert plan.kv_lens == [s.length + r for s, r in zip(call, rows)]
                accept_rows("accept", call, [rng.randint(0, r) for r in rows], i)
            elif action < 0.75 and mine:
                gone = rng.sample(mine, rng.randint(1, len(mine)))
                for seq in gone:
                    owned.release(seq.pages)
                    mine.remove(seq)
                assert free_all("free", gone, i) == len(gone)
            else:
                order = rng.sample(shared, len(shared))
                plan_forward("forward", order, [1] * len(order), 99)
                accept_rows("accept", order, [0] * len(order), 99)
        for seq in mine:
            owned.release(seq.pages)
        assert free_all("free", mine, i) == len(mine)

    tallies = run_threads(worker)
    # only the shared sequences are left; they only ever accepted 0 of 1 pending row
    check_pages_world(pool, shared)
    assert all(s.length == 0 and s.pending in (0, 1) for s in shared)
    for seq in shared:
        owned.release(seq.pages)
    assert free_all("free", shared, 99) == len(shared)
    assert owned.empty() and pool.num_free == pool.num_pages
    check_world(pool, [])
    assert sum(t.exhausted for t in tallies) > 0
