"""The engine loop: the one thread that calls the engine.

:class:`~blockdraft.engine.SpeculativeEngine` is not thread-safe, and HTTP handlers run on
asyncio's loop, so the two meet through queues: a handler posts a submission or a
cancellation to the loop's inbox (thread-safe, never blocks) and gets its request's progress
back on an ``asyncio.Queue`` (filled with ``call_soon_threadsafe``). The loop drains its
inbox, steps the batch while anything is waiting or running, and sleeps on the inbox when
nothing is, so an idle server spends no CPU.

A step that raises (a shared failure: the target's forward, say) has already failed every
request it held; the loop reports those requests as errors and goes on with the rest.

An engine that is one rank of a tensor-parallel group (``engine.tp``) is run as its rank 0:
each iteration ends by broadcasting the engine calls it made to the other ranks
(:mod:`blockdraft.serve.tp`), an idle loop wakes every heartbeat to broadcast an empty list,
and a step that raises ends the loop (``on_failure`` is called): after it the ranks can no
longer be shown to be in step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from blockdraft.engine import SpeculativeEngine
from blockdraft.results import TokenLogprob
from blockdraft.serve.errors import APIError, invalid, queue_full, server_error, unavailable
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.tp import Leader, Submission, submit_to

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """New tokens of one request and, on its last update, why it ended.

    Attributes:
        finish_reason: ``None`` while it runs, else ``"stop"``, ``"length"``,
            ``"cancelled"`` or ``"error"`` (``error`` then holds the message).
        steps: tokens per speculative step, for the steps since the previous update (the
            first token comes from the prefill, outside any step).
        out_of_memory: the error was the device running out of memory for the request (a
            later or smaller one may fit: the server answers 503, not 500).
        logprobs: one per token when the submission asked for them, else empty.
    """

    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    steps: tuple[int, ...] = ()
    out_of_memory: bool = False
    logprobs: tuple[TokenLogprob, ...] = ()


_Item = Update | APIError | int


class Ticket:
    """The asyncio side of one submission: its admission answer, then its updates.

    Created on the event loop by :meth:`EngineLoop.submit`; only the engine thread posts to it.
    """

    def __init__(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.request_id: int | None = None  # written by the engine thread only

    async def admitted(self) -> int:
        """Wait for the engine to take the request; returns its id.

        Raises:
            APIError: it was refused (400 bad for this engine, 429 queue full, 503 closing).
        """
        item = await self._items.get()
        if isinstance(item, APIError):
            raise item
        assert isinstance(item, int)
        return item

    async def next(self) -> Update:
        """The request's next update (after :meth:`admitted`)."""
        item = await self._items.get()
        assert isinstance(item, Update)
        return item

    def post(self, item: _Item) -> None:
        """Hand ``item`` to the event loop (from any thread); dropped if that loop is closed."""
        try:
            self._aloop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:
            pass


@dataclass
class _Live:
    ticket: Ticket
    delivered: int = 0
    steps_seen: int = 0
    first_at: float | None = None


_Command = (tuple[Literal["submit"], Ticket, Submission] | tuple[Literal["cancel"], Ticket]
            | tuple[Literal["drain"], float] | tuple[Literal["stop"]])


@dataclass
class FinalState:
    """The pools when the loop stopped (every page back when ``used`` is all zero)."""

    used: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)

    @property
    def all_back(self) -> bool:
        return not any(self.used.values())


