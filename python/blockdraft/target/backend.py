"""The target side of a speculative step, behind one interface.

:class:`TargetBackend` is what the engine needs from a target: make a sequence, prefill
prompts, verify blocks (the rows stay pending), accept the first ``k`` rows of each, free.
:class:`RuntimeTarget` runs the target on blockdraft's runtime (paged K/V, one forward for
every sequence's block); :class:`~blockdraft.target.hf.HFTarget` runs the model's own
Hugging Face forward, one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from blockdraft.target.runtime import TargetRuntime

ChunkFn = Callable[[list[int], list[range], Tensor], None]
"""``on_chunk(indices, positions, ctx_rows)``: a prefill chunk's captured rows ``[rows, k*H]``
for the sequences ``indices`` (into the prefill's list) at ``positions``."""


class TargetBackend(Protocol):
    """What the engine needs from a target."""

    name: str
    """``"blockdraft"`` or ``"hf"``: what runs the target (``GenerationStats.target_runtime``)."""

    def pages_for(self, capacity: int) -> int:
        """Target pages a sequence of ``capacity`` tokens holds (0: not page-budgeted)."""

    @property
    def total_pages(self) -> int | None:
        """Pages the target has in all (``None``: not page-budgeted)."""

    def new(self, capacity: int) -> Any:
        """A sequence that may hold ``capacity`` tokens."""

    def prefill(self, seqs: Sequence[Any], prompts: Sequence[Sequence[int]], on_chunk: ChunkFn) -> Tensor:
        """Each prompt through its new sequence, accepted; each prompt's last-row logits
        ``[n, V]``."""

    def verify(self, seqs: Sequence[Any], blocks: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """``blocks[i]`` appended to sequence ``i`` (pending): logits ``[R, V]`` and ctx rows
        ``[R, k*H]`` of every row, sequence by sequence."""

    def accept(self, seqs: Sequence[Any], counts: Sequence[int]) -> None:
        """Keep the first ``counts[i]`` rows of each sequence's last verify."""

    def free(self, seqs: Sequence[Any]) -> None:
        """Give back everything the sequences hold (idempotent)."""

    def close(self) -> None:
        """Detach from the model."""


class RuntimeTarget:
    """The target on :class:`~blockdraft.TargetRuntime` (capturing the drafter's layers)."""

    name = "blockdraft"

    def __init__(self, runtime: TargetRuntime, block_size: int) -> None:
        self.runtime = runtime
        self.block_size = block_size

    def pages_for(self, capacity: int) -> int:
        return self.runtime.pages_for(capacity)

    @property
    def total_pages(self) -> int | None:
        return self.runtime.pool.num_pages

    @property
    def used_pages(self) -> int:
        return self.runtime.pool.num_used

    def new(self, capacity: int) -> Any:
        return self.runtime.new_sequence(min(capacity, self.runtime.max_seq_len))

    def prefill(self, seqs: Sequence[Any], prompts: Sequence[Sequence[int]], on_chunk: ChunkFn) -> Tensor:
        return self.runtime.prefill(seqs, prompts, on_chunk=on_chunk)

    def verify(self, seqs: Sequence[Any], blocks: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Blocks shorter than B (a request's last steps) are padded to B rows when every
        sequence has room, so the step is the fixed shape the runtime's graphs replay; the
        padding rows' K/V is pending like any rejected draft's, and their rows are dropped
        from what this returns."""
        rt, b = self.runtime, self.block_size
        ragged = any(len(blk) != b for blk in blocks)
        pad = (ragged and rt.graphs is not None and rt.graphs.accepts(len(blocks), b)
               and all(s.length + b <= s.capacity for s in seqs))
        run = [[*blk, *([0] * (b - len(blk)))] for blk in blocks] if pad else blocks
        out = rt.forward(seqs, run, logits="all", capture=True)
        assert out.ctx_rows is not None
        if not pad:
            return out.logits, out.ctx_rows
        keep = torch.tensor([i * b + j for i, blk in enumerate(blocks) for j in range(len(blk))],
                            dtype=torch.int64, device=out.logits.device)
        return out.logits.index_select(0, keep), out.ctx_rows.index_select(0, keep)

    def accept(self, seqs: Sequence[Any], counts: Sequence[int]) -> None:
        self.runtime.accept(seqs, counts)

    def free(self, seqs: Sequence[Any]) -> None:
        self.runtime.free(seqs)

    def close(self) -> None:
        """Nothing to detach: the fused weights stay the model's storage."""


__all__ = ["ChunkFn", "RuntimeTarget", "TargetBackend"]
