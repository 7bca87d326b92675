"""Target-only decoding on the runtime: the fast baseline every speed-up is measured against."""

from __future__ import annotations

import operator
import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch

from blockdraft._core import SeqPages
from blockdraft.pair.checks import check_context
from blockdraft.results import GenerationResult, GenerationStats
from blockdraft.sampling import Penalties, SamplingParams, as_sampling, draw, target_probs
from blockdraft.target.runtime.runtime import TargetRuntime
from blockdraft.target.runtime.spec import TargetSpec


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """Prompts as lists of ints, each non-empty and inside the vocabulary.

    Raises:
        TypeError / ValueError: naming the prompt.
    """
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = [operator.index(t) for t in p]
        except TypeError as exc:
            raise TypeError(f"prompts must hold int token ids (prompt {i}: {exc})") from None
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab})")
        out.append(ids)
    return out


@torch.inference_mode()
def decode(
    target: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Target-only decoding of ``prompts`` on blockdraft's runtime, all prompts in one forward
    per token.

    Args:
        target: a supported Hugging Face causal LM (the runtime attaches to it: its q/k/v and
            gate/up weights become fused storage, the model keeps working) or a
            :class:`TargetRuntime` (its pool must hold every prompt + ``max_new_tokens``).
        prompts: token ids per prompt (each non-empty; lengths may differ).
        max_new_tokens: most tokens generated per prompt (>= 1).
        sampling: how tokens are chosen, penalties included (``None``: greedy).
        stop_token_ids: a sequence ends after producing one of these (included).
        generator: random source for sampling. On a tensor-parallel runtime every rank calls
            ``decode`` alike; without a generator, sampling draws from one seeded by rank 0
            (every rank must pick the same tokens).

    Returns:
        the tokens per prompt (greedy fp32 output equals ``target.generate(do_sample=False)``)
        and :class:`~blockdraft.GenerationStats` (``target_runtime="blockdraft"``).

    Raises:
        ConfigError: an unsupported target (named by its architecture).
        TypeError / ValueError: bad prompts or settings, or a prompt + ``max_new_tokens``
            past the model's positions.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, not {type(max_new_tokens).__name__}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
    params = as_sampling(sampling)
    runtime = target if isinstance(target, TargetRuntime) else None
    spec = runtime.spec if runtime is not None else TargetSpec.from_model(target)
    ids = check_prompts(prompts, int(spec.embed.weight.shape[0]))
    # Lengths are checked before a runtime is built for the call (fused weights, a page pool).
    limit = runtime.max_seq_len if runtime is not None else spec.max_positions
    for i, p in enumerate(ids):
        check_context(len(p), max_new_tokens, limit, prompt=f"prompt {i}")
    if runtime is None:
        page = 16
        pages = sum(-(-(len(p) + max_new_tokens) // page) for p in ids)
        runtime = TargetRuntime(target, max_seq_len=max(len(p) for p in ids) + max_new_tokens,
                                num_pages=pages, page_size=page, max_batch=len(ids))
    stops = frozenset(int(t) for t in (stop_token_ids or ()))
    if generator is None and not params.greedy and runtime.tp.size > 1:
        generator = torch.Generator().manual_seed(int(runtime.tp.broadcast(secrets.randbits(62))))
    start = time.perf_counter()
    seqs: list[SeqPages] = []
    try:
        for p in ids:
            seqs.append(runtime.new_sequence(len(p) + max_new_tokens))
        logits = runtime.prefill(seqs, ids)
        out: list[list[int]] = [[] for _ in ids]
        ttft = [0.0] * len(ids)
        live = list(range(len(ids)))
        first = True
        while live:
            if params.penalised:
                vocab = logits.shape[-1]
                logits = torch.stack([Penalties(params, vocab, ids[i], out[i]).apply(logits[k].float())
                                      for k, i in enumerate(live)])
            chosen = _choose(logits, params, generator)
            now = time.perf_counter() - start
            still: list[int] = []
            for k, i in enumerate(live):
                out[i].append(chosen[k])
                if first:
                    ttft[i] = now
                if chosen[k] in stops or len(out[i]) >= max_new_tokens:
                    runtime.free([seqs[i]])
                else:
                    still.append(i)
            first = False
            live = still
            if live:
                step = runtime.forward([seqs[i] for i in live], [[out[i][-1]] for i in live],
                                       logits="last", capture=False)
                runtime.accept([seqs[i] for i in live], [1] * len(live))
                logits = step.logits
    finally:
        runtime.free(seqs)
    elapsed = time.perf_counter() - start
    return GenerationResult(
        out,
        GenerationStats.collect([[1] * len(o) for o in out], sum(len(o) for o in out), elapsed,
                                ttft, "blockdraft"),
    )


def _choose(logits: torch.Tensor, params: SamplingParams,
            generator: torch.Generator | None) -> list[int]:
    """The next token of each row of ``logits [n, V]``."""
    if params.greedy:
        picked: list[int] = torch.argmax(logits, dim=-1).tolist()
        return picked
    probs = target_probs(logits.cpu(), params.temperature, params.top_p, params.top_k)
    return [draw(row, generator) for row in probs]


__all__ = ["check_prompts", "decode"]
