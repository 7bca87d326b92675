"""The bench's proposers and the live sequences it drives through steady-state steps."""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from blockdraft.pair import Shape


@contextlib.contextmanager
def window_cap(cap: int | None) -> Iterator[None]:
    """Proposers built inside the block have the context-window cap ``cap``
    (``ENV_CTX_CAP``; 0 = uncapped; ``None`` leaves the environment as it is)."""
    from blockdraft.core import ENV_CTX_CAP

    if cap is None:
        yield
        return
    old = os.environ.get(ENV_CTX_CAP)
    os.environ[ENV_CTX_CAP] = str(cap)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_CTX_CAP, None)
        else:
            os.environ[ENV_CTX_CAP] = old


def uncapped_window() -> contextlib.AbstractContextManager[None]:
    """Proposers built inside the block have no context-window cap: the window is
    ``max_seq_len``, so a context grown past its nominal length never slides (a slide would
    recompute the whole context's K/V inside a timed call)."""
    return window_cap(0)


def make_proposer(
    drafter: Any, target: Any, shape: Shape, ctx: int, max_batch: int, graphs: str, grow: int
) -> Any:
    """A proposer for up to ``max_batch`` sequences of ``ctx`` rows that may each grow by
    ``grow`` rows, with a pool of 16-row pages holding all of them and an uncapped window."""
    from blockdraft import DFlashProposer

    max_seq_len = ctx + grow
    page = 16
    with uncapped_window():
        return DFlashProposer(
            drafter,
            target,
            max_seq_len=max_seq_len,
            num_pages=max_batch * math.ceil(max_seq_len / page) + 1,
            page_size=page,
            max_batch=max_batch,
            graphs=graphs,  # type: ignore[arg-type]
        )


def release(prop: Any) -> None:
    """Drop a proposer's graphs (they reference it back) and give its memory to the device."""
    prop.graph_runner = None
    gc.collect()
    if prop.device.type == "cuda":
        torch.cuda.empty_cache()


class Seqs:
    """Live states at one context length, each advanced one ctx row per step.

    Each step commits one new ctx row per sequence (a random pair accepts nothing, so a step
    adds ``accepted + 1 = 1`` row), so every timed proposal includes the K/V precompute of that
    row, as in steady state.
    """

    def __init__(self, prop: Any, shape: Shape, ctx: int, count: int, gen: torch.Generator) -> None:
        self.prop = prop
        self.shape = shape
        self.gen = gen
        device = prop.device
        self.rows = torch.empty((count, shape.ctx_row_width), dtype=prop.dtype, device=device)
        self.states: list[Any] = []
        self.next_pos: list[int] = []
        self.tokens: list[int] = []
        self.alloc_bytes: list[int] = []
        rows = torch.empty((ctx, shape.ctx_row_width), dtype=prop.dtype, device=device)
        for i in range(count):
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            st = prop.alloc_state()
            if device.type == "cuda":
                self.alloc_bytes.append(int(torch.cuda.memory_allocated(device) - before))
            rows.normal_(generator=gen)
            prop.commit_ctx(st, rows, range(ctx))
            tok = (17 * i + 3) % shape.vocab
            # The first proposal computes the K/V of all ctx rows (one sequence at a time, so
            # the batched precompute never concatenates every context at once).
            prop.propose(st, tok, ctx, shape.block_size - 1)
            prop.after_verify(st, 0)
            self.states.append(st)
            self.next_pos.append(ctx)
            self.tokens.append(tok)
        del rows

    def advance(self, idx: Sequence[int], fresh: bool = True) -> None:
        """Commit one new ctx row (the last anchor's hidden state) to each of ``idx``, as a
        serving step does: ``commit_ctx`` for one sequence, ``commit_ctx_batch`` for more.
        Random rows unless ``fresh=False`` (the last rows again: no launch of the bench's own)."""
        rows = self.rows[: len(idx)]
        if fresh:
            rows.normal_(generator=self.gen)
        if len(idx) == 1:
            self.prop.commit_ctx(self.states[idx[0]], rows, [self.next_pos[idx[0]]])
        else:
            self.prop.commit_ctx_batch(
                [self.states[i] for i in idx], rows, [[self.next_pos[i]] for i in idx]
            )
        for i in idx:
            self.next_pos[i] += 1
            self.tokens[i] = (self.tokens[i] * 31 + 7) % self.shape.vocab

    def warm(self, idx: Sequence[int], steps: int) -> None:
        """``steps`` untimed steady-state steps (commit one row, propose, verify)."""
        for _ in range(steps):
            self.advance(idx)
            self.propose_batch(idx)

    def propose_batch(self, idx: Sequence[int], verify: bool = True) -> list[list[int]]:
        """One ``propose`` (n = 1) or ``propose_batch`` call; ``verify`` then records a verify
        of 0 accepted drafts for each sequence."""
        b = self.shape.block_size - 1
        if len(idx) == 1:
            i = idx[0]
            out = [self.prop.propose(self.states[i], self.tokens[i], self.next_pos[i], b)]
        else:
            got = self.prop.propose_batch(
                [self.states[i] for i in idx],
                [self.tokens[i] for i in idx],
                [self.next_pos[i] for i in idx],
                b,
            )
            if got is None:
                raise RuntimeError(f"propose_batch declined {len(idx)} sequences")
            out = got
        if verify:
            self.verify(idx)
        return out

    def verify(self, idx: Sequence[int]) -> None:
        """Record a verify of 0 accepted drafts for each of ``idx`` (a random pair's step):
        ``after_verify`` for one sequence, ``after_verify_batch`` for more."""
        if len(idx) == 1:
            self.prop.after_verify(self.states[idx[0]], 0)
        else:
            self.prop.after_verify_batch([self.states[i] for i in idx], [0] * len(idx))

    def propose_loop(self, idx: Sequence[int]) -> None:
        """The same sequences one ``propose`` (and verify record) at a time."""
        b = self.shape.block_size - 1
        for i in idx:
            self.prop.propose(self.states[i], self.tokens[i], self.next_pos[i], b)
            self.prop.after_verify(self.states[i], 0)

    def free(self) -> None:
        """Free every state (their pages go back to the pool)."""
        for st in self.states:
            self.prop.free_state(st)
