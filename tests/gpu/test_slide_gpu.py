"""The recompute after a window slide on the GPU: ``DraftForward.store_long_plans`` (the graph
path's fused steps, Triton kernels, launches of fixed sizes) against the plain store, and a run
whose windows slide several times against windows rebuilt from scratch (GPU only).

The long store is compared on the stored K/V, by the parity tests' normwise relative error
(max |got - want| / max |want|): against one fused launch over all rows (the same math; only
the GEMMs' row counts differ) within the kernel tests' bf16 tolerance, and against the plain
store (whose context fusion rounds differently) within the parity tests' forward bound. Drafts
are compared token for token in fp32 only (bf16 logits tie too often for exact tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import DFlashProposer
from blockdraft import pair as bd_pair
from blockdraft.levers import Levers

pytestmark = pytest.mark.gpu

# Normwise relative error allowed against one fused launch / against the plain store.
ONE_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
PLAIN_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

SHAPE = bd_pair.Shape("gpu-test", 6, 256, 8, 2, 32, 512, 4096, 2, (1, 4), 8, 4095)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN anywhere fails: an unwritten slot)."""
    diff = (got.double() - want.double()).abs().max()
    return float(diff / want.double().abs().max().clamp_min(1e-30))


def _proposer(drafter: Any, target: Any, graphs: str, slide: float = 0.125) -> DFlashProposer:
    return DFlashProposer(drafter, target, max_seq_len=4096, num_pages=1200, page_size=16,
                          max_batch=4, graphs=graphs,  # type: ignore[arg-type]
                          levers=Levers(ctx_cap=0, slide=slide))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_store_equals_the_plain_store(dtype: torch.dtype) -> None:
    """Plans of 1750, 3000, 70 and 1024 rows (whole, spanning and padded launches; a slide's
    recompute is such a plan) stored in fixed-size launches: the K/V of one fused launch over
    all rows and of the plain store within tolerance, the same slot positions exactly, and no
    other slot written."""
    dev = torch.device("cuda")
    target = bd_pair.random_target(SHAPE, dev, dtype)
    drafter = bd_pair.random_drafter(SHAPE, dev, dtype)
    prop = _proposer(drafter, target, "capture")
    fwd, cache = prop.forward, prop.forward.cache
    gen = torch.Generator(device=dev).manual_seed(17)
    states = []
    for n in (1750, 3000, 70, 1024):
        st = prop.alloc_state()
        prop.commit_ctx(st, torch.randn(n, SHAPE.ctx_row_width, generator=gen, device=dev,
                                        dtype=dtype), range(n))
        states.append(st)
    plans = [st.ctx.plan_precompute() for st in states]
    items = list(zip(states, plans))
    slot_list = [s for p in plans for s in p.slots]
    slots = torch.tensor(slot_list, device=dev)

    def at_slots(t: torch.Tensor) -> torch.Tensor:
        # [L, pages, page_size, Hkv, D] -> [L, slots, Hkv, D]
        return t.flatten(1, 2)[:, slots]

    def stored(store: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache.k.fill_(float("nan"))  # an unwritten slot fails the comparisons
        cache.v.fill_(float("nan"))
        fwd.slot_pos.fill_(-7)
        store()
        torch.cuda.synchronize()
        return cache.k.clone(), cache.v.clone(), fwd.slot_pos.clone()

    plain = stored(lambda: fwd.store_plans(items))
    rows = torch.cat([st.acc[p.row_start : p.row_end] for st, p in items])  # type: ignore[index]
    pos = torch.tensor([q for p in plans for q in p.positions], device=dev)
    one = stored(lambda: fwd.write_ctx_kv(rows, pos, slots, fused=True))
    got = stored(lambda: fwd.store_long_plans(items))
    for name, i in (("K", 0), ("V", 1)):
        for ref, tol, what in ((one, ONE_TOL, "one fused launch"), (plain, PLAIN_TOL, "the plain store")):
            err = _rel_err(at_slots(got[i]), at_slots(ref[i]))
            assert err <= tol[dtype], f"{name} against {what}: rel err {err:.3g}"
        # Slots no plan holds stay unwritten (NaN), as in the plain store.
        untouched = torch.ones(got[i].shape[1] * got[i].shape[2], dtype=torch.bool, device=dev)
        untouched[slots] = False
        assert bool(got[i].flatten(1, 2)[:, untouched].isnan().all())
    assert torch.equal(got[2], plain[2])
    assert len(set(slot_list)) == len(slot_list)
    for st, plan in items:
        st.ctx.abort_precompute(plan)
        prop.free_state(st)


def test_sliding_windows_draft_what_rebuilt_windows_draft() -> None:
    """fp32, captured graphs: three sequences in windows of 300-700 rows (slides leave a
    quarter free) slide several times; every step's drafts equal a plain-path proposer's
    given each window rebuilt from the original rows."""
    dev = torch.device("cuda")
    target = bd_pair.random_target(SHAPE, dev, torch.float32)
    drafter = bd_pair.random_drafter(SHAPE, dev, torch.float32)
    prop = _proposer(drafter, target, "capture", slide=0.25)
    ref = _proposer(drafter, target, "off", slide=0.25)
    gen = torch.Generator(device=dev).manual_seed(23)
    data = torch.randn(1400, SHAPE.ctx_row_width, generator=gen, device=dev)
    states = [prop.alloc_state_for(b) for b in (300, 480, 700)]
    pos = [st.window + 40 for st in states]  # prompts longer than the windows
    for st, p in zip(states, pos):
        prop.commit_ctx(st, data[:p], range(p))
    slides = 0
    take = SHAPE.block_size - 1
    for step in range(60):
        tokens = [(step * 131 + i) % SHAPE.vocab for i in range(3)]
        got = prop.propose_batch(states, tokens, list(pos), take)
        assert got is not None
        for i, st in enumerate(states):
            fresh = ref.alloc_state_for(st.ctx_len)
            kept = st.ctx_positions
            ref.commit_ctx(fresh, data[kept], kept)
            assert ref.propose(fresh, tokens[i], pos[i], take) == got[i], (step, i)
            ref.free_state(fresh)
            prop.after_verify(st, 0)
            k = 1 + (step * 3 + i) % SHAPE.block_size  # up to B rows: accepted + 1
            first = st.ctx_positions[0]
            prop.commit_ctx(st, data[pos[i] : pos[i] + k], range(pos[i], pos[i] + k))
            pos[i] += k
            slides += int(st.ctx_positions[0] != first)
    runner = prop.graph_runner
    assert runner is not None and runner.disabled is None and runner.replays >= 60
    assert slides >= 3
    for st in states:
        prop.free_state(st)
    assert prop.pool.num_free == prop.pool.num_pages
