"""The serve engine loop (``EngineLoop``) driven directly over a tiny engine, no HTTP.

The engine's steps are held at a gate the test opens one step at a time, so "while queued",
"while running" and "in flight at shutdown" are states the test puts the loop in, not races.
Every wait has a deadline: a loop that hangs fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

import blockdraft
from blockdraft.engine import SpeculativeEngine
from blockdraft.serve.errors import APIError
from blockdraft.serve.loop import EngineLoop, Submission, Ticket, Update
from blockdraft.serve.metrics import ServeMetrics

from support.tinypair import drafter_config, tiny_drafter, tiny_target

TARGET = tiny_target("qwen3")
DRAFTER = tiny_drafter(drafter_config(block=4))
PROMPTS = [[1, 2, 3], [7], [9, 9, 9, 9, 9], [40, 2]]
DEADLINE_S = 30.0
T = TypeVar("T")


def engine(max_active: int = 4) -> SpeculativeEngine:
    return SpeculativeEngine(TARGET, DRAFTER, runtime="blockdraft", max_seq_len=40,
                             max_active=max_active, target_pages=48, page_size=4, num_pages=48,
                             max_batch=4)


_REFERENCE: dict[tuple[int, int], list[int]] = {}


def reference(prompt: int, n: int) -> list[int]:
    """``engine.generate``'s tokens for ``PROMPTS[prompt]`` (greedy, ``n`` new tokens)."""
    if (prompt, n) not in _REFERENCE:
        with engine() as eng:
            _REFERENCE[(prompt, n)] = list(eng.generate([PROMPTS[prompt]], max_new_tokens=n).tokens[0])
    return _REFERENCE[(prompt, n)]


