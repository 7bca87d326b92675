"""Warm-up: it runs the request paths and leaves nothing behind; compiles and captures after
it are counted and logged."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from blockdraft.engine import SpeculativeEngine, compiles
from blockdraft.engine.compiles import CompileWatch
from blockdraft.engine.warmup import pow2_upto, prompt_lengths

from support import runtime_models
from support.tinypair import drafter_config, tiny_drafter, tiny_target

TARGET = tiny_target("qwen3")
DRAFTER = tiny_drafter(drafter_config(block=4))
PROMPTS = [[1, 2, 3], [7], [(3 * i + 5) % 60 for i in range(11)]]


def small_engine(**kw: Any) -> SpeculativeEngine:
    kw = {"runtime": "blockdraft", "max_seq_len": 40, "max_active": 3, "page_size": 4,
          "max_batch": 3, "graphs": "static", **kw}
    return SpeculativeEngine(TARGET, DRAFTER, **kw)


def hf_greedy(prompt: list[int], n: int) -> list[int]:
    return runtime_models.hf_greedy(TARGET, prompt, n)


def test_warmup_leaves_nothing_behind_and_counts_nothing_after() -> None:
    """After warm-up: every page back in both pools, no request known, the next request id
    and the step counters as on a fresh engine; the requests that follow decode as the
    target's own greedy decoding, and no compile or capture happens for them."""
    engine = small_engine()
    fresh = small_engine()
    assert not engine.is_warm and engine.compiles_after_warmup == 0
    report = engine.warmup()
    assert report.requests > 0 and report.forwards > 0 and report.seconds > 0
    assert engine.is_warm and engine.warmup_report is report
    assert engine.pages_used() == {"target": 0, "drafter": 0}
    assert engine.request_ids() == [] and engine.num_waiting == engine.num_running == 0
    assert engine.runtime is not None and fresh.runtime is not None
    assert engine.runtime.pool.num_free == engine.runtime.pool.num_pages
    engine.proposer.pool.check_invariants()
    for name in ("steps", "batched_proposals", "single_proposals"):
        assert getattr(engine, name) == getattr(fresh, name) == 0, name
    assert engine.submit([1, 2], max_new_tokens=2) == fresh.submit([1, 2], max_new_tokens=2)
    engine.cancel(1)
    engine.forget(1)
    got = engine.generate(PROMPTS, max_new_tokens=6).tokens
    assert got == [hf_greedy(p, 6) for p in PROMPTS]
    assert engine.compiles_after_warmup == 0 and engine.captures_after_warmup == 0


def test_warmup_reaches_every_graph_bucket() -> None:
    """The static graph paths (same buffers as captured graphs) took every batch bucket:
    the target's decode and verify rows, the proposer's buckets."""
    engine = small_engine()
    engine.warmup(max_prompt=4)
    rt = engine.runtime
    assert rt is not None and rt.graphs is not None
    assert rt.graphs.calls >= len(rt.graphs.buckets) * len(rt.graphs.rows)
    runner = engine.proposer.graph_runner
    assert runner is not None
    assert all(runner.bucket(b) is not None for b in runner.buckets)


def test_warmup_refuses_a_busy_engine() -> None:
    engine = small_engine()
    engine.submit([1, 2, 3], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warmup()
    assert engine.num_waiting == 1


def test_prompt_lengths_are_length_classes() -> None:
    assert pow2_upto(1) == [1] and pow2_upto(12) == [1, 2, 4, 8, 12]
    engine = small_engine()
    assert prompt_lengths(engine, None) == [1, 2, 3, 4, 8, 16, 32, 39]  # max_seq_len 40, a new token
    assert prompt_lengths(engine, 5) == [1, 2, 3, 4, 5]


def test_warmup_fits_an_engine_sized_for_one_short_request() -> None:
    """An engine whose max_seq_len holds less than a block of new tokens (the one-call
    ``generate`` sizes it to its prompts) warms up with the requests that fit."""
    engine = SpeculativeEngine(TARGET, DRAFTER, runtime="blockdraft", max_seq_len=6, max_active=2)
    report = engine.warmup()
    assert report.requests > 0 and engine.is_warm
    assert engine.pages_used() == {"target": 0, "drafter": 0}


def test_triton_compile_hook_counts_and_chains() -> None:
    """The hook this Triton calls after each compile counts it, and a hook installed before
    still runs."""
    triton = pytest.importorskip("triton")
    assert compiles.install()
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton takes the hook on JITFunction (3.3)")
    ours = runtime.jit_post_compile_hook
    seen: list[str] = []
    runtime.jit_post_compile_hook = compiles._on_compile(lambda **kw: seen.append(kw["repr"]))
    try:
        before = compiles.triton_compiles()
        runtime.jit_post_compile_hook(key="k", repr="some_kernel[...]", fn=None, compile={},
                                      is_manual_warmup=False, already_compiled=False)
        assert compiles.triton_compiles() == before + 1
        assert seen == ["some_kernel[...]"]
    finally:
        runtime.jit_post_compile_hook = ours


def test_watch_counts_and_logs_after_arming(caplog: pytest.LogCaptureFixture) -> None:
    captured = [3]
    watch = CompileWatch(lambda: captured[0])
    captured[0] += 1  # before arming: not counted
    assert watch.captures == 0
    watch.arm()
    captured[0] += 2
    with caplog.at_level(logging.WARNING, logger="blockdraft.engine.compiles"):
        watch.check()
        watch.check()  # nothing new: no second warning
    assert watch.captures == 2
    warnings = [r for r in caplog.records if "after warm-up" in r.getMessage()]
    assert len(warnings) == 1 and "2 CUDA graph" in warnings[0].getMessage()
