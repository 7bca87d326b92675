"""Fault injection: every allocation site x every position inside a proposal or a generate call.

For each scenario the suite first records how often each site of :mod:`blockdraft.faults` is hit
by one fault-free call; then, for every (site, n-th hit), it builds the same world afresh, arms
that one fault and runs the call again. Afterwards:

* a raised error is the injected one, and the pool and every state (core bookkeeping,
  accumulator rows, device page table) are byte-identical to before (TESTING.md invariant 5);
* a ``propose_batch`` that swallowed the fault declined (``None``) and also changed nothing;
* a ``generate`` that absorbed the fault (a batch declined, the per-sequence path took over)
  returned exactly the fault-free tokens;
* the next, fault-free call returns exactly the fault-free result (no corrupt K/V or
  accumulator rows), and once every state is freed the pool is exactly full (no leaked page).

Each (scenario, site, hit) is one ``score.fault_points``; pages missing from the pool at the end
go to ``score.leaked_pages`` (and fail the test).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from blockdraft import PoolExhaustedError, faults
from blockdraft.engine import SpeculativeEngine
from blockdraft.proposer import DFlashProposer, DFlashState

from support.core_checks import check_world
from support.scorecard import score
from support.tinypair import K_H, drafter_config, tiny_drafter

BLOCK = 4  # paged block size of these worlds


@pytest.fixture(scope="module")
def drafter() -> Any:
    # Two layers: two attention kernels per forward, so faults land between kernels too.
    return tiny_drafter(drafter_config(block=4, layers=2))


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, K_H, generator=torch.Generator().manual_seed(seed))


def snapshot(prop: DFlashProposer, states: list[DFlashState]) -> Any:
    """Everything a failed call must leave alone: the pool's bitmap and each state in full."""
    pool = prop.pool
    return (
        pool.num_free,
        tuple(pool.is_allocated(b) for b in range(pool.num_pages)),
        [
            (
                s.freed,
                s.ctx_len,
                s.ctx_committed,
                tuple(s.ctx_positions),
                tuple(s.page_table),
                s.seq_len,
                s.prefill_done,
                s.last_num_drafted,
                s.last_num_accepted,
                None if s.acc is None else s.acc.clone(),
                None if s.page_table_dev is None else s.page_table_dev.clone(),
            )
            for s in states
        ],
    )


def same(a: Any, b: Any) -> bool:
    if a[:2] != b[:2] or len(a[2]) != len(b[2]):
        return False
    for x, y in zip(a[2], b[2]):
        if x[:9] != y[:9]:
            return False
        for tx, ty in zip(x[9:], y[9:]):
            if (tx is None) != (ty is None) or (tx is not None and not torch.equal(tx, ty)):
                return False
    return True


@dataclass
class World:
    prop: DFlashProposer
    states: list[DFlashState]
    anchors: list[int]
    positions: list[int]


def free_all_and_count_leaks(world: World) -> None:
    """Free every state; the pool must be exactly full (invariant 7)."""
    live = [s.ctx for s in world.states if not s.freed]
    check_world(world.prop.pool, live)
    for s in world.states:
        world.prop.free_state(s)
    pool = world.prop.pool
    pool.check_invariants()
    leaked = pool.num_used
    score.leaked_pages += leaked
    assert leaked == 0 and pool.num_free == pool.num_pages, f"{leaked} pages leaked"
    score.invariant_checks += 1


def make_world(drafter: Any, target: Any, n: int, **kw: Any) -> World:
    """``n`` states with different context lengths; odd ones already proposed once, so a
    proposal takes new pages for some sequences and none for others."""
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("num_pages", 8 * 12)
    prop = DFlashProposer(
        drafter, target, page_size=BLOCK, max_batch=8, backend="torch", **kw
    )
    states, anchors, positions = [], [], []
    for i in range(n):
        st = prop.alloc_state_for(40)
        length = 3 + 2 * i
        prop.commit_ctx(st, rows(length, 100 + i), range(length))
        if i % 2:
            prop.propose(st, 5, length, 2)
            prop.after_verify(st, 1)
            prop.commit_ctx(st, rows(2, 200 + i), [length, length + 1])
            length += 2
        states.append(st)
        anchors.append((7 * i + 3) % 60)
        positions.append(length)
    return World(prop, states, anchors, positions)


