"""``blockdraft.generate``: speculative generation in one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from blockdraft.engine.draft_length import DraftLength
from blockdraft.engine.engine import SpeculativeEngine
from blockdraft.parallel import TPGroup
from blockdraft.results import GenerationResult
from blockdraft.sampling import SamplingParams


def pool_sizes(lengths: Sequence[int], max_new_tokens: int, block_size: int,
               page_size: int = 16) -> tuple[int, int]:
    """(target pages, drafter pages) that hold prompts of ``lengths`` at their longest (each
    plus ``max_new_tokens`` and one block of look-ahead), and no more."""
    target = sum(-(-(n + max_new_tokens + block_size) // page_size) for n in lengths)
    drafter = sum(-(-(n + max_new_tokens + block_size + 1) // page_size) for n in lengths)
    return target, drafter


def generate(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_token_ids: Sequence[int] | None = None,
    grammar_bitmask_fn: Callable[[int, Sequence[int]], Tensor | None] | None = None,
    generator: torch.Generator | None = None,
    runtime: str = "auto",
    sampled_drafts: bool = False,
    tp: TPGroup | None = None,
    min_tokens: int = 0,
    logprobs: int | None = None,
    draft_length: DraftLength | None = None,
    grammar: Any = None,
    tokenizer: Any = None,
) -> GenerationResult:
    """Speculative generation for one or many prompts (a one-off :class:`SpeculativeEngine`
    whose pools hold exactly these prompts; build an engine yourself to reuse it).

    Args:
        runtime: what runs the target: ``"auto"`` (blockdraft's runtime when it supports
            the model), ``"blockdraft"`` or ``"hf"``.
        sampled_drafts: at ``temperature > 0``, sample the drafts from the drafter's
            distribution (see :class:`SpeculativeEngine`).
        tp: the tensor-parallel group this process is a rank of (every rank calls
            ``generate`` with the same arguments; see :class:`SpeculativeEngine`).
        min_tokens: ``stop_token_ids`` are masked out of the target's choice until each
            prompt has this many new tokens.
        logprobs: also return each token's log-probability under the target with this many
            likeliest alternatives (``GenerationResult.logprobs``).
        draft_length: drafts verified per prompt and step (see :class:`SpeculativeEngine`;
            a fixed ``B - 1`` measures the drafter alone, as the benchmarks do).
        grammar: a :class:`~blockdraft.grammar.GrammarSpec` (or a compiled grammar) every
            prompt's output must match (needs ``blockdraft[serve]``'s llguidance); each
            prompt gets its own matcher, and the grammar's end token stops it. Not with
            ``grammar_bitmask_fn``.
        tokenizer: the target's Hugging Face tokenizer, to compile ``grammar`` with.
        (the rest as :meth:`SpeculativeEngine.generate`; penalties are
        :class:`~blockdraft.SamplingParams` fields)

    Raises:
        ConfigError: ``runtime="blockdraft"`` on an unsupported model (named).
        TypeError / ValueError: bad arguments.
    """
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("no prompts given")
    block = int(drafter.config.block_size)
    lengths = [len(p) for p in prompts]
    longest = max(lengths) + max_new_tokens
    page = 16
    target_pages, drafter_pages = pool_sizes(lengths, max_new_tokens, block, page)
    with SpeculativeEngine(
        target, drafter, runtime=runtime, max_seq_len=longest, max_active=len(prompts),
        target_pages=target_pages, page_size=page, num_pages=drafter_pages,
        max_batch=min(len(prompts), 16), sampled_drafts=sampled_drafts, tp=tp,
        draft_length=draft_length,
    ) as engine:
        if grammar is not None:
            grammar_bitmask_fn, stop_token_ids = grammar_masks(grammar, tokenizer, engine.proposer.vocab_size,
                                                               len(prompts), grammar_bitmask_fn, stop_token_ids)
        return engine.generate(
            prompts, max_new_tokens=max_new_tokens, sampling=sampling,
            stop_token_ids=stop_token_ids, grammar_bitmask_fn=grammar_bitmask_fn,
            generator=generator, min_tokens=min_tokens, logprobs=logprobs,
        )


def grammar_masks(
    grammar: Any, tokenizer: Any, vocab_size: int, prompts: int,
    mask_fn: Callable[[int, Sequence[int]], Tensor | None] | None, stops: Sequence[int] | None,
) -> tuple[Callable[[int, Sequence[int]], Tensor | None], list[int]]:
    """``(fn(prompt_index, generated), stop ids)`` for ``grammar``: one matcher per prompt,
    and the grammar's end tokens added to ``stops`` so a finished grammar ends the output.

    Raises:
        ValueError: ``grammar`` with ``grammar_bitmask_fn``, or a grammar that does not compile.
    """
    if mask_fn is not None:
        raise ValueError("give grammar or grammar_bitmask_fn, not both")
    from blockdraft.grammar import matcher_for  # llguidance is an optional dependency

    matchers = [matcher_for(grammar, tokenizer, vocab_size) for _ in range(prompts)]
    ends = matchers[0].grammar.eos_token_ids
    return (lambda i, generated: matchers[i](generated)), list(dict.fromkeys([*(stops or ()), *ends]))


__all__ = ["generate", "grammar_masks", "pool_sizes"]
