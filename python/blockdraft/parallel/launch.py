"""Run one callable on N ranks of a fresh tensor-parallel group, and watch them.

:func:`launch` starts N processes (``multiprocessing`` spawn: CUDA and gloo both need a fresh
interpreter), gives them a free local port for the group's rendezvous, and calls ``fn(group,
*args)`` on each with its :class:`~blockdraft.parallel.TPGroup`. The launcher is the watchdog:
the moment any rank exits non-zero (an exception, a signal, the OOM killer), it stops every
other rank and raises :class:`RankFailedError` naming the rank that failed first. Ranks blocked
in a collective on the dead rank would otherwise wait for the group's timeout; the watchdog
does not wait for them.

A long-running group that stops itself (a server: rank 0 drains its requests, then tells the
other ranks to stop) asks for ``forward_signals``: SIGINT and SIGTERM sent to the launcher go
to rank 0 alone instead of stopping every rank, and the ranks run in a process group of their
own, so a terminal's Ctrl-C reaches the launcher only (and through it rank 0, once).

Under ``torchrun`` there is nothing to launch: every rank calls
:func:`~blockdraft.parallel.init_tp` itself, and ``torchrun`` is the watchdog.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from blockdraft._core import ConfigError
from blockdraft.errors import error_line
from blockdraft.parallel.group import DEFAULT_TIMEOUT_S, TPGroup, end_rank_process, init_tp

log = logging.getLogger(__name__)

T = TypeVar("T")

STOP_GRACE_S = 5.0
"""How long a rank asked to stop (SIGTERM) may take before it is killed."""

CAUSE_GRACE_S = 2.0
"""How long the watchdog waits, once every failed rank failed in a collective that lost its
peer, for the rank that caused it to end too."""


class RankFailedError(RuntimeError):
    """One rank of a launched group failed; every other rank was stopped.

    Attributes:
        rank: the rank that failed first.
        exitcode: its exit code (negative: the signal that ended it).
        error: its exception as one line (``None`` when it died without raising).
        remote_traceback: that exception's traceback as text (``None`` likewise).
    """

    def __init__(self, rank: int, exitcode: int | None, error: str | None,
                 remote_traceback: str | None = None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.error = error
        self.remote_traceback = remote_traceback
        if error is not None:
            how = f"failed: {error}"
        elif exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = str(-exitcode)
            how = f"was killed by signal {name}"
        elif exitcode == 0:
            how = "exited without a result"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"tensor-parallel rank {rank} {how}; the other ranks were stopped")


@dataclass
class _Report:
    ok: bool
    value: Any = None
    error: str | None = None
    trace: str | None = None
    collective: bool = False  # the failure was a collective losing its peer, not a cause


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _one_line(exc: BaseException) -> str:
    line = error_line(exc)
    return line if line == type(exc).__name__ else f"{type(exc).__name__}: {line}"


def _is_collective_failure(exc: BaseException) -> bool:
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return any(w in text for w in ("gloo", "nccl", "connection closed", "connection reset"))


def _send(conn: Any, report: _Report) -> None:
    # Plain pickle copies tensors into the message; multiprocessing's own pickling would pass
    # shared-memory handles that die with this process.
    conn.send_bytes(pickle.dumps(report))


def _rank_main(rank: int, size: int, port: int, fn: Callable[..., Any], args: Sequence[Any],
               conn: Any, device: str | None, backend: str | None, timeout_s: float,
               threads: int | None, own_group: bool = False) -> None:
    if own_group:
        os.setpgrp()
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(size),
    })
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        group = init_tp(device=device, backend=backend, timeout_s=timeout_s)
        value = fn(group, *args)
        group.close()
        _send(conn, _Report(ok=True, value=value))
        conn.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then this rank ends
        try:
            _send(conn, _Report(ok=False, error=_one_line(exc), trace=traceback.format_exc(),
                                collective=_is_collective_failure(exc)))
            conn.close()
        finally:
            # No interpreter teardown: joining the group's threads can block on a dead peer.
            end_rank_process(1)
    end_rank_process(0)


def _stop(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(
    fn: Callable[..., T],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    device: str | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = None,
    forward_signals: bool = False,
) -> list[T]:
    """Run ``fn(group, *args)`` on ``nprocs`` ranks and return each rank's value, in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function: each rank is a fresh
    interpreter that imports it). Each rank prints what it prints; by convention only rank 0
    (``group.is_first``) does. With ``nprocs == 1`` ``fn`` runs here, in a group of one.

    Args:
        device: ``"cuda"`` (rank ``r`` on ``cuda:r``, NCCL) or ``"cpu"`` (gloo); default:
            CUDA when present.
        backend: override the backend (``"gloo"`` or ``"nccl"``).
        timeout_s: the longest one collective waits (the group's timeout).
        threads: torch CPU threads per rank (default on the CPU: the cores shared out, at
            least 1; on CUDA: torch's default).
        forward_signals: pass SIGINT/SIGTERM to rank 0 (which is to stop the group) instead
            of stopping every rank, and start the ranks in a process group of their own
            (signal handlers are installed only when called from the main thread).

    Raises:
        RankFailedError: a rank raised or died; every other rank has been stopped.
        ConfigError: more ranks than CUDA devices.
        ValueError: ``nprocs`` below 1.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, not {nprocs!r}")
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if nprocs == 1:
        return [fn(TPGroup.single(kind if kind == "cpu" else f"cuda:{torch.cuda.current_device()}"), *args)]
    if kind.startswith("cuda") and nprocs > torch.cuda.device_count():
        raise ConfigError(f"{nprocs} ranks need {nprocs} CUDA devices; {torch.cuda.device_count()} are visible")
    if threads is None and not kind.startswith("cuda"):
        threads = max(1, (os.cpu_count() or 1) // nprocs)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs: list[Any] = []
    conns: list[Any] = []
    previous = _forward_to_first(procs) if forward_signals else {}
    try:
        for rank in range(nprocs):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"blockdraft-tp-rank{rank}",
                            args=(rank, nprocs, port, fn, tuple(args), send, device, backend,
                                  timeout_s, threads, forward_signals))
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        log.debug("tensor parallelism: launched %d ranks (port %d)", nprocs, port)
        return _watch(procs, conns)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward_to_first(procs: Sequence[Any]) -> dict[int, Any]:
    """Handlers that pass SIGINT/SIGTERM on to rank 0; returns the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(sig: int, frame: Any) -> None:
        if procs and procs[0].pid is not None and procs[0].exitcode is None:
            os.kill(procs[0].pid, sig)
        elif not procs:  # before rank 0 exists there is nothing to stop gracefully
            raise KeyboardInterrupt

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}


def _watch(procs: Sequence[Any], conns: Sequence[Any]) -> list[Any]:
    """Wait for every rank; on the first failure, stop the rest and raise."""
    reports: dict[int, _Report] = {}
    n = len(procs)
    while True:
        _wait(procs, conns, reports, 1.0)
        failed = _failed(procs, conns, reports)
        # A collective that lost its peer is a symptom: the peer's own end (a signal, its
        # exception) can reach this process after the symptom does, so give it a moment.
        deadline = time.monotonic() + CAUSE_GRACE_S
        while (failed and len(failed) < n and all(_lost_a_peer(reports.get(r)) for r in failed)
               and time.monotonic() < deadline):
            _wait(procs, conns, reports, deadline - time.monotonic())
            failed = _failed(procs, conns, reports)
        if failed:
            # How each failed rank ended, before stopping the others turns them into SIGTERMs.
            codes = {r: procs[r].exitcode for r in failed}
            _stop(procs)
            for r in failed:
                rep = reports.get(r)
                if codes[r] is None and (rep is None or rep.error is None):
                    codes[r] = procs[r].exitcode  # it died on its own before it was reaped
            r = _culprit(failed, codes, reports)
            rep = reports.get(r)
            raise RankFailedError(r, procs[r].exitcode, rep.error if rep else None,
                                  rep.trace if rep else None)
        if all(procs[r].exitcode == 0 for r in range(n)) and all(reports[r].ok for r in range(n)):
            return [reports[r].value for r in range(n)]


def _wait(procs: Sequence[Any], conns: Sequence[Any], reports: dict[int, _Report],
          timeout: float) -> None:
    """Wait up to ``timeout`` for a report or a rank's end; read every report that arrived."""
    waiting = [conns[r] for r in range(len(procs)) if r not in reports]
    multiprocessing.connection.wait([*waiting, *(p.sentinel for p in procs)], timeout=max(0.0, timeout))
    for r in range(len(procs)):
        if r not in reports and conns[r].poll():
            try:
                reports[r] = pickle.loads(conns[r].recv_bytes())
            except EOFError:
                reports[r] = _Report(ok=False)


def _failed(procs: Sequence[Any], conns: Sequence[Any], reports: dict[int, _Report]) -> list[int]:
    """The ranks that have failed so far, in rank order: a non-zero exit, a failure report, or
    a clean exit that left no report."""
    failed = []
    for r, p in enumerate(procs):
        if p.exitcode == 0 and r not in reports and not conns[r].poll():
            reports[r] = _Report(ok=False)
        if p.exitcode not in (None, 0) or (r in reports and not reports[r].ok):
            failed.append(r)
    return failed


def _lost_a_peer(rep: _Report | None) -> bool:
    return rep is not None and rep.collective


def _culprit(failed: list[int], codes: dict[int, int | None], reports: dict[int, _Report]) -> int:
    """The rank to name as the cause: one ended by a signal first, then one whose exception is
    not a collective that lost its peer, then the lowest rank."""
    def order(r: int) -> tuple[int, int]:
        code = codes[r]
        rep = reports.get(r)
        if code is not None and code < 0 and (rep is None or rep.error is None):
            return (0, r)
        return (2 if rep is not None and rep.collective else 1, r)

    return min(failed, key=order)


__all__ = ["RankFailedError", "free_port", "launch"]
