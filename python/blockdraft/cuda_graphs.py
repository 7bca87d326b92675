"""What the proposer's and the runtime's CUDA-graph paths share: the mode setting, the
batch-size buckets, and the capture of one fixed-shape forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from blockdraft._core import ConfigError

GraphMode = Literal["auto", "capture", "static", "off"]
"""``"auto"``: capture CUDA graphs on CUDA, none elsewhere; ``"capture"``: capture (CUDA
only); ``"static"``: the graph path's fixed-shape buffers run eagerly (any device, for tests);
``"off"``: no graph path."""

T = TypeVar("T")


def resolve_mode(mode: str, device: torch.device) -> Literal["capture", "static"] | None:
    """The graph path a ``mode`` gives on ``device`` (``None``: none).

    Raises:
        ConfigError: an unknown mode, or ``"capture"`` off CUDA.
    """
    if mode not in ("auto", "capture", "static", "off"):
        raise ConfigError(f"graphs must be 'auto', 'capture', 'static' or 'off', not {mode!r}")
    if mode == "off":
        return None
    if mode == "auto":
        return "capture" if device.type == "cuda" else None
    if mode == "capture" and device.type != "cuda":
        raise ConfigError("graphs='capture' needs a CUDA device")
    return "static" if mode == "static" else "capture"


def default_buckets(most: int) -> list[int]:
    """Batch sizes with graphs of their own: powers of two below ``most``, and ``most``."""
    out = [1]
    while out[-1] * 2 < most:
        out.append(out[-1] * 2)
    if out[-1] != most:
        out.append(most)
    return out


def capture(fn: Callable[[], T], device: torch.device, pool: Any) -> tuple[Any, T]:
    """``fn`` recorded into a CUDA graph (sharing ``pool``) after two warm-up calls on a side
    stream (Triton compiles, cuBLAS picks its kernels); returns ``(graph, fn's output)``,
    the output being the graph's static result that each replay overwrites."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


__all__ = ["GraphMode", "capture", "default_buckets", "resolve_mode"]
