"""Serving over tensor-parallel ranks: the engine calls as values, shared by rank 0.

Every rank's :class:`~blockdraft.engine.SpeculativeEngine` must see the same calls in the same
order (submit, cancel, step): the ranks then hold the same pools and hand out the same request
ids without comparing them. Rank 0 runs the HTTP server and the engine loop
(:mod:`blockdraft.serve.loop`); each loop iteration makes its engine calls on rank 0 first, so
rank 0 alone decides what is valid, then broadcasts one :class:`Tick` holding those calls, each
with the id rank 0 got (``None`` when rank 0's call raised), and whether a step follows. The
other ranks (:func:`follow`) make the same calls, check that they get the same ids, and step
when rank 0 steps; their step events are dropped (only rank 0 answers clients).

A submission rank 0's engine refused is still sent: the engine may use up a request id before
it refuses (a request that could never fit the pools), so every rank makes the call and fails
it the same way. Refusals the loop makes without calling the engine (a full queue) are not
sent.

Idle, rank 0 still broadcasts an empty tick every :func:`heartbeat_s`: the other ranks wait in
that broadcast, and the group's collective timeout bounds the wait so that a rank that stops
answering is noticed, which an idle server must not look like.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from blockdraft.engine import SpeculativeEngine
from blockdraft.parallel import TPGroup
from blockdraft.sampling import SamplingParams

if TYPE_CHECKING:
    from blockdraft.grammar import CompiledGrammar

log = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 5.0
"""The longest an idle rank 0 goes without a broadcast (shorter for short collective
timeouts: :func:`heartbeat_s`)."""


def heartbeat_s(timeout_s: float) -> float:
    """How often an idle rank 0 broadcasts: a tenth of the collective timeout, at most
    :data:`HEARTBEAT_MAX_S`, so one late heartbeat is far from a timeout."""
    return min(HEARTBEAT_MAX_S, timeout_s / 10)


@dataclass(frozen=True)
class Submission:
    """What the engine is asked to generate (checked by the handler; the engine checks the
    rest: token ids in the vocabulary, the pools' size). ``grammar``: compiled by the
    handler; each submission gets its own matcher."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: CompiledGrammar | None = None


def submit_to(engine: SpeculativeEngine, sub: Submission) -> int:
    """``engine.submit`` with ``sub``'s arguments: the one call every rank makes for it."""
    mask_fn = None
    if sub.grammar is not None:
        from blockdraft.grammar import matcher_for  # llguidance only when a grammar is asked

        mask_fn = matcher_for(sub.grammar)
    return engine.submit(sub.prompt, max_new_tokens=sub.max_new_tokens,
                         sampling=sub.sampling,
                         stop_token_ids=list(sub.stop_token_ids), seed=sub.seed,
                         min_tokens=sub.min_tokens, logprobs=sub.logprobs,
                         grammar_bitmask_fn=mask_fn)


@dataclass(frozen=True)
class Submit:
    """A submission and the request id rank 0's engine gave it (``None``: it raised)."""

    sub: Submission
    request_id: int | None


@dataclass(frozen=True)
class Cancel:
    """A cancellation of a request that was still running or waiting on rank 0."""

    request_id: int


Call = Submit | Cancel


@dataclass(frozen=True)
class Tick:
    """One iteration of rank 0's engine loop: the calls to make in order, then a step if
    ``step``; ``stop``: close the engine and leave."""

    calls: tuple[Call, ...] = ()
    step: bool = False
    stop: bool = False


class DivergedError(RuntimeError):
    """A rank's engine answered a call differently from rank 0's: the ranks are no longer in
    step, so this rank stops (and with it the group)."""


class Leader:
    """Rank 0's side: the calls of the current iteration, broadcast once per iteration."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.heartbeat_s = heartbeat_s(group.timeout_s)
        self._calls: list[Call] = []
        self._stopped = False

    def submitted(self, sub: Submission, request_id: int | None) -> None:
        if not self._stopped:
            self._calls.append(Submit(sub, request_id))

    def cancelled(self, request_id: int) -> None:
        if not self._stopped:
            self._calls.append(Cancel(request_id))

    def publish(self, *, step: bool) -> None:
        """Send this iteration's calls (none: a heartbeat) and whether a step follows."""
        tick = Tick(tuple(self._calls), step)
        self._calls.clear()
        self.group.broadcast(tick)

    def stop(self) -> None:
        """Tell every rank to close its engine (once; calls recorded afterwards are dropped)."""
        if not self._stopped:
            self._stopped = True
            self._calls.clear()
            self.group.broadcast(Tick(stop=True))


def _apply(engine: SpeculativeEngine, call: Call, rank: int) -> None:
    if isinstance(call, Submit):
        try:
            got: int | None = submit_to(engine, call.sub)
        except Exception:  # noqa: BLE001 - rank 0's call raised too, or the check below says so
            got = None
        if got != call.request_id:
            raise DivergedError(f"tensor-parallel rank {rank}: a submission gave request {got}, "
                                f"rank 0's gave {call.request_id}")
    elif not engine.cancel(call.request_id):
        raise DivergedError(f"tensor-parallel rank {rank}: request {call.request_id} had already "
                            "ended when rank 0 cancelled it")


def follow(engine: SpeculativeEngine, group: TPGroup) -> tuple[dict[str, int], dict[str, int]]:
    """Run a rank after rank 0: make rank 0's engine calls and steps until it says stop, then
    cancel what is left and close the engine.

    Returns:
        the pools at exit, ``(used, total)`` per pool (every page back when ``used`` is all
        zero).

    Raises:
        DivergedError: this rank's engine answered a call differently from rank 0's.
        whatever a step raised, and the group's errors (a collective timed out or lost its
            peer): either leaves the ranks out of step, so this rank ends.
    """
    if group.rank == 0:
        raise ValueError("rank 0 leads (it runs the engine loop); follow() is for the other ranks")
    ticks = 0
    while True:
        tick = group.broadcast(None)
        if not isinstance(tick, Tick):
            raise DivergedError(f"tensor-parallel rank {group.rank}: rank 0 sent "
                                f"{type(tick).__name__}, not a tick")
        if tick.stop:
            break
        ticks += 1
        for call in tick.calls:
            _apply(engine, call, group.rank)
        if tick.step:
            engine.step()
        for rid in engine.request_ids():  # forget() keeps requests that have not ended
            engine.forget(rid)
    for rid in engine.request_ids():
        engine.cancel(rid)
    used, total = engine.pages_used(), engine.pages_total()
    engine.close()
    log.info("tensor-parallel rank %d: engine closed after %d ticks; pools at exit: %s", group.rank,
             ticks, ", ".join(f"{p} {used[p]}/{total[p]} pages used" for p in total))
    return used, total


__all__ = ["HEARTBEAT_MAX_S", "Call", "Cancel", "DivergedError", "Leader", "Submission", "Submit",
           "Tick", "follow", "heartbeat_s", "submit_to"]