def sweep(
    build: Callable[[], World],
    act: Callable[[World], Any],
    *,
    declines: bool = False,
    absorbs: bool = False,
    unchanged: bool = True,
) -> int:
    """Inject a fault at every hit of every site that one ``act`` reaches; returns the number of
    injection points. ``declines``: ``act`` may swallow a fault by returning ``None``;
    ``absorbs``: it may swallow a fault and still return the fault-free result."""
    world = build()
    with faults.record() as rec:
        reference = act(world)
    assert reference is not None
    free_all_and_count_leaks(world)
    points = [(site, k) for site in faults.SITES for k in range(1, rec.hits[site] + 1)]
    assert points, "the call reached no fault site"
    for site, k in points:
        world = build()
        before = snapshot(world.prop, world.states)
        with faults.inject(site, k) as plan:
            try:
                out = act(world)
                raised: BaseException | None = None
            except Exception as exc:  # noqa: BLE001 - inspected below
                raised = exc
        assert plan.fired, (site, k)
        if raised is not None:
            assert "fault injection" in str(raised), (site, k, raised)
        elif out is None:
            assert declines, f"{site} #{k}: declined"
        else:
            assert absorbs, f"{site} #{k}: the fault vanished"
            assert out == reference, (site, k)
        if unchanged and (raised is not None or out is None):
            assert same(before, snapshot(world.prop, world.states)), f"{site} #{k} changed state"
            score.invariant_checks += 1
        # The next call is unaffected by the fault.
        assert act(world) == reference, f"after {site} #{k}"
        free_all_and_count_leaks(world)
        score.fault_points += 1
        score.sequences += 1
    return len(points)


@pytest.mark.parametrize("n", range(2, 9))
def test_propose_batch_every_site_every_position(drafter: Any, target: Any, n: int) -> None:
    def act(w: World) -> Any:
        return w.prop.propose_batch(w.states, w.anchors, w.positions, 3)

    points = sweep(lambda: make_world(drafter, target, n), act, declines=True)
    # One pool allocation per sequence, at least: every position in the batch was hit.
    assert points >= n + 5


@pytest.mark.parametrize("n", [2, 5, 8])
def test_graph_path_every_site_every_position(drafter: Any, target: Any, n: int) -> None:
    """The CUDA-graph path's buffers (``graphs="static"``: the same staging, metadata and fused
    forward, run eagerly on the CPU) under the same sweep: its K/V staging and forward sites
    decline without touching the pool or any state."""

    def act(w: World) -> Any:
        return w.prop.propose_batch(w.states, w.anchors, w.positions, 3)

    points = sweep(lambda: make_world(drafter, target, n, graphs="static"), act, declines=True)
    assert points >= n + 2