class EngineLoop:
    """Runs ``engine`` on a thread of its own.

    Args:
        engine: the engine; from :meth:`start` on, only this loop's thread touches it.
        metrics: updated with tokens, steps, latencies, queue and pool gauges.
        max_queue: the most requests that wait beyond those the next step can start; one
            more is refused with 429 (``Retry-After: retry_after_s``).
        warmup: run :meth:`~blockdraft.SpeculativeEngine.warmup` on the loop's thread before
            the first request (:attr:`warming` until it ends; requests that arrive meanwhile
            wait for it); ``progress`` is passed to it.

    Attributes:
        on_failure: called on the loop's thread when a loop of tensor-parallel rank 0 fails
            (a server stops listening then: every rank has to end).
    """

    def __init__(self, engine: SpeculativeEngine, metrics: ServeMetrics, *, max_queue: int,
                 retry_after_s: int = 1, warmup: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {max_queue}")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._thread = threading.Thread(target=self._run, name="blockdraft-engine", daemon=True)
        self._closing = False
        self._warmup = warmup
        self._progress = progress
        self._warm = threading.Event()
        self._deadline: float | None = None  # draining: cancel what still runs at this time
        self.failure: BaseException | None = None
        self.final: FinalState | None = None
        self.on_failure: Callable[[], None] | None = None
        tp = engine.tp
        self._leader = Leader(tp) if tp is not None and tp.size > 1 else None
        metrics.tp_size.set(tp.size if tp is not None else 1)
        metrics.speculation.set(1 if engine.speculate else 0)
        metrics.set_pools(engine.pages_used(), engine.pages_total())

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    @property
    def warming(self) -> bool:
        """Whether the loop runs but its warm-up has not ended yet."""
        return self._warmup and self.alive and not self._warm.is_set()

    def submit(self, sub: Submission) -> Ticket:
        """Queue ``sub`` (call on the event loop); await :meth:`Ticket.admitted` next."""
        ticket = Ticket(asyncio.get_running_loop())
        if not self.alive:
            ticket.post(unavailable("the server is shutting down" if self._closing
                                    else "the engine loop is not running"))
        else:
            self._inbox.put(("submit", ticket, sub))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End the ticket's request if it still runs (idempotent)."""
        if self._thread.is_alive():
            self._inbox.put(("cancel", ticket))

    def drain(self, grace_s: float) -> None:
        """Take no new request; cancel those still running or waiting after ``grace_s``.

        Safe to call from a signal handler (it only sets a flag and puts one command).
        """
        self._closing = True
        self._inbox.put(("drain", time.monotonic() + grace_s))

    def stop(self, timeout: float | None = None) -> FinalState | None:
        """Cancel what is left, close the engine, and return the pools' final state
        (``None`` when the loop did not finish within ``timeout``)."""
        self._closing = True
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("blockdraft serve: the engine loop did not stop within %s s", timeout)
        elif self.final is None:  # never started: no other thread has touched the engine
            self._close_engine()
        return self.final

    def _run(self) -> None:
        try:
            if self._warmup:
                report = self.engine.warmup(progress=self._progress)
                self.metrics.warmup_seconds.set(report.seconds)
            self._warm.set()
            while True:
                busy = bool(self.engine.num_running or self.engine.num_waiting)
                commands = self._take_commands(block=not busy)
                if any(c[0] == "stop" for c in commands):
                    for c in commands:  # refuse what arrived with the stop
                        if c[0] == "submit":
                            c[1].post(unavailable("the server is shutting down"))
                    break
                for command in commands:
                    self._handle(command)
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._cancel_all()
                step = bool(self.engine.num_running or self.engine.num_waiting)
                if self._leader is not None:
                    self._leader.publish(step=step)
                if step:
                    self._step()
                self._gauges()
        except Exception as exc:  # noqa: BLE001 - the loop's own fault: fail what is live, say why
            log.exception("blockdraft serve: the engine loop failed")
            self.failure = exc
            for live in self._live.values():
                live.ticket.post(Update((), "error", f"the engine loop failed: {exc}"))
            self._live.clear()
        finally:
            self._closing = True
            self._refuse_queued()
            self._close_engine()
            if self.failure is not None and self._leader is not None and self.on_failure is not None:
                self.on_failure()

    def _take_commands(self, *, block: bool) -> list[_Command]:
        out: list[_Command] = []
        if block:
            # Rank 0 of a group wakes to broadcast a heartbeat: the other ranks wait on it.
            timeout = self._leader.heartbeat_s if self._leader is not None else None
            try:
                out.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _handle(self, command: _Command) -> None:
        if command[0] == "submit":
            self._submit(command[1], command[2])
        elif command[0] == "drain":
            deadline = command[1]
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            log.info("blockdraft serve: draining: %d requests running, %d waiting; those left "
                     "in %.1f s are cancelled", self.engine.num_running, self.engine.num_waiting,
                     max(0.0, deadline - time.monotonic()))
        elif command[0] == "cancel":
            ticket = command[1]
            if ticket.request_id is not None and ticket.request_id in self._live:
                self._cancel(ticket.request_id)
                self._report(ticket.request_id)

    def _cancel(self, rid: int) -> None:
        if self.engine.cancel(rid) and self._leader is not None:
            self._leader.cancelled(rid)

    def _submit(self, ticket: Ticket, sub: Submission) -> None:
        eng = self.engine
        startable = max(0, eng.max_active - eng.num_running)
        if eng.num_waiting >= self.max_queue + startable:
            ticket.post(queue_full(self.max_queue, self.retry_after_s))
            return
        try:
            rid = submit_to(eng, sub)
        except Exception as exc:  # noqa: BLE001 - a 400 or a 500 for this request, the loop goes on
            if self._leader is not None:  # the other ranks make the call and fail it too
                self._leader.submitted(sub, None)
            if isinstance(exc, (TypeError, ValueError)):
                ticket.post(invalid(str(exc), "prompt"))
            else:
                log.error("blockdraft serve: submit failed: %s: %s", type(exc).__name__, exc)
                ticket.post(server_error(f"{type(exc).__name__}: {exc}"))
            return
        if self._leader is not None:
            self._leader.submitted(sub, rid)
        ticket.request_id = rid
        self._live[rid] = _Live(ticket)
        ticket.post(rid)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the step's requests have failed; the rest go on
            if self._leader is not None:
                raise  # a rank whose step raised may have left the others inside a collective
            log.error("blockdraft serve: a step failed (%s: %s); its requests are answered "
                      "with errors", type(exc).__name__, exc)
            for rid in list(self._live):
                if self.engine.request(rid).status.ended:
                    self._report(rid)
            return
        for ev in events:
            if ev.request_id in self._live:
                self._report(ev.request_id)

    def _report(self, rid: int) -> None:
        """Post the request's new tokens (and its end); count them in the metrics."""
        live = self._live[rid]
        req = self.engine.request(rid)
        now = time.perf_counter()
        new = tuple(req.out[live.delivered:])
        lps = tuple(req.out_logprobs[live.delivered:len(req.out)])
        live.delivered = len(req.out)
        m = self.metrics
        if new:
            m.generated.inc(len(new))
            if live.first_at is None:
                live.first_at = now
                m.ttft.observe(now - live.ticket.arrived)
        steps = req.steps[live.steps_seen:]
        live.steps_seen = len(req.steps)
        if steps:
            m.spec_steps.inc(len(steps))
            m.accepted.inc(sum(steps) - len(steps))
        if not req.status.ended:
            if new or steps:
                live.ticket.post(Update(new, steps=tuple(steps), logprobs=lps))
            return
        if live.first_at is not None and len(req.out) > 1:
            m.tpot.observe((now - live.first_at) / (len(req.out) - 1))
        oom = isinstance(req.exception, torch.OutOfMemoryError)
        live.ticket.post(Update(new, req.finish_reason, req.error, tuple(steps), oom, lps))
        del self._live[rid]
        self.engine.forget(rid)

    def _cancel_all(self) -> None:
        for rid in list(self._live):
            try:
                self._cancel(rid)
                self._report(rid)
            except Exception:  # noqa: BLE001 - the rest are cancelled all the same
                log.exception("blockdraft serve: cancelling request %d failed", rid)
                live = self._live.pop(rid, None)
                if live is not None:
                    live.ticket.post(Update((), "cancelled"))

    def _gauges(self) -> None:
        self.metrics.running.set(self.engine.num_running)
        self.metrics.waiting.set(self.engine.num_waiting)
        self.metrics.set_pools(self.engine.pages_used(), self.engine.pages_total())
        self.metrics.set_after_warmup(self.engine.compiles_after_warmup,
                                      self.engine.captures_after_warmup)

    def _refuse_queued(self) -> None:
        """Answer the submissions still in the inbox once the loop has ended (503)."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "submit":
                command[1].post(unavailable("the server is shutting down"))

    def _close_engine(self) -> None:
        """Tell the other ranks to stop (a group's rank 0, unless the loop failed: then they
        are stopped by the process that watches them), cancel every request left (their
        clients get ``cancelled``), record the pools, detach the engine from its models."""
        if self._leader is not None and self.failure is None:
            try:
                self._leader.stop()
            except Exception:  # noqa: BLE001 - this rank still closes; the watchdog ends the rest
                log.exception("blockdraft serve: telling the other ranks to stop failed")
        self._cancel_all()
        for rid in self.engine.request_ids():  # any the loop no longer tracks (after a fault)
            self.engine.cancel(rid)
        used, total = self.engine.pages_used(), self.engine.pages_total()
        self.final = FinalState(used, total)
        self._gauges()
        self.engine.close()
        state = ", ".join(f"{p} {used[p]}/{total[p]} pages used" for p in total)
        if self.final.all_back:
            log.info("blockdraft serve: engine closed; pools at exit: %s (every page back)", state)
        else:
            log.error("blockdraft serve: engine closed; pools at exit: %s (pages NOT back)", state)


__all__ = ["EngineLoop", "FinalState", "Submission", "Ticket", "Update"]
