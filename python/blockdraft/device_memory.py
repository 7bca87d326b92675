"""How much memory a device has free now: what the paged K/V pools size themselves against."""

from __future__ import annotations

import os

import torch

UNKNOWN_HOST_FREE = 1 << 30
"""Free host memory assumed where the OS does not report it (1 GiB)."""


def free_bytes(device: torch.device) -> int:
    """Free bytes on ``device``: the CUDA allocator's free memory on a GPU, the available
    physical memory of the host otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return UNKNOWN_HOST_FREE


__all__ = ["UNKNOWN_HOST_FREE", "free_bytes"]
