"""Continuous batching: requests join while others run and leave the moment they end; pages
are admitted by budget and conserved; faults and interrupts lose nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from blockdraft import faults
from blockdraft.engine import SpeculativeEngine, Status

from support.scorecard import expect_clear_error, score
from support.tinypair import drafter_config, tiny_drafter, tiny_target

TARGET = tiny_target("qwen3")
DRAFTER = tiny_drafter(drafter_config(block=4))
PROMPTS = [[1, 2, 3], [7], [9, 9, 9, 9, 9], [(3 * i + 5) % 60 for i in range(11)], [40, 2],
           [5, 6, 7, 8, 9, 10, 11, 12]]
_REFERENCE: dict[tuple[int, int], list[int]] = {}


def reference(prompt_index: int, n: int) -> list[int]:
    key = (prompt_index, n)
    if key not in _REFERENCE:
        ids = torch.tensor([PROMPTS[prompt_index]])
        out = TARGET.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        _REFERENCE[key] = out[0, ids.shape[1]:].tolist()
    return _REFERENCE[key]


def small_engine(**kw: Any) -> SpeculativeEngine:
    """Pools that hold about three requests, so others wait."""
    kw = {"runtime": "blockdraft", "max_seq_len": 40, "max_active": 4, "target_pages": 14,
          "page_size": 4, "num_pages": 20, "max_batch": 4, **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


def check_pages(engine: SpeculativeEngine) -> None:
    """Target pages in use are exactly what the running requests reserved; waiting and ended
    requests hold nothing; the drafter pool is consistent."""
    running = [engine.request(rid) for rid in engine_ids(engine) if engine.request(rid).status is Status.RUNNING]
    assert engine.pages_used()["target"] == sum(r.target_pages for r in running)
    assert engine.pages_used()["drafter"] <= sum(r.drafter_pages for r in running)
    for rid in engine_ids(engine):
        r = engine.request(rid)
        if r.status is not Status.RUNNING:
            assert r.target_seq is None and r.state is None
    engine.proposer.pool.check_invariants()
    score.invariant_checks += 3


def engine_ids(engine: SpeculativeEngine) -> list[int]:
    return list(engine.request_ids())


class EngineMachine(RuleBasedStateMachine):
    """Submit / step / cancel in any order; every ended request's tokens are its solo greedy
    output (or a prefix of it when cancelled)."""

    graphs = "auto"  # on the CPU: no graph path

    def __init__(self) -> None:
        super().__init__()
        self.engine = small_engine(graphs=self.graphs)
        assert self.engine.draft_ahead == (self.graphs == "static")
        self.asked: dict[int, tuple[int, int]] = {}
        score.sequences += 1

    @rule(p=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, 9))
    def submit(self, p: int, n: int) -> None:
        rid = self.engine.submit(PROMPTS[p], max_new_tokens=n)
        self.asked[rid] = (p, n)
        assert self.engine.request(rid).status is Status.WAITING
        score.operations += 1

    @rule()
    def step(self) -> None:
        for ev in self.engine.step():
            want = reference(*self.asked[ev.request_id])
            req = self.engine.request(ev.request_id)
            assert req.out == want[: len(req.out)]
            if ev.finished:
                assert ev.finish_reason == "length" and req.out == want
        score.operations += 1

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = [rid for rid in self.asked if not self.engine.request(rid).status.ended]
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        assert self.engine.cancel(rid)
        req = self.engine.request(rid)
        assert req.status is Status.CANCELLED and req.out == reference(*self.asked[rid])[: len(req.out)]
        assert not self.engine.cancel(rid)  # ended: nothing to do
        score.operations += 2

    @invariant()
    def pages(self) -> None:
        check_pages(self.engine)

    def teardown(self) -> None:
        while any(not self.engine.request(r).status.ended for r in self.asked):
            self.engine.step()
        for rid in self.asked:
            assert self.engine.request(rid).status.ended
        assert self.engine.pages_used() == {"target": 0, "drafter": 0}
        self.engine.close()


class GraphBufferEngineMachine(EngineMachine):
    """The same on the graph paths' buffers (``graphs="static"``): a step's drafts stay on the
    device and the next step's are launched before its bookkeeping, so submissions and
    cancellations land between a draft's launch and its verify."""

    graphs = "static"


