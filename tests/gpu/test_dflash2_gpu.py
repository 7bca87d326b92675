"""DFlash2 on the GPU: its kernels against their references in bf16/fp16, and its drafts
through captured CUDA graphs against the plain path's.

fp32: the two paths differ only in summation order (the fused view, the attention splits), so
drafts agree exactly. bf16: the plain path runs the drafter's torch modules (a rounding per
step), the graph path the fused view (fp32 inside each kernel), so a draft may differ where two
candidates' scores nearly tie; every difference must be such a near-tie.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from blockdraft import DFlashProposer
from blockdraft import pair as bd_pair
from blockdraft.sampling import SamplingParams

import test_kernels_dflash2 as dk

pytestmark = pytest.mark.gpu
GPU = torch.device("cuda")
SHAPE = bd_pair.Shape("gpu-test-dflash2", 6, 256, 8, 2, 32, 512, 4096, 2, (1, 4), 8, 4095,
                      dflash2=(3, 32, 16, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "block", "size", "kernel", "group"),
                         [(1, 16, 4096, 3, 32), (32, 16, 4096, 3, 32), (3, 7, 1000, 4, 8)])
def test_dynamic_conv_gpu(dtype: torch.dtype, n: int, block: int, size: int, kernel: int,
                          group: int) -> None:
    dk.case_dynamic_conv(GPU, dtype, n, block, size, kernel, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "steps", "top_k", "rank", "vocab"),
                         [(1, 15, 8, 32, 151936), (32, 15, 8, 32, 151936), (5, 3, 5, 7, 300)])
@pytest.mark.parametrize("sampled", [False, True])
def test_selector_walk_gpu(dtype: torch.dtype, n: int, steps: int, top_k: int, rank: int,
                           vocab: int, sampled: bool) -> None:
    dk.case_selector_walk(GPU, dtype, n, steps, top_k, rank, vocab, sampled)


def _run(prop: DFlashProposer, seed: int) -> list[list[list[int]]]:
    """5 sequences, 12 steps: single proposals and batches of 2..4 (buckets 1, 2, 4)."""
    gen = torch.Generator(device=GPU).manual_seed(seed)
    states = [prop.alloc_state_for(700) for _ in range(5)]
    pos = [300, 450, 100, 520, 37]
    width = SHAPE.ctx_row_width
    for st, p in zip(states, pos):
        prop.commit_ctx(st, torch.randn(p, width, generator=gen, device=GPU, dtype=prop.dtype), range(p))
    out: list[list[list[int]]] = []
    for step in range(12):
        idx = [i for i in range(5) if (i + step) % 3 != 0] if step % 2 else [step % 5]
        toks = [(step * 131 + i) % SHAPE.vocab for i in idx]
        if len(idx) == 1:
            out.append([prop.propose(states[idx[0]], toks[0], pos[idx[0]], SHAPE.block_size - 1)])
        else:
            got = prop.propose_batch([states[i] for i in idx], toks, [pos[i] for i in idx],
                                     SHAPE.block_size - 1)
            assert got is not None
            out.append(got)
        for i in idx:
            prop.after_verify(states[i], 0)
            k = 1 + (step + i) % 4
            rows = torch.randn(k, width, generator=gen, device=GPU, dtype=prop.dtype)
            prop.commit_ctx(states[i], rows, range(pos[i], pos[i] + k))
            pos[i] += k
    for st in states:
        prop.free_state(st)
    return out


def _proposer(drafter: Any, target: Any, mode: str) -> DFlashProposer:
    return DFlashProposer(drafter, target, max_seq_len=1024, num_pages=400, page_size=16,
                          max_batch=8, graphs=mode)  # type: ignore[arg-type]


def test_dflash2_captured_graphs_give_the_plain_drafts_in_fp32() -> None:
    target, drafter = bd_pair.random_pair(SHAPE, GPU, torch.float32)
    plain = _run(_proposer(drafter, target, "off"), seed=5)
    prop = _proposer(drafter, target, "capture")
    graph = _run(prop, seed=5)
    runner = prop.graph_runner
    assert runner is not None and runner.disabled is None
    assert runner.captures >= 2 and runner.replays >= 12
    assert graph == plain


def test_dflash2_captured_graphs_give_the_plain_drafts_in_bf16_up_to_near_ties() -> None:
    """Where a band's drafts first differ, both tokens score within bf16 noise of each other
    under the plain path's own rows (fp32 rescoring from the common prefix), or the graph's
    token sits at the plain path's top-K boundary."""
    target, drafter = bd_pair.random_pair(SHAPE, GPU, torch.bfloat16)
    off = _proposer(drafter, target, "off")
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_select = off.forward.select

    def recording(rows: torch.Tensor, anchors: torch.Tensor, *args: Any) -> Any:
        seen.append((rows.clone(), anchors.clone()))
        return real_select(rows, anchors, *args)

    off.forward.select = recording  # type: ignore[method-assign]
    plain = _run(off, seed=6)
    prop = _proposer(drafter, target, "capture")
    graph = _run(prop, seed=6)
    assert prop.graph_runner is not None and prop.graph_runner.replays >= 12
    assert len(seen) == len(plain)
    sel = drafter.candidate_selector
    head = off.head.lm_head  # a module or a weight
    lm_head = (head.weight if isinstance(head, torch.nn.Module) else head).float()
    pred, succ = sel.predecessor_codebook.float(), sel.successor_codebook.float()
    same = 0
    far: list[str] = []
    for call, (p_call, g_call) in enumerate(zip(plain, graph)):
        rows_all, anchors = seen[call]
        for i, (p, g) in enumerate(zip(p_call, g_call)):
            if p == g:
                same += 1
                continue
            j = next(t for t, (a, b) in enumerate(zip(p, g)) if a != b)
            prev = int(anchors[i]) if j == 0 else p[j - 1]
            row = rows_all[i, j].float()
            logits = F.linear(row, lm_head)
            h = F.linear(row, sel.hidden_projection.weight.float())
            score = logits + (succ * (pred[prev] * h)).sum(-1)
            kth = torch.topk(logits, sel.top_k).values[-1]
            gap = abs(float(score[p[j]] - score[g[j]]))
            boundary = abs(float(logits[g[j]] - kth))
            if min(gap, boundary) > 0.05:
                far.append(f"call {call} band {i} draft {j}: gap {gap:.4f}, boundary {boundary:.4f}")
    total = sum(len(c) for c in plain)
    assert not far, far
    assert same >= total // 2, f"only {same} of {total} bands identical"


