"""A plain single-sequence greedy speculative loop built only from blockdraft's pieces.

It is an oracle for tests and for the generation engine: with exact arithmetic its output equals
the target's greedy decoding. It mirrors the public reference's step schedule (block of
``min(B, max_length - start)`` rows, accept the longest matching prefix, one bonus token, append
``accepted + 1`` ctx rows) so acceptance lengths can be compared step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from blockdraft.models.attention import ReferenceAttend
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.target import TargetAdapter


@dataclass
class GreedyResult:
    """``tokens``: prompt + generated ids; ``acceptance_lengths``: tokens produced per step."""

    tokens: list[int]
    acceptance_lengths: list[int] = field(default_factory=list)


@torch.inference_mode()
def speculative_greedy(
    drafter: DFlashDrafter,
    target: TargetAdapter,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    block_size: int | None = None,
) -> GreedyResult:
    """Greedy speculative decoding of one prompt (batch 1, torch reference path).

    Returns at most ``len(prompt) + max_new_tokens`` tokens; stops after the first stop token.
    """
    if drafter.mask_token_id is None:
        raise ValueError("the reference loop needs a drafter with a mask_token_id")
    if not prompt:
        raise ValueError("prompt must not be empty")
    mask = drafter.mask_token_id
    block = drafter.block_size if block_size is None else block_size
    device = target.device
    stops = set(stop_token_ids or ())
    max_length = len(prompt) + max_new_tokens
    cache = target.new_cache()

    prompt_ids = torch.tensor([list(prompt)], dtype=torch.int64, device=device)
    first = target.forward(prompt_ids, torch.arange(len(prompt), device=device)[None], cache, logits_to_keep=1)
    tokens = list(prompt) + [int(torch.argmax(first.logits[0, -1]))]
    start = len(prompt)
    ctx_kv = drafter.context_kv(
        drafter.fuse_context(first.ctx_rows), torch.arange(start, device=device)
    )
    ctx_pos = torch.arange(start, device=device)
    result = GreedyResult(tokens=tokens)
    stopped = tokens[start] in stops

    while start + 1 < max_length and not stopped:
        size = min(block, max_length - start)
        positions = torch.arange(start, start + size, device=device)
        block_ids = torch.full((size,), mask, dtype=torch.int64, device=device)
        block_ids[0] = tokens[start]
        attend = ReferenceAttend(drafter.config, [ctx_kv], [ctx_pos], positions[None])
        hidden = drafter.forward_block(target.embed(block_ids)[None], positions[None], attend)
        draft = drafter.draft(hidden[:, 1:], block_ids[:1], target.lm_head)
        block_ids[1:] = draft.tokens[0]

        verify = target.forward(block_ids[None], positions[None], cache)
        choice = torch.argmax(verify.logits[0], dim=-1)
        matches = (block_ids[1:] == choice[:-1]).to(torch.int64)
        accepted = int(matches.cumprod(0).sum())
        new = [int(x) for x in block_ids[1 : accepted + 1]] + [int(choice[accepted])]
        produced = min(accepted + 1, max_length - start - 1)
        for j, tok in enumerate(new[:produced]):
            if tok in stops:
                produced = j + 1
                stopped = True
                break
        del tokens[start + 1 :]
        tokens += new[:produced]
        rows = verify.ctx_rows[:produced]
        new_pos = positions[:produced]
        new_kv = drafter.context_kv(drafter.fuse_context(rows), new_pos)
        ctx_kv = [(torch.cat((k0, k1)), torch.cat((v0, v1))) for (k0, v0), (k1, v1) in zip(ctx_kv, new_kv)]
        ctx_pos = torch.cat((ctx_pos, new_pos))
        start += produced
        TargetAdapter.crop_cache(cache, start)
        result.acceptance_lengths.append(produced)

    del tokens[min(start + 1, max_length) :]
    return result

