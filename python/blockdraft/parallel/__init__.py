"""Tensor parallelism: the process group, the launcher, and how sizes split over ranks.

| module | concept |
| --- | --- |
| ``group`` | :class:`TPGroup` and :func:`init_tp`: this rank, its device, its collectives; :func:`end_rank_process` |
| ``launch`` | :func:`launch`: a callable on N fresh ranks, watched (a failed rank stops them all) |
| ``split`` | which head counts and sizes divide, and each rank's part |

The target runtime takes a group (``TargetRuntime(model, tp=group)``,
``SpeculativeEngine(target, drafter, tp=group)``); ``docs/runtime.md`` ("Tensor
parallelism") and ``docs/design/tensor-parallel.md`` describe the split.
"""

from __future__ import annotations

from blockdraft.parallel.group import DEFAULT_TIMEOUT_S, TPGroup, end_rank_process, init_tp, launched_by_torchrun
from blockdraft.parallel.launch import RankFailedError, free_port, launch
from blockdraft.parallel.split import check_split, part

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankFailedError",
    "TPGroup",
    "check_split",
    "end_rank_process",
    "free_port",
    "init_tp",
    "launch",
    "launched_by_torchrun",
    "part",
]
