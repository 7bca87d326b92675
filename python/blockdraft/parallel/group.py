"""The tensor-parallel process group: who this process is, and the few collectives TP needs.

A :class:`TPGroup` is built once per process by :func:`init_tp`, from the environment
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
or :func:`~blockdraft.parallel.launch` sets the same way. Backends: NCCL on CUDA (rank ``r``
uses ``cuda:LOCAL_RANK``), gloo on the CPU. Every collective waits at most the group's timeout
(``init_process_group(timeout=...)``), so a rank that stops answering ends the others with an
error instead of a hang.

A group of one rank (:meth:`TPGroup.single`) needs no ``torch.distributed`` at all: every
collective is the identity, which is how the runtime runs without TP.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
from torch import Tensor

from blockdraft._core import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""The longest one collective waits for the other ranks (every rank runs the same forward,
so a healthy wait is one forward's skew, far below this)."""


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of several started by ``torchrun`` (or a launcher that
    sets the same variables): ``WORLD_SIZE`` > 1 and ``RANK`` set."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group.

    Attributes:
        rank / size: this rank and the number of ranks.
        device: the device this rank computes on (``cuda:LOCAL_RANK`` under NCCL, else CPU).
        backend: ``"nccl"``, ``"gloo"``, or ``None`` for a group of one.
        timeout_s: the longest one collective waits.
    """

    rank: int
    size: int
    device: torch.device
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    process_group: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TPGroup:
        """A group of one rank: every collective is the identity."""
        return cls(rank=0, size=1, device=torch.device(device))

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that prints and answers."""
        return self.rank == 0

    def all_reduce_(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks, in place (every rank ends with the same bits: the sum
        of two floats does not depend on their order, and ring reductions hand every rank
        the same reduced chunks); returns ``t``."""
        if self.size > 1:
            torch.distributed.all_reduce(t, group=self.process_group)
        return t

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (pool sizes sized from each rank's free
        memory must be one number on every rank)."""
        if self.size == 1:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self._comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.process_group)
        return int(t.item())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (any picklable value)."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=self.process_group,
                                                device=self._comm_device)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self.process_group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier(group=self.process_group)

    def close(self) -> None:
        """Wait for every rank, then leave the process group (a group of one: nothing)."""
        if self.size > 1 and torch.distributed.is_initialized():
            self.barrier()
            torch.distributed.destroy_process_group()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")


def end_rank_process(code: int) -> NoReturn:
    """End this rank's process with ``code`` once its work is done and its group closed:
    flush the logs and the standard streams, then exit without interpreter teardown.

    gloo's worker threads outlive ``destroy_process_group``. One that drops its last reference
    to a tensor with a Python object while the interpreter finalizes cannot take the GIL; its
    thread is ended inside C++ code that must not unwind, and the process aborts (SIGABRT)
    after a correct run. Only the process's entry point may call this (the CLI's rank paths,
    the launcher's rank main); nothing after it runs, ``atexit`` handlers included.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush
            pass
    os._exit(code)


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"tensor parallelism: the environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"tensor parallelism: {name}={raw!r} is not an integer") from None


def init_tp(*, device: str | torch.device | None = None, backend: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """Join the tensor-parallel group this process was started in (``WORLD_SIZE`` ranks;
    without ``WORLD_SIZE``, or with 1, a group of one).

    Args:
        device: ``"cuda"`` or ``"cpu"`` (default: CUDA when present). On CUDA, rank ``r``
            takes ``cuda:LOCAL_RANK`` and is made the current device.
        backend: ``"nccl"`` or ``"gloo"`` (default: NCCL on CUDA, gloo on the CPU).
        timeout_s: the longest one collective waits before it raises.

    Raises:
        ConfigError: missing or malformed variables, a rank outside ``0..WORLD_SIZE-1``, more
            local ranks than GPUs, or NCCL without CUDA.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, not {timeout_s}")
    size = _env_int("WORLD_SIZE", 1)
    kind = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"tensor parallelism runs on cpu or cuda, not {kind}")
    if size < 1:
        raise ConfigError(f"tensor parallelism: WORLD_SIZE={size} must be >= 1")
    if size == 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        return TPGroup(rank=0, size=1, device=dev, timeout_s=timeout_s)
    rank = _env_int("RANK")
    local = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < size:
        raise ConfigError(f"tensor parallelism: RANK={rank} is outside 0..{size - 1}")
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"tensor parallelism: backend must be nccl or gloo, not {backend!r}")
    if backend == "nccl" and kind != "cuda":
        raise ConfigError("tensor parallelism: the nccl backend needs CUDA devices")
    if kind == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(
                f"tensor parallelism: LOCAL_RANK={local} but only {torch.cuda.device_count()} "
                "CUDA devices are visible"
            )
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ConfigError(f"tensor parallelism: the environment variable {name} is not set")
    torch.distributed.init_process_group(
        backend, init_method="env://", rank=rank, world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    log.debug("tensor parallelism: rank %d of %d on %s (%s)", rank, size, dev, backend)
    return TPGroup(rank=rank, size=size, device=dev, backend=backend, timeout_s=timeout_s,
                   process_group=torch.distributed.group.WORLD)


__all__ = ["DEFAULT_TIMEOUT_S", "TPGroup", "end_rank_process", "init_tp", "launched_by_torchrun"]
