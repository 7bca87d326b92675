"""The drafter's paged context K/V: one K and one V tensor for every layer, in pages drawn from
one :class:`~blockdraft.BlockPool` shared by all the proposer's sequences."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from blockdraft._core import BlockPool, ConfigError
from blockdraft.devices import free_bytes
from blockdraft.proposer.spec import DraftSpec


class DrafterCache:
    """Paged ctx K/V of a pool: ``k``, ``v`` ``[L, num_pages, page_size, Hkv, D]`` and
    ``slot_pos`` ``[num_pages * page_size]`` int32 (the position of the row in each slot,
    for sliding-window layers; ``-1`` = never written).

    Slot ``s`` is row ``s % page_size`` of page ``s // page_size``. ``k_layers[l]`` /
    ``v_layers[l]`` are layer ``l``'s ``[num_pages, page_size, Hkv, D]`` views.
    """

    def __init__(self, pool: BlockPool, spec: DraftSpec, dtype: torch.dtype, device: torch.device):
        self.pool = pool
        self.page_size = pool.page_size
        shape = (spec.num_layers, pool.num_pages, pool.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Plain select views: unbind() views refuse in-place writes.
        self.k_layers: list[Tensor] = [self.k[i] for i in range(spec.num_layers)]
        self.v_layers: list[Tensor] = [self.v[i] for i in range(spec.num_layers)]
        self.slot_pos = torch.full(
            (pool.num_pages * pool.page_size,), -1, dtype=torch.int32, device=device
        )

    @property
    def bytes_per_page(self) -> int:
        """Bytes one pool page holds across every layer's K and V (plus its ``slot_pos``)."""
        elem = self.k.element_size()
        return 2 * int(self.k[:, 0].numel()) * elem + 4 * self.page_size

    @staticmethod
    def page_bytes(spec: DraftSpec, page_size: int, elem: int) -> int:
        """:attr:`bytes_per_page` of a cache not yet made."""
        per_slot = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem
        return page_size * per_slot + 4 * page_size

    @staticmethod
    def default_num_pages(
        spec: DraftSpec,
        page_size: int,
        elem: int,
        *,
        windows: int,
        window: int,
        fraction: float,
        device: torch.device,
    ) -> int:
        """Blocks for ``windows`` full windows of ``window`` rows, at most ``fraction`` of the
        device's free memory (host memory off CUDA).

        Raises:
            ConfigError: that fraction holds no page at all.
        """
        per_block = DrafterCache.page_bytes(spec, page_size, elem)
        want = windows * math.ceil(window / page_size)
        free = free_bytes(device)
        fits = int(free * fraction) // per_block
        if fits < 1:
            raise ConfigError(
                f"pool_memory_fraction={fraction} of {free} free bytes holds no K/V page "
                f"({per_block} bytes each)"
            )
        return max(1, min(want, fits))


__all__ = ["DrafterCache"]
