"""The target's paged K/V: per layer one K and one V tensor of pages from the runtime's pool."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from blockdraft._core import BlockPool, ConfigError
from blockdraft.devices import free_bytes
from blockdraft.target.runtime.spec import TargetSpec


class TargetKVCache:
    """K and V ``[L, num_pages, page_size, Hkv, D]`` in the target's dtype, on its device.

    ``k_layers[l]`` / ``v_layers[l]`` are layer ``l``'s ``[num_pages, page_size, Hkv, D]``
    views; token position ``p`` of a sequence lies in row ``p % page_size`` of page
    ``pages[p // page_size]`` (the core's page table, ``SeqPages.pages``).
    """

    def __init__(self, pool: BlockPool, spec: TargetSpec) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        shape = (spec.num_layers, pool.num_pages, pool.page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        # Plain select views: unbind() views refuse in-place writes.
        self.k_layers: list[Tensor] = [self.k[i] for i in range(spec.num_layers)]
        self.v_layers: list[Tensor] = [self.v[i] for i in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def page_bytes(spec: TargetSpec, page_size: int) -> int:
        """Bytes one page takes over every layer's K and V."""
        return page_size * spec.kv_bytes_per_token

    @staticmethod
    def default_num_pages(spec: TargetSpec, page_size: int, *, tokens: int, fraction: float) -> int:
        """Pages for ``tokens`` tokens (at least one page), at most ``fraction`` of the free
        memory of the target's device (host memory off CUDA).

        Raises:
            ConfigError: that fraction holds no page.
        """
        per_page = TargetKVCache.page_bytes(spec, page_size)
        want = max(1, math.ceil(tokens / page_size))
        device = spec.device
        free = free_bytes(device)
        fits = int(free * fraction) // per_page
        if fits < 1:
            raise ConfigError(
                f"memory_fraction={fraction} of {free} free bytes holds no target K/V page "
                f"({per_page} bytes each)"
            )
        return min(want, fits)


__all__ = ["TargetKVCache"]
