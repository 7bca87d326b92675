"""Argument checks shared by the kernel launchers: each failure is a ValueError naming the
argument, raised before anything is launched or written."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; ``None`` entries in ``shape`` accept any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape)
        ):
            want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want_s}, got {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1)")
    return t


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def prev_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x.bit_length() - 1)


def split_count(want: int, tiles: int) -> int:
    """Context splits from a wanted count and the key tiles of the longest context: a power
    of two (at most ``want``, at most the tiles rounded up to one), so the split count is
    one of a few values whatever the lengths are: a split count is a compile-time constant
    of the attention kernels, and a new value on the request path is a compile there."""
    return min(prev_pow2(max(1, want)), next_pow2(max(1, tiles)))


def split_span(split_len: int | None, num_splits: int, block_n: int, max_ctx: int) -> int:
    """The attention kernels' ``split_len`` argument: ``0`` for ``None`` (each sequence's own
    keys shared over the splits, read on the device), else ``split_len`` checked.

    Raises:
        ValueError: not a positive multiple of ``block_n`` whose ``num_splits`` splits cover
            the table's ``max_ctx`` tokens.
    """
    if split_len is None:
        return 0
    if split_len < 1 or split_len % block_n or split_len * num_splits < max_ctx:
        raise ValueError(f"split_len: must be a positive multiple of {block_n} whose "
                         f"{num_splits} splits cover the table's {max_ctx} tokens, got {split_len}")
    return split_len


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 off CUDA, for the interpreter); cached, since the
    properties query would otherwise be host time on every decode step."""
    if device.type != "cuda":
        return 4
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
