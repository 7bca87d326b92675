"""Checks shared by the training tests: a trained drafter agrees with the public reference
class that loads the same checkpoint, and drives the speculative loop to the target's output."""

from __future__ import annotations

from typing import Any

import torch

import blockdraft


def assert_matches_reference_and_target(mine: Any, ref: Any, target: Any, prompt: list[int]) -> None:
    """``mine`` (blockdraft) and ``ref`` (dflash, same checkpoint) give the same block rows for
    a random context and block (block size 4), and speculative greedy decoding of ``prompt``
    with ``mine`` equals the target's own greedy output."""
    c = mine.config
    ctx = torch.randn(1, 9, c.num_context_layers * c.hidden_size)
    emb = torch.randn(1, 4, c.hidden_size)
    pos = torch.arange(0, 13)[None]
    with torch.no_grad():
        want = ref(position_ids=pos, noise_embedding=emb, target_hidden=ctx)[0]
        got = mine.reference_forward(ctx[0], pos[0, :9], emb[0], pos[0, 9:])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)

    out = blockdraft.generate(target, mine, [prompt], max_new_tokens=20)
    with torch.no_grad():
        ref_out = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[0] == ref_out
