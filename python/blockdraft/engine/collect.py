"""Many prompts through an engine in one call: submit them all, step until every one ends,
collect the tokens and the statistics (:meth:`~blockdraft.SpeculativeEngine.generate`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from blockdraft.engine.request import MaskFn
from blockdraft.pair import check_context
from blockdraft.results import GenerationResult, GenerationStats
from blockdraft.sampling import SamplingParams, as_sampling
from blockdraft.target import check_prompts

if TYPE_CHECKING:
    from blockdraft.engine.engine import SpeculativeEngine


def generate_all(
    engine: SpeculativeEngine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None,
    stop_token_ids: Sequence[int] | None,
    grammar_bitmask_fn: Callable[[int, Sequence[int]], Tensor | None] | None,
    generator: torch.Generator | None,
    progress: Callable[[int], None] | None,
    min_tokens: int = 0,
    logprobs: int | None = None,
) -> GenerationResult:
    """:meth:`SpeculativeEngine.generate`'s work (arguments and errors as documented there).
    Every prompt is checked before any is submitted; on any exception every request of the
    call is cancelled, its pages back in the pools."""
    ids = check_prompts(prompts, engine.proposer.head.vocab_in)
    as_sampling(sampling)
    for i, p in enumerate(ids):
        check_context(len(p), max_new_tokens, engine.max_seq_len, prompt=f"prompt {i}")
    start = time.perf_counter()
    rids: list[int] = []
    batched0, single0 = engine.batched_proposals, engine.single_proposals
    try:
        for i, p in enumerate(ids):
            mask = None if grammar_bitmask_fn is None else _bind_mask(grammar_bitmask_fn, i)
            rids.append(engine.submit(
                p, max_new_tokens=max_new_tokens, sampling=sampling,
                stop_token_ids=stop_token_ids, generator=generator, grammar_bitmask_fn=mask,
                min_tokens=min_tokens, logprobs=logprobs,
            ))
        for ev in engine.stream(rids):
            if progress is not None and ev.tokens:
                progress(len(ev.tokens))
            if ev.finish_reason == "error":
                failure = engine.request(ev.request_id).exception
                if failure is not None:
                    raise failure
                raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
    finally:
        for rid in rids:
            engine.cancel(rid)
    elapsed = time.perf_counter() - start
    reqs = [engine.request(rid) for rid in rids]
    for rid in rids:
        engine.forget(rid)
    return GenerationResult(
        [r.out for r in reqs],
        GenerationStats.collect(
            [r.steps for r in reqs], sum(len(r.out) for r in reqs), elapsed,
            [(r.ttft_s or 0.0) - (start - r.submitted_at) for r in reqs], engine.target.name,
            engine.batched_proposals - batched0, engine.single_proposals - single0,
        ),
        None if logprobs is None else [r.out_logprobs for r in reqs],
    )


def _bind_mask(fn: Callable[[int, Sequence[int]], Tensor | None], index: int) -> MaskFn:
    return lambda generated: fn(index, generated)


__all__ = ["generate_all"]
