"""The target side of a speculative step, behind one interface.

:class:`TargetBackend` is what the engine needs from a target: make a sequence, prefill
prompts, verify blocks (the rows stay pending), accept the first ``k`` rows of each, free.
:class:`RuntimeTarget` runs the target on blockdraft's runtime (paged K/V, one forward for
every sequence's block); :class:`~blockdraft.target.hf.HFTarget` runs the model's own
Hugging Face forward, one sequence at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from blockdraft._core import ConfigError
from blockdraft.target.runtime import TargetRuntime, TargetSpec

log = logging.getLogger(__name__)

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
        """Blocks of different lengths (draft counts chosen per request, a request's last
        steps) are padded to the shortest graph row count that holds the longest of them,
        when every sequence has room, so the step is a fixed shape the runtime's graphs
        replay; the padding rows' K/V is pending like any rejected draft's, and their rows
        are dropped from what this returns."""
        rt = self.runtime
        rows = self._graph_rows(seqs, blocks)
        if rows is None or all(len(blk) == rows for blk in blocks):
            out = rt.forward(seqs, blocks, logits="all", capture=True)
            assert out.ctx_rows is not None
            return out.logits, out.ctx_rows
        out = rt.forward(seqs, [[*blk, *([0] * (rows - len(blk)))] for blk in blocks], logits="all", capture=True)
        assert out.ctx_rows is not None
        keep = torch.tensor([i * rows + j for i, blk in enumerate(blocks) for j in range(len(blk))],
                            dtype=torch.int64, device=out.logits.device)
        return out.logits.index_select(0, keep), out.ctx_rows.index_select(0, keep)

    def verify_drafted(self, seqs: Sequence[Any], anchors: Sequence[int], drafts: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`verify` of the blocks ``[anchors[i], *drafts[i]]`` whose drafts ``[n, k]``
        are still on the device: where a graph takes ``k + 1`` rows they go into its ids on
        the device (:meth:`~blockdraft.TargetRuntime.forward_drafted`); elsewhere they are
        read and padded as :meth:`verify` pads."""
        graphs = self.runtime.graphs
        if graphs is not None and graphs.accepts(len(seqs), drafts.shape[1] + 1):
            out = self.runtime.forward_drafted(seqs, anchors, drafts)
            assert out.ctx_rows is not None
            return out.logits, out.ctx_rows
        return self.verify(seqs, [[a, *d] for a, d in zip(anchors, drafts.tolist())])

    def _graph_rows(self, seqs: Sequence[Any], blocks: Sequence[Sequence[int]]) -> int | None:
        """The graph row count these blocks pad to, or ``None`` (no graph takes them)."""
        graphs = self.runtime.graphs
        if graphs is None:
            return None
        longest = max(len(blk) for blk in blocks)
        rows = min((r for r in graphs.rows if r >= longest), default=None)
        if rows is None or not graphs.accepts(len(blocks), rows):
            return None
        return rows if all(s.length + rows <= s.capacity for s in seqs) else None

    def accept(self, seqs: Sequence[Any], counts: Sequence[int]) -> None:
        self.runtime.accept(seqs, counts)

    def free(self, seqs: Sequence[Any]) -> None:
        self.runtime.free(seqs)

    def close(self) -> None:
        """Nothing to detach: the fused weights stay the model's storage."""


RUNTIMES = ("auto", "blockdraft", "hf")


def resolve_runtime(runtime: str, target: Any) -> str:
    """``"blockdraft"`` or ``"hf"`` for ``runtime`` on ``target``.

    ``"auto"`` picks the blockdraft runtime for a model it supports (the families of
    :data:`~blockdraft.target.runtime.FAMILIES`, without a feature it lacks) and the Hugging
    Face path (:class:`~blockdraft.target.hf.HFTarget`, any causal LM whose hidden states can
    be read) for every other, and logs one line saying which and why.

    Raises:
        ConfigError: an unknown name, or ``"blockdraft"`` on an unsupported model (named).
    """
    if runtime not in RUNTIMES:
        raise ConfigError(f"runtime must be one of {RUNTIMES}, not {runtime!r}")
    if runtime == "hf":
        return "hf"
    try:
        TargetSpec.from_model(target)
    except ConfigError as exc:
        if runtime == "blockdraft":
            raise
        log.info("target runtime 'auto': hf, the model's own Hugging Face forward one sequence at a "
                 "time, because %s", exc)
        return "hf"
    if runtime == "auto":
        log.info("target runtime 'auto': blockdraft, because it supports %s", type(target).__name__)
    return "blockdraft"


__all__ = ["RUNTIMES", "ChunkFn", "RuntimeTarget", "TargetBackend", "resolve_runtime"]
