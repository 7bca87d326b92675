"""The target side of a speculative step, behind one interface with two implementations.

:class:`RuntimeTarget` runs the target on blockdraft's runtime (paged K/V, one forward for
every sequence's block); :class:`HFTarget` runs the model's own Hugging Face forward, one
sequence at a time, each with its own ``DynamicCache``. Both expose the same five operations:
make a sequence, prefill prompts, verify blocks (the rows stay pending), accept the first ``k``
rows of each, free.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.attention as _attention
from torch import Tensor
from torch.nn.attention import SDPBackend

from blockdraft import faults
from blockdraft.runtime import TargetRuntime
from blockdraft.target import TargetAdapter

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
        return self.runtime.pool.num_blocks

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


DEFAULT_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
"""The attention backends the Hugging Face target's forwards may use by default, in priority
order: every backend except cuDNN, whose plans depend on the K/V length (which changes every
speculative step)."""

_SDPA_SELECTABLE = frozenset({
    SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION, SDPBackend.OVERRIDEABLE,
})


def validate_sdpa_backends(backends: object) -> tuple[SDPBackend, ...] | None:
    """``sdpa_backends`` as a tuple (``None`` stays ``None``); TypeError/ValueError if bad."""
    if backends is None:
        return None
    if isinstance(backends, SDPBackend):
        backends = (backends,)
    if isinstance(backends, (str, bytes)) or not isinstance(backends, Iterable):
        raise TypeError(
            "sdpa_backends must be None or a sequence of torch.nn.attention.SDPBackend members, "
            f"not {type(backends).__name__}"
        )
    got = tuple(backends)
    if not got:
        raise ValueError("sdpa_backends must name at least one backend (None = torch's choice)")
    for b in got:
        if not isinstance(b, SDPBackend):
            raise TypeError(
                "sdpa_backends must hold torch.nn.attention.SDPBackend members, "
                f"not {type(b).__name__} ({b!r})"
            )
        if b not in _SDPA_SELECTABLE:
            raise ValueError(f"sdpa_backends: {b!r} is not a selectable attention backend")
    if len(set(got)) != len(got):
        raise ValueError(f"sdpa_backends names a backend twice: {got!r}")
    return got


def _sdpa_kernel_has_priority() -> bool:
    """Whether ``torch.nn.attention.sdpa_kernel`` takes ``set_priority`` (newer torch)."""
    try:
        return "set_priority" in inspect.signature(_attention.sdpa_kernel).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class _HFSeq:
    cache: Any
    length: int = 0  # tokens in the cache that are kept
    freed: bool = False


class HFTarget:
    """The target's own Hugging Face forward, one sequence at a time, each with its own
    ``DynamicCache`` (a rejected block is cropped off); context rows are captured by the
    :class:`~blockdraft.TargetAdapter`'s hooks.

    Args:
        adapter: the hooked target.
        sdpa_backends: the attention backends its forwards may use, in priority order (every
            call runs inside ``torch.nn.attention.sdpa_kernel``); ``None`` leaves torch's
            choice alone. A different backend rounds differently: bf16 greedy output can
            differ with the selection.
    """

    name = "hf"

    def __init__(self, adapter: TargetAdapter, sdpa_backends: Sequence[SDPBackend] | SDPBackend | None) -> None:
        self.adapter = adapter
        self.sdpa_backends = validate_sdpa_backends(sdpa_backends)
        self._priority = _sdpa_kernel_has_priority()
        self.device = adapter.device

    def pages_for(self, capacity: int) -> int:
        return 0

    @property
    def total_pages(self) -> int | None:
        return None

    def _backends(self) -> contextlib.AbstractContextManager[Any]:
        if self.sdpa_backends is None:
            return contextlib.nullcontext()
        backends = list(self.sdpa_backends)
        if self._priority:
            return _attention.sdpa_kernel(backends, set_priority=True)
        return _attention.sdpa_kernel(backends)

    def forward(self, ids: Sequence[int], cache: Any, *, last_only: bool = False) -> tuple[Tensor, Tensor]:
        """``ids`` through the target after ``cache``: logits ``[T, V]`` (``[1, V]`` with
        ``last_only``) in the target's dtype and ctx rows ``[T, k*H]``."""
        if faults.active():
            faults.hit("target_forward")
        inp = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with self._backends():
            out = self.adapter.forward(inp, past_key_values=cache, logits_to_keep=1 if last_only else 0)
        return out.logits[0], out.ctx_rows

    def new(self, capacity: int) -> Any:
        return _HFSeq(self.adapter.new_cache())

    def prefill(self, seqs: Sequence[Any], prompts: Sequence[Sequence[int]], on_chunk: ChunkFn) -> Tensor:
        last = []
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            logits, rows = self.forward(p, s.cache, last_only=True)
            s.length = len(p)
            on_chunk([i], [range(len(p))], rows)
            last.append(logits[-1])
        return torch.stack(last)

    def verify(self, seqs: Sequence[Any], blocks: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        logits, rows = [], []
        for s, block in zip(seqs, blocks):
            lg, r = self.forward(block, s.cache)
            logits.append(lg)
            rows.append(r)
        return torch.cat(logits), torch.cat(rows)

    def accept(self, seqs: Sequence[Any], counts: Sequence[int]) -> None:
        for s, k in zip(seqs, counts):
            s.length += k
            self.adapter.crop_cache(s.cache, s.length)

    def free(self, seqs: Sequence[Any]) -> None:
        for s in seqs:
            s.cache = None
            s.freed = True

    def close(self) -> None:
        self.adapter.close()


__all__ = [
    "DEFAULT_SDPA_BACKENDS",
    "HFTarget",
    "RuntimeTarget",
    "TargetBackend",
    "validate_sdpa_backends",
]
