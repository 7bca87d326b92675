"""Threads driving proposers: separate proposers on one shared pool, and one proposer shared by
threads that each own their states (docs/RELIABILITY.md lists which calls are thread-safe).

Threads start together on a barrier and switch every few bytecodes. Each thread runs a seeded
lifecycle script (alloc -> commit -> (propose -> verify -> commit) x k -> free, with aborts);
with enough blocks for everyone, every draft must equal the one the same script produces alone
(so no thread ever read another's K/V or rows). With a tight pool, threads meet exhaustion and
retry; invariants hold throughout, and at the end the pool is exactly full.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from blockdraft import BlockPool, PoolExhaustedError
from blockdraft.proposer import DFlashProposer, DFlashState

from support.core_checks import check_world
from support.scorecard import score
from support.tinypair import K_H, tiny_drafter, tiny_target

N_THREADS = 4


@pytest.fixture(autouse=True)
def eager_thread_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    return tiny_target(), tiny_drafter()


def make(pair: tuple[Any, Any], pool: BlockPool | None = None, num_pages: int = 64) -> DFlashProposer:
    target, drafter = pair
    return DFlashProposer(
        drafter, target, max_seq_len=48, num_pages=num_pages, page_size=4,
        max_batch=4, backend="torch", pool=pool,
    )


def script(prop: DFlashProposer, seed: int, tally: list[int], on_exhausted: str = "raise") -> list[Any]:
    """One thread's lifecycles; returns everything it drafted. ``on_exhausted="retry"`` skips a
    proposal that found the pool dry (the state is unchanged) and carries on."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for _ in range(4):
        states: list[tuple[DFlashState, int]] = []
        for _ in range(rng.randint(1, 3)):
            st = prop.alloc_state_for(30)
            n = rng.randint(1, 9)
            prop.commit_ctx(st, torch.randn(n, K_H, generator=gen), range(n))
            states.append((st, n))
            tally[0] += 2
        for _step in range(rng.randint(1, 3)):
            nxt = []
            for st, pos in states:
                try:
                    drafts = prop.propose(st, rng.randrange(60), pos, 3)
                except PoolExhaustedError:
                    if on_exhausted == "raise":
                        raise
                    tally[1] += 1
                    nxt.append((st, pos))
                    continue
                out.append(drafts)
                acc = rng.randint(0, len(drafts))
                prop.after_verify(st, acc)
                prop.commit_ctx(st, torch.randn(acc + 1, K_H, generator=gen), range(pos, pos + acc + 1))
                tally[0] += 3
                nxt.append((st, pos + acc + 1))
            states = nxt
            if rng.random() < 0.3 and states:
                # Abort a sequence mid-life.
                prop.free_state(states.pop(rng.randrange(len(states)))[0])
        if len(states) >= 2 and prop.propose_batch_max() >= 2:
            got = prop.propose_batch([s for s, _ in states], [1] * len(states), [p for _, p in states], 2)
            if got is not None:
                out.append(got)
        for st, _ in states:
            prop.free_state(st)
            prop.free_state(st)  # idempotent
        tally[0] += len(states)
    return out


def run_threads(work: Callable[[int], Any]) -> list[Any]:
    barrier = threading.Barrier(N_THREADS)
    results: list[Any] = [None] * N_THREADS
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a proposer thread hung"
    if errors:
        raise errors[0]
    score.sequences += N_THREADS
    return results


def finish(pool: BlockPool, tallies: list[list[int]]) -> None:
    check_world(pool, [])
    assert pool.num_free == pool.num_pages, f"{pool.num_used} pages still held"
    score.operations += sum(t[0] for t in tallies)


def test_separate_proposers_on_one_pool_draft_as_if_alone(pair: tuple[Any, Any]) -> None:
    pool = BlockPool(96, 4)
    props = [make(pair, pool) for _ in range(N_THREADS)]
    tallies = [[0, 0] for _ in range(N_THREADS)]
    alone = [script(make(pair), 100 + i, [0, 0]) for i in range(N_THREADS)]
    together = run_threads(lambda i: script(props[i], 100 + i, tallies[i]))
    assert together == alone
    finish(pool, tallies)


def test_one_proposer_shared_by_threads_owning_their_states(pair: tuple[Any, Any]) -> None:
    prop = make(pair, num_pages=96)
    tallies = [[0, 0] for _ in range(N_THREADS)]
    alone = [script(make(pair), 200 + i, [0, 0]) for i in range(N_THREADS)]
    together = run_threads(lambda i: script(prop, 200 + i, tallies[i]))
    assert together == alone
    finish(prop.pool, tallies)


def test_tight_shared_pool_exhausts_and_recovers(pair: tuple[Any, Any]) -> None:
    """Fewer pages than the threads need at once: proposals meet PoolExhaustedError (nothing
    changes, the thread carries on), invariants hold, and the pool ends exactly full."""
    pool = BlockPool(6, 4)
    props = [make(pair, pool) for _ in range(N_THREADS)]
    tallies = [[0, 0] for _ in range(N_THREADS)]
    run_threads(lambda i: [script(props[i], 300 + i + 10 * r, tallies[i], "retry") for r in range(3)])
    assert sum(t[1] for t in tallies) > 0, "the pool never ran dry: the test is not tight"
    finish(pool, tallies)
