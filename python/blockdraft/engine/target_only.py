"""Speculation off: the engine's step as plain target decoding.

Every running request gets one decode row (its last token) in one target forward over the
batch; the next token is chosen as a verify's bonus token is (:func:`accept_blocks` with no
drafts), so greedy, sampled and grammar-masked requests behave as with speculation on. On the
runtime this is the forward :func:`blockdraft.decode` runs per token, here under continuous
batching. No drafter work is done and no drafter pages are held.
"""

from __future__ import annotations

from collections.abc import Sequence

from blockdraft.engine.accept import accept_blocks
from blockdraft.engine.logprobs import emitted_logprobs
from blockdraft.engine.request import Request
from blockdraft.target import RuntimeTarget, TargetBackend


def decode_step(target: TargetBackend, running: Sequence[Request]) -> None:
    """One step: each running request's last token goes into its K/V, and its next token is
    chosen and pushed (a step of one token in its ``steps``).

    Args:
        target: the engine's target.
        running: requests with a live target sequence and at least one generated token.
    """
    seqs = [r.target_seq for r in running]
    last = [[r.out[-1]] for r in running]
    if isinstance(target, RuntimeTarget):
        logits = target.runtime.forward(seqs, last, logits="last", capture=False).logits
    else:
        logits, _ = target.verify(seqs, last)
    nexts = [[nxt] for _, nxt in accept_blocks(running, [[] for _ in running], logits)]
    lps = emitted_logprobs(running, logits, [1] * len(running), nexts)
    target.accept(seqs, [1] * len(running))
    for r, nxt, lp in zip(running, nexts, lps):
        r.steps.append(1)
        r.push(nxt, lp)


__all__ = ["decode_step"]
