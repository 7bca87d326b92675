"""The recompute after a window slide, on the graph path.

A slide resets ``ctx_committed`` to 0, so the next proposal's precompute plan covers every
kept row: more than a graph stages, so ``DraftForward.store_long_plans`` stores it before the
replay, through the graph path's fused steps in launches of fixed sizes. Checked here in fp32
on the tiny pair: the long store writes the plain store's K/V (plans of many lengths, several
sequences, every way a launch can be cut), and a run whose windows slide several times drafts
exactly what a plain-path proposer drafts from each window rebuilt from scratch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockdraft import DFlashProposer
from blockdraft.kernels import triton_available
from blockdraft.levers import Levers
from blockdraft.proposer.forward import LONG_STORE_SIZES, launch_sizes

from support.tinypair import drafter_config, tiny_drafter, tiny_target

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="Triton is not importable here"))]


@given(rows=st.integers(0, 5000))
def test_launch_sizes_cover_the_rows_with_fixed_sizes(rows: int) -> None:
    sizes = launch_sizes(rows)
    assert all(s in LONG_STORE_SIZES for s in sizes)
    assert sum(sizes) >= rows
    # Whole launches of the largest size, then one that holds the rest and no smaller one does.
    assert sizes[:-1] == [LONG_STORE_SIZES[-1]] * (len(sizes) - 1)
    rest = rows - LONG_STORE_SIZES[-1] * (len(sizes) - 1)
    if rows:
        assert rest > 0 and sizes[-1] == min(s for s in LONG_STORE_SIZES if s >= rest)
        # The padding is under half of the last launch (under 64 rows when that is small).
        assert sum(sizes) - rows < max(64, sizes[-1] // 2)
    else:
        assert sizes == []


def _proposer(drafter: Any, target: Any, graphs: str, backend: str = "torch",
              slide: float = 0.125) -> DFlashProposer:
    return DFlashProposer(drafter, target, max_seq_len=200, num_pages=120, page_size=4,
                          max_batch=4, graphs=graphs, backend=backend,  # type: ignore[arg-type]
                          levers=Levers(ctx_cap=0, slide=slide))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None)
@given(lens=st.lists(st.integers(1, 23), min_size=1, max_size=3),
       committed=st.lists(st.integers(0, 6), min_size=3, max_size=3))
def test_long_store_writes_the_plain_stores_kv(
    backend: str, lens: list[int], committed: list[int]
) -> None:
    """Plans of random lengths over up to three sequences (some rows already committed), in
    launches of 4 and 8 rows so that whole, spanning and padded launches all occur: the
    paged K/V and slot positions equal the plain store's."""
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    prop = _proposer(drafter, tiny_target(), "static", backend)
    fwd, cache = prop.forward, prop.forward.cache
    gen = torch.Generator().manual_seed(sum(lens) * 31 + sum(committed))
    states = [prop.alloc_state() for _ in lens]
    for st_, n, c in zip(states, lens, committed):
        c = min(c, n - 1)
        if c:
            # Rows with K/V already: the plan starts mid-page.
            prop.commit_ctx(st_, torch.randn(c, 64, generator=gen), range(c))
            prop.propose(st_, 1, c, 1)
        prop.commit_ctx(st_, torch.randn(n - c, 64, generator=gen), range(c, n))
    plans = [st_.ctx.plan_precompute() for st_ in states]
    items = list(zip(states, plans))
    base = (cache.k.clone(), cache.v.clone(), fwd.slot_pos.clone())
    fwd.store_plans(items)
    want = (cache.k.clone(), cache.v.clone(), fwd.slot_pos.clone())
    cache.k.copy_(base[0])
    cache.v.copy_(base[1])
    fwd.slot_pos.copy_(base[2])
    fwd.store_long_plans(items, sizes=(4, 8))
    torch.testing.assert_close(cache.k, want[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cache.v, want[1], atol=2e-5, rtol=1e-5)
    # Equal everywhere, so padding rows (slot PAD_SLOT) wrote nothing: a write through slot
    # -1 would land in the cache's last slot, which no plan here holds.
    assert torch.equal(fwd.slot_pos, want[2])
    assert max(s for plan in plans for s in plan.slots) < fwd.slot_pos.shape[0] - 1
    for st_, plan in items:
        st_.ctx.abort_precompute(plan)
        prop.free_state(st_)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_windows_draft_what_a_rebuilt_window_drafts(backend: str) -> None:
    """Two sequences whose windows (25 and 33 rows, slides leaving a quarter free) slide
    several times, drafted together on the graph path; after every step each sequence's drafts
    equal those of a plain-path proposer given that sequence's window rebuilt from the original
    rows. Every recompute after a slide went through ``store_long_plans`` (here in launches of
    4 and 8 rows, so each is cut into several)."""
    target = tiny_target()
    drafter = tiny_drafter(drafter_config(block=4, layers=2))
    prop = _proposer(drafter, target, "static", backend, slide=0.25)
    ref = _proposer(drafter, target, "off", "torch", slide=0.25)
    long_rows: list[int] = []
    long_store = prop.forward.store_long_plans

    def recording(items: Any) -> None:
        long_rows.extend(plan.row_end - plan.row_start for _, plan in items)
        # Launches of 4 and 8 rows: every recompute here is cut into several of them.
        long_store(items, (4, 8))

    prop.forward.store_long_plans = recording  # type: ignore[method-assign]
    data = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))
    states = [prop.alloc_state_for(20), prop.alloc_state_for(28)]
    assert [s.window for s in states] == [25, 33]
    assert [s.ctx.slide_room for s in states] == [6, 8]
    pos = [30, 40]  # prompts longer than the windows: the newest rows are kept
    for st_, p in zip(states, pos):
        prop.commit_ctx(st_, data[:p], range(p))
    slides = 0
    for step in range(14):
        tokens = [(7 * step + i) % 60 for i in range(2)]
        got = prop.propose_batch(states, tokens, list(pos), 3)
        assert got is not None
        for i, st_ in enumerate(states):
            assert st_.ctx_committed == st_.ctx_len
            fresh = ref.alloc_state_for(st_.ctx_len)
            kept = st_.ctx_positions
            ref.commit_ctx(fresh, data[kept], kept)
            assert ref.propose(fresh, tokens[i], pos[i], 3) == got[i], (step, i)
            ref.free_state(fresh)
            prop.after_verify(st_, 0)
            k = 1 + (step * 5 + i) % 4  # 1..B rows: accepted + 1
            before = st_.ctx_positions[0]
            prop.commit_ctx(st_, data[pos[i] : pos[i] + k], range(pos[i], pos[i] + k))
            pos[i] += k
            if st_.ctx_positions[0] != before:
                slides += 1
                assert st_.ctx_committed == 0
                assert st_.ctx_len == max(st_.window - st_.ctx.slide_room, k)
    assert slides >= 4
    # The first plans and every recompute after a slide: all longer than a graph stages.
    assert len(long_rows) >= 2 + slides
    assert min(long_rows) > 4
    for st_ in states:
        prop.free_state(st_)
    assert prop.pool.num_free == prop.pool.num_pages