def test_dflash2_sampled_drafts_from_a_host_generator() -> None:
    """Sampled DFlash2 drafts on CUDA with a host generator: the same drafts for the same seed,
    each one of its row's candidates with q > 0, and q a distribution."""
    target, drafter = bd_pair.random_pair(SHAPE, GPU, torch.bfloat16)
    prop = _proposer(drafter, target, "auto")
    states = [prop.alloc_state_for(200) for _ in range(3)]
    rows = torch.randn(40, SHAPE.ctx_row_width, device=GPU, dtype=torch.bfloat16)
    for st in states:
        prop.commit_ctx(st, rows, range(40))
    params = SamplingParams(temperature=0.8)
    got = []
    for _ in range(2):
        drafts, q = prop.propose_sampled(states, [1, 2, 3], [40, 40, 40], 5, params,
                                         torch.Generator().manual_seed(3))
        got.append(drafts)
        for st in states:
            prop.after_verify(st, 0)
        assert q.shape == (3, 5, SHAPE.vocab)
        torch.testing.assert_close(q.sum(-1), torch.ones(3, 5, device=GPU))
        assert ((q > 0).sum(-1) <= SHAPE.dflash2[3]).all()  # type: ignore[index]
        picked = q.gather(2, torch.tensor(drafts, device=GPU)[..., None])
        assert (picked > 0).all()
    assert got[0] == got[1]