class Gate:
    """Holds each ``engine.step`` until :meth:`allow` lets it through (``open`` lets every
    step through)."""

    def __init__(self, eng: SpeculativeEngine) -> None:
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self._arrived = threading.Condition()
        self.arrivals = 0
        self.steps = 0
        real = eng.step

        def step() -> Any:
            with self._arrived:
                self.arrivals += 1
                self._arrived.notify_all()
            if not self._open.is_set() and not self._permits.acquire(timeout=DEADLINE_S):
                raise AssertionError("the test never let this step through")
            self.steps += 1
            return real()

        eng.step = step  # type: ignore[method-assign]

    def allow(self, n: int = 1) -> None:
        self._permits.release(n)

    def wait_held(self, n: int) -> None:
        """Wait until the ``n``-th step has reached the gate."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: self.arrivals >= n, DEADLINE_S), "no step came"

    def open(self) -> None:
        self._open.set()
        self._permits.release(1)


def run(body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(asyncio.wait_for(body(), 3 * DEADLINE_S))


async def within(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, DEADLINE_S)


async def updates_until(ticket: Ticket, *, tokens_at_least: int | None = None) -> tuple[list[int], Update]:
    """The request's tokens and its last update: its end, or (``tokens_at_least``) the
    update that brings it to that many tokens."""
    out: list[int] = []
    while True:
        up = await within(ticket.next())
        out.extend(up.tokens)
        if up.finish_reason is not None:
            return out, up
        if tokens_at_least is not None and len(out) >= tokens_at_least:
            return out, up


async def refused(ticket: Ticket) -> APIError:
    with pytest.raises(APIError) as info:
        await within(ticket.admitted())
    return info.value


def sample(metrics: ServeMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def stop(loop: EngineLoop) -> None:
    final = await asyncio.to_thread(loop.stop, DEADLINE_S)
    assert final is not None and final.all_back, final
    assert not loop.alive


def test_submissions_get_the_engines_tokens() -> None:
    """Three concurrent submissions stream, in order, exactly ``engine.generate``'s tokens;
    the metrics count them; a prompt the engine refuses is a 400 and the loop goes on."""
    want = [reference(i, 12) for i in range(3)]

    async def body() -> None:
        metrics = ServeMetrics()
        loop = EngineLoop(engine(), metrics, max_queue=8)
        loop.start()
        try:
            tickets = [loop.submit(Submission(PROMPTS[i], 12)) for i in range(3)]
            rids = [await within(t.admitted()) for t in tickets]
            assert len(set(rids)) == 3
            bad = await refused(loop.submit(Submission([10**6], 4)))
            assert bad.status == 400
            got = [await updates_until(t) for t in tickets]
            assert [g[0] for g in got] == want
            assert all(g[1].finish_reason == "length" and g[1].error is None for g in got)
            assert sample(metrics, "blockdraft_generated_tokens_total") == sum(map(len, want))
            assert sample(metrics, "blockdraft_time_to_first_token_seconds_count") == 3
            assert loop.alive and loop.failure is None
        finally:
            await stop(loop)

    run(body)


def test_cancel_while_queued_and_while_running() -> None:
    """One request runs at a time: the queued one cancelled ends with no token, the running
    one ends ``cancelled`` with the tokens it had (a prefix of its full output), and every page
    is back while the loop still runs."""
    full = reference(0, 30)

    async def body() -> None:
        metrics = ServeMetrics()
        eng = engine(max_active=1)
        gate = Gate(eng)
        loop = EngineLoop(eng, metrics, max_queue=4)
        loop.start()
        try:
            running = loop.submit(Submission(PROMPTS[0], 30))
            queued = loop.submit(Submission(PROMPTS[1], 30))
            await within(running.admitted())
            await within(queued.admitted())
            gate.allow()
            first, _ = await updates_until(running, tokens_at_least=1)
            loop.cancel(queued)
            gate.allow()  # the step in progress ends; then the cancel is taken
            tokens, end = await updates_until(queued)
            assert (tokens, end.finish_reason) == ([], "cancelled")
            loop.cancel(running)
            gate.allow()
            rest, end = await updates_until(running)
            assert end.finish_reason == "cancelled" and end.error is None
            got = first + rest
            assert 0 < len(got) < 30 and got == full[:len(got)]
            loop.cancel(running)  # ended: nothing happens
            await within(asyncio.to_thread(_wait_idle, metrics))
            assert loop.alive
        finally:
            gate.open()
            await stop(loop)

    run(body)


def _wait_idle(metrics: ServeMetrics) -> None:
    """Nothing running or waiting and every page back, by the loop's gauges."""
    import time

    end = time.monotonic() + DEADLINE_S
    while not (sample(metrics, "blockdraft_requests_running") == 0
               and sample(metrics, "blockdraft_requests_waiting") == 0
               and sample(metrics, "blockdraft_pool_pages_used", pool="target") == 0
               and sample(metrics, "blockdraft_pool_pages_used", pool="drafter") == 0):
        assert time.monotonic() < end, "the pages did not come back"
        time.sleep(0.01)


def test_a_full_queue_refuses_with_429() -> None:
    """One request can start and one more may wait: a third is refused with 429 and
    ``Retry-After``; the two taken finish with their full outputs."""

    async def body() -> None:
        eng = engine(max_active=1)
        gate = Gate(eng)
        loop = EngineLoop(eng, ServeMetrics(), max_queue=1, retry_after_s=7)
        loop.start()
        try:
            tickets = [loop.submit(Submission(PROMPTS[i], 8)) for i in range(3)]
            await within(tickets[0].admitted())
            gate.allow()  # whether or not the others came with the first, the answer is the same
            await within(tickets[1].admitted())
            full = await refused(tickets[2])
            assert full.status == 429 and full.headers == {"Retry-After": "7"}
            gate.open()
            for i in range(2):
                tokens, end = await updates_until(tickets[i])
                assert tokens == reference(i, 8) and end.finish_reason == "length"
        finally:
            gate.open()
            await stop(loop)

    with pytest.raises(ValueError, match="max_queue"):
        EngineLoop(engine(), ServeMetrics(), max_queue=-1)
    run(body)


