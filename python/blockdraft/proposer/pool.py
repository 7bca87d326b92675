"""How many pages the drafter's K/V pool holds: enough for ``max_batch`` full windows where
the memory share allows, the same on every tensor-parallel rank."""

from __future__ import annotations

import math

import torch

from blockdraft._core import ConfigError
from blockdraft.kv_cache import PagedKVCache
from blockdraft.parallel.group import TPGroup
from blockdraft.proposer.spec import DraftSpec


def pool_pages(spec: DraftSpec, num_pages: int | None, *, page_size: int, max_batch: int, ceiling: int,
               dtype: torch.dtype, device: torch.device, fraction: float, tp: TPGroup | None) -> int:
    """``num_pages``, or (``None``) the pages of ``max_batch`` windows of ``ceiling`` rows as
    far as ``fraction`` of the free device memory holds them; with ``tp``, the size every rank
    agrees on (:func:`agreed_pool_size`)."""
    sized = num_pages is None
    if num_pages is None:
        num_pages = PagedKVCache.pages_for_memory(
            max_batch * math.ceil(ceiling / page_size),
            PagedKVCache.page_bytes(
                page_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, dtype=dtype, slot_pos=True,
            ),
            fraction=fraction, device=device, lever="pool_memory_fraction",
        )
    if tp is not None and tp.size > 1:
        num_pages = agreed_pool_size(tp, num_pages, sized=sized)
    return num_pages


def agreed_pool_size(tp: TPGroup, num_pages: int, *, sized: bool) -> int:
    """The drafter pool size of every rank of ``tp``: the smallest one found in free memory
    (``sized``), or the given one when every rank was given the same.

    Raises:
        ConfigError: sizes that were given (not ``sized``) differ between ranks.
    """
    sizes = [int(n) for n in tp.gather(num_pages)]
    if not sized and len(set(sizes)) > 1:
        raise ConfigError(f"tensor-parallel ranks have drafter pools of different sizes: {sizes}")
    return min(sizes)


__all__ = ["agreed_pool_size", "pool_pages"]
