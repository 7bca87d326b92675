"""CUDA-graph replay of the draft forward gives the plain path's drafts (GPU only).

fp32 (IEEE dots in the Triton attention): the two paths differ only in how the attention
splits the context (the graphs use the window ceiling's width), so drafts agree unless two
logits tie to ~1e-6; bf16 is compared on the final hidden rows instead of exact tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from blockdraft import DFlashProposer
from blockdraft import pair as bd_pair

pytestmark = pytest.mark.gpu


def _run(prop: DFlashProposer, shape: Any, seed: int) -> list[Any]:
    dev = prop.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    states = [prop.alloc_state_for(700) for _ in range(5)]
    pos = [300, 450, 100, 520, 37]
    for st, p in zip(states, pos):
        prop.commit_ctx(st, torch.randn(p, shape.ctx_row_width, generator=gen, device=dev, dtype=prop.dtype), range(p))
    out = []
    for step in range(12):
        idx = [i for i in range(5) if (i + step) % 3 != 0] if step % 2 else [step % 5]
        toks = [(step * 131 + i) % shape.vocab for i in idx]
        if len(idx) == 1:
            out.append([prop.propose(states[idx[0]], toks[0], pos[idx[0]], shape.block_size - 1)])
        else:
            out.append(prop.propose_batch([states[i] for i in idx], toks, [pos[i] for i in idx], shape.block_size - 1))
        for i in idx:
            prop.after_verify(states[i], 0)
            k = 1 + (step + i) % 4
            rows = torch.randn(k, shape.ctx_row_width, generator=gen, device=dev, dtype=prop.dtype)
            prop.commit_ctx(states[i], rows, range(pos[i], pos[i] + k))
            pos[i] += k
    for st in states:
        prop.free_state(st)
    return out


def test_captured_graphs_give_the_plain_drafts() -> None:
    shape = bd_pair.Shape("gpu-test", 6, 256, 8, 2, 32, 512, 4096, 2, (1, 4), 8, 4095)
    dev = torch.device("cuda")
    target = bd_pair.random_target(shape, dev, torch.float32)
    drafter = bd_pair.random_drafter(shape, dev, torch.float32)
    results = []
    for mode in ("off", "capture"):
        prop = DFlashProposer(drafter, target, max_seq_len=1024, num_pages=400, page_size=16,
                              max_batch=8, graphs=mode)  # type: ignore[arg-type]
        results.append(_run(prop, shape, seed=5))
        if mode == "capture":
            runner = prop.graph_runner
            assert runner is not None and runner.disabled is None
            assert runner.captures >= 2 and runner.replays >= 10
    assert results[0] == results[1]


SHAPE = bd_pair.Shape("gpu-test", 6, 256, 8, 2, 32, 512, 4096, 2, (1, 4), 8, 4095)
FIRSTS = [40, 7, 130, 64]
STEPS = [[3, 1, 8, 2], [1, 1, 1, 1], [2, 0, 5, 8], [8, 8, 8, 8]]


def _single(prop: DFlashProposer, states: list[Any], rows: torch.Tensor, positions: list[list[int]],
            pos: list[int]) -> Any:
    offset = 0
    for s, p in zip(states, positions):
        if p:
            prop.commit_ctx(s, rows[offset : offset + len(p)], p)
        offset += len(p)
    return _propose(prop, states, pos)


def _propose(prop: DFlashProposer, states: list[Any], pos: list[int]) -> list[list[int]]:
    got = prop.propose_on_device(states, [5, 6, 7, 8], pos, SHAPE.block_size - 1)
    assert got is not None
    out: list[list[int]] = got.tolist()
    return out


def _batch(prop: DFlashProposer, states: list[Any], rows: torch.Tensor, positions: list[list[int]],
           pos: list[int]) -> Any:
    prop.commit_ctx_batch(states, rows, positions)
    return _propose(prop, states, pos)


def _committing(prop: DFlashProposer, states: list[Any], rows: torch.Tensor, positions: list[list[int]],
                pos: list[int]) -> Any:
    with prop.committing(states, rows, positions):
        got = prop.propose_on_device(states, [5, 6, 7, 8], pos, SHAPE.block_size - 1)
    # read after the accumulator kernel was launched behind the replay, as the engine does
    assert got is not None
    return got.tolist()


def _commit_rounds(dtype: torch.dtype, commit: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """A first commit of many rows per state, then steps of a few, each committed by
    ``commit`` (which drafts after it) on the captured graphs; returns the drafts and the
    accumulator rows."""
    dev = torch.device("cuda")
    target = bd_pair.random_target(SHAPE, dev, dtype)
    drafter = bd_pair.random_drafter(SHAPE, dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(9)
    prop = DFlashProposer(drafter, target, max_seq_len=1024, num_pages=400, page_size=16, max_batch=4,
                          graphs="capture")
    assert prop.backend == "triton"
    states = [prop.alloc_state_for(300) for _ in FIRSTS]
    pos = [0] * len(FIRSTS)
    out = []
    for counts in [FIRSTS] + STEPS:
        rows = torch.randn(sum(counts), SHAPE.ctx_row_width, generator=gen, device=dev, dtype=dtype)
        positions = [list(range(p, p + c)) for p, c in zip(pos, counts)]
        pos = [p + c for p, c in zip(pos, counts)]
        out.append(commit(prop, states, rows, positions, pos))
        for s in states:
            prop.after_verify(s, 0)
    runner = prop.graph_runner
    assert runner is not None and runner.disabled is None and runner.replays >= len(STEPS)
    accs = [s.acc[: s.ctx_len].clone() for s in states]
    for s in states:
        prop.free_state(s)
    assert prop.pool.num_free == prop.pool.num_pages
    return out, accs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_commit_on_the_gpu_equals_single_commits(dtype: torch.dtype) -> None:
    """``commit_ctx_batch`` (one accumulator-kernel launch) leaves the accumulators and the
    drafts of one ``commit_ctx`` per sequence, with the graph path on."""
    single, batch = _commit_rounds(dtype, _single), _commit_rounds(dtype, _batch)
    assert single[0] == batch[0]
    assert all(torch.equal(a, b) for a, b in zip(single[1], batch[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_committing_on_the_gpu_equals_a_commit_then_a_proposal(dtype: torch.dtype) -> None:
    """``committing`` with the proposal inside its block (the captured graph gathers the new
    rows from the committed rows by address; the accumulator kernel runs after the replay)
    gives the drafts and the accumulators of ``commit_ctx_batch`` followed by the proposal."""
    batch, deferred = _commit_rounds(dtype, _batch), _commit_rounds(dtype, _committing)
    assert batch[0] == deferred[0]
    assert all(torch.equal(a, b) for a, b in zip(batch[1], deferred[1]))
