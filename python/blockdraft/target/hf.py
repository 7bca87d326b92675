"""The target's own Hugging Face forward as a :class:`~blockdraft.target.backend.TargetBackend`:
one sequence at a time, each with its own ``DynamicCache``, under a chosen set of attention
backends.

It serves any causal LM the :class:`~blockdraft.TargetAdapter` can read hidden states from
(GPT-2, GPT-NeoX, Phi, Gemma, OPT, Falcon, ... beside the runtime's own families) whose cache
can be rolled back: a verify appends the whole block to the cache and the rows past the
accepted ones are cropped off again. A cache with recurrent state (Mamba and the hybrids
built on it) cannot be cropped back and is refused.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.attention as _attention
from torch import Tensor
from torch.nn.attention import SDPBackend

from blockdraft import faults
from blockdraft._core import ConfigError
from blockdraft.target.adapter import TargetAdapter
from blockdraft.target.backend import ChunkFn

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
        adapter: the target, capturing the drafter's layers.
        sdpa_backends: the attention backends its forwards may use, in priority order (every
            call runs inside ``torch.nn.attention.sdpa_kernel``); ``None`` leaves torch's
            choice alone. A different backend rounds differently: bf16 greedy output can
            differ with the selection.

    Raises:
        ConfigError: the target's cache cannot be cropped (recurrent state), named.
    """

    name = "hf"

    def __init__(self, adapter: TargetAdapter, sdpa_backends: Sequence[SDPBackend] | SDPBackend | None) -> None:
        self.adapter = adapter
        self.sdpa_backends = validate_sdpa_backends(sdpa_backends)
        cache = adapter.new_cache()
        if not getattr(cache, "is_croppable", True):
            kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())})
            raise ConfigError(
                f"target {type(adapter.model).__name__} cannot run on the Hugging Face path: its cache "
                f"({', '.join(kinds) or type(cache).__name__}) keeps recurrent state, which cropping "
                "cannot roll back, and a rejected draft's rows are dropped by cropping the cache")
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


__all__ = ["DEFAULT_SDPA_BACKENDS", "HFTarget", "validate_sdpa_backends"]
