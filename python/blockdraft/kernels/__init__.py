"""The hot-path kernels of the drafter (and of any forward built on the same pieces).

One op family per module: the Triton kernels and their host launcher (``kv_store``,
``paged_attention``, ``accumulator``, ``selection``, ``topk``, ``graph_inputs``, ``fused``,
``dflash2``, ``skinny_gemm``), and one plain-torch reference for every launcher in
:mod:`blockdraft.kernels.reference`, which is also the ``"torch"`` backend (any device). A
launcher and its reference take the same arguments, so a caller picks a backend once and calls
through :class:`KernelOps`::

    ops = kernels.ops(kernels.resolve_backend("auto", device))
    ops.ctx_kv_store(kv, positions, slots, ...)

Both backends agree within dtype tolerance. Shapes (``R`` rows, ``L`` layers, ``Hq``/``Hkv``
heads, ``D`` head dim, ``B`` block size, ``n`` sequences, ``V`` vocab) are in each reference's
docstring and in ``docs/design/interfaces.md``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from blockdraft._core import ConfigError

from . import reference
from ._validate import interpreting
from .reference import PAD_SLOT, SKINNY_MAX_ROWS

logger = logging.getLogger(__name__)

Backend = Literal["triton", "torch"]

# op name -> the module of its Triton launcher (the reference has the same name)
_TRITON_HOME: dict[str, str] = {
    "ctx_kv_store": "kv_store",
    "block_attention": "paged_attention",
    "masked_argmax": "selection",
    "topk": "topk",
    "block_inputs": "graph_inputs",
    "add_rms_norm": "fused",
    "qk_norm_rope": "fused",
    "silu_mul": "fused",
    "qk_norm_rope_store": "fused",
    "causal_attention": "causal_attention",
    "dynamic_conv": "dflash2",
    "selector_walk": "dflash2",
    "linear": "skinny_gemm",
    "linear_silu_mul": "skinny_gemm",
    "linear_argmax": "skinny_gemm",
}
_triton_mods: dict[str, ModuleType] = {}
_triton_error: str | None = None


def _load_triton() -> str | None:
    """Import the Triton kernel modules once; return why they are unavailable, if they are."""
    global _triton_error
    if _triton_mods or _triton_error is not None:
        return _triton_error
    try:
        for name in (*sorted(set(_TRITON_HOME.values())), "accumulator"):
            _triton_mods[name] = importlib.import_module(f"{__name__}.{name}")
    except ImportError as exc:  # no triton on this platform
        _triton_mods.clear()
        _triton_error = f"triton kernels unavailable: {exc}"
        logger.info("%s; using the torch references", _triton_error)
    return _triton_error


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here."""
    return _load_triton() is None


def resolve_backend(backend: str, device: torch.device) -> Backend:
    """``"auto"`` -> ``"triton"`` on CUDA (the interpreter counts as Triton only when asked
    for by name), ``"torch"`` elsewhere; ``"triton"`` and ``"torch"`` as given.

    Raises:
        ConfigError: an unknown name, or ``"triton"`` where Triton cannot be imported.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ConfigError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise ConfigError(str(_triton_error))
    return "triton" if backend == "triton" else "torch"


@dataclass(frozen=True)
class KernelOps:
    """The launchers of one backend (see the module docstring); built by :func:`ops`.

    Every op but the last two has the signature of the same-named function of
    :mod:`blockdraft.kernels.reference`. ``acc_append`` and ``stage_gather`` address the
    proposer's accumulators by their device addresses, which only a kernel can use: they are
    ``None`` on the torch backend, whose callers copy rows with tensor copies instead.
    """

    backend: Backend
    ctx_kv_store: Callable[..., None]
    block_attention: Callable[..., torch.Tensor]
    masked_argmax: Callable[..., torch.Tensor]
    topk: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    block_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]
    qk_norm_rope_store: Callable[..., torch.Tensor]
    causal_attention: Callable[..., torch.Tensor]
    dynamic_conv: Callable[..., torch.Tensor]
    selector_walk: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    linear: Callable[..., torch.Tensor]
    """Triton: at most :data:`SKINNY_MAX_ROWS` rows (the weight-streaming GEMM)."""
    linear_silu_mul: Callable[..., torch.Tensor]
    linear_argmax: Callable[..., torch.Tensor]
    acc_append: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    """Triton: ``acc_append(rows [R, C], table)`` with ``table`` from :attr:`append_table`
    (columns contiguous, rows any stride apart)."""
    append_table: Callable[..., torch.Tensor] | None = None
    stage_gather: Callable[..., None] | None = None


_OPS: dict[Backend, KernelOps] = {}


def ops(backend: Backend) -> KernelOps:
    """The launchers of ``backend`` (built once per process and backend).

    Raises:
        ConfigError: an unknown backend, or ``"triton"`` where Triton cannot be imported.
    """
    if backend not in ("triton", "torch"):
        raise ConfigError(f"backend must be 'triton' or 'torch', not {backend!r}")
    got = _OPS.get(backend)
    if got is not None:
        return got
    fns: dict[str, Any] = {}
    if backend == "torch":
        fns = {name: getattr(reference, name) for name in _TRITON_HOME}
    else:
        error = _load_triton()
        if error is not None:
            raise ConfigError(error)
        fns = {name: getattr(_triton_mods[mod], name) for name, mod in _TRITON_HOME.items()}
        acc = _triton_mods["accumulator"]
        fns.update(acc_append=acc.acc_append, append_table=acc.append_table,
                   stage_gather=acc.stage_gather)
    made = KernelOps(backend=backend, **fns)
    _OPS[backend] = made
    return made


__all__ = [
    "PAD_SLOT",
    "SKINNY_MAX_ROWS",
    "Backend",
    "KernelOps",
    "interpreting",
    "ops",
    "reference",
    "resolve_backend",
    "triton_available",
]
