"""Shared set-up for the kernel tests (CPU interpreter and GPU).

Importing this module before ``blockdraft.kernels`` turns on Triton's CPU interpreter when no
GPU is present (the variable must be set before any kernel module is imported). The ``case_*``
helpers in the ``test_kernels_*`` modules take a device and dtype, so the GPU file reruns the
same checks in bf16/fp16.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import blockdraft.kernels as K  # noqa: E402

# Absolute and relative tolerance per dtype: fp32 math with one rounding at the end, compared
# against an fp32 reference that rounds once too.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def triton_skip_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` here, or None if it can."""
    if not K.triton_available():
        return "triton is not importable on this platform"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CPU tensors need TRITON_INTERPRET=1 (set before triton is imported)"
    return None


def need_triton(device: torch.device) -> None:
    reason = triton_skip_reason(device)
    if reason is not None:
        pytest.skip(reason)


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{name}: {m}")


def nan_like(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


def sparse_tensor(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``numel`` elements backed by a sparse file: only the pages
    that are touched take memory, so tests can address element offsets beyond 2**31."""
    size = numel * torch.tensor([], dtype=dtype).element_size()
    with open(path, "wb") as f:
        f.truncate(size)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def random_bitmask(rows: int, vocab: int, gen: torch.Generator, device: torch.device,
                   density: float = 0.5) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32 with each id allowed with probability ``density``."""
    allowed = torch.rand(rows, vocab, generator=gen) < density
    return pack_bitmask(allowed).to(device)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bool -> [R, ceil(V/32)] int32, bit j of word w = id 32*w + j."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64).cpu()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (padded.view(rows, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed)
    return packed.to(torch.int32)
