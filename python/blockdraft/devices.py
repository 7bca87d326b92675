"""What the library asks of a device: the memory it has free now (what the paged K/V pools size
themselves against), the dtype models run in there by default, and waiting for its queued work."""

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


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere (CPUs compute bf16 slowly and less exactly)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA, where every call is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["UNKNOWN_HOST_FREE", "default_dtype", "free_bytes", "sync"]
