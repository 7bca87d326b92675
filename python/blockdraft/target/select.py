"""Which backend runs a target, and building it: the engine's one call for its target side."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blockdraft._core import ConfigError
from blockdraft.cuda_graphs import GraphMode
from blockdraft.parallel.group import TPGroup
from blockdraft.target.adapter import TargetAdapter
from blockdraft.target.backend import RuntimeTarget, TargetBackend, resolve_runtime
from blockdraft.target.hf import HFTarget
from blockdraft.target.runtime import TargetRuntime, model_shard


def choose_runtime(runtime: str, target: Any, tp: TPGroup | None) -> str:
    """``"blockdraft"`` or ``"hf"`` (:func:`~blockdraft.target.backend.resolve_runtime`), with
    what tensor parallelism needs: every rank on the blockdraft runtime, and no Hugging Face
    forward over a shard.

    Raises:
        ConfigError: the choice cannot serve this target or group (the message says why).
    """
    parallel = tp is not None and tp.size > 1
    if parallel and runtime == "hf":
        raise ConfigError("tensor parallelism runs the target on the blockdraft runtime, not runtime='hf'")
    which = resolve_runtime(runtime, target)
    if which == "hf" and parallel:
        raise ConfigError("tensor parallelism needs the blockdraft runtime, which does not "
                          f"support {type(target).__name__}")
    if which == "hf" and model_shard(target) != (0, 1):
        raise ConfigError("the target holds a tensor-parallel shard: its Hugging Face "
                          "forward cannot run (use runtime='blockdraft' with its group)")
    return which


def open_target(
    target: Any,
    drafter_config: Any,
    which: str,
    *,
    block_size: int,
    max_seq_len: int,
    num_pages: int | None,
    page_size: int,
    max_batch: int,
    capture_layers: Sequence[int],
    graphs: GraphMode,
    graph_rows: Sequence[int],
    tp: TPGroup | None,
    sdpa_backends: Any,
) -> TargetBackend:
    """The backend ``which`` (from :func:`choose_runtime`) over ``target``: the runtime with
    its paged K/V and graphs sized by the arguments, or the model's own forward under
    ``sdpa_backends`` (the sizes do not apply to it)."""
    if which == "blockdraft":
        rt = TargetRuntime(
            target, max_seq_len=max_seq_len, num_pages=num_pages, page_size=page_size,
            max_batch=max_batch, capture_layers=tuple(capture_layers), graphs=graphs,
            graph_rows=tuple(graph_rows), tp=tp,
        )
        return RuntimeTarget(rt, block_size)
    return HFTarget(TargetAdapter(target, drafter_config), sdpa_backends)


__all__ = ["choose_runtime", "open_target"]