def test_stop_with_requests_in_flight() -> None:
    """``stop`` while a step is held: it gives up waiting after its timeout (``None``); once
    the step ends, each request in flight, running or queued, ends ``cancelled``, every page
    is back, and a later submission is a 503."""

    async def body() -> None:
        eng = engine(max_active=2)
        gate = Gate(eng)
        loop = EngineLoop(eng, ServeMetrics(), max_queue=4)
        loop.start()
        tickets = [loop.submit(Submission(PROMPTS[i], 30)) for i in range(3)]
        for t in tickets:
            await within(t.admitted())
        gate.allow()
        await updates_until(tickets[0], tokens_at_least=1)
        await within(asyncio.to_thread(gate.wait_held, 2))
        assert await asyncio.to_thread(loop.stop, 0.05) is None  # the step is still held
        assert not loop.alive
        late = await refused(loop.submit(Submission(PROMPTS[0], 4)))
        assert late.status == 503 and "shutting down" in str(late)
        gate.open()
        await stop(loop)
        for t in tickets:
            _, end = await updates_until(t)
            assert end.finish_reason == "cancelled"

    run(body)


def test_an_unstarted_loop_refuses_and_still_closes_the_engine() -> None:
    async def body() -> None:
        eng = engine()
        loop = EngineLoop(eng, ServeMetrics(), max_queue=4)
        no = await refused(loop.submit(Submission(PROMPTS[0], 4)))
        assert no.status == 503 and "not running" in str(no)
        final = loop.stop(1.0)
        assert final is not None and final.all_back and final.total["target"] == 48

    run(body)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    """The target's forward fails inside a step (an injected out-of-memory): both requests of
    that step end with an error naming it, their pages come back, and the next request runs
    to its full output."""

    async def body() -> None:
        metrics = ServeMetrics()
        eng = engine(max_active=2)
        gate = Gate(eng)
        loop = EngineLoop(eng, metrics, max_queue=4)
        loop.start()
        try:
            tickets = [loop.submit(Submission(PROMPTS[i], 30)) for i in range(2)]
            for t in tickets:
                await within(t.admitted())
            for t in tickets:  # the engine starts one request per step
                gate.allow()
                await updates_until(t, tokens_at_least=1)
            # the loop thread waits at the gate: arming here races with no engine call
            await within(asyncio.to_thread(gate.wait_held, 3))
            with blockdraft.faults.inject("target_forward", 1) as plan:
                gate.allow()
                ends = [await updates_until(t) for t in tickets]
            assert plan.fired
            for _, end in ends:
                assert end.finish_reason == "error"
                assert end.error is not None and "fault injection" in end.error
            await within(asyncio.to_thread(_wait_idle, metrics))
            gate.open()
            after = loop.submit(Submission(PROMPTS[3], 10))
            await within(after.admitted())
            tokens, end = await updates_until(after)
            assert tokens == reference(3, 10) and end.finish_reason == "length"
            assert loop.alive and loop.failure is None
        finally:
            gate.open()
            await stop(loop)

    run(body)


def test_the_loop_failing_ends_every_request_and_health() -> None:
    """A fault of the loop's own (its gauges, here) ends the loop: the running request gets an
    error naming it, the loop is no longer alive (``/health`` answers 503 on that), later
    submissions are 503, and the engine is closed with every page back."""

    async def body() -> None:
        metrics = ServeMetrics()
        eng = engine()
        gate = Gate(eng)
        loop = EngineLoop(eng, metrics, max_queue=4)
        loop.start()
        ticket = loop.submit(Submission(PROMPTS[0], 30))
        await within(ticket.admitted())
        real = metrics.set_pools
        failed: list[bool] = []

        def set_pools_once_broken(used: dict[str, int], total: dict[str, int]) -> None:
            if not failed:
                failed.append(True)
                raise RuntimeError("gauge broke")
            real(used, total)

        metrics.set_pools = set_pools_once_broken  # type: ignore[method-assign]
        gate.open()
        _, end = await updates_until(ticket)
        assert end.finish_reason == "error"
        assert end.error == "the engine loop failed: gauge broke"
        await within(asyncio.to_thread(_joined, loop))
        assert not loop.alive and isinstance(loop.failure, RuntimeError)
        assert loop.final is not None and loop.final.all_back
        late = await refused(loop.submit(Submission(PROMPTS[0], 4)))
        assert late.status == 503

    run(body)


def _joined(loop: EngineLoop) -> None:
    """Wait for the loop's thread to end (``stop`` on an ended loop returns at once)."""
    import time

    end = time.monotonic() + DEADLINE_S
    while loop.final is None:
        assert time.monotonic() < end, "the loop did not end"
        time.sleep(0.01)
    loop.stop(DEADLINE_S)