# Each step is a real forward of both models: shorter runs keep the example count.
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(settings.default, stateful_step_count=25)
TestGraphBufferEngineMachine = GraphBufferEngineMachine.TestCase
TestGraphBufferEngineMachine.settings = settings(settings.default, stateful_step_count=25)


def test_a_request_that_never_fits_is_refused() -> None:
    engine = small_engine(max_seq_len=100)
    with expect_clear_error(ValueError, "can never run"):
        engine.submit(list(range(1, 50)), max_new_tokens=20)  # 18 target pages of 14
    with expect_clear_error(ValueError, "max_seq_len"):
        engine.submit([1], max_new_tokens=100)
    with expect_clear_error(ValueError, "empty"):
        engine.submit([], max_new_tokens=2)
    assert engine.num_waiting == 0 and engine.pages_used() == {"target": 0, "drafter": 0}


def test_requests_wait_for_pages_then_run() -> None:
    engine = small_engine()
    rids = [engine.submit(PROMPTS[3], max_new_tokens=9) for _ in range(5)]
    engine.step()
    assert engine.num_running < 5 and engine.num_waiting > 0  # the pools hold fewer
    done = {ev.request_id for ev in engine.stream(rids) if ev.finished}
    assert done == set(rids)
    assert all(engine.request(r).out == reference(3, 9) for r in rids)
    assert engine.pages_used() == {"target": 0, "drafter": 0}


def test_a_fault_at_admission_fails_that_request_only() -> None:
    engine = small_engine()
    rids = [engine.submit(PROMPTS[p], max_new_tokens=6) for p in (0, 1, 2)]
    with faults.inject("target_pages", 2):
        events = engine.step()
    failed = [ev for ev in events if ev.finish_reason == "error"]
    assert [ev.request_id for ev in failed] == [rids[1]] and "fault injection" in (failed[0].error or "")
    list(engine.stream())
    assert engine.request(rids[0]).out == reference(0, 6)
    assert engine.request(rids[2]).out == reference(2, 6)
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    score.fault_points += 1


@pytest.mark.parametrize("site", ["target_forward", "workspace", "attention", "pool_pages"])
def test_a_fault_in_the_batched_step_loses_no_page(site: str) -> None:
    """The running requests of a failed step fail (or, where the fault is absorbed, finish
    right); one that was waiting for pages meanwhile is unaffected."""
    engine = small_engine()
    running = [engine.submit(PROMPTS[p], max_new_tokens=8) for p in (0, 3)]
    waiting = engine.submit(PROMPTS[3], max_new_tokens=8)  # 6 more pages: 16 of 14
    engine.step()
    engine.step()
    assert engine.request(waiting).status is Status.WAITING
    with faults.inject(site, 1) as plan:
        try:
            engine.step()
        except Exception as exc:  # noqa: BLE001 - inspected below
            assert "fault injection" in str(exc)
    assert plan.fired
    check_pages(engine)
    list(engine.stream())
    for rid, p in zip(running, (0, 3)):
        req = engine.request(rid)
        assert req.out == reference(p, 8)[: len(req.out)]
        assert req.status in (Status.FINISHED, Status.FAILED)
    assert engine.request(waiting).out == reference(3, 8)
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    score.fault_points += 1


def test_keyboard_interrupt_mid_step_leaves_the_pools_full(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = small_engine()
    rids = [engine.submit(PROMPTS[p], max_new_tokens=8) for p in (0, 1, 3)]
    engine.step()

    def interrupted(seqs: Any, blocks: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.target, "verify", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert all(engine.request(r).status is Status.FAILED for r in rids)
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    assert engine.proposer.pool.num_free == engine.proposer.pool.num_pages


def test_stream_yields_each_token_once_in_order() -> None:
    engine = small_engine()
    rids = [engine.submit(PROMPTS[p], max_new_tokens=7) for p in (1, 2)]
    got: dict[int, list[int]] = {r: [] for r in rids}
    for ev in engine.stream():
        got[ev.request_id].extend(ev.tokens)
    assert got == {rids[0]: reference(1, 7), rids[1]: reference(2, 7)}
