"""Paged K/V: one K and one V tensor for every layer, in pages drawn from a
:class:`~blockdraft.BlockPool`. The drafter's context K/V and the target runtime's K/V are both
one of these."""

from __future__ import annotations

import torch
from torch import Tensor

from blockdraft import devices
from blockdraft._core import BlockPool, ConfigError


class PagedKVCache:
    """K and V ``[L, num_pages, page_size, Hkv, D]`` for the pages of ``pool``.

    Slot ``s`` is row ``s % page_size`` of page ``s // page_size``: token position ``p`` of a
    sequence lies in row ``p % page_size`` of page ``pages[p // page_size]`` (the core's page
    table). ``k_layers[l]`` / ``v_layers[l]`` are layer ``l``'s ``[num_pages, page_size, Hkv,
    D]`` views of ``k`` / ``v``.

    Args:
        pool: the pool whose pages the cache holds (its ``num_pages`` and ``page_size``).
        num_layers / num_kv_heads / head_dim: L, Hkv, D.
        dtype / device: of K and V.
        slot_pos: also keep ``slot_pos`` ``[num_pages * page_size]`` int32, the position of the
            row in each slot (sliding-window layers read it; ``-1``: never written).
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slot_pos: bool = False,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        shape = (num_layers, pool.num_pages, pool.page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Plain select views: unbind() views refuse in-place writes.
        self.k_layers: list[Tensor] = [self.k[i] for i in range(num_layers)]
        self.v_layers: list[Tensor] = [self.v[i] for i in range(num_layers)]
        self.slot_pos: Tensor | None = (
            torch.full((pool.num_pages * pool.page_size,), -1, dtype=torch.int32, device=device)
            if slot_pos else None
        )

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Every layer's K and V (and ``slot_pos``) of slots ``src`` into slots ``dst``
        (int64 index tensors of one length on the cache's device)."""
        for t in (self.k, self.v):
            flat = t.view(t.shape[0], -1, *t.shape[3:])
            flat[:, dst] = flat[:, src]
        if self.slot_pos is not None:
            self.slot_pos[dst] = self.slot_pos[src]

    @property
    def nbytes(self) -> int:
        """Bytes of K, V and ``slot_pos`` together."""
        pos = 0 if self.slot_pos is None else self.slot_pos.numel() * self.slot_pos.element_size()
        return 2 * self.k.numel() * self.k.element_size() + pos

    @property
    def bytes_per_page(self) -> int:
        """Bytes one pool page holds across every layer's K and V (plus its ``slot_pos``)."""
        num_layers, _, page_size, num_kv_heads, head_dim = self.k.shape
        return self.page_bytes(
            page_size, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=self.k.dtype, slot_pos=self.slot_pos is not None,
        )

    @staticmethod
    def page_bytes(
        page_size: int,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        slot_pos: bool = False,
    ) -> int:
        """:attr:`bytes_per_page` of a cache not yet made."""
        elem = dtype.itemsize
        per_slot = 2 * num_layers * num_kv_heads * head_dim * elem + (4 if slot_pos else 0)
        return page_size * per_slot

    @staticmethod
    def pages_for_memory(
        want: int,
        page_bytes: int,
        *,
        fraction: float,
        device: torch.device,
        lever: str,
        what: str = "K/V",
    ) -> int:
        """``want`` pages (at least one), at most as many as ``fraction`` of the device's free
        memory (host memory off CUDA, :func:`blockdraft.devices.free_bytes`) holds at
        ``page_bytes`` each.

        Args:
            lever: the caller's argument that sets ``fraction`` (the error names it).
            what: what a page is of, for the error.

        Raises:
            ConfigError: that fraction holds no page at all.
        """
        free = devices.free_bytes(device)
        fits = int(free * fraction) // page_bytes
        if fits < 1:
            raise ConfigError(
                f"{lever}={fraction} of {free} free bytes holds no {what} page "
                f"({page_bytes} bytes each)"
            )
        return min(max(1, want), fits)


__all__ = ["PagedKVCache"]
