"""The engine at its limits: a drafter whose ``max_position_embeddings`` is below the
context (drafting stops there, the target decodes alone, output unchanged), a target
reached before ``max_new_tokens`` (the request ends with ``"length"``), and device memory
running out while a request is admitted or prefilled (that request fails, the others finish
with their solo tokens). The tiny pair on the CPU in fp32; every page back after each."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from blockdraft import faults
from blockdraft.engine import SpeculativeEngine
from blockdraft.engine.admission import num_admissible
from blockdraft.engine.request import Request
from blockdraft.sampling import SamplingParams

from support.scorecard import score
from support.tinypair import drafter_config, tiny_drafter, tiny_target

B = 4
DRAFTER_POSITIONS = 24
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def target() -> Any:
    return tiny_target()


@pytest.fixture(scope="module")
def drafter() -> Any:
    return tiny_drafter(drafter_config(block=B))


def short_drafter(positions: int) -> Any:
    """The tiny drafter's weights under a config whose ``max_position_embeddings`` is
    ``positions`` (the target's is 512)."""
    return tiny_drafter(dataclasses.replace(drafter_config(block=B), max_position_embeddings=positions))


def target_only(target: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's greedy continuation by the target alone (its own ``generate``)."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        got = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        out.append(got[0, len(p):].tolist())
    return out


N = 24


@pytest.fixture(scope="module")
def solo(target: Any) -> list[list[int]]:
    """Each of PROMPTS decoded by the target alone, N tokens."""
    return target_only(target, PROMPTS, N)


def idle(engine: SpeculativeEngine) -> bool:
    return not any(engine.pages_used().values()) and engine.num_running == engine.num_waiting == 0


def test_drafter_limit_stops_drafting_and_the_target_decodes_alone(target: Any, solo: list[list[int]]) -> None:
    prompts = PROMPTS
    n = N  # every prompt runs past the drafter's 24 positions
    engine = SpeculativeEngine(target, short_drafter(DRAFTER_POSITIONS), max_seq_len=128, max_active=4)
    prop = engine.proposer
    assert prop.max_positions == DRAFTER_POSITIONS
    assert prop.can_draft(DRAFTER_POSITIONS - B) and not prop.can_draft(DRAFTER_POSITIONS - B + 1)
    rids = [engine.submit(p, max_new_tokens=n) for p in prompts]
    drafted_at: dict[int, list[int]] = {rid: [] for rid in rids}
    real_draft = prop.draft

    def watch(states: Any, anchors: Any, positions: Any, want: Any, **kw: Any) -> Any:
        got = real_draft(states, anchors, positions, want, **kw)
        owner = {id(engine.request(rid).state): rid for rid in rids}
        for st, pos, toks in zip(states, positions, got.tokens):
            if toks:
                drafted_at[owner[id(st)]].append(pos)
        assert not any(got.errors)
        return got

    prop.draft = watch  # type: ignore[method-assign]
    for _ in engine.stream(rids):
        pass
    reqs = [engine.request(r) for r in rids]
    assert all(r.finish_reason == "length" and r.error is None for r in reqs)
    assert [r.out for r in reqs] == solo
    for r in reqs:
        # Drafts were accepted while the blocks fit; past that, one token a step.
        assert drafted_at[r.id] and max(drafted_at[r.id]) <= DRAFTER_POSITIONS - B
        out = 1  # the prefill's token
        for k, got in enumerate(r.steps):
            anchor = len(r.prompt) + out - 1
            assert prop.can_draft(anchor) or got == 1, (r.id, k, anchor, got)
            out += got
        assert out == n
    assert idle(engine)
    engine.close()


def test_drafter_limit_below_the_prompt_drafts_nothing(target: Any) -> None:
    prompt = [(5 * i + 1) % 60 for i in range(50)]
    engine = SpeculativeEngine(target, short_drafter(40), max_seq_len=128, max_active=2)
    got = engine.generate([prompt], max_new_tokens=8)
    assert got.tokens == target_only(target, [prompt], 8)
    assert engine.batched_proposals == engine.single_proposals == 0
    assert idle(engine)
    # Called directly, the proposer refuses the position (nothing changes) or declines a batch.
    st = engine.proposer.alloc_state()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.proposer.propose(st, 1, 40 - B + 1, 3)
    engine.proposer.free_state(st)
    assert engine.proposer.pool.num_used == 0
    engine.close()


def test_the_target_limit_ends_a_request_with_length(target: Any, drafter: Any) -> None:
    """An engine whose max_seq_len is past the target's positions: a request reaching them
    ends there, as at max_new_tokens; a prompt that fills them is refused."""
    limit = int(target.config.max_position_embeddings)
    engine = SpeculativeEngine(target, drafter, max_seq_len=limit + 64, max_active=2)
    long = [(3 * i + 2) % 60 for i in range(limit - 10)]
    rid = engine.submit(long, max_new_tokens=50)
    for _ in engine.stream([rid]):
        pass
    req = engine.request(rid)
    assert req.finish_reason == "length" and req.error is None
    assert len(req.prompt) + len(req.out) == limit
    assert req.out == target_only(target, [long], 10)[0]
    with pytest.raises(ValueError, match="the target's max_position_embeddings"):
        engine.submit([1] * limit, max_new_tokens=1)
    assert idle(engine)
    engine.close()


def _run_to_end(engine: SpeculativeEngine, rids: list[int]) -> None:
    for _ in engine.stream(rids):
        pass


def test_out_of_memory_in_one_prefill_fails_that_request_alone(
    target: Any, drafter: Any, solo: list[list[int]],
) -> None:
    prompts, n = PROMPTS, N
    engine = SpeculativeEngine(target, drafter, max_seq_len=256, max_active=4)
    a, b = (engine.submit(p, max_new_tokens=n) for p in prompts[:2])
    engine.step()  # both prefilled and running
    c = engine.submit(prompts[2], max_new_tokens=n)
    with faults.inject("prefill", 1) as plan:
        events = engine.step()  # c's prefill: its own, before the running ones' step
    assert plan.fired
    score.fault_points += 1
    failed = engine.request(c)
    assert failed.finish_reason == "error" and "out of memory" in (failed.error or "")
    assert isinstance(failed.exception, torch.OutOfMemoryError)
    assert any(ev.request_id == c and ev.finish_reason == "error" for ev in events)
    assert {ev.request_id for ev in events if ev.tokens} == {a, b}  # they stepped on
    _run_to_end(engine, [a, b])
    assert [engine.request(r).out for r in (a, b)] == solo[:2]
    assert idle(engine)
    # The failure left nothing behind: the same prompt runs to its solo tokens now.
    assert engine.generate([prompts[2]], max_new_tokens=n).tokens == [solo[2]]
    engine.close()


def test_out_of_memory_in_a_batched_prefill_retries_each_alone(
    target: Any, drafter: Any, solo: list[list[int]],
) -> None:
    """No request of a batch can be blamed: they go back to the head of the queue and are
    prefilled one a step; one whose own prefill runs out again fails, the rest finish."""
    prompts, n = PROMPTS, N
    engine = SpeculativeEngine(target, drafter, max_seq_len=256, max_active=3)
    rids = [engine.submit(p, max_new_tokens=n) for p in prompts]
    later = engine.submit(prompts[0], max_new_tokens=n)
    with faults.inject("prefill", 1):
        assert engine.step() == []
    assert engine.num_running == 0 and engine.num_waiting == 4 and not any(engine.pages_used().values())
    assert [engine.request(r).prefill_alone for r in [*rids, later]] == [True, True, True, False]
    engine.step()
    assert engine.num_running == 1  # the first, alone
    with faults.inject("prefill", 1):
        engine.step()  # the second's own prefill fails
    assert engine.request(rids[1]).finish_reason == "error"
    _run_to_end(engine, [rids[0], rids[2], later])
    assert [engine.request(r).out for r in (rids[0], rids[2], later)] == [solo[0], solo[2], solo[0]]
    assert idle(engine)
    score.fault_points += 2
    engine.close()


def test_out_of_memory_at_admission_fails_that_request_alone(target: Any, drafter: Any, solo: list[list[int]]) -> None:
    """The proposer state's accumulator (a device allocation at admission) runs out."""
    prompts, n = PROMPTS, N
    engine = SpeculativeEngine(target, drafter, max_seq_len=256, max_active=4)
    with faults.inject("accumulator", 2) as plan:  # the second request's state
        rids = [engine.submit(p, max_new_tokens=n) for p in prompts]
        engine.step()
    assert plan.fired
    bad = engine.request(rids[1])
    assert bad.finish_reason == "error" and isinstance(bad.exception, torch.OutOfMemoryError)
    _run_to_end(engine, rids)
    assert [engine.request(r).out for r in (rids[0], rids[2])] == [solo[0], solo[2]]
    assert idle(engine)
    score.fault_points += 1
    engine.close()


def _req(rid: int, t: int, d: int, *, alone: bool = False) -> Request:
    r = Request(id=rid, prompt=[1], max_new_tokens=1, params=SamplingParams(), stops=frozenset(),
                mask_fn=None, generator=None, submitted_at=0.0, target_pages=t, drafter_pages=d)
    r.prefill_alone = alone
    return r


def test_admission_order_pages_and_prefill_alone() -> None:
    running = [_req(1, 4, 2)]
    waiting = [_req(2, 3, 1), _req(3, 3, 1), _req(4, 1, 1)]
    # Pages: 4 + 3 fit 8, the third does not, and the fourth may not jump it.
    assert num_admissible(waiting, running, max_active=8, target_pages=8, drafter_pages=10) == 1
    assert num_admissible(waiting, running, max_active=8, target_pages=None, drafter_pages=10) == 3
    assert num_admissible(waiting, running, max_active=8, target_pages=None, drafter_pages=4) == 2
    assert num_admissible(waiting, running, max_active=2, target_pages=None, drafter_pages=10) == 1
    alone = [_req(2, 1, 1, alone=True), _req(3, 1, 1)]
    assert num_admissible(alone, running, max_active=8, target_pages=None, drafter_pages=10) == 1
    behind = [_req(2, 1, 1), _req(3, 1, 1, alone=True)]
    assert num_admissible(behind, running, max_active=8, target_pages=None, drafter_pages=10) == 1