def test_propose_batch_without_batched_precompute(
    drafter: Any, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-sequence precompute: a decline may keep the ctx K/V already written (documented), so
    states need not be identical, but nothing leaks and the next call is exact."""
    monkeypatch.setenv("BLOCKDRAFT_DFLASH_BATCHED_PRECOMPUTE", "0")

    def act(w: World) -> Any:
        return w.prop.propose_batch(w.states, w.anchors, w.positions, 3)

    sweep(lambda: make_world(drafter, target, 4), act, declines=True, unchanged=False)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["never-proposed", "proposed", "fresh-rows"])
def test_propose_with_bitmask_every_site(drafter: Any, target: Any, which: int) -> None:
    mask = torch.full((2,), -1, dtype=torch.int32)  # ceil(64/32) words
    mask[0] = 0x0F0F0F0F

    def act(w: World) -> Any:
        return w.prop.propose(w.states[which], w.anchors[which], w.positions[which], 3, mask)

    sweep(lambda: make_world(drafter, target, 3), act)


def _slid_world(drafter: Any, target: Any, slide_now: bool) -> World:
    """Two ordinary states and a 6-row state with 5 rows and K/V (the last one); with
    ``slide_now`` the last state has already slid (its K/V is to be recomputed)."""
    w = make_world(drafter, target, 2)
    st = w.prop.alloc_state_for(1)  # a 6-row window
    w.prop.commit_ctx(st, rows(5, 7), range(5))
    w.prop.propose(st, 1, 5, 3)
    if slide_now:
        w.prop.commit_ctx(st, rows(3, 8), range(5, 8))
    w.states.append(st)
    return w


def test_commit_that_slides_every_site(drafter: Any, target: Any) -> None:
    """The accumulator staging of an append that slides the window (5 + 3 rows > 6)."""

    def act(w: World) -> Any:
        st = w.states[-1]
        w.prop.commit_ctx(st, rows(3, 8), range(5, 8))
        assert st.acc is not None
        return tuple(st.ctx_positions), st.acc.tolist()

    sweep(lambda: _slid_world(drafter, target, False), act)


def test_batch_commit_with_a_slide_every_site(drafter: Any, target: Any) -> None:
    """``commit_ctx_batch`` over three states, the last one sliding (5 + 3 rows > 6): a fault
    leaves every state as it was, and the next call commits exactly."""

    def act(w: World) -> Any:
        w.prop.commit_ctx_batch(
            w.states, rows(5, 10), [[w.positions[0]], [w.positions[1]], [5, 6, 7]]
        )
        return [(tuple(s.ctx_positions), s.acc.tolist() if s.acc is not None else None)
                for s in w.states]

    sweep(lambda: _slid_world(drafter, target, False), act)


@pytest.mark.parametrize("slides", [False, True], ids=["deferred", "sliding"])
def test_committing_every_site(drafter: Any, target: Any, slides: bool) -> None:
    """``committing`` with its writes deferred to the end of the block, and with a state that
    slides (written at once): a fault leaves every state as it was (the core records nothing
    before every allocation is made), and the next call commits exactly."""

    def act(w: World) -> Any:
        last = [5, 6, 7] if slides else [5]
        with w.prop.committing(w.states, rows(2 + len(last), 10), [[w.positions[0]], [w.positions[1]], last]):
            pass
        return [(tuple(s.ctx_positions), s.acc.tolist() if s.acc is not None else None)
                for s in w.states]

    sweep(lambda: _slid_world(drafter, target, False), act)


def test_batch_commit_with_two_slides_every_site(drafter: Any, target: Any) -> None:
    """``commit_ctx_batch`` where two states slide: an allocation failing at the second
    slide's copy must not leave the first state's accumulator slid (the core would still
    describe its old rows)."""

    def build() -> World:
        w = _slid_world(drafter, target, False)
        st = w.prop.alloc_state_for(1)  # a second 6-row window, 5 rows with K/V
        w.prop.commit_ctx(st, rows(5, 11), range(5))
        w.prop.propose(st, 1, 5, 3)
        w.states.append(st)
        return w

    def act(w: World) -> Any:
        w.prop.commit_ctx_batch(w.states[2:], rows(6, 12), [[5, 6, 7], [5, 6, 7]])
        return [(tuple(s.ctx_positions), s.acc.tolist() if s.acc is not None else None)
                for s in w.states]

    points = sweep(build, act)
    assert points >= 3  # the staging and each slide's copy


def test_propose_after_slide_every_site(drafter: Any, target: Any) -> None:
    def act(w: World) -> Any:
        return w.prop.propose(w.states[-1], 2, 8, 3)

    sweep(lambda: _slid_world(drafter, target, True), act)


def test_alloc_and_first_commit_every_site(drafter: Any, target: Any) -> None:
    def act(w: World) -> Any:
        fresh = w.prop.alloc_state_for(10)
        w.prop.commit_ctx(fresh, rows(2, 9), [0, 1])
        w.states.append(fresh)  # only once whole: a failed call leaves the world as it was
        return fresh.window, tuple(fresh.ctx_positions)

    sweep(lambda: make_world(drafter, target, 2), act)


def test_real_pool_exhaustion_at_every_batch_position(drafter: Any, target: Any) -> None:
    """Not simulated: the pool really runs dry at sequence i of the batch."""
    n = 6
    ref_world = make_world(drafter, target, n)
    need = []
    for st in ref_world.states:
        need.append(-(-st.ctx_len // BLOCK) - len(st.page_table))
    reference = ref_world.prop.propose_batch(ref_world.states, ref_world.anchors, ref_world.positions, 3)
    assert reference is not None
    free_all_and_count_leaks(ref_world)
    for i in range(n):
        if need[i] == 0:
            continue
        w = make_world(drafter, target, n)
        pool = w.prop.pool
        hold = pool.alloc(pool.num_free - (sum(need[:i]) + need[i] - 1))
        before = snapshot(w.prop, w.states)
        assert w.prop.propose_batch(w.states, w.anchors, w.positions, 3) is None
        assert same(before, snapshot(w.prop, w.states))
        # Alone, sequence i finds the blocks its predecessors would have taken: hold those too.
        more = pool.alloc(sum(need[:i]))
        with pytest.raises(PoolExhaustedError):
            w.prop.propose(w.states[i], w.anchors[i], w.positions[i], 3)
        pool.free(more)
        assert same(before, snapshot(w.prop, w.states))
        pool.free(hold)
        assert w.prop.propose_batch(w.states, w.anchors, w.positions, 3) == reference
        free_all_and_count_leaks(w)
        score.fault_points += 1
        score.invariant_checks += 2


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("graphs", ["auto", "static"])
def test_generate_every_site_every_position(drafter: Any, target: Any, graphs: str) -> None:
    """Faults anywhere inside a multi-prompt generate: it either raises the injected error with
    every state freed, or (a batched proposal declined) finishes with the exact tokens. With
    the graph paths' buffers (``static``) the drafts stay on the device and each step's
    successor drafts are launched before its bookkeeping, so a fault may hit drafts launched
    ahead."""
    engine = SpeculativeEngine(
        target, drafter, max_seq_len=64, num_pages=4 * 8, max_batch=4, page_size=BLOCK, graphs=graphs
    )
    assert engine.draft_ahead == (graphs == "static")
    pool = engine.proposer.pool

    def run() -> list[list[int]]:
        return engine.generate(PROMPTS, max_new_tokens=5).tokens

    with faults.record() as rec:
        reference = run()
    points = [(site, k) for site in faults.SITES for k in range(1, rec.hits[site] + 1)]
    # The graph paths' attention runs inside their forwards' fault site ("forward").
    assert {"target_forward", "target_pages", "workspace", "pool_pages", "accumulator"} <= set(rec.hits)
    assert ("attention" in rec.hits) == (graphs == "auto")
    assert engine.target_runtime == "blockdraft"
    absorbed = 0
    for site, k in points:
        with faults.inject(site, k) as plan:
            try:
                out = run()
            except Exception as exc:  # noqa: BLE001 - inspected below
                assert "fault injection" in str(exc), (site, k, exc)
            else:
                assert out == reference, (site, k)
                absorbed += 1
        assert plan.fired
        pool.check_invariants()
        leaked = pool.num_used + engine.pages_used()["target"]
        score.leaked_pages += leaked
        assert leaked == 0, f"{site} #{k}: {leaked} drafter / target pages leaked"
        score.fault_points += 1
        score.invariant_checks += 2
    # The batched path declined (and the per-sequence path recovered) at least once.
    assert absorbed > 0
    assert run() == reference


def test_switch_is_off_and_arms_one_plan_at_a_time() -> None:
    assert not faults.active()
    faults.hit("pool_pages")  # off: nothing happens
    with faults.inject("kv_cache", 2) as plan:
        faults.hit("kv_cache")
        with pytest.raises(torch.OutOfMemoryError, match="fault injection"):
            faults.hit("kv_cache")
        faults.hit("kv_cache")  # fires once only
        assert plan.fired and plan.hits["kv_cache"] == 3
        with pytest.raises(RuntimeError, match="already armed"), faults.record():
            pass
    assert not faults.active()
    with pytest.raises(ValueError, match="site"), faults.inject("nowhere", 1):
        pass
    with pytest.raises(ValueError, match="nth"), faults.inject("forward", 0):
        pass
