"""Continuations written by a causal LM itself: the data its drafters and its fine-tuning read.

A drafter is accepted when it predicts what the target will write next, and at inference the
context it reads is text the target wrote. Training it on corpus windows labels block row
``k`` with the target's choice after the *corpus* prefix, which is not the target's own
continuation once the corpus and the target part ways. Training windows that the target
wrote itself (greedy, or sampled at T = 1) have the labels speculative decoding accepts at
every row. :func:`rollout` writes them with a key/value cache, a batch of prompts at a time;
:func:`prompt_starts` picks the prompts from a token stream: the starts of documents (where the
held-out prompts start, too) and random offsets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from blockdraft.sampling import sample_rows


@torch.no_grad()
def rollout(
    model: Any,
    prompts: Tensor,
    new_tokens: int,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    batch: int = 0,
) -> Tensor:
    """Continue every row of ``prompts`` by ``new_tokens`` tokens of ``model``'s own.

    Greedy at ``temperature`` 0 (the continuation equals ``model.generate(do_sample=False)``'s,
    with no stop token), else drawn from ``softmax(logits / temperature)`` over the whole
    vocabulary (no top-k or top-p).

    Args:
        model: a Hugging Face causal LM (``past_key_values`` / ``use_cache``), in eval mode.
        prompts: [n, P] int64 token ids, all of one length P >= 1.
        batch: rows per forward (0: all of them at once).
    Returns:
        [n, new_tokens] int64 on ``prompts``' device.
    Raises:
        ValueError: an empty prompt, ``new_tokens`` < 1 or a negative temperature.
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [n, P] with P >= 1, not {tuple(prompts.shape)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, not {new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    from transformers import DynamicCache

    device = next(model.parameters()).device
    n = prompts.shape[0]
    step = batch if batch > 0 else max(1, n)
    out = torch.empty(n, new_tokens, dtype=torch.int64, device=prompts.device)
    for lo in range(0, n, step):
        ids = prompts[lo : lo + step].to(device)
        cache = DynamicCache()
        # Only the last prompt row's logits are needed (a whole batch of prompt logits is large).
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        for i in range(new_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = sample_rows(torch.softmax(logits.float() / temperature, dim=-1), generator)
            out[lo : lo + ids.shape[0], i] = nxt.to(out.device)
            if i + 1 < new_tokens:
                logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return out


def document_starts(stream: Tensor, eos_id: int, min_tokens: int) -> Tensor:
    """Offsets of ``stream`` [N] where a document starts (offset 0 and every offset after an
    ``eos_id``) with at least ``min_tokens`` tokens of the stream after it: [D] int64."""
    after_eos = (stream[:-1] == eos_id).nonzero().flatten() + 1
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), after_eos))
    return starts[starts + min_tokens <= stream.numel()]


def prompt_starts(stream: Tensor, eos_id: int, n: int, prompt_len: int, gen: torch.Generator,
                  *, doc_fraction: float = 0.5) -> Tensor:
    """``n`` offsets of ``stream`` at which prompts of ``prompt_len`` tokens start: [n] int64.

    About ``doc_fraction`` of them are document starts (drawn without replacement while they
    last: the beginnings of files, as the held-out prompts are), the rest uniform offsets.
    """
    if not 0.0 <= doc_fraction <= 1.0:
        raise ValueError(f"doc_fraction must be in [0, 1], not {doc_fraction}")
    if stream.numel() <= prompt_len:
        raise ValueError(f"the stream has {stream.numel()} tokens; prompts need more than {prompt_len}")
    docs = document_starts(stream, eos_id, prompt_len)
    k = min(int(round(n * doc_fraction)), docs.numel())
    chosen = docs[torch.randperm(docs.numel(), generator=gen)[:k]]
    rest = torch.randint(0, stream.numel() - prompt_len, (n - k,), generator=gen)
    return torch.cat((chosen, rest))


def rollout_stream(
    model: Any,
    stream: Tensor,
    eos_id: int,
    *,
    num: int,
    prompt_len: int,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    batch: int = 0,
    doc_fraction: float = 0.5,
) -> Tensor:
    """``num`` rollouts of ``model`` from prompts of ``stream``, as one training stream.

    Each rollout is its prompt (``prompt_len`` tokens from :func:`prompt_starts`) followed by
    ``new_tokens`` tokens of the model's (:func:`rollout`), then ``eos_id``, so that the result
    reads like a corpus stream of documents: [num * (prompt_len + new_tokens + 1)] int64 on
    the CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    starts = prompt_starts(stream, eos_id, num, prompt_len, gen, doc_fraction=doc_fraction)
    prompts = torch.stack([stream[s : s + prompt_len] for s in starts.tolist()])
    device = next(model.parameters()).device
    sample_gen = None
    if temperature > 0:
        sample_gen = torch.Generator(device=device).manual_seed(seed + 1)
    cont = rollout(model, prompts.to(device), new_tokens, temperature=temperature, generator=sample_gen,
                   batch=batch).cpu()
    eos = torch.full((num, 1), eos_id, dtype=torch.int64)
    return torch.cat((prompts, cont, eos), dim=1).reshape(-1)
