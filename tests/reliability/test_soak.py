"""Lifecycle soak: alloc -> commit -> (propose -> verify -> commit) x k -> free, many times over,
with random aborts, real pool exhaustion and injected faults, ending with the pool exactly full.

Up to ``LIVE`` sequences are in flight at once and their steps interleave at random, so pages
are freed and re-taken in every order. Each cycle is one sequence's whole life; it ends in
``free_state`` after its k-th verify, or earlier by an abort (1 in 40 steps, or whenever the pool
is dry). 1 step in 100 arms a random fault site (:mod:`blockdraft.faults`) first; a failed step
must leave the state as it was, so the sequence carries on.

On the CPU, where a drafter forward costs milliseconds, the 100,000-cycle run replaces the
drafter forward of most proposals by a stand-in that only confirms the core's plans (every
piece of proposer and core bookkeeping still runs: accumulator writes, plans, confirms, aborts,
frees); ``real_every`` proposals run the real drafter (torch backend). The GPU variants run
the real Triton path for every proposal, with injected faults on a build with the extension's
test hooks and without them on any build (a release wheel has none):

    BLOCKDRAFT_SOAK_CYCLES=100000 python -m pytest tests/reliability/test_soak.py -m gpu -s
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from blockdraft import PoolExhaustedError, _core, faults
from blockdraft.proposer import DFlashProposer, DFlashState, Proposal

from support.core_checks import check_world
from support.scorecard import score
from support.tinypair import K_H, tiny_drafter, tiny_target

LIVE = 8
VOCAB = 64
# Without injected faults the 40-page pool seldom runs dry (none in 5,000 cycles of seed 3);
# 24 pages keep real pool exhaustion in the soak.
NO_FAULT_PAGES = 24


@dataclass
class Seq:
    state: DFlashState
    pos: int
    steps_left: int


@dataclass
class SoakReport:
    cycles: int = 0
    aborts: int = 0
    exhausted: int = 0
    faults: int = 0
    proposals: int = 0
    real_proposals: int = 0
    batched: int = 0
    operations: int = 0
    seconds: float = 0.0


def soak(
    cycles: int,
    *,
    device: str = "cpu",
    backend: str = "torch",
    real_every: int = 1,
    num_pages: int = 40,
    seed: int = 0,
    fault_rate: float = 0.01,
) -> SoakReport:
    """Run ``cycles`` sequence lifecycles on one proposer; returns what happened.

    ``fault_rate`` is the share of steps that arm a fault first; ``0`` arms none, so the soak
    runs on a build of the extension without test hooks.
    """
    target = tiny_target().to(device)
    drafter = tiny_drafter().to(device)
    prop = DFlashProposer(
        drafter, target, max_seq_len=64, num_pages=num_pages, page_size=4,
        max_batch=LIVE, backend=backend,  # type: ignore[arg-type]
    )
    rep = SoakReport()
    rng = random.Random(seed)
    real_run = prop.forward.run
    calls = [0]

    def run(proposal: Proposal, take: int, mask: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] % real_every == 0:
            rep.real_proposals += len(proposal.plans)
            return real_run(proposal, take, mask)
        # drafts without the forward; the proposer confirms and notes them as after a real one
        return torch.tensor([[(tok + 1 + j) % VOCAB for j in range(take)] for tok in proposal.tokens],
                            dtype=torch.int64, device=device)

    prop.forward.run = run  # type: ignore[method-assign]
    runner = prop.graph_runner
    if runner is not None:
        # On CUDA the graph path drafts without forward.run: its drafts are real ones too.
        graph_draft = runner.draft

        def counted(proposal: Proposal) -> torch.Tensor | None:
            got = graph_draft(proposal)
            if got is not None:
                rep.real_proposals += len(proposal.plans)
            return got

        runner.draft = counted  # type: ignore[method-assign]
    rows = torch.randn(64, K_H, device=device)
    live: list[Seq] = []
    # Only the proposer's sites: one the soak never reaches would make an armed step a no-op.
    sites = faults.PROPOSER_SITES
    start = time.perf_counter()

    def end(seq: Seq, aborted: bool) -> None:
        prop.free_state(seq.state)
        live.remove(seq)
        rep.cycles += 1
        rep.aborts += aborted
        rep.operations += 1

    def guarded(seq: Seq, fn: Any) -> bool:
        """Run one step, sometimes under an injected fault; False when it failed cleanly."""
        armed = rng.random() < fault_rate
        before = (seq.state.ctx_len, seq.state.ctx_committed, seq.state.page_table)
        try:
            if armed:
                with faults.inject(rng.choice(sites), 1):
                    fn()
            else:
                fn()
        except PoolExhaustedError:
            rep.exhausted += 1
        except RuntimeError as exc:
            assert armed and "fault injection" in str(exc), exc
            rep.faults += 1
        else:
            return True
        assert (seq.state.ctx_len, seq.state.ctx_committed, seq.state.page_table) == before
        return False

    while rep.cycles < cycles:
        if len(live) < LIVE and (not live or rng.random() < 0.3):
            st = prop.alloc_state_for(48)
            n = rng.randint(1, 20)
            prop.commit_ctx(st, rows[:n], range(n))
            live.append(Seq(st, n, rng.randint(1, 4)))
            rep.operations += 2
            continue
        if len(live) >= 3 and rng.random() < 0.1:
            group = rng.sample(live, rng.randint(2, len(live)))
            got = prop.propose_batch(
                [s.state for s in group], [s.pos % VOCAB for s in group], [s.pos for s in group], 3
            )
            rep.operations += 1
            if got is not None:
                rep.batched += 1
                for s, d in zip(group, got):
                    assert len(d) <= 3
                    prop.after_verify(s.state, rng.randint(0, len(d)))
            continue
        seq = rng.choice(live)
        if rng.random() < 1 / 40:
            end(seq, aborted=True)
            continue
        drafts: list[int] = []

        def step(seq: Seq = seq, drafts: list[int] = drafts) -> None:
            drafts[:] = prop.propose(seq.state, seq.pos % VOCAB, seq.pos, 3)

        rep.operations += 1
        if not guarded(seq, step):
            if rng.random() < 0.5:
                end(seq, aborted=True)  # give up on it: an abort with K/V held
            continue
        rep.proposals += 1
        acc = rng.randint(0, len(drafts))
        prop.after_verify(seq.state, acc)
        n = acc + 1

        def commit(seq: Seq = seq, n: int = n) -> None:
            prop.commit_ctx(seq.state, rows[:n], range(seq.pos, seq.pos + n))

        rep.operations += 2
        if guarded(seq, commit):
            seq.pos += n
        seq.steps_left -= 1
        if seq.steps_left == 0:
            end(seq, aborted=False)
        if rep.cycles % 500 == 0:
            check_world(prop.pool, [s.state.ctx for s in live])
    for seq in list(live):
        prop.free_state(seq.state)
    prop.pool.check_invariants()
    assert prop.pool.num_free == prop.pool.num_pages, f"{prop.pool.num_used} pages leaked"
    score.leaked_pages += prop.pool.num_used
    score.sequences += rep.cycles
    score.operations += rep.operations
    score.fault_points += rep.faults
    score.invariant_checks += 2
    rep.seconds = time.perf_counter() - start
    return rep


def _check(rep: SoakReport, cycles: int, *, with_faults: bool = True) -> None:
    assert rep.cycles == cycles
    # Every kind of event happened, so the soak exercised what it claims.
    assert rep.aborts > 0 and rep.exhausted > 0 and (rep.faults > 0) == with_faults
    assert rep.batched > 0 and rep.real_proposals > 0


def needs_test_hooks() -> None:
    """Skip the calling test unless the extension has its test hooks, which arming a fault needs."""
    if not _core.TEST_HOOKS:
        pytest.skip("this build of blockdraft._core has no test hooks (a release wheel): the soak "
                    "with injected faults needs `--features test-hooks`; the soak without faults "
                    "runs on this build")


def test_soak_short() -> None:
    """A short soak with the real drafter on every tenth proposal (every CI run)."""
    rep = soak(1_500, real_every=10, seed=1)
    _check(rep, 1_500)


@pytest.mark.slow
def test_soak_100k_lifecycles() -> None:
    cycles = int(os.environ.get("BLOCKDRAFT_SOAK_CYCLES", "100000"))
    # BLOCKDRAFT_SOAK_REAL_EVERY=1 runs the real torch drafter on every proposal (an on-demand
    # run of about an hour on a 2-core CPU; the CI default keeps the soak within minutes).
    real_every = int(os.environ.get("BLOCKDRAFT_SOAK_REAL_EVERY", "200"))
    rep = soak(cycles, real_every=real_every, seed=2)
    _check(rep, cycles)
    print(f"\nsoak (cpu, torch): {rep}")


def test_the_fault_soak_skips_on_a_build_without_test_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_core, "TEST_HOOKS", False)
    with pytest.raises(pytest.skip.Exception, match="no test hooks.*--features test-hooks"):
        needs_test_hooks()
    monkeypatch.setattr(_core, "TEST_HOOKS", True)
    needs_test_hooks()


def test_a_soak_without_faults_arms_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the release-wheel GPU soak does, on the CPU: it never reaches the test hooks."""
    monkeypatch.setattr(_core, "TEST_HOOKS", False)
    rep = soak(300, real_every=10, num_pages=NO_FAULT_PAGES, seed=1, fault_rate=0.0)
    _check(rep, 300, with_faults=False)


@pytest.mark.gpu
@pytest.mark.slow
def test_soak_gpu_triton() -> None:
    """Every proposal runs the real drafter through the Triton kernels, with injected faults."""
    needs_test_hooks()
    cycles = int(os.environ.get("BLOCKDRAFT_SOAK_CYCLES", "100000"))
    rep = soak(cycles, device="cuda", backend="triton", real_every=1, seed=3)
    _check(rep, cycles)
    print(f"\nsoak (cuda, triton): {rep}")


@pytest.mark.gpu
@pytest.mark.slow
def test_soak_gpu_triton_without_faults() -> None:
    """The same soak with no fault armed: it runs on a release wheel."""
    cycles = int(os.environ.get("BLOCKDRAFT_SOAK_CYCLES", "100000"))
    rep = soak(cycles, device="cuda", backend="triton", real_every=1, num_pages=NO_FAULT_PAGES, seed=3,
               fault_rate=0.0)
    _check(rep, cycles, with_faults=False)
    print(f"\nsoak (cuda, triton, no faults): {rep}")
