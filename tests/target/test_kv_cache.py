"""The paged K/V cache on its own: shapes, layer views, slot positions, page bytes and the
page count from a memory fraction."""

from __future__ import annotations

import pytest
import torch

from blockdraft import devices
from blockdraft._core import BlockPool, ConfigError
from blockdraft.kv_cache import PagedKVCache

CPU = torch.device("cpu")
SIZES = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}


def make(num_pages: int = 5, page_size: int = 4, *, slot_pos: bool = False,
         dtype: torch.dtype = torch.float32) -> PagedKVCache:
    return PagedKVCache(BlockPool(num_pages, page_size), dtype=dtype, device=CPU,
                        slot_pos=slot_pos, **SIZES)


def test_shapes_and_layer_views() -> None:
    cache = make(slot_pos=True)
    assert cache.page_size == 4
    assert cache.k.shape == cache.v.shape == (3, 5, 4, 2, 8)
    assert cache.k.dtype == torch.float32 and cache.k.device == CPU
    assert len(cache.k_layers) == len(cache.v_layers) == 3
    for i in range(3):
        assert cache.k_layers[i].shape == (5, 4, 2, 8)
        assert cache.k_layers[i].data_ptr() == cache.k[i].data_ptr()
        assert cache.v_layers[i].data_ptr() == cache.v[i].data_ptr()
    assert not cache.k.any() and not cache.v.any()


def test_a_write_through_a_layer_view_lands_in_the_stacked_tensor() -> None:
    cache = make()
    cache.k_layers[1][2, 3] = 7.0
    cache.v_layers[2][0, 1, 1] = -1.5
    assert (cache.k[1, 2, 3] == 7.0).all()
    assert cache.k.count_nonzero() == 2 * 8
    assert (cache.v[2, 0, 1, 1] == -1.5).all()
    assert cache.v.count_nonzero() == 8


def test_slot_pos_starts_at_minus_one() -> None:
    cache = make(slot_pos=True)
    assert cache.slot_pos is not None
    assert cache.slot_pos.shape == (5 * 4,)
    assert cache.slot_pos.dtype == torch.int32
    assert (cache.slot_pos == -1).all()
    assert make().slot_pos is None


@pytest.mark.parametrize("slot_pos", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_page_against_a_hand_count(slot_pos: bool, dtype: torch.dtype) -> None:
    elem = 4 if dtype == torch.float32 else 2
    # K and V, 3 layers x 4 rows x 2 heads x 8 dims; 4 int32 positions with slot_pos.
    hand = 2 * 3 * 4 * 2 * 8 * elem + (4 * 4 if slot_pos else 0)
    cache = make(slot_pos=slot_pos, dtype=dtype)
    assert cache.bytes_per_page == hand
    assert PagedKVCache.page_bytes(4, dtype=dtype, slot_pos=slot_pos, **SIZES) == hand
    assert cache.nbytes == 5 * hand


def test_page_count_from_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "free_bytes", lambda device: 10_000)
    # A quarter of 10,000 bytes holds 25 pages of 100 bytes.
    assert PagedKVCache.pages_for_memory(100, 100, fraction=0.25, device=CPU, lever="f") == 25
    assert PagedKVCache.pages_for_memory(7, 100, fraction=0.25, device=CPU, lever="f") == 7
    assert PagedKVCache.pages_for_memory(0, 100, fraction=0.25, device=CPU, lever="f") == 1


def test_a_fraction_that_holds_no_page_names_the_lever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "free_bytes", lambda device: 1_000)
    with pytest.raises(ConfigError, match=r"pool_memory_fraction=0\.05 of 1000 free bytes holds "
                                          r"no K/V page \(100 bytes each\)"):
        PagedKVCache.pages_for_memory(4, 100, fraction=0.05, device=CPU,
                                      lever="pool_memory_fraction")
    with pytest.raises(ConfigError, match=r"memory_fraction=0\.05 .* no target K/V page"):
        PagedKVCache.pages_for_memory(4, 100, fraction=0.05, device=CPU, lever="memory_fraction",
                                      what="target K/V")
