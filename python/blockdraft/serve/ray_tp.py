"""A tensor-parallel group inside a Ray Serve replica.

``blockdraft serve --tp N --replicas M``: each replica is rank 0 of its own group of N ranks,
as ``blockdraft serve --tp N`` is without Ray, with the same engine loop and the same
broadcast of engine calls (:mod:`blockdraft.serve.tp`). What differs is who starts the
other ranks: the replica starts them as Ray actors (:class:`RankActor`) in the replica's placement group
(``placement_group_bundles``: one bundle of one CPU, and one GPU on CUDA, per rank;
``STRICT_PACK`` keeps them on the replica's node). The replica holds one bundle (which one is
Ray's choice), so each rank actor asks for any bundle of the group and gets one of the others. Ray gives
each rank's actor one GPU, which that actor sees as ``cuda:0``; NCCL finds its peers across
processes that each see one GPU. The group meets on a free loopback port of the replica's
node (``MASTER_ADDR``/``MASTER_PORT``, as :func:`blockdraft.parallel.launch` sets them).

The rank actors are owned by the replica: when Ray stops or replaces the replica, they end
with it. A rank that fails ends its actor call; the replica's health check sees it and raises,
so Ray replaces the whole replica (its group with it). A rank that hangs is noticed by rank 0
after ``--tp-timeout`` (its collective raises, the engine loop ends, the health check raises).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from blockdraft.cli.common import tp_device
from blockdraft.cli.serve_setup import build_serving
from blockdraft.parallel import TPGroup, free_port, init_tp

log = logging.getLogger(__name__)


def _join(args: argparse.Namespace, rank: int, size: int, port: int) -> TPGroup:
    """Join the group as ``rank`` (the environment :func:`init_tp` reads, as torchrun sets it)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": "0", "WORLD_SIZE": str(size)})
    return init_tp(device=tp_device(args.device), timeout_s=float(args.tp_timeout))


class RankActor:
    """One rank after rank 0 (a Ray actor): joins the group, builds its engine as rank 0 does,
    then :meth:`run` follows rank 0 until it says stop."""

    def __init__(self, args: argparse.Namespace, rank: int, size: int, port: int) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        self.args = args
        self.group = _join(args, rank, size, port)
        self.engine = build_serving(args, self.group).engine

    def run(self) -> str | None:
        """Warm up (a collective: rank 0 warms up on its engine loop), then follow rank 0.

        Returns:
            ``None``, or why the pools were not all back at exit.
        """
        from blockdraft.serve.tp import follow

        if not self.args.no_warmup:
            self.engine.warmup()
        used, total = follow(self.engine, self.group)
        self.group.close()
        if any(used.values()):
            return f"tensor-parallel rank {self.group.rank}: pages were not all back at exit: {used} of {total}"
        return None


@dataclass
class RankGroup:
    """Rank 0's view of its group inside a replica: the group and the other ranks' actors.

    Attributes:
        group: rank 0's :class:`~blockdraft.parallel.TPGroup`.
        actors: the rank actors, rank 1 first.
        runs: their :meth:`RankActor.run` calls once :meth:`follow` made them.
    """

    group: TPGroup
    actors: list[Any]
    runs: list[Any]

    @classmethod
    def start(cls, args: argparse.Namespace, size: int) -> RankGroup:
        """Start ranks ``1..size-1`` in the free bundles of the replica's placement group and
        join the group as rank 0 (returns once every rank has joined)."""
        pg = get_current_placement_group()
        if pg is None:
            raise RuntimeError("a tensor-parallel replica needs its placement group "
                               "(placement_group_bundles, one bundle per rank)")
        gpus = 1.0 if tp_device(args.device) == "cuda" else 0.0
        port = free_port()
        remote = ray.remote(RankActor)
        in_group = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=-1)
        actors = [remote.options(num_cpus=1.0, num_gpus=gpus, scheduling_strategy=in_group)
                  .remote(args, rank, size, port) for rank in range(1, size)]
        group = _join(args, 0, size, port)
        log.info("blockdraft replica: tensor-parallel group of %d ranks joined (%s)", size, group.backend)
        return cls(group, actors, [])

    def follow(self) -> None:
        """Let the other ranks follow rank 0 (call once rank 0's engine is built)."""
        self.runs = [actor.run.remote() for actor in self.actors]

    def check(self) -> None:
        """Raise when a rank has ended while rank 0 serves (its error, or that it ended).

        Raises:
            RuntimeError: naming the rank.
        """
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                outcome = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the rank's failure, reported as the replica's
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {type(exc).__name__}: {exc}") from None
            raise RuntimeError(f"tensor-parallel rank {rank} stopped while rank 0 serves"
                               + (f" ({outcome})" if outcome else ""))


__all__ = ["RankActor", "RankGroup"]
